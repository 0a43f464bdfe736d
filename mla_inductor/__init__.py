"""mla-inductor: DeepSeek-style sparse MLA attention as ``torch.compile``-native custom ops.

Public names: :func:`sparse_mla`, :func:`indexer_target` and :func:`indexer_kl_loss` (the
indexer's training signal), :func:`lightning_indexer` (the indexer's top-k;
:func:`lightning_indexer_seen` under a dense mask) and :func:`lightning_indexer_scores` (its
differentiable scores of the selected keys),
:func:`quantize_fp8` (per-row fp8 for the indexer's fp8 form), :func:`use_backend`, :func:`precompile`, ``__version__``.
"""

import torch

from .api import indexer_kl_loss, indexer_target, sparse_mla
from .api import lightning_indexer, lightning_indexer_scores, lightning_indexer_seen
from .backends import use_backend
from .precompile import precompile
from .quantize import quantize_fp8

__version__ = "0.1.0"

if torch.distributed.is_available():  # DTensor sharding rules for the ops (mla_inductor.distributed)
    from . import distributed

    distributed.register_when_dtensor_imported()

__all__ = ["sparse_mla", "indexer_target", "indexer_kl_loss", "lightning_indexer",
           "lightning_indexer_seen", "lightning_indexer_scores", "quantize_fp8", "use_backend",
           "precompile", "__version__"]
