"""The lightning indexer's per-row top-k select for Hopper (SM90a), written in CuTe DSL.

For every row ``r`` of a score buffer ``buf [R, ld]`` float32 and its length ``n = row_len[r]``
(clamped to ``[0, ld]``), writes the ``min(topk, n)`` largest of ``buf[r, :n]`` to
``out_indices[r]`` (their key indices, in ascending order, then -1) and ``out_scores[r]`` (their
scores, bit for bit, then 0). Order: a NaN (any payload, either sign) ranks above +inf, -0.0
equals +0.0, and of exactly equal scores the smaller key index wins, so the selected set is a
deterministic function of the row.

Design
------
* One CTA per row (grid ``R``), ``num_threads`` threads. A row with ``n <= topk`` selects all
  its keys: one coalesced copy pass (four loads per thread in flight), no selection.
* Order-preserving keys: the float's bits ``x`` (int32) become ``key = x`` for ``x >= 0`` and
  ``x ^ 0x7fffffff`` for ``x < 0`` (more negative float, smaller key), after -0.0 -> +0.0, and
  every NaN -> ``0x7fffffff`` (above +inf, ``0x7f800000``). ``u = key ^ 0x80000000`` orders the
  same as unsigned bits, so its digits form a radix; ``key >> s`` (arithmetic) is monotone in the
  key and equal exactly on the keys that share their top ``32 - s`` bits. No float has ``u``'s
  top digit below 3 (-inf is ``0x007fffff``), so ``u = 0`` is a sentinel below every element.
* Radix select (digits 11, 11, 10 bits from the top; 2048-bin shared-memory histograms filled
  with ``red.shared.add``; two histogram buffers, the first reused for the third digit): each
  pass histograms the digit of the elements whose higher digits equal the threshold's; a
  block-wide scan of the bins (highest first) finds the bin of the ``need``-th largest element,
  the count above it, and the bin's own count. ``need`` drops by the count above; the selection
  stops after the pass where the bin holds exactly ``need`` elements (all of it is taken), else
  after the last digit, where the bin holds exactly equal keys. With the threshold prefix
  ``thr`` at the final shift ``s``: an element is selected iff ``key >> s > thr`` or (``key >> s
  == thr`` and it is among the first ``need`` such in index order).
* Guessed threshold, for a row longer than the row cache (up to ``8 * cache_elems``) when ``topk +
  2 * margin`` candidates fit the row cache next to the row's two bitmaps (``margin = max(topk /
  4, 256)``): one 16-byte vector in ``SAMPLE = 8`` is read (a quarter of the row's 32-byte
  sectors) and its radix keys kept in the row cache; two histogram passes over that sample find
  the 22-bit prefix of its ``k_s``-th largest key, ``k_s`` being the sample's share of ``topk +
  margin``. The lowest key of that prefix, as a float ``t``, is the guess: one pass over the row
  appends every element with ``x >= t`` or NaN (``setp.geu.f32``, which is ``order_key(x) >=
  order_key(t)`` for every float) to the candidates as ``(float bits, index)``, counting them.
  Their count is about ``topk + margin``, with a standard deviation of about ``sqrt(7 (topk +
  margin))`` for a sample of one in eight: the margin is 3.5 of them at topk 512, 3.8 at 2048, and
  the room for ``topk + 2 margin`` as many above. With at least ``topk`` candidates and no more
  than fit, the top ``topk`` of the row are all among them: a radix select over the candidates
  alone (digits as below), their bits set in the selected and tied bitmaps, the ties ranked as
  below, and each selected candidate writes itself to its output slot, the rank of its index in
  the selected bitmap (a per-word prefix of popcounts, kept over the tied bitmap, resolved by
  then). Otherwise (a sample far from the rest of the row, exact ties across the guess, a guess
  among NaNs) the radix select below runs over the whole row. The row is read 1.25 times instead
  of twice, with one float comparison per element where the radix select's two passes convert,
  histogram and compare every element twice.
* The first pass reads the row from global memory in 16-byte vectors (four per thread in
  flight). A row of at most ``cache_elems`` keeps its radix keys ``u`` in shared memory, padded
  with sentinels to whole tiles (the later passes read it without bounds checks); a longer row
  is re-read from global memory (L2).
* Candidates and bitmaps: when the first digit's threshold bin holds at most ``cand_elems``
  elements, a second pass over the row appends their ``(radix key, index)`` pairs to a
  shared-memory buffer (one ``atom.shared.add`` on a counter per warp and batch of 16 elements a
  thread, any order) and sets, with ``red.shared.or``, the bits of the elements above that bin in
  a bitmap of the row (one bit a key, ``ceil(n / 32)`` words). Read from global memory, this pass
  walks the row from its end: the first pass read that end last, so more of it is still in L2. The
  second and third digits are histogrammed over the candidates alone; then the candidates above
  the final threshold get their bits, and so do those at it when all of them are taken. Otherwise
  (exact ties across the boundary) those go to a second bitmap, and a block scan of the threads'
  counts of its bits (each thread owns a contiguous range of words) moves the first ``need`` of
  them, in index order, into the first. A cached row's bitmaps have their own buffer
  (``cache_elems / 16`` words); a longer row's use the row cache, unused then, so rows up to ``16
  * cache_elems`` keys take this path.
* Output from the bitmap: a block scan of the threads' popcounts gives each thread the first
  slot of its words' bits; the threads write ``(index, score)`` of their bits in order into a
  shared-memory staging area (the candidates' buffer, free by now; ``cand_elems`` slots a
  round), and the staged slots go out in coalesced rows. Slots are therefore in ascending key
  index and ties go to the smaller index. A score comes from the row cache (rebuilt from its
  key, re-read from global memory for the keys that stand for several floats: +-0, NaN) or is
  re-read from global memory.
* Fallback, when the threshold bin holds more than ``cand_elems`` elements or a row is too long
  for its bitmaps: the second and third digits are histogrammed over the whole row, then an
  ordered compaction walks it in tiles of ``16 * num_threads`` elements, 16 consecutive per
  thread: each thread counts its elements above and equal to the threshold, one block-wide
  exclusive scan of the packed counts ``above + 65536 * equal`` (warp shuffles, then the warps'
  totals in shared memory, double-buffered by tile parity) gives each element its slot:
  ``above_before + min(equal_before, need)``. The tile loop stops once all ``topk`` slots are
  filled.
* Occupancy: ``min_blocks`` CTAs per SM bound the registers (``nvvm.minctasm``); the shared
  memory carveout is the largest.
* 64-bit addressing of the buffer and outputs (``R * ld`` may pass 2**31). One compiled kernel
  serves every ``R``, ``ld`` and ``topk`` (symbolic); the compile key is ``(num_threads,
  cache_elems, cand_elems, min_blocks)``. Launched on torch's current stream through TVM-FFI.

Measured (H200, torch 2.11, 2026-12-03; real score buffers: the score kernel's output for
``randn`` q and k, 64 heads, causal ``row_len = t + 1``, the rows of one chunk; topk 2048; CUDA
events, medians of 3 interleaved rounds; cuDNN frontend 1.32's ``indexer_top_k_wrapper`` on
the same buffer in the same process; all outputs bitwise the same as the compaction's):

==========  ============  =================  ===============================  ==========
T           rows          this kernel ms     the compaction (before) ms       cuDNN ms
==========  ============  =================  ===============================  ==========
16384       0-16384       0.641              0.777                            0.528
32768       24576-32768   0.841              1.026                            0.745
65536       28672-32768   0.461              0.564                            0.428
65536       61440-65536   0.875              1.103                            0.722
131072      129024-       0.916              1.139                            0.703
==========  ============  =================  ===============================  ==========

The staged output made the most of it (16384: 0.79 -> 0.64 ms; writing each slot straight to
global memory, a warp's 32 stores fell on 32 sectors); the reversed second pass gave 2-4% on
rows longer than the cache. 512 threads with a 16384-key cache and 2 CTAs per SM were the
fastest of the configurations measured on rows longer than the cache (256 threads, 8192 keys,
3 CTAs: 1-7% slower there, 1-25% faster on rows under 8192 keys); 8 vectors in flight per
thread in the global passes instead of 4 were 1-3% slower.

Rows longer than the row cache then went to the guessed threshold. Measured on an H100 (torch
2.11, 2026-12-06): every chunk of the fp8 score kernel's output for ``bench lightning --fp8``'s
problems (T = S, causal, 64 heads, topk 2048), the select's time summed over the chunks (medians
of 5 calls each), the radix select alone against this kernel, outputs bitwise the same:

==========  ===================  =============  =======
T           radix select ms      this kernel    speed
==========  ===================  =============  =======
16384       0.667                0.674          0.99x
32768       2.617                2.531          1.03x
65536       8.881                7.024          1.26x
131072      35.883               24.104         1.49x
==========  ===================  =============  =======

(T 16384 has no row longer than the cache.) Then the radix select's candidates too took one
atomic per warp and batch: 0.679 / 2.153 / 6.669 ms against 0.684 / 2.213 / 6.776 at T 16384 /
32768 / 65536 (same process, bitwise the same). With the guess, 256 threads, an 8192-key cache
and 3 CTAs per SM took 0.630 / 1.955 / 8.967 ms there: faster while the rows are at most 32768
keys, slower past that (rows past 32768 do not fit the guess's candidates next to their bitmaps
in the smaller cache), so the launcher takes that configuration for buffers of rows up to 32768
keys (``topk_host.SHORT_CONFIG``). Of the others measured the same way (H100, 2026-12-06), 256
threads with a 12288-key cache and 2 CTAs per SM took 0.743 / 2.140 / 7.054 ms, 1024 threads
with 16384 keys and 1 CTA 1.213 / 3.334 / 8.888, and 128 threads with 4096 keys and 5 CTAs
0.844 / 3.087 / 11.879, against 0.677 / 2.092 / 6.845 for the default and 0.626 / 1.914 / 9.132
for the short rows' configuration.

The guess on rows that fit the cache, from the cached row, was slower: 0.786 against 0.661 ms at
T 16384 (same process). Its ~2600 candidates are a third of such a row, and each takes several
passes; the radix select's second pass reads the cached row anyway.

The radix select with a shared-memory histogram per digit is the standard GPU selection
technique, and selecting from a sample's order statistic is Floyd and Rivest's (1975); this
kernel's own choices are the digit split, the exact-need early stop, the candidate buffer, the
bitmap output with its tie ranking, the guess as one float comparison, the slot of a candidate
from the bitmap's word prefix, and the fallback compaction. cuDNN frontend 1.32's deterministic
SM90 top-k also orders its output with an index bitmap and popcounts.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .common import SMEM_LIMIT
from .ptx import (atom_shared_add, ge_or_nan, ld_global_nc_b32, ld_global_v4, ld_shared_b32,
                  ld_shared_v4, popc, red_shared_add_1, red_shared_or, st_global_b32,
                  st_shared_b32_ordered, st_shared_v2, st_shared_v4)

BINS = 2048  # histogram bins (the widest digit, 11 bits)
DIGITS = ((21, 0x7FF), (10, 0x7FF), (0, 0x3FF))  # (shift, mask) of the three digits
VEC = 4  # elements per 16-byte vector
BATCH = 4  # vectors per thread in flight in a pass
PER_THREAD = 16  # consecutive elements per thread in a compaction tile
INT_MIN = -(2**31)
SAMPLE = 8  # the guess samples one 16-byte vector in SAMPLE
MIN_MARGIN = 256  # the guess aims at topk + max(topk / 4, MIN_MARGIN) candidates
NEG_INF_BITS = -0x800000  # 0xff800000, -inf
KEY_NEG_INF = NEG_INF_BITS ^ 0x7FFFFFFF  # order_key(-inf); keys below it are negative NaNs'


# ------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------

@cute.jit
def order_key(x: Int32) -> Int32:
    """The order-preserving signed key of a float's bits ``x`` (module docstring)."""
    x = cutlass.select_(x == Int32(INT_MIN), Int32(0), x)
    key = cutlass.select_(x < 0, x ^ Int32(0x7FFFFFFF), x)
    return cutlass.select_((x & Int32(0x7FFFFFFF)) > Int32(0x7F800000), Int32(0x7FFFFFFF), key)


