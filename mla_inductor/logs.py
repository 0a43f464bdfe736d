"""The package's logger, ``mla_inductor``, registered with torch's logging.

``TORCH_LOGS="mla_inductor"`` shows the threshold decision of every graph capture (INFO);
``TORCH_LOGS="+mla_inductor"`` adds a DEBUG line per eager call and per FakeTensor propagation.
From Python: ``torch._logging.set_logs(modules={"mla_inductor": logging.INFO})``. The lines
carry torch's log prefix (level, time, process, file, compile id). ``TORCH_LOGS="help"`` lists the
name once the package is imported. Plain :mod:`logging` configuration of the ``mla_inductor``
logger works as well.
"""

from __future__ import annotations

import logging

NAME = "mla_inductor"
log = logging.getLogger(NAME)


def _register() -> bool:
    """Registers :data:`NAME` as a torch log (``torch._logging._internal.register_log``, present
    in torch 2.1 to 2.14); returns False where it is missing (then only the module-name form of
    ``TORCH_LOGS`` and plain logging configuration apply)."""
    try:
        from torch._logging._internal import register_log
    except ImportError:
        return False
    register_log(NAME, NAME)
    return True


REGISTERED = _register()
