"""DTensor sharding rules for the leaf ops ``sparse_mla_fwd``, ``sparse_mla_bwd``,
``indexer_target`` and the lightning indexer's ``lightning_indexer``,
``lightning_indexer_scores`` and ``lightning_indexer_scores_bwd`` (an integration registers its
own ops' rules through :func:`register_when_dtensor_imported`).

With these rules DTensor inputs flow through :func:`mla_inductor.sparse_mla` (eager and
``torch.compile``) without the caller writing a collective: the entry op decomposes (it is
CompositeImplicitAutograd) into the leaf ops, and DTensor's dispatcher picks, for each leaf call,
the cheapest of the rules below given its inputs' placements, redistributes the inputs to it and
runs the op on the local shards. The mechanism is PyTorch's public
``torch.distributed.tensor.experimental.register_sharding`` (its docstring: a rule is a list of
``(output placements, input placements)`` for one mesh dimension; DTensor expands it over every
dimension of the mesh, ``torch/distributed/tensor/_ops/utils.py``
``expand_to_full_mesh_op_strategy``).

Rules, per mesh dimension, in the canonical layout (``q [T, H, d_qk]``, ``kv [S, d_qk]``,
``indices [T, topk]``, ``topk_length``/``q_positions [T]``, ``attn_sink [H]``):

============  ==================================  =========================================
rule          inputs                              outputs
============  ==================================  =========================================
heads         q Shard(1); kv, indices,            out, lse, o_lo, max_logits Shard(1);
              topk_length, q_positions R;         dq Shard(1), dkv Partial, d_sink Shard(0)
              attn_sink Shard(0)
tokens        q, indices, topk_length,            out, lse, o_lo, max_logits Shard(0);
              q_positions Shard(0); kv, sink R    dq Shard(0), dkv Partial, d_sink Partial
replicated    everything R                        everything R
============  ==================================  =========================================

(R = Replicate; the backward's ``dout``, ``dlse``, ``out``, ``lse``, ``o_lo`` are placed like
q's rows, as the forward's outputs.) ``indexer_target`` has the tokens and replicated rules only
(its ``lse`` placed like q's rows, its ``target [T, topk]`` like the indices): the target sums
over heads and then normalises each row, which no head-sharded placement expresses, so a q
sharded on heads is gathered for it. Any other placement is redistributed to one of these: a kv
sharded on tokens is all-gathered (the context-parallel recipe: the latent KV is small), a q
sharded on d_qk is gathered. An empty output (``o_lo`` or ``max_logits`` not asked for, ``d_sink``
without a sink) is replicated.

The batched layout ``[B, T, ...]`` is flattened by :mod:`mla_inductor.layout` on the DTensors:
``B`` sharded becomes tokens sharded in ``[B*T, ...]`` and ``[B*S, d_qk]``, with global per-batch
index offsets, so the tokens rule applies and kv is all-gathered over the batch shards (correct,
not communication-free; for data parallelism the op is better run on local tensors, as under
FSDP2 or DDP).

The lightning indexer's ops keep the batched layout (``q [B, T, H, D]``, ``k [B, S, D]``,
``weights [B, T, H]``, ``q_positions``/``indices``/``scores [B, T, .]``), so their rules shard
tokens (dim 1, k replicated) or the batch (dim 0, k too: communication-free) and need no offsets:

============  ===========================================  ====================================
rule          inputs                                       outputs
============  ===========================================  ====================================
tokens        q, weights, q_positions, indices, dscores    indices, scores, dq, dweights
              Shard(1); k R                                Shard(1); dk Partial
batch         everything Shard(0)                          everything Shard(0)
heads         q Shard(2), weights Shard(2); k, indices,    scores Partial; dq, dweights
(scores)      dscores R                                    Shard(2); dk Partial
replicated    everything R                                 everything R
============  ===========================================  ====================================

The heads rule is the scores' only (a sum over heads: each shard's partial sum is ``Partial``);
the selection's top-k of that sum has none, so a q sharded on heads is gathered for
``lightning_indexer``. The selection's fp8 scales are placed like the rows they scale:
``q_scale [B, T, H]`` as q (tokens: Shard(1); batch: Shard(0)) and ``k_scale [B, S]`` as k
(tokens: R; batch: Shard(0)).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import torch

_DTENSOR = "torch.distributed.tensor"
_pending: list = []  # registrations waiting for the DTensor import


def register_when_dtensor_imported(registration=None) -> None:
    """Calls ``registration`` (default :func:`register`, this module's rules) now if
    ``torch.distributed.tensor`` is imported, else right after it is first imported. A DTensor
    cannot exist before that import, so the rules are always in place for the first DTensor
    call, and ``import mla_inductor`` does not pay for importing DTensor (and sympy with it: 0.8 s
    of a 0.9 s import on a CPU machine, about 2 s on an H200 host) in processes that never use
    it. Call only where ``torch.distributed.is_available()``."""
    registration = register if registration is None else registration
    if _DTENSOR in sys.modules:
        registration()
        return
    _pending.append(registration)
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def _register_pending() -> None:
    while _pending:
        _pending.pop(0)()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Import hook: finds ``torch.distributed.tensor`` as the path finder would and calls the
    pending registrations once its module has executed; removes itself from ``sys.meta_path``
    then."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, finder = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, module_spec):
                return loader.create_module(module_spec)

            def exec_module(self, module):
                loader.exec_module(module)
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                _register_pending()

        spec.loader = _Loader()
        return spec


def _given(t, placement):
    """``placement`` for a tensor argument, ``None`` for an absent optional one."""
    return None if t is None else placement


def register() -> None:
    """Registers the rules with DTensor's sharding propagator (a second call replaces them with
    the same ones). Call only where ``torch.distributed.is_available()``."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    from . import custom_ops  # noqa: F401  (define the ops)

    R = Replicate()
    # Per rule: the placement of a row tensor [T, H, ...] (q and its outputs), of a per-token
    # tensor [T, ...] (indices, topk_length, q_positions), of the sink [H], of dkv, of d_sink.
    rules = (
        (Shard(1), R, Shard(0), Partial(), Shard(0)),  # heads (tensor parallel)
        (Shard(0), Shard(0), R, Partial(), Partial()),  # tokens (context / batch parallel)
        (R, R, R, R, R),  # replicated
    )

    @register_sharding(torch.ops.mla_inductor.sparse_mla_fwd.default)
    def _fwd(q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v,
             rescale_threshold, return_o_lo, return_max_logits):
        found = []
        for row, token, sink, _, _ in rules:
            outputs = [row, row, row if return_o_lo else R, row if return_max_logits else R]
            inputs = [row, R, token, _given(topk_length, token), _given(q_positions, token),
                      _given(attn_sink, sink)]
            found.append((outputs, inputs))
        return found

    @register_sharding(torch.ops.mla_inductor.indexer_target.default)
    def _indexer_target(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale):
        found = []
        for row, token, sink, _, _ in rules[1:]:  # tokens, replicated
            inputs = [row, R, token, _given(topk_length, token), _given(q_positions, token),
                      _given(attn_sink, sink), row]
            found.append(([token], inputs))
        return found

    @register_sharding(torch.ops.mla_inductor.sparse_mla_bwd.default)
    def _bwd(dout, dlse, q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo,
             sm_scale, d_v, deterministic=False):
        found = []
        for row, token, sink, dkv, d_sink in rules:
            outputs = [row, dkv, R if attn_sink is None else d_sink]
            inputs = [row, _given(dlse, row), row, R, token, _given(topk_length, token),
                      _given(q_positions, token), _given(attn_sink, sink), row, row,
                      row if o_lo.ndim == 3 else R]
            found.append((outputs, inputs))
        return found

    _register_lightning(register_sharding, R, Shard, Partial)