class TopkSelectSm90:
    """Compile-time configuration of one select kernel (see the module docstring)."""

    def __init__(self, num_threads: int, cache_elems: int, cand_elems: int, min_blocks: int):
        tile = PER_THREAD * num_threads
        if (num_threads not in (128, 256, 512, 1024) or cache_elems % tile != 0
                or cand_elems <= 0 or cand_elems % num_threads != 0 or min_blocks < 1):
            raise ValueError(f"lightning_indexer: sm90 top-k needs 128, 256, 512 or 1024 threads, "
                             f"a row cache of a multiple of {PER_THREAD} x threads, a candidate "
                             f"buffer of a multiple of threads and min_blocks >= 1, got "
                             f"{num_threads}, {cache_elems}, {cand_elems}, {min_blocks}")
        self.num_threads = num_threads
        self.num_warps = num_threads // 32
        self.cache_elems = cache_elems
        self.cand_elems = cand_elems
        self.min_blocks = min_blocks
        self.tile = tile
        self.bins_per_thread = BINS // num_threads
        if self._smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"lightning_indexer: sm90 top-k row cache of {cache_elems} and "
                             f"{cand_elems} candidates do not fit in shared memory")

    def _smem_bytes(self):
        # row cache, 2 histograms, candidates (key, index), their counter, the cached rows' two
        # bitmaps, 2 x warps' totals, 4 result words, alignment slack
        return 4 * (self.cache_elems + 2 * BINS + 2 * self.cand_elems + 4
                    + self.cache_elems // 16 + 2 * self.num_warps + 4) + 256

    @cute.jit
    def __call__(self, mBuf: cute.Tensor, mRowLen: cute.Tensor, mIdx: cute.Tensor,
                 mScore: cute.Tensor, stream):
        self.kernel(mBuf, mRowLen, mIdx, mScore).launch(
            grid=[mBuf.shape[0], 1, 1],
            block=[self.num_threads, 1, 1],
            smem=self._smem_bytes(),
            stream=stream,
            min_blocks_per_mp=self.min_blocks,
            preferred_smem_carveout=100,  # percent: the most shared memory (several rows per SM)
        )

    @cute.kernel
    def kernel(self, mBuf: cute.Tensor, mRowLen: cute.Tensor, mIdx: cute.Tensor,
               mScore: cute.Tensor):
        """Device entry: one CTA per row; the design is the module docstring."""
        nt = self.num_threads
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        ld = mBuf.shape[1]
        topk = mIdx.shape[1]
        n = cutlass.max(cutlass.min(mRowLen[r], ld), Int32(0))
        row = mBuf.iterator.toint() + Int64(r) * Int64(ld) * 4
        out_off = Int64(r) * Int64(topk)
        idx_row = mIdx.iterator.toint() + out_off * 4
        score_row = mScore.iterator.toint() + out_off * 4

        smem = cutlass.memory.SmemAllocator()
        sRow = smem.allocate_tensor(Int32, cute.make_layout((self.cache_elems,)), 16)
        sHist = smem.allocate_tensor(Int32, cute.make_layout((2 * BINS,)), 16)
        sCand = smem.allocate_tensor(Int32, cute.make_layout((2 * self.cand_elems,)), 16)
        sCount = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)
        sBits = smem.allocate_tensor(Int32, cute.make_layout((self.cache_elems // 16,)), 16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((2 * self.num_warps,)), 16)
        sRes = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)
        row_s = sRow.iterator.toint()
        hist_a = sHist.iterator.toint()
        hist_b = hist_a + BINS * 4
        cand_s = sCand.iterator.toint()
        count_s = sCount.iterator.toint()

        if n <= topk:
            # every key is selected: indices 0..n-1 with their scores, then -1 / 0
            # (BATCH slots per thread at a time, their loads in flight together; ld >= 4)
            for base in cutlass.range(0, topk, nt * BATCH, unroll=1):
                vals = []
                for u in cutlass.range_constexpr(BATCH):
                    j = base + u * nt + tidx
                    j = cutlass.max(cutlass.min(j, n - 1), Int32(0))
                    vals.append(ld_global_nc_b32(row + Int64(j) * 4))
                for u in cutlass.range_constexpr(BATCH):
                    j = base + u * nt + tidx
                    if j < topk:
                        st_global_b32(idx_row + Int64(j) * 4,
                                      cutlass.select_(j < n, j, Int32(-1)))
                        st_global_b32(score_row + Int64(j) * 4,
                                      cutlass.select_(j < n, vals[u], Int32(0)))
        else:
            nvec = (n + VEC - 1) // VEC
            n_words = (n + 31) // 32
            margin = cutlass.max(topk // 4, Int32(MIN_MARGIN))
            nvs = (nvec + SAMPLE - 1) // SAMPLE
            done = Int32(0)
            # a row longer than the row cache: the candidates' room in it, after the bitmaps
            cap = (self.cache_elems - 2 * n_words) // 2
            if ((n > self.cache_elems) & (nvs * VEC <= self.cache_elems)
                    & (topk + 2 * margin <= cap)):
                done = self._guessed(row, row_s, sHist, hist_a, hist_b, count_s, sWarp, sRes, n,
                                     nvec, nvs, n_words, topk, cap, margin, idx_row, score_row,
                                     tidx, lane, warp)
            if done == 0:
                self._radix(row, row_s, sHist, sCand, sCount, sBits, sWarp, sRes, hist_a, hist_b,
                            cand_s, count_s, n, nvec, n_words, topk, idx_row, score_row, tidx,
                            lane, warp)

    @cute.jit
    def _radix(self, row, row_s, sHist, sCand, sCount, sBits, sWarp, sRes, hist_a, hist_b,
               cand_s, count_s, n, nvec, n_words, topk, idx_row, score_row, tidx, lane, warp):
        """The radix select over the whole row (module docstring, from "Radix select" to
        "Fallback"), for a row longer than ``topk``."""
        nt = self.num_threads
        cute.arch.sync_threads()  # the shared memory may still be read by the guessed select
        for i in cutlass.range_constexpr(2 * BINS // nt):
            sHist[i * nt + tidx] = Int32(0)
        if tidx == 0:
            sCount[0] = Int32(0)
        cached = n <= self.cache_elems
        # the bitmaps (selected, tied), n_words words each: a cached row's in their own
        # buffer, a longer row's in the unused row cache when they fit there
        fits = cached | (2 * n_words <= self.cache_elems)
        sel_s = cutlass.select_(cached, sBits.iterator.toint(), row_s)
        eq_s = sel_s + n_words * 4
        if fits:
            for w in cutlass.range(tidx, 2 * n_words, nt, unroll=1):
                st_shared_b32_ordered(sel_s + w * 4, Int32(0))
        cute.arch.sync_threads()
        # vectors of the cached row, padded with sentinels to whole tiles
        npv = (n + self.tile - 1) // self.tile * (self.tile // VEC)
        if cached:
            self._first_pass(row, row_s, hist_a, n, nvec, tidx, True)
        else:
            self._first_pass(row, row_s, hist_a, n, nvec, tidx, False)
        cute.arch.sync_threads()
        need = topk
        b, above, count = self._find(sHist, 0, sWarp, sRes, need, tidx, lane, warp)
        top_bin = b
        thr_u = b << DIGITS[0][0]
        need = need - above
        shift = Int32(DIGITS[0][0])
        n_cand = count
        cnt = count
        with_cand = n_cand <= self.cand_elems
        use_bits = fits & with_cand
        if use_bits | (cnt != need):
            # histogram A is free again (its scan is over): zeroed for the third digit
            for i in cutlass.range_constexpr(BINS // nt):
                sHist[i * nt + tidx] = Int32(0)
            if with_cand:
                if cached:
                    self._gather(row, row_s, cand_s, count_s, sel_s, use_bits, n, nvec, npv,
                                 top_bin, tidx, True)
                else:
                    self._gather(row, row_s, cand_s, count_s, sel_s, use_bits, n, nvec, npv,
                                 top_bin, tidx, False)
                cute.arch.sync_threads()
                if cnt != need:
                    self._cand_hist(lambda i: sCand[2 * i], hist_b, n_cand, thr_u, 1, False,
                                    tidx)
                    cute.arch.sync_threads()
                    b, above, cnt = self._find(sHist, BINS, sWarp, sRes, need, tidx, lane,
                                               warp)
                    thr_u = thr_u | (b << DIGITS[1][0])
                    need = need - above
                    shift = Int32(DIGITS[1][0])
                    if cnt != need:
                        self._cand_hist(lambda i: sCand[2 * i], hist_a, n_cand, thr_u, 2, True,
                                        tidx)
                        cute.arch.sync_threads()
                        b, above, cnt = self._find(sHist, 0, sWarp, sRes, need, tidx, lane,
                                                   warp)
                        thr_u = thr_u | b
                        need = need - above
                        shift = Int32(0)
            else:
                if cached:
                    self._hist_pass(row, row_s, hist_b, n, nvec, npv, thr_u, 1, tidx, True)
                else:
                    self._hist_pass(row, row_s, hist_b, n, nvec, npv, thr_u, 1, tidx, False)
                cute.arch.sync_threads()
                b, above, cnt = self._find(sHist, BINS, sWarp, sRes, need, tidx, lane, warp)
                thr_u = thr_u | (b << DIGITS[1][0])
                need = need - above
                shift = Int32(DIGITS[1][0])
                if cnt != need:
                    if cached:
                        self._hist_pass(row, row_s, hist_a, n, nvec, npv, thr_u, 2, tidx,
                                        True)
                    else:
                        self._hist_pass(row, row_s, hist_a, n, nvec, npv, thr_u, 2, tidx,
                                        False)
                    cute.arch.sync_threads()
                    b, above, cnt = self._find(sHist, 0, sWarp, sRes, need, tidx, lane,
                                               warp)
                    thr_u = thr_u | b
                    need = need - above
                    shift = Int32(0)
        thr = (thr_u ^ Int32(INT_MIN)) >> shift
        if use_bits:
            self._cand_mark(sCand, n_cand, thr, shift, cnt == need, sel_s, eq_s, tidx)
            cute.arch.sync_threads()
            if cnt != need:
                self._tie_mark(sel_s, eq_s, n_words, need, sWarp, tidx, lane, warp)
                cute.arch.sync_threads()
            if cached:
                self._emit(sel_s, n_words, topk, cand_s, row, row_s, idx_row, score_row,
                           sWarp, tidx, lane, warp, True)
            else:
                self._emit(sel_s, n_words, topk, cand_s, row, row_s, idx_row, score_row,
                           sWarp, tidx, lane, warp, False)
        else:
            if cached:
                self._compact(row, row_s, n, nvec, topk, thr, shift, need, sWarp, idx_row,
                              score_row, tidx, lane, warp, True)
            else:
                self._compact(row, row_s, n, nvec, topk, thr, shift, need, sWarp, idx_row,
                              score_row, tidx, lane, warp, False)

    @cute.jit
    def _guessed(self, row, row_s, sHist, hist_a, hist_b, count_s, sWarp, sRes, n, nvec, nvs,
                 n_words, topk, cap, margin, idx_row, score_row, tidx, lane, warp):
        """The select from a sampled guess for a row longer than the row cache (module
        docstring, "Guessed threshold"): returns 1 when it wrote the row's outputs, 0 when the
        guess failed (the caller then runs the radix select over the whole row). The row cache
        holds the sample's radix keys, then the two bitmaps and up to ``cap`` candidates
        ``(float bits, index)``."""
        nt = self.num_threads
        shift0, mask0 = DIGITS[0]
        shift1, mask1 = DIGITS[1]
        sel_s = row_s
        eq_s = sel_s + n_words * 4
        cands = row_s + 2 * n_words * 4
        for i in cutlass.range_constexpr(2 * BINS // nt):
            sHist[i * nt + tidx] = Int32(0)
        cute.arch.sync_threads()
        # the sample: vectors 0, SAMPLE, 2 SAMPLE, ... (a quarter of the row's 32-byte
        # sectors), their top digits histogrammed and their radix keys in the row cache (0 past
        # the row's end) for the second digit
        npv_s = (nvs + nt * BATCH - 1) // (nt * BATCH) * (nt * BATCH)
        for base in cutlass.range(0, nvs, nt * BATCH, unroll=1):
            vals = []
            for j in cutlass.range_constexpr(BATCH):
                v = cutlass.min(base + j * nt + tidx, nvs - 1) * SAMPLE
                vals.append(ld_global_v4(row + Int64(v) * (VEC * 4)))
            for j in cutlass.range_constexpr(BATCH):
                vs = base + j * nt + tidx
                us = []
                for i in cutlass.range_constexpr(VEC):
                    ok = vs * (SAMPLE * VEC) + i < n
                    u = cutlass.select_(ok, order_key(vals[j][i]) ^ Int32(INT_MIN), Int32(0))
                    if ok:
                        red_shared_add_1(hist_a + ((u >> shift0) & mask0) * 4)
                    us.append(u)
                st_shared_v4(row_s + vs * (VEC * 4), us[0], us[1], us[2], us[3])
        cute.arch.sync_threads()
        full = n // (SAMPLE * VEC)
        n_s = full * VEC + cutlass.min(Int32(VEC), n - full * (SAMPLE * VEC))
        # the sample's k_s-th largest stands for the row's (topk + margin)-th
        k_s = cutlass.min(((topk + margin) * n_s + n - 1) // n, n_s)
        b, above, _ = self._find(sHist, 0, sWarp, sRes, k_s, tidx, lane, warp)
        thr_u = b << shift0
        for v in cutlass.range(tidx, npv_s, nt, unroll=1):
            us = ld_shared_v4(row_s + v * (VEC * 4))
            for i in cutlass.range_constexpr(VEC):
                if ((us[i] ^ thr_u) >> shift0) == 0:
                    red_shared_add_1(hist_b + ((us[i] >> shift1) & mask1) * 4)
        cute.arch.sync_threads()
        b, _, _ = self._find(sHist, BINS, sWarp, sRes, k_s - above, tidx, lane, warp)
        key_g = (thr_u | (b << shift1)) ^ Int32(INT_MIN)
        done = Int32(0)
        # a guess among the NaNs' keys cannot be a float comparison: the radix select runs
        if key_g <= Int32(0x7F800000):
            # the guess as a float t: "x >= t or x is NaN" iff order_key(x) >= key_g
            t = cutlass.select_(key_g < 0, key_g ^ Int32(0x7FFFFFFF), key_g)
            t = cutlass.select_(key_g < Int32(KEY_NEG_INF), Int32(NEG_INF_BITS), t)
            for i in cutlass.range_constexpr(2 * BINS // nt):
                sHist[i * nt + tidx] = Int32(0)
            if tidx == 0:
                st_shared_b32_ordered(count_s, Int32(0))
            for w in cutlass.range(tidx, 2 * n_words, nt, unroll=1):
                st_shared_b32_ordered(sel_s + w * 4, Int32(0))
            cute.arch.sync_threads()
            # the candidates: every element at or above the guess; a thread's hits of a batch
            # in a bit mask, one shared-memory atomic per warp and batch for their room
            for base in cutlass.range(0, nvec, nt * BATCH, unroll=1):
                vals = self._load_batch(row, row_s, base, nvec, tidx, False)
                hits = Int32(0)
                for j in cutlass.range_constexpr(BATCH):
                    for i in cutlass.range_constexpr(VEC):
                        hit = (((base + j * nt + tidx) * VEC + i < n)
                               & (ge_or_nan(vals[j][i], t) != 0))
                        hits = hits | cutlass.select_(hit, Int32(1 << (j * VEC + i)), Int32(0))
                self._append(hits, [x for vec in vals for x in vec], base, cands, count_s, cap,
                             tidx)
            cute.arch.sync_threads()
            n_cand = ld_shared_b32(count_s)
            if (n_cand >= topk) & (n_cand <= cap):
                self._select_candidates(sHist, hist_a, hist_b, cands, sel_s, eq_s, sWarp,
                                        sRes, n_cand, n_words, topk, idx_row, score_row, tidx,
                                        lane, warp)
                done = Int32(1)
        return done

    @cute.jit
    def _append(self, hits, words, base, cands, count_s, cap, tidx):
        """Appends ``(words[m], index)`` for each bit ``m`` set in ``hits``, the elements of a
        batch (:meth:`_load_batch` at ``base``), to the candidates at ``cands``, at most ``cap``
        of them, and counts them all in ``count_s``: one ``atom.shared.add`` per warp for the
        warp's hits, placed in lane order."""
        lane = tidx % 32
        c = popc(hits)
        incl = self._warp_scan(c, lane)
        total = cute.arch.shuffle_sync(incl, 31)
        if total > 0:
            first = Int32(0)
            if lane == 31:
                first = atom_shared_add(count_s, total)
            pos = cute.arch.shuffle_sync(first, 31) + incl - c
            for j in cutlass.range_constexpr(BATCH):
                for i in cutlass.range_constexpr(VEC):
                    if ((hits >> (j * VEC + i)) & 1) != 0:
                        if pos < cap:
                            st_shared_v2(cands + pos * 8, words[j * VEC + i],
                                         (base + j * self.num_threads + tidx) * VEC + i)
                        pos = pos + 1

    @cute.jit
    def _cand(self, cands, i):
        """Candidate ``i``: (its float bits, its index)."""
        return ld_shared_b32(cands + i * 8), ld_shared_b32(cands + i * 8 + 4)

    @cute.jit
    def _cand_level(self, sHist, hist, cands, n_cand, need, thr_u, level: cutlass.Constexpr,
                    sWarp, sRes, tidx, lane, warp):
        """Histogram of digit ``level`` over the candidates whose higher digits equal
        ``thr_u``'s, then (bin, count above it, its count) of the ``need``-th largest."""
        self._cand_hist(lambda i: order_key(self._cand(cands, i)[0]) ^ Int32(INT_MIN), hist,
                        n_cand, thr_u, level, level > 0, tidx)
        cute.arch.sync_threads()
        return self._find(sHist, BINS if level == 1 else 0, sWarp, sRes, need, tidx, lane, warp)

    @cute.jit
    def _select_candidates(self, sHist, hist_a, hist_b, cands, sel_s, eq_s, sWarp, sRes, n_cand,
                           n_words, topk, idx_row, score_row, tidx, lane, warp):
        """The radix select of ``topk`` among ``n_cand`` candidates (histograms zeroed, bitmaps
        cleared), then the output in ascending index: a selected candidate's slot is its
        index's rank in the selected bitmap (each word's first slot, from a block scan of
        popcounts, written over the tied bitmap once the ties are resolved), staged in the
        histograms' memory ``BINS`` slots a round."""
        nt = self.num_threads
        need = topk
        b, above, cnt = self._cand_level(sHist, hist_a, cands, n_cand, need, Int32(0), 0, sWarp,
                                         sRes, tidx, lane, warp)
        thr_u = b << DIGITS[0][0]
        need = need - above
        shift = Int32(DIGITS[0][0])
        # histogram A again for the third digit (the scan of it is over)
        for i in cutlass.range_constexpr(BINS // nt):
            sHist[i * nt + tidx] = Int32(0)
        if cnt != need:
            b, above, cnt = self._cand_level(sHist, hist_b, cands, n_cand, need, thr_u, 1, sWarp,
                                             sRes, tidx, lane, warp)
            thr_u = thr_u | (b << DIGITS[1][0])
            need = need - above
            shift = Int32(DIGITS[1][0])
            if cnt != need:
                b, above, cnt = self._cand_level(sHist, hist_a, cands, n_cand, need, thr_u, 2,
                                                 sWarp, sRes, tidx, lane, warp)
                thr_u = thr_u | b
                need = need - above
                shift = Int32(0)
        thr = (thr_u ^ Int32(INT_MIN)) >> shift
        take_ties = cnt == need
        for i in cutlass.range(tidx, n_cand, nt, unroll=1):
            x, e = self._cand(cands, i)
            k = order_key(x) >> shift
            bit = Int32(1) << (e & 31)
            if (k > thr) | ((k == thr) & take_ties):
                red_shared_or(sel_s + (e >> 5) * 4, bit)
            if (k == thr) & (cnt != need):
                red_shared_or(eq_s + (e >> 5) * 4, bit)
        cute.arch.sync_threads()
        if cnt != need:
            self._tie_mark(sel_s, eq_s, n_words, need, sWarp, tidx, lane, warp)
            cute.arch.sync_threads()
        # each word's first slot, over the tied bitmap (done with)
        wpre_s = eq_s
        w0, w1, first = self._words_first(sel_s, n_words, 1, sWarp, tidx, lane, warp)
        for w in cutlass.range(w0, w1, 1, unroll=1):
            st_shared_b32_ordered(wpre_s + w * 4, first)
            first = first + popc(ld_shared_b32(sel_s + w * 4))
        cute.arch.sync_threads()
        stage_s = hist_a  # both histograms: BINS slots of (index, bits)
        for s0 in cutlass.range(0, topk, BINS, unroll=1):
            for i in cutlass.range(tidx, n_cand, nt, unroll=1):
                x, e = self._cand(cands, i)
                word = ld_shared_b32(sel_s + (e >> 5) * 4)
                if ((word >> (e & 31)) & 1) != 0:
                    slot = ld_shared_b32(wpre_s + (e >> 5) * 4) + popc(
                        word & ((Int32(-1) << (e & 31)) ^ Int32(-1)))
                    if (slot >= s0) & (slot < s0 + BINS):
                        st_shared_v2(stage_s + (slot - s0) * 8, e, x)
            cute.arch.sync_threads()
            for j in cutlass.range(tidx, cutlass.min(Int32(BINS), topk - s0), nt, unroll=1):
                pair = stage_s + j * 8
                off = Int64(s0 + j) * 4
                st_global_b32(idx_row + off, ld_shared_b32(pair))
                st_global_b32(score_row + off, ld_shared_b32(pair + 4))
            cute.arch.sync_threads()

    @cute.jit
    def _load_batch(self, row, row_s, base, nvec, tidx, from_smem: cutlass.Constexpr):
        """``BATCH`` vectors ``base + j * num_threads + tidx``: cached radix keys (padded, never
        past the cache) or the row's float bits (clamped to the row's last vector)."""
        vals = []
        for j in cutlass.range_constexpr(BATCH):
            if const_expr(from_smem):
                vals.append(ld_shared_v4(row_s + (base + j * self.num_threads + tidx) * (VEC * 4)))
            else:
                v = cutlass.min(base + j * self.num_threads + tidx, nvec - 1)
                vals.append(ld_global_v4(row + Int64(v) * (VEC * 4)))
        return vals

    @cute.jit
    def _first_pass(self, row, row_s, hist, n, nvec, tidx, store: cutlass.Constexpr):
        """Histogram of the top digit of every element, read from global memory; with ``store``
        the radix keys ``u`` go to the row cache, 0 (below every key) past the row's end."""
        shift, mask = DIGITS[0]
        for base in cutlass.range(0, nvec, self.num_threads * BATCH, unroll=1):
            vals = self._load_batch(row, row_s, base, nvec, tidx, False)
            for j in cutlass.range_constexpr(BATCH):
                v = base + j * self.num_threads + tidx
                us = []
                for i in cutlass.range_constexpr(VEC):
                    ok = v * VEC + i < n
                    u = cutlass.select_(ok, order_key(vals[j][i]) ^ Int32(INT_MIN), Int32(0))
                    if ok:
                        red_shared_add_1(hist + ((u >> shift) & mask) * 4)
                    us.append(u)
                if const_expr(store):
                    st_shared_v4(row_s + v * (VEC * 4), us[0], us[1], us[2], us[3])

    @cute.jit
    def _gather(self, row, row_s, cand_s, count_s, sel_s, use_bits, n, nvec, npv, top_bin, tidx,
                from_smem: cutlass.Constexpr):
        """Appends ``(radix key, index)`` of the elements whose top digit is ``top_bin`` to the
        candidates (any order); with ``use_bits``, sets the bits of the elements whose top digit
        is above it in the selected bitmap at ``sel_s``."""
        shift, mask = DIGITS[0]
        stop = npv if const_expr(from_smem) else nvec
        step = self.num_threads * BATCH
        n_iter = (stop + step - 1) // step
        for it in cutlass.range(0, n_iter, 1, unroll=1):
            base = it * step
            if const_expr(not from_smem):
                # from the row's end: the first pass read it last, so L2 still holds it
                base = (n_iter - 1 - it) * step
            vals = self._load_batch(row, row_s, base, nvec, tidx, from_smem)
            hits = Int32(0)
            keys = []
            for j in cutlass.range_constexpr(BATCH):
                v = base + j * self.num_threads + tidx
                for i in cutlass.range_constexpr(VEC):
                    e = v * VEC + i
                    if const_expr(from_smem):
                        u = vals[j][i]  # sentinels (digit 0) never reach a bin of a float
                        d = (u >> shift) & mask
                        hit = d == top_bin
                        up = use_bits & (d > top_bin)
                    else:
                        u = order_key(vals[j][i]) ^ Int32(INT_MIN)
                        d = (u >> shift) & mask
                        ok = e < n
                        hit = ok & (d == top_bin)
                        up = use_bits & ok & (d > top_bin)
                    hits = hits | cutlass.select_(hit, Int32(1 << (j * VEC + i)), Int32(0))
                    keys.append(u)
                    if up:
                        red_shared_or(sel_s + (e >> 5) * 4, Int32(1) << (e & 31))
            self._append(hits, keys, base, cand_s, count_s, Int32(self.cand_elems), tidx)

    @cute.jit
    def _cand_hist(self, key_of, hist, n_cand, thr_u, level: cutlass.Constexpr,
                   filtered: cutlass.Constexpr, tidx):
        """Histogram of digit ``level`` over the candidates' radix keys ``key_of(i)``; with
        ``filtered``, only of those whose higher digits equal ``thr_u``'s (without, all of them
        are counted: the top digit, or candidates that all share it)."""
        shift, mask = DIGITS[level]
        for i in cutlass.range(tidx, n_cand, self.num_threads, unroll=1):
            u = key_of(i)
            if const_expr(not filtered):
                red_shared_add_1(hist + ((u >> shift) & mask) * 4)
            else:
                if ((u ^ thr_u) >> DIGITS[level - 1][0]) == 0:
                    red_shared_add_1(hist + ((u >> shift) & mask) * 4)

    @cute.jit
    def _cand_mark(self, sCand, n_cand, thr, shift, take_ties, sel_s, eq_s, tidx):
        """Sets the selected bits of the candidates above the threshold, and of those at it:
        in the selected bitmap when all of them are taken (``take_ties``), else in the tied
        bitmap at ``eq_s``."""
        for i in cutlass.range(tidx, n_cand, self.num_threads, unroll=1):
            key = sCand[2 * i] ^ Int32(INT_MIN)
            e = sCand[2 * i + 1]
            k = key >> shift
            bit = Int32(1) << (e & 31)
            if k > thr:
                red_shared_or(sel_s + (e >> 5) * 4, bit)
            if k == thr:
                if take_ties:
                    red_shared_or(sel_s + (e >> 5) * 4, bit)
                else:
                    red_shared_or(eq_s + (e >> 5) * 4, bit)

    @cute.jit
    def _word_range(self, n_words, tidx):
        """This thread's contiguous words of a bitmap: ``[w0, w1)``."""
        per = (n_words + self.num_threads - 1) // self.num_threads
        w0 = cutlass.min(tidx * per, n_words)
        return w0, cutlass.min(w0 + per, n_words)

    @cute.jit
    def _words_first(self, bits_s, n_words, parity, sWarp, tidx, lane, warp):
        """This thread's words ``[w0, w1)`` of a bitmap and the bits set before them (a block
        scan, ``sWarp`` half ``parity``): ``(w0, w1, first)``."""
        w0, w1 = self._word_range(n_words, tidx)
        c = Int32(0)
        for w in cutlass.range(w0, w1, 1, unroll=1):
            c = c + popc(ld_shared_b32(bits_s + w * 4))
        first, _ = self._block_scan(c, sWarp, parity, lane, warp)
        return w0, w1, first

    @cute.jit
    def _tie_mark(self, sel_s, eq_s, n_words, need, sWarp, tidx, lane, warp):
        """Moves the first ``need`` tied elements, in index order, into the selected bitmap:
        a block scan of the threads' tied counts ranks each thread's first tie."""
        w0, w1, rank = self._words_first(eq_s, n_words, 1, sWarp, tidx, lane, warp)
        for w in cutlass.range(w0, w1, 1, unroll=1):
            ties = ld_shared_b32(eq_s + w * 4)
            take = Int32(0)
            while (ties != 0) & (rank < need):
                low = ties & (Int32(0) - ties)
                take = take | low
                ties = ties ^ low
                rank = rank + 1
            if take != 0:
                st_shared_b32_ordered(sel_s + w * 4, ld_shared_b32(sel_s + w * 4) | take)

    @cute.jit
    def _emit(self, sel_s, n_words, topk, stage_s, row, row_s, idx_row, score_row, sWarp, tidx,
              lane, warp, from_smem: cutlass.Constexpr):
        """Writes the selected elements in ascending index order: a block scan of the threads'
        set-bit counts gives each thread its first slot, then it walks its words' bits. Staged:
        ``cand_elems`` slots at a time go to shared memory (the candidates' buffer, free by
        now), then out in coalesced rows."""
        w0, w1, first = self._words_first(sel_s, n_words, 0, sWarp, tidx, lane, warp)
        cap = self.cand_elems
        for s0 in cutlass.range(0, topk, cap, unroll=1):
            slot = first
            for w in cutlass.range(w0, w1, 1, unroll=1):
                bits = ld_shared_b32(sel_s + w * 4)
                while bits != 0:
                    low = bits & (Int32(0) - bits)
                    e = w * 32 + popc(low - 1)
                    bits = bits ^ low
                    if (slot >= s0) & (slot < s0 + cap):
                        if const_expr(from_smem):
                            key = ld_shared_b32(row_s + e * 4) ^ Int32(INT_MIN)
                            val = self._score(key, key, row, e, True)
                        else:
                            val = ld_global_nc_b32(row + Int64(e) * 4)
                        st_shared_v2(stage_s + (slot - s0) * 8, e, val)
                    slot = slot + 1
            cute.arch.sync_threads()
            for j in cutlass.range(tidx, cutlass.min(cap, topk - s0), self.num_threads, unroll=1):
                pair = stage_s + j * 8
                off = Int64(s0 + j) * 4
                st_global_b32(idx_row + off, ld_shared_b32(pair))
                st_global_b32(score_row + off, ld_shared_b32(pair + 4))
            cute.arch.sync_threads()

    @cute.jit
    def _hist_pass(self, row, row_s, hist, n, nvec, npv, thr_u, level: cutlass.Constexpr, tidx,
                   from_smem: cutlass.Constexpr):
        """Histogram of digit ``level`` over the row's elements whose higher digits equal
        ``thr_u``'s, read from the row cache (``from_smem``) or global memory (when the
        candidates do not fit their buffer)."""
        shift, mask = DIGITS[level]
        prev_shift = DIGITS[level - 1][0]
        stop = npv if const_expr(from_smem) else nvec
        for base in cutlass.range(0, stop, self.num_threads * BATCH, unroll=1):
            vals = self._load_batch(row, row_s, base, nvec, tidx, from_smem)
            for j in cutlass.range_constexpr(BATCH):
                v = base + j * self.num_threads + tidx
                for i in cutlass.range_constexpr(VEC):
                    if const_expr(from_smem):
                        u = vals[j][i]
                        ok = ((u ^ thr_u) >> prev_shift) == 0
                    else:
                        u = order_key(vals[j][i]) ^ Int32(INT_MIN)
                        ok = (v * VEC + i < n) & (((u ^ thr_u) >> prev_shift) == 0)
                    if ok:
                        red_shared_add_1(hist + ((u >> shift) & mask) * 4)

    @cute.jit
    def _warp_scan(self, x, lane):
        """The warp's inclusive prefix sum of ``x`` (shuffles)."""
        incl = x
        for k in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(incl, offset=1 << k)
            incl = incl + cutlass.select_(lane >= (1 << k), y, Int32(0))
        return incl

    @cute.jit
    def _block_scan(self, x, sWarp, parity, lane, warp):
        """Block-wide (exclusive prefix, total) of ``x``; ``sWarp`` half ``parity`` holds the
        warps' totals (one barrier)."""
        incl = self._warp_scan(x, lane)
        if lane == 31:
            sWarp[parity * self.num_warps + warp] = incl
        cute.arch.sync_threads()
        before = incl - x
        total = Int32(0)
        for w in cutlass.range_constexpr(self.num_warps):
            t = sWarp[parity * self.num_warps + w]
            before = before + cutlass.select_(warp > w, t, Int32(0))
            total = total + t
        return before, total

    @cute.jit
    def _find(self, sHist, base: cutlass.Constexpr, sWarp, sRes, need, tidx, lane, warp):
        """(bin, count above it, its count) of the ``need``-th largest element of a histogram;
        bins are read highest first, ``bins_per_thread`` per thread."""
        per = self.bins_per_thread
        counts = [sHist[base + BINS - 1 - (tidx * per + i)] for i in range(per)]
        s = Int32(0)
        for i in cutlass.range_constexpr(per):
            s = s + counts[i]
        before, _ = self._block_scan(s, sWarp, 0, lane, warp)
        run = before
        for i in cutlass.range_constexpr(per):
            if (run < need) & (run + counts[i] >= need):
                sRes[0] = BINS - 1 - (tidx * per + i)
                sRes[1] = run
                sRes[2] = counts[i]
            run = run + counts[i]
        cute.arch.sync_threads()
        return sRes[0], sRes[1], sRes[2]

    @cute.jit
    def _compact(self, row, row_s, n, nvec, topk, thr, shift, need, sWarp, idx_row, score_row,
                 tidx, lane, warp, from_smem: cutlass.Constexpr):
        """The ordered compaction (module docstring): writes the selected elements' indices and
        scores in ascending index order. From the row cache, a score is rebuilt from its key,
        except for the keys that stand for several floats (+-0, NaN): those are re-read."""
        nv = PER_THREAD // VEC
        e0 = Int32(0)
        above_run = Int32(0)
        equal_run = Int32(0)
        parity = Int32(0)
        while e0 < n:
            vals = []
            for j in cutlass.range_constexpr(nv):
                v = e0 // VEC + tidx * nv + j
                if const_expr(from_smem):
                    vals.append(ld_shared_v4(row_s + v * (VEC * 4)))
                else:
                    vals.append(ld_global_v4(row + Int64(cutlass.min(v, nvec - 1)) * (VEC * 4)))
            first = e0 + tidx * PER_THREAD
            keys = []
            gt = []
            eq = []
            packed = Int32(0)
            for j in cutlass.range_constexpr(nv):
                for i in cutlass.range_constexpr(VEC):
                    if const_expr(from_smem):
                        key = vals[j][i] ^ Int32(INT_MIN)  # sentinels are below every threshold
                        k = key >> shift
                        g = k > thr
                        q = k == thr
                    else:
                        key = order_key(vals[j][i])
                        ok = first + (j * VEC + i) < n
                        k = key >> shift
                        g = ok & (k > thr)
                        q = ok & (k == thr)
                    keys.append(key)
                    gt.append(g)
                    eq.append(q)
                    packed = packed + cutlass.select_(g, Int32(1), Int32(0)) + \
                        cutlass.select_(q, Int32(65536), Int32(0))
            before, total = self._block_scan(packed, sWarp, parity, lane, warp)
            a = above_run + (before & 0xFFFF)
            e = equal_run + (before >> 16)
            for j in cutlass.range_constexpr(nv):
                for i in cutlass.range_constexpr(VEC):
                    m = j * VEC + i
                    if gt[m]:
                        slot = Int64(a + cutlass.min(e, need)) * 4
                        st_global_b32(idx_row + slot, first + m)
                        st_global_b32(score_row + slot,
                                      self._score(vals[j][i], keys[m], row, first + m, from_smem))
                        a = a + 1
                    if eq[m]:
                        if e < need:
                            slot = Int64(a + e) * 4
                            st_global_b32(idx_row + slot, first + m)
                            st_global_b32(score_row + slot, self._score(vals[j][i], keys[m], row,
                                                                        first + m, from_smem))
                        e = e + 1
            above_run = above_run + (total & 0xFFFF)
            equal_run = equal_run + (total >> 16)
            parity = parity ^ 1
            filled = (above_run + cutlass.min(equal_run, need)) >= topk
            e0 = cutlass.select_(filled, n, e0 + self.tile)

    @cute.jit
    def _score(self, val, key, row, index, from_smem: cutlass.Constexpr):
        """The float bits of a selected element: ``val`` itself when read from global memory,
        else rebuilt from its key (re-read for +-0 and NaN)."""
        bits = val
        if const_expr(from_smem):
            bits = cutlass.select_(key < 0, key ^ Int32(0x7FFFFFFF), key)
            if (key == 0) | (key == Int32(0x7FFFFFFF)):
                bits = ld_global_nc_b32(row + Int64(index) * 4)
        return bits


# ------------------------------------------------------------------------------------------------
# compiling (the launcher is in topk_host.py)
# ------------------------------------------------------------------------------------------------

def compile_select(num_threads: int, cache_elems: int, cand_elems: int, min_blocks: int):
    """Compile one select kernel (no GPU needed when the target arch is set).

    R, ld and topk are symbolic. Returns the TVM-FFI callable ``fn(buf, row_len, out_indices,
    out_scores)`` (buf ``[R, ld]`` float32 16-byte aligned, ld a multiple of 4; row_len ``[R]``
    int32; outputs ``[R, topk]`` int32 / float32), launched on the current stream.
    """
    kernel = TopkSelectSm90(num_threads, cache_elems, cand_elems, min_blocks)
    rows, ld, topk = (cute.sym_int() for _ in range(3))
    fake = cute.runtime.make_fake_compact_tensor
    buf = fake(Float32, (rows, ld), stride_order=(1, 0), assumed_align=16)
    row_len = fake(Int32, (rows,), assumed_align=4)
    out_idx = fake(Int32, (rows, topk), stride_order=(1, 0), assumed_align=4)
    out_score = fake(Float32, (rows, topk), stride_order=(1, 0), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, buf, row_len, out_idx, out_score, stream,
                        options="--enable-tvm-ffi")
