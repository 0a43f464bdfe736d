"""The values of ``rescale_threshold`` (log2 units) that the threshold policy chooses between.
Every module that names one imports it from here: the policy
(:mod:`mla_inductor.threshold_policy`), the kernels (sm90 and sm100 precompile both), the
numerics tool and the bench. Importing it imports nothing.
"""

from __future__ import annotations

# The exact running max (the training default): p never exceeds 1, and the forward leaves no
# coherent gain error for a backward to inherit (docs/numerics.md).
EXACT_THRESHOLD = 0.0
# The lazy rescale (the inference default): the running max may stay stale while the row's
# scores pass it by up to 8, so p can reach 2**8.
LAZY_THRESHOLD = 8.0