def _register_lightning(register_sharding, R, Shard, Partial) -> None:
    """The lightning indexer ops' rules (module docstring)."""
    from . import custom_ops  # noqa: F401  (define the ops)

    tokens, batch, heads = Shard(1), Shard(0), Shard(2)

    @register_sharding(torch.ops.mla_inductor.lightning_indexer.default)
    def _select(q, k, weights, q_positions, topk, q_scale=None, k_scale=None):
        return [([row, row], [row, k_p, row, _given(q_positions, row), _given(q_scale, row),
                              _given(k_scale, k_p)])
                for row, k_p in ((tokens, R), (batch, batch), (R, R))]

    @register_sharding(torch.ops.mla_inductor.lightning_indexer_scores.default)
    def _scores(q, k, weights, indices):
        return [([tokens], [tokens, R, tokens, tokens]), ([batch], [batch] * 4),
                ([Partial()], [heads, R, heads, R]), ([R], [R] * 4)]

    @register_sharding(torch.ops.mla_inductor.lightning_indexer_scores_bwd.default)
    def _scores_bwd(dscores, q, k, weights, indices, deterministic=False):
        return [([tokens, Partial(), tokens], [tokens, tokens, R, tokens, tokens]),
                ([batch] * 3, [batch] * 5),
                ([heads, Partial(), heads], [R, heads, R, heads, R]),
                ([R] * 3, [R] * 5)]
