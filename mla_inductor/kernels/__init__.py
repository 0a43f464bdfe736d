"""Sparse-MLA kernel backends: ``reference`` (PyTorch, any device; :mod:`.reference` with
:mod:`.reference_lightning`, :mod:`.reference_lightning_indexer_scores`, :mod:`.reference_kl`),
``emulate`` (the GPU kernels' online-softmax arithmetic in PyTorch), ``sm90`` (our Hopper CuTe
DSL kernels), ``sm100`` (FlashAttention-4's Blackwell kernels), and what backends share: the
compiled-kernel cache of the CuTe DSL kernels (:mod:`.cache`, :mod:`.sharedlib`) and PyTorch's
deterministic mode for the PyTorch backends' accumulations (:mod:`.determinism`).

Every backend module has the same surface, :class:`mla_inductor.backends.Backend` (the argument
order and meaning of each function), so that :mod:`mla_inductor.backends` dispatches by name and
tests parametrise over backends.
"""
