"""The values of ``rescale_threshold`` (log2 units): the two that the threshold policy chooses
between and the bound per dtype of q. Every module that names one imports it from here: the
policy (:mod:`mla_inductor.threshold_policy`), the op's check (:mod:`mla_inductor.validation`),
the kernels (sm90 and sm100 precompile both values; sm90's forward asserts the bound), the
numerics tool and the bench. Importing it imports only torch.
"""

from __future__ import annotations

import torch

# The exact running max (the training default): p never exceeds 1, and the forward leaves no
# coherent gain error for a backward to inherit (docs/notes/exact-max-for-training.md).
EXACT_THRESHOLD = 0.0
# The lazy rescale (the inference default): the running max may stay stale while the row's
# scores pass it by up to 8, so p can reach 2**8.
LAZY_THRESHOLD = 8.0

# Exclusive upper bound of rescale_threshold per dtype of q. The lazy rescale lets
# p = exp2(s - stale max) reach 2**threshold, and p is rounded to q's dtype for the P.V product:
# float16 tops out at 65504 < 2**16. bfloat16 and float32 reach 2**128, but p also enters fp32
# row sums and outputs over up to 2**31 slots of values up to 2**32: below 2**64 they cannot
# overflow. The SM90 forward kernel asserts the same bounds.
MAX_RESCALE_THRESHOLD = {torch.float16: 15.0, torch.bfloat16: 64.0, torch.float32: 64.0}
