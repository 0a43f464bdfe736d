"""``python -m mla_inductor.bench``: see :mod:`mla_inductor.bench.cli`."""

from .cli import main

main()
