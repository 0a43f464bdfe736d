"""Each row of slots in ascending key order, for Hopper (SM90a), written in CuTe DSL.

For ``indices [R, K]`` int32, an optional ``topk_length [R]`` and the key count ``S``, writes
``out [R, K]`` int32: row ``r``'s valid slots (``0 <= index < S`` at a position ``<
topk_length[r]``) in ascending index order, duplicates kept, then -1. A row's slots as a multiset
are unchanged; only their order is, so a sparse-attention backward over the sorted rows computes
the same sums (in another order) and, with ``topk_length`` passed on unchanged, sees the same
valid slots (at most ``topk_length[r]`` of them, now all first).

Why: the SM90 backward adds each slot's dkv row into an fp32 accumulator ``[S, d_qk]`` with L2
atomics (:mod:`.bwd`). When the accumulator and kv outgrow the L2, the order in which the CTAs
of a wave touch the keys decides how often a line is fetched from memory again: with every row
ascending, the CTAs running at once walk nearby keys (performance.md, "Deterministic backward":
H100, 2026-12-06, 0.63-0.84x the backward's time on random rows at T 16384, S 32768, this
kernel's 0.87 ms included; 0.10 ms on rows that are ascending already).

Design: one CTA per row, ``N`` = the row's slots padded to a power of two (at most
:data:`MAX_N`), ``N * 4`` bytes of shared memory. The row is read once (coalesced, one word per
thread and pass), its invalid slots and the padding become ``INT32_MAX`` (above every key), and
every thread checks its neighbours; an ascending row (the lightning indexer's, and most rows of
a causal window) is written straight back. Any other row is sorted in shared memory by a bitonic
network (``log2 N (log2 N + 1) / 2`` stages, each thread one compare-exchange of a pair per
``2 * num_threads`` elements and stage, a barrier between stages), then written with
``INT32_MAX`` as -1. The result depends only on the row: no atomics, bitwise the same in every
run.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from .ptx import ld_global_nc_b32, st_global_b32

INT32_MAX = 2**31 - 1
MAX_N = 8192  # the longest row (slots, padded to a power of two) the kernel sorts
MIN_N = 256  # the shortest: two slots a thread at the fewest threads (128)


def threads_for(n: int) -> int:
    """The CTA's threads for rows padded to ``n``: 8 slots a thread, between 128 and 512."""
    return max(128, min(512, n // 8))


class RowSortSm90:
    """Compile-time configuration: ``n`` (a power of two, :data:`MIN_N` to :data:`MAX_N`: the
    padded row; rows of more than ``n`` slots are not sorted, so the launcher passes ``K <= n``)
    and whether a ``topk_length`` is read."""

    def __init__(self, n: int, has_len: bool):
        if n < MIN_N or n > MAX_N or n & (n - 1):
            raise ValueError(f"sparse_mla: the sm90 row sort takes a power of two from {MIN_N} "
                             f"to {MAX_N} slots, got {n}")
        self.n = n
        self.has_len = has_len
        self.num_threads = threads_for(n)

    @cute.jit
    def __call__(self, mIdx: cute.Tensor, mLen: Optional[cute.Tensor], mOut: cute.Tensor, S: Int32, stream):
        self.kernel(mIdx, mLen, mOut, S).launch(
            grid=[mIdx.shape[0], 1, 1],
            block=[self.num_threads, 1, 1],
            smem=self.n * 4 + 64,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mLen: Optional[cute.Tensor], mOut: cute.Tensor, S: Int32):
        """Device entry: one CTA per row (the module docstring)."""
        nt, n = self.num_threads, self.n
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        K = mIdx.shape[1]
        length = K
        if const_expr(self.has_len):
            length = cutlass.max(cutlass.min(mLen[r], K), Int32(0))
        row_in = mIdx.iterator.toint() + Int64(r) * Int64(K) * 4
        row_out = mOut.iterator.toint() + Int64(r) * Int64(K) * 4
        smem = cutlass.memory.SmemAllocator()
        sKeys = smem.allocate_tensor(Int32, cute.make_layout((n,)), 16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)
        if tidx == 0:
            sFlag[0] = Int32(0)
        for u in cutlass.range_constexpr(n // nt):
            i = u * nt + tidx
            key = Int32(INT32_MAX)
            if i < length:
                x = ld_global_nc_b32(row_in + Int64(i) * 4)
                key = cutlass.select_((x >= 0) & (x < S), x, Int32(INT32_MAX))
            sKeys[i] = key
        cute.arch.sync_threads()
        bad = Int32(0)
        for u in cutlass.range_constexpr(n // nt):
            i = u * nt + tidx
            if i + 1 < n:
                bad = bad | Int32(sKeys[i] > sKeys[i + 1])
        if bad != 0:
            sFlag[0] = Int32(1)
        cute.arch.sync_threads()
        if sFlag[0] != 0:
            self._bitonic(sKeys, tidx)
        for u in cutlass.range_constexpr(n // nt):
            i = u * nt + tidx
            if i < K:
                key = sKeys[i]
                st_global_b32(row_out + Int64(i) * 4,
                              cutlass.select_(key == Int32(INT32_MAX), Int32(-1), key))

    @cute.jit
    def _bitonic(self, sKeys, tidx):
        """Sorts the ``n`` keys of ``sKeys`` ascending in place (a bitonic network; every thread
        exchanges ``n / (2 * num_threads)`` pairs per stage)."""
        nt, n = self.num_threads, self.n
        stages = bitonic_stages(n)
        for s in cutlass.range_constexpr(len(stages)):
            k, j = stages[s]
            for p in cutlass.range_constexpr(n // (2 * nt)):
                lo = pair_low(p * nt + tidx, j)
                hi = lo + j
                a, b = sKeys[lo], sKeys[hi]
                up = (lo & k) == 0
                small, large = cutlass.min(a, b), cutlass.max(a, b)
                sKeys[lo] = cutlass.select_(up, small, large)
                sKeys[hi] = cutlass.select_(up, large, small)
            cute.arch.sync_threads()


def pair_low(q, j: int):
    """The lower element of the ``q``-th pair at distance ``j`` (a power of two): ``q`` with a
    0 bit inserted at bit ``log2 j``. ``q`` is an int, a DSL integer or an integer tensor."""
    lj = j.bit_length() - 1
    return ((q >> lj) << (lj + 1)) | (q & (j - 1))


def bitonic_stages(n: int) -> list[tuple[int, int]]:
    """The bitonic network's stages for ``n`` (a power of two) keys, in order: ``(k, j)``, the
    size of the sequences being merged and the distance of the pairs compared (an element
    ``i`` with bit ``j`` clear is compared with ``i + j``, ascending where ``i & k == 0``)."""
    stages = []
    k = 2
    while k <= n:
        j = k // 2
        while j >= 1:
            stages.append((k, j))
            j //= 2
        k *= 2
    return stages


def compile_sort(n: int, has_len: bool):
    """Compiles one row-sort kernel (no GPU needed when the target arch is set). R and K are
    symbolic (K <= n). Returns the TVM-FFI callable ``fn(indices, topk_length_or_None, out, S)``
    (``indices`` and ``out`` ``[R, K]`` int32, contiguous; ``topk_length [R]`` int32 when
    ``has_len``; ``S`` an int), launched on the current stream."""
    kernel = RowSortSm90(n, has_len)
    rows, width = cute.sym_int(), cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor
    idx = fake(Int32, (rows, width), stride_order=(1, 0), assumed_align=4)
    out = fake(Int32, (rows, width), stride_order=(1, 0), assumed_align=4)
    length = fake(Int32, (rows,), assumed_align=4) if has_len else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, idx, length, out, Int32(0), stream, options="--enable-tvm-ffi")
