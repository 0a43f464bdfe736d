"""The indexer KL loss's per-row reductions and their gradient for Hopper (SM90a), in CuTe DSL.

DSA's indexer loss (:func:`mla_inductor.indexer_kl_loss`) is, per row ``r`` of ``K`` slots with
its valid set ``V_r`` (``0 <= indices[r, j] <= hi[r]`` and ``j < length[r]``),
``kl[r] = sum_{j in V_r, t != 0} t_j (log t_j - (l_j - lse_r))`` with ``t = target[r]``, ``l =
logits[r]`` and ``lse_r = log sum_{j in V_r} exp(l_j)``. In PyTorch that is a dozen element-wise
passes over the ``[R, K]`` float32 tensors forward and as many backward; here it is one read of
``logits``, ``target`` and ``indices`` per pass.

* Forward (:class:`IndexerKlSm90` with ``backward=False``): one warp per row. Each lane walks
  the slots ``lane, lane + 32, ...`` (coalesced 4-byte loads, ``UNROLL`` slots in flight) and
  keeps an online log-sum-exp (running max ``m`` and ``s = sum exp(l - m)``), ``a = sum t log t
  - t l`` and ``tsum = sum t`` over the valid slots with ``t != 0``, and the count of valid
  slots; a butterfly over the warp combines them. Lane 0 writes ``kl = a + tsum * lse`` (``a``
  alone when ``tsum`` is 0; 0 for a row without a valid slot), ``lse``, ``tsum`` and the count.
  The expansion ``a + tsum * lse`` equals the definition (``sum t (log t - l + lse)``).
* Backward (``backward=True``): one warp per row, ``dlogits[r, j] = dkl[r] (exp(l_j - lse_r)
  tsum_r - t_j)`` on the valid slots (the gradient of ``-sum t log_softmax(l)``), 0 elsewhere.
* Non-finite values follow the PyTorch formula: a NaN logit on a valid slot, or a +inf one, makes
  ``lse`` NaN; a logit of -inf is a probability of 0 (the KL is +inf where its target is not 0);
  a row whose valid logits are all -inf has ``lse = -inf``.
* The order of every sum is fixed (per lane in slot order, then the butterfly), so the results
  are bitwise the same in every run. ``exp`` and ``log`` are the accurate (non-approximate)
  functions. 64-bit addressing: ``R * K`` may pass 2**31.

One compiled kernel per direction serves every ``R`` and ``K`` (symbolic); launched on torch's
current stream through TVM-FFI.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .ptx import ld_global_nc_b32, ld_global_nc_f32, st_global_b32, st_global_f32

WARPS = 8  # rows per CTA, one per warp
UNROLL = 8  # slots per lane in flight
NEG_INF = -math.inf


@cute.jit
def _scaled_exp(x: Float32, m: Float32) -> Float32:
    """``exp(x - m)``, 1 when both are -inf (a running max that is still -inf)."""
    return cutlass.select_(m == Float32(NEG_INF), Float32(1.0), cute.math.exp(x - m))


class IndexerKlSm90:
    """Compile-time configuration of the forward or the backward kernel (module docstring)."""

    def __init__(self, backward: bool):
        self.backward = backward
        self.num_threads = 32 * WARPS

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mTarget: cute.Tensor, mIdx: cute.Tensor,
                 mHi: cute.Tensor, mLen: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor,
                 mC: cute.Tensor, mD: cute.Tensor, stream):
        rows = mLogits.shape[0]
        self.kernel(mLogits, mTarget, mIdx, mHi, mLen, mA, mB, mC, mD).launch(
            grid=[(rows + WARPS - 1) // WARPS, 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mTarget: cute.Tensor, mIdx: cute.Tensor,
               mHi: cute.Tensor, mLen: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor,
               mC: cute.Tensor, mD: cute.Tensor):
        """Device entry. Forward: ``mA..mD`` = kl, lse, tsum (outputs, ``[R]`` float32) and the
        valid count (``[R]`` int32). Backward: ``mA`` = dkl, ``mB`` = lse, ``mC`` = tsum
        (inputs, ``[R]`` float32) and ``mD`` = dlogits (``[R, K]`` float32 output)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        r = bidx * WARPS + tidx // 32
        rows = mLogits.shape[0]
        K = mLogits.shape[1]
        if r < rows:
            base = Int64(r) * Int64(K) * 4
            logits = mLogits.iterator.toint() + base
            target = mTarget.iterator.toint() + base
            idx = mIdx.iterator.toint() + base
            hi = mHi[r]
            length = cutlass.min(mLen[r], K)
            if const_expr(self.backward):
                self._backward(logits, target, idx, hi, length, K, lane, mA[r], mB[r], mC[r],
                               mD.iterator.toint() + base)
            else:
                self._forward(logits, target, idx, hi, length, lane, mA, mB, mC, mD, r)

    @cute.jit
    def _load(self, logits, target, idx, hi, length, j):
        """(valid, logit, target) of slot ``j`` (any ``j``: past ``length`` it reads slot 0 and is
        not valid)."""
        jj = cutlass.select_(j < length, j, Int32(0))
        index = ld_global_nc_b32(idx + Int64(jj) * 4)
        valid = (j < length) & (index >= 0) & (index <= hi)
        return (valid, ld_global_nc_f32(logits + Int64(jj) * 4),
                ld_global_nc_f32(target + Int64(jj) * 4))

    @cute.jit
    def _forward(self, logits, target, idx, hi, length, lane, mKl, mLse, mTsum, mCount, r):
        m = Float32(NEG_INF)
        s = Float32(0.0)
        a = Float32(0.0)
        tsum = Float32(0.0)
        count = Int32(0)
        for j0 in cutlass.range(0, length, 32 * UNROLL, unroll=1):
            slots = [self._load(logits, target, idx, hi, length, j0 + u * 32 + lane)
                     for u in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                valid, x, t = slots[u]
                if valid:
                    m_new = cute.arch.fmax(m, x)
                    s = s * _scaled_exp(m, m_new) + cutlass.select_(
                        m_new == Float32(NEG_INF), Float32(0.0), cute.math.exp(x - m_new))
                    m = m_new
                    count = count + 1
                    if t != Float32(0.0):
                        a = a + (t * cute.math.log(t) - t * x)
                        tsum = tsum + t
        for k in cutlass.range_constexpr(5):
            off = 16 >> k
            m_o = cute.arch.shuffle_sync_bfly(m, offset=off)
            s_o = cute.arch.shuffle_sync_bfly(s, offset=off)
            m_new = cute.arch.fmax(m, m_o)
            s = s * _scaled_exp(m, m_new) + s_o * _scaled_exp(m_o, m_new)
            m = m_new
            a = a + cute.arch.shuffle_sync_bfly(a, offset=off)
            tsum = tsum + cute.arch.shuffle_sync_bfly(tsum, offset=off)
            count = count + cute.arch.shuffle_sync_bfly(count, offset=off)
        if lane == 0:
            lse = cutlass.select_(m == Float32(NEG_INF), Float32(NEG_INF), m + cute.math.log(s))
            kl = a + cutlass.select_(tsum != Float32(0.0), tsum * lse, Float32(0.0))
            kl = cutlass.select_(count > 0, kl, Float32(0.0))
            out = Int64(r) * 4
            st_global_f32(mKl.iterator.toint() + out, kl)
            st_global_f32(mLse.iterator.toint() + out, lse)
            st_global_f32(mTsum.iterator.toint() + out, tsum)
            st_global_b32(mCount.iterator.toint() + out, count)

    @cute.jit
    def _backward(self, logits, target, idx, hi, length, K, lane, dkl, lse, tsum, dlogits):
        for j0 in cutlass.range(0, K, 32 * UNROLL, unroll=1):
            slots = [self._load(logits, target, idx, hi, length, j0 + u * 32 + lane)
                     for u in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                j = j0 + u * 32 + lane
                valid, x, t = slots[u]
                g = dkl * (cute.math.exp(x - lse) * tsum - t)
                if j < K:
                    st_global_f32(dlogits + Int64(j) * 4,
                                  cutlass.select_(valid, g, Float32(0.0)))


# ------------------------------------------------------------------------------------------------
# compiling (the launcher is in kl_host.py)
# ------------------------------------------------------------------------------------------------

def compile_kl(backward: bool):
    """Compiles the forward (``backward=False``) or backward kernel (no GPU needed when the target
    arch is set). R and K are symbolic. Returns the TVM-FFI callable: forward ``fn(logits,
    target, indices, hi, length, kl, lse, tsum, count)``, backward ``fn(logits, target, indices,
    hi, length, dkl, lse, tsum, dlogits)`` (``[R, K]`` float32 / float32 / int32 contiguous;
    ``hi``, ``length``, ``count`` ``[R]`` int32; ``kl``, ``lse``, ``tsum``, ``dkl`` ``[R]``
    float32; ``dlogits`` ``[R, K]`` float32), launched on the current stream."""
    kernel = IndexerKlSm90(backward)
    rows, width = cute.sym_int(), cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor
    mat = [fake(dt, (rows, width), stride_order=(1, 0), assumed_align=4)
           for dt in (Float32, Float32, Int32)]
    vec_i = [fake(Int32, (rows,), assumed_align=4) for _ in range(2)]
    vec_f = [fake(Float32, (rows,), assumed_align=4) for _ in range(3)]
    last = (fake(Float32, (rows, width), stride_order=(1, 0), assumed_align=4) if backward
            else fake(Int32, (rows,), assumed_align=4))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *mat, *vec_i, *vec_f, last, stream, options="--enable-tvm-ffi")
