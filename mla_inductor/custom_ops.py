"""Every op the package registers in ``torch.ops.mla_inductor``: importing this module defines
them all. Each op's schema, fake kernel, autograd and checks sit in its module of
:mod:`mla_inductor.ops` (the checks the sparse-MLA ops share with the indexer target in
:mod:`mla_inductor.validation`); the library fragment, the layout tag and the list of ops the
lowering registers are :mod:`mla_inductor.ops.registry`'s.

- :mod:`mla_inductor.ops.sparse_mla`: ``sparse_mla`` (entry op), ``sparse_mla_fwd`` and its
  autograd partner ``sparse_mla_bwd``.
- :mod:`mla_inductor.ops.indexer_target`: ``indexer_target_entry`` (entry op) and
  ``indexer_target`` (not differentiable: a constant of the indexer loss).
- :mod:`mla_inductor.ops.indexer_kl`: ``indexer_kl`` and its autograd partner ``indexer_kl_bwd``.
- :mod:`mla_inductor.ops.lightning_indexer`: ``lightning_indexer_entry`` (entry op) and
  ``lightning_indexer`` (its scores' backward is ``lightning_indexer_scores_bwd``).
- :mod:`mla_inductor.ops.lightning_indexer_scores`: ``lightning_indexer_scores_entry`` (entry op),
  ``lightning_indexer_scores`` and its autograd partner ``lightning_indexer_scores_bwd``.

An entry op (``CompositeImplicitAutograd``) takes the public layouts; Dynamo keeps it as one
node and AOTAutograd decomposes it into the canonical op below it, which inductor calls through
the fallbacks of :mod:`mla_inductor.lowering`. The transformers integration adds one op of its
own, ``head_matmul`` (:mod:`mla_inductor.integrations.transformers.head_matmul`), defined when
that integration is imported.
"""

from .ops import (indexer_kl, indexer_target, lightning_indexer, lightning_indexer_scores,
                  sparse_mla)
from .ops.registry import lowered_ops

__all__ = ["indexer_kl", "indexer_target", "lightning_indexer", "lightning_indexer_scores",
           "sparse_mla", "lowered_ops"]
