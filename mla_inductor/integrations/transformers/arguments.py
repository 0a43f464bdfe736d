"""The checks a switched attention layer makes of the arguments of its call (every model family
alike)."""

from __future__ import annotations

from torch import nn


def the_cache(cache, past_key_values):
    """The model's cache, passed as ``cache=`` (transformers 5.24) or ``past_key_values=`` (its
    older name: 5.17's layers pass it so, and 5.24's layers still accept it), or None.

    Raises:
        RuntimeError: both are given.
    """
    if past_key_values is None:
        return cache
    if cache is not None:
        raise RuntimeError(
            "mla_inductor: the switched attention got both cache= and past_key_values= (two "
            "names for the same argument); pass one"
        )
    return past_key_values


def check_call(attn: nn.Module, attention_mask,
               mask: str = "its 4D mask [B, 1, T, S], or what the model builds under apply()"
               ) -> None:
    """Raises a ``RuntimeError`` for a call the op cannot run as the model would: no attention
    mask (the model always builds one; a layer called alone must be given it; ``mask`` says
    which the layer takes), or attention dropout while training."""
    if attention_mask is None:
        raise RuntimeError(
            f"mla_inductor: the switched attention needs the model's attention mask ({mask}); "
            "call the layer as the model does (the model always builds one)"
        )
    if attn.training and attn.attention_dropout:
        raise RuntimeError(
            f"mla_inductor: attention_dropout={attn.attention_dropout} is not supported on "
            "sparse_mla; set model.config.attention_dropout = 0.0 and every layer's "
            "attention_dropout to 0.0, or mla_inductor.integrations.transformers.remove(model)"
        )
