"""Benchmarks of the sparse-MLA kernels on the current GPU: one command with subcommands.

    python -m mla_inductor.bench fwd   [--T 4096 16384] [--H 128 64] [--topk 2048] [--protocol P]
    python -m mla_inductor.bench bwd   [--T ...] [--H ...] [--topk N] [--protocol P]
        [--no-reference]
    python -m mla_inductor.bench train [--T ...] [--H ...] [--topk N] [--skip-layer] [--skip-model]
    python -m mla_inductor.bench indexer [--T ...] [--H ...] [--topk N] [--S T] [--protocol P]
    python -m mla_inductor.bench lightning-scores [--T 16384 32768 65536] [--H 64] [--topk 2048]
    python -m mla_inductor.bench hf    [--T 4096 16384] [--topk 2048] [--warmup N] [--iters N]
        [--tiny]
    python -m mla_inductor.bench hf-glm5-next [--T 16384 32768 65536 131072] [--kpool 4]
        [--breakdown] [--json PATH] [--tiny]
    python -m mla_inductor.bench dist  [--ranks 2] [--T 16384 65536] [--topk 2048]
        [--device cuda|cpu] [--warmup N] [--iters N] [--tiny] [--train STEPS] [--lr LR]

``--help`` works at every level. Modules: :mod:`.cli` (the command), one module per subcommand
(:mod:`.fwd`, :mod:`.bwd`, :mod:`.train`, :mod:`.indexer`, :mod:`.lightning`,
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
