"""The package's ops in ``torch.ops.mla_inductor``, one module per op family (schema, fake kernel,
autograd, entry op and the op's own checks; those the sparse-MLA ops share are in
:mod:`mla_inductor.validation`); :mod:`mla_inductor.custom_ops` imports them all and
lists every op. This package's ``__init__`` imports nothing, so :mod:`mla_inductor.lowering` can
read :mod:`.registry` while the op modules import the lowering.
"""
