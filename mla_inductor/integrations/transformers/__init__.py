"""Hugging Face transformers' sparse-attention models on :func:`mla_inductor.sparse_mla`.

:func:`apply` switches the attention layers of the model families below from transformers' dense
masked attention to the op, for training, prefill and generation, keeping every parameter and
submodule the model's own; :func:`remove` and :func:`switched` undo it; :func:`indexer_loss`
returns the indexer loss that ``apply(model, indexer_loss=True)`` records. One module per family:

- :mod:`.deepseek_v32`: DeepSeek-V3.2 (``models/deepseek_v32``) and GLM-5
  (``models/glm_moe_dsa``): DSA in the absorbed MLA form;
- :mod:`.deepseek_v4`: DeepSeek-V4 (``models/deepseek_v4``): sliding-window, compressed sparse
  (CSA) and heavily compressed (HCA) attention;
- :mod:`.glm5_next`: GLM-5.3-Flash (``models/glm5_next``): its DSA layers (``indexed_attention``,
  MLA without RoPE, an indexer over pooled keys) in the absorbed form.

The parts they share: :mod:`.visibility` (the attention implementation under which the model
builds token positions and key padding instead of its dense mask, and the gather of the keys a
padding mask leaves), :mod:`.indexer` (a DSA indexer's top-k on
:func:`mla_inductor.lightning_indexer`), :mod:`.pooling` (entries pooled from consecutive tokens
and which a token sees), :mod:`.loss` (DeepSeek-V3.2's indexer KL loss, also over pools),
:mod:`.head_matmul` (the absorbed form's per-head GEMMs) and :mod:`.arguments` (the checks of a
switched layer's call). Tested with transformers 5.24 (the ``transformers``
extra pins ``>=5.24,<5.25``: the attention classes are transformers internals).
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

from torch import Tensor, nn

from . import deepseek_v4, deepseek_v32, glm5_next
from . import loss as _loss
from .indexer import check_precision, set_precision
from .visibility import ATTN_IMPLEMENTATION, drop_visibility, use_visibility

__all__ = ["ATTN_IMPLEMENTATION", "apply", "indexer_loss", "remove", "switched"]

# The model families: each module's LAYERS (the attention classes it switches), forward (the
# switched layer's forward), INDEXER_LOSS (whether apply's indexer_loss option covers it) and
# VISIBILITY (whether apply sets ATTN_IMPLEMENTATION, so that the model builds what
# :mod:`.visibility` describes instead of its dense mask).
_FAMILIES = (deepseek_v32, deepseek_v4, glm5_next)
_FAMILY = {cls: family for family in _FAMILIES for cls in family.LAYERS}
_FORWARDS = tuple(family.forward for family in _FAMILIES)


def _is_switched(attn: nn.Module) -> bool:
    return getattr(attn.__dict__.get("forward"), "__func__", None) in _FORWARDS


def _attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = [(name, m) for name, m in model.named_modules() if type(m) in _FAMILY]
    if not layers:
        raise ValueError(
            f"mla_inductor: {type(model).__name__} has no DSA attention layer (transformers' "
            f"{', '.join(cls.__name__ for cls in _FAMILY)}); pass a model of "
            "models/deepseek_v32, models/glm_moe_dsa, models/deepseek_v4 or models/glm5_next "
            "(DeepSeek-V3.2, GLM-5, DeepSeek-V4, GLM-5.3-Flash)"
        )
    return layers


def _apply(model: nn.Module, indexer_loss: bool, indexer_precision: str) -> list[nn.Module]:
    layers = _attention_layers(model)
    check_precision(indexer_precision)
    if indexer_loss:
        for name, attn in layers:
            if not _FAMILY[type(attn)].INDEXER_LOSS:
                raise ValueError(
                    f"mla_inductor: indexer_loss=True is not offered for {name} "
                    f"({type(attn).__name__}): {_FAMILY[type(attn)].NO_INDEXER_LOSS}"
                )
    switched = []
    for name, attn in layers:
        if _is_switched(attn):
            continue
        if "forward" in attn.__dict__:
            raise RuntimeError(
                f"mla_inductor: {name}.forward is already replaced on the instance (for example "
                "by accelerate's device_map or offloading hooks); switching it would drop that "
                "wrapper. Apply to a model without such hooks"
            )
        attn.forward = types.MethodType(_FAMILY[type(attn)].forward, attn)
        switched.append(attn)
    return switched


def apply(model: nn.Module, *, indexer_loss: bool = False, indexer_precision: str = "bf16") -> int:
    """Switches every sparse-attention layer of ``model`` (any module tree containing them, e.g.
    a ``*ForCausalLM``) to :func:`mla_inductor.sparse_mla`: DeepSeek-V3.2's
    ``DeepseekV32Attention`` and GLM-5's ``GlmMoeDsaAttention`` (:mod:`.deepseek_v32`: the
    absorbed MLA form), DeepSeek-V4's ``DeepseekV4Attention`` (:mod:`.deepseek_v4`: the sliding
    window and the compressed entries as the op's slots), GLM-5.3-Flash's
    ``Glm5NextTextAttention`` (:mod:`.glm5_next`: every ``indexed_attention`` layer, its pooled
    indexer on :func:`mla_inductor.lightning_indexer`; the linear-attention layers stay
    transformers').

    Each layer keeps its own parameters and submodules (nothing is copied or added to the state
    dict); its softmax scale, its indexer, its compressors and the model's attention mask
    (causality, sliding window, padding, packed sequences) decide what each token attends to.
    Prefill, training and generation all run on the op, with the model's own cache. Inputs as the
    model takes them: float32 on the CPU (the op's reference backend); on a GPU, bf16 runs on the
    op's kernels where they cover the layer's shapes (other shapes fall back to the reference
    with a warning). The layer returns no attention weights (``None``).

    The model's dense mask ``[B, 1, T, S]`` is not built: ``apply`` sets the config's attention
    implementation to :data:`ATTN_IMPLEMENTATION` (``remove`` puts the previous one back), whose
    mask function returns each token's position, the sliding window and the model's 2D padding
    mask over the keys (O(B·S + T); :mod:`.visibility`). Packed sequences (position_ids that
    restart, no mask, no cache) get transformers' dense bool mask, as does a model whose attention
    implementation is set to another one after ``apply`` (sdpa, eager); the family modules say
    what each does with it. GLM-5.3-Flash's model passes its layers the 2D padding mask, not a
    dense one: its attention implementation is left as it is.

    ``indexer_loss=True`` also trains the indexers of DeepSeek-V3.2 and GLM-5 with DeepSeek-V3.2's
    KL loss, and GLM-5.3-Flash's with the same KL over its selected pools (off by default; off,
    the forward is exactly the one without the option): each
    forward of a layer with its own indexer, in training mode with grad enabled, records it
    (:mod:`.loss`), and :func:`indexer_loss` returns it for the training loop to add. The
    option is set on every switched layer of ``model`` by each call (a later ``apply(model)``
    turns it off again).

    ``indexer_precision="fp8"`` makes every indexer (DeepSeek-V3.2's, GLM-5's, DeepSeek-V4's CSA
    one, GLM-5.3-Flash's over its pooled keys) select on its queries and keys quantised per row to float8_e4m3fn with one float32
    scale each (:func:`mla_inductor.quantize_fp8`: DeepSeek-V3.2-Exp's inference code quantises
    them so), :func:`mla_inductor.lightning_indexer` with ``q_scale`` and ``k_scale``; the
    indexer loss's logits stay those of the unquantised queries and keys. ``"bf16"`` (the
    default) selects in the layer's own dtype. Set, like the loss option, by each call.

    Returns:
        The number of layers this call switched (layers already switched keep their forward).

    Raises:
        ValueError: ``model`` has no such layer; ``indexer_loss=True`` on a model with a layer
            the loss does not cover (DeepSeek-V4: :mod:`.deepseek_v4` says why); an
            ``indexer_precision`` other than ``"bf16"`` and ``"fp8"``.
        RuntimeError: a layer's ``forward`` is already replaced on the instance (accelerate's
            hooks), which switching would drop. At call time: ``attention_dropout > 0`` while
            training, a missing attention mask (``None``; for GLM-5.3-Flash also one that is
            not the 2D padding mask ``[B, T]``), a GLM-5 or GLM-5.3-Flash shared-top-k layer
            called without ``prev_topk_indices``, :func:`sparse_mla`'s own checks, and with
            ``indexer_loss`` a training forward with grad over a cache that held earlier tokens.
    """
    switched = len(_apply(model, indexer_loss, indexer_precision))
    layers = [attn for _, attn in _attention_layers(model) if _is_switched(attn)]
    _set_options(layers, indexer_loss, indexer_precision)
    return switched


def _set_options(layers, indexer_loss: bool, indexer_precision: str) -> None:
    for attn in layers:
        _loss.enable(attn, indexer_loss)
        set_precision(attn, indexer_precision)
    use_visibility([attn for attn in layers if _FAMILY[type(attn)].VISIBILITY])


def indexer_loss(model: nn.Module) -> Tensor:
    """The indexer loss of ``model``'s DSA layers since the last call, for a training loop to add
    (``loss = lm_loss + coef * indexer_loss(model)``), after :func:`apply` with
    ``indexer_loss=True``.

    Each recorded loss holds its graph (about 12 bytes per selected slot and layer) until it is
    taken, so call this once per forward: after several forwards (gradient accumulation without a
    call in between) it gives the mean over all of them. With transformers' gradient
    checkpointing (non-reentrant, its default) each forward records once; reentrant
    checkpointing runs the layers without grad, so nothing is recorded.

    Returns:
        A 0-d float32 tensor on the model's device: the mean of the losses recorded since the last
        call, one per forward of each layer that has its own indexer (GLM-5's "shared" layers
        have none) in training mode with grad enabled, each
        :func:`~mla_inductor.integrations.transformers.loss.layer_loss`; its gradient
        reaches the indexers' parameters only. The record is then cleared. 0 (without grad)
        where none was recorded (eval mode, ``torch.no_grad()``, no forward since), with a
        ``UserWarning`` saying which.

    Raises:
        ValueError: ``model`` has no DSA attention layer.
        RuntimeError: none of its layers has the indexer loss enabled.
    """
    layers = [attn for _, attn in _attention_layers(model) if _loss.enabled(attn)]
    if not layers:
        raise RuntimeError(
            f"mla_inductor: indexer_loss(model) needs the indexer loss enabled: no DSA layer of "
            f"this {type(model).__name__} has it; call "
            "mla_inductor.integrations.transformers.apply(model, indexer_loss=True) first"
        )
    return _loss.take(layers)


def _remove(layers) -> None:
    drop_visibility(layers)
    for attn in layers:
        if _is_switched(attn):
            del attn.forward
        _loss.enable(attn, False)
        set_precision(attn, "bf16")


def remove(model: nn.Module) -> int:
    """Puts every switched attention layer of ``model`` back on transformers' own forward
    (bitwise the model's outputs before :func:`apply`), its indexer loss off and its recorded
    losses dropped.

    Returns:
        The number of layers switched back.

    Raises:
        ValueError: ``model`` has no DSA attention layer.
    """
    layers = [attn for _, attn in _attention_layers(model) if _is_switched(attn)]
    _remove(layers)
    return len(layers)


@contextlib.contextmanager
def switched(model: nn.Module, *, indexer_loss: bool = False,
             indexer_precision: str = "bf16") -> Iterator[int]:
    """``with switched(model) as n:`` runs the block with :func:`apply` in effect (``n`` layers
    switched) and switches exactly those layers back on exit, also on an exception; with
    ``indexer_loss`` those layers record their indexer loss, with ``indexer_precision`` their
    indexers select so (:func:`apply`'s options), inside the block. Raises as :func:`apply`."""
    layers = _apply(model, indexer_loss, indexer_precision)
    _set_options(layers, indexer_loss, indexer_precision)
    try:
        yield len(layers)
    finally:
        _remove(layers)
