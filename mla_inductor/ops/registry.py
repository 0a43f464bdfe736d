"""The one registry of the package's ops: the library fragment of the ``mla_inductor`` namespace,
the layout tag every op carries, and the list of ops that :mod:`mla_inductor.lowering` registers.

- :func:`custom_op` defines an op with ``torch.library.custom_op`` under :data:`LAYOUT` and records
  it: inductor meets these ops (schema, fake kernel and autograd in the op's module).
- :func:`entry_op` defines an entry op on :data:`LIBRARY` with a ``CompositeImplicitAutograd``
  body (the layouts and the threshold policy): AOTAutograd decomposes it before inductor, so it
  is not recorded for the lowering.
- :func:`lowered_ops` gives the recorded ops' default overloads.

Every op module of :mod:`mla_inductor.ops` defines its ops here; :mod:`mla_inductor.custom_ops`
imports them all.
"""

from __future__ import annotations

import torch

LIBRARY = torch.library.Library("mla_inductor", "FRAGMENT")
# Inductor writes the tensor operands of an op with this tag contiguously, fusing pointwise
# producers into the kernel it generates before the call (:mod:`mla_inductor.lowering`).
LAYOUT = (torch.Tag.needs_contiguous_strides,)

_LOWERED: list[str] = []


def custom_op(name: str):
    """A decorator: ``torch.library.custom_op("mla_inductor::<name>", mutates_args=(),
    tags=LAYOUT)``, the op recorded for :func:`lowered_ops`.

    Args:
        name: the op's name in ``torch.ops.mla_inductor``.

    Returns:
        The decorator; it returns the ``CustomOpDef`` (``register_fake``,
        ``register_autograd``).
    """

    def define(fn):
        op = torch.library.custom_op(f"mla_inductor::{name}", fn, mutates_args=(), tags=LAYOUT)
        _LOWERED.append(name)
        return op

    return define


def entry_op(schema: str, body) -> None:
    """Defines ``schema`` (``"name(args) -> outputs"``) on :data:`LIBRARY` with ``body`` as its
    ``CompositeImplicitAutograd`` kernel: Dynamo keeps the op as one node, and its checks and
    layout code run in the decomposition, on FakeTensors at trace time."""
    LIBRARY.define(schema)
    LIBRARY.impl(schema.split("(", 1)[0], body, "CompositeImplicitAutograd")


def lowered_ops() -> tuple[torch._ops.OpOverload, ...]:
    """The default overloads of every op :func:`custom_op` defined, in definition order."""
    return tuple(getattr(torch.ops.mla_inductor, name).default for name in _LOWERED)
