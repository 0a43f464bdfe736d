"""Benchmarks of the sparse-MLA kernels on the current GPU: one command with subcommands.

    python -m mla_inductor.bench --help              # the subcommands, one line each
    python -m mla_inductor.bench <subcommand> --help # its flags, defaults and columns

Modules: :mod:`.cli` (the command and its table of subcommands), one module per subcommand
(:mod:`.fwd`, :mod:`.bwd`, :mod:`.train`, :mod:`.indexer_target`, :mod:`.lightning`,
:mod:`.lightning_scores`, :mod:`.hf`, :mod:`.dist`: each
``add_arguments(parser)`` and ``run(args)``; ``hf`` times a transformers DeepSeek-V3.2 layer
unpatched and patched (``hf-v4`` a DeepSeek-V4 one, :mod:`.hf_glm5_next` a GLM-5.3-Flash one),
``dist`` one layer tensor and context parallel over spawned ranks, with ``--train`` a small
model trained so, :mod:`.dist_train`), :mod:`.ranks` (spawned process
groups), :mod:`.timing` (the timers and protocols every table uses) and :mod:`.problems` (widths,
index patterns, shape flags, the SM90 check).

A tool on top of the op, like :mod:`mla_inductor.demo` and :mod:`mla_inductor.numerics`: it
imports the package; nothing in the package imports it.
"""
