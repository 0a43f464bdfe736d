"""The indexer's training target for Hopper (SM90a), written in CuTe DSL.

Computes, for every token ``t`` and slot ``j`` (the op :mod:`mla_inductor.ops.indexer_target`)::

    w[t, j]      = sum_h exp(sm_scale * q[t, h, :d_qk] . kv[indices[t, j], :d_qk] - lse[t, h])
    target[t, j] = w[t, j] / sum_{valid i} w[t, i]                           (fp32)

on the valid slots (``0 <= indices[t, j] < S``, ``j < topk_length[t]``, ``indices[t, j] <=
q_positions[t]`` when positions are given, the forward's rules); an empty slot is never read
(its ``cp.async`` has source size 0) and gets exactly 0, and a row whose sum is 0 (no valid slot)
is all 0. A NaN score or lse reaches the row's sum and so every valid slot of the row (the
reference's ``where(valid & (total != 0), w / total, 0)``, to the rounding of the order of the
sums).

Design (decisions, in the order they were taken)
-------------------------------------------------
* Only ``S = Q K^T`` is needed (0.53 of the forward's FLOPs at d_qk 576, d_v 512), so the kernel
  must gather each key row ONCE per token, not once per 64-head tile as the forward does (which
  would double the L2 gather traffic, the forward's other limit). One CTA = one token with ALL
  its heads (``tile_heads`` = 64 for H <= 64, 128 for H <= 128; padded heads are zero rows of Q
  whose terms are dropped). Grid ``T`` on x.
* The TRANSPOSED product ``S^T = K Q^T``: wgmma M = 64 gathered keys (A operand: the K block in
  shared memory, K-major, 128-byte swizzle, as the forward's KV tile), N = ``tile_heads`` (B
  operand: Q ``[tile_heads, d_qk]``, K-major, loaded once), K-dim = d_qk. The head sum is then
  along the accumulator's N: 32 (or 16) in-thread adds per key row and two quad shuffles, and
  each thread keeps ``lse * log2(e)`` of its own head columns in registers. With M = keys,
  m64n128k16 reads 2 + 4 KiB of shared memory per 64 tensor clocks.
* Shared memory (d_qk 576, 128 heads): Q 144 KiB leaves no room for two 72 KiB key blocks, so
  keys stream through a RING of 64-key x 64-column chunks (8 KiB, 9 per block; 10 slots here,
  up to two blocks' worth when Q is smaller), each slot with its own full / empty mbarrier.
* Warp specialisation, 3 warpgroups (384 threads), registers 56 / 224 / 224 via ``setmaxnreg``
  (the forward's split of the launch allocation):
  - WG0, producer: gathers every chunk of every block in order with 16-byte ``cp.async.cg``
    (L2 evict_last, 256-byte prefetch hint; 8 threads per 128-byte row segment, 4 passes of 16
    rows; the forward's gather), and Q (L2 evict_first) chunk by chunk next to the first block's
    chunks, each Q chunk with its own mbarrier, so that the first products start before all of
    Q has landed. The indices of block b + 1 are loaded while block b's chunks are issued (block
    0's before anything else). With the first chunk of a block it writes the block's key
    validity (``sValid``, two slots by block parity), published by 16 plain arrivals on every
    chunk's full barrier (so that every slot's barrier counts the same 128 + 16 arrivals).
  - WG1 and WG2, consumers, ping-pong on blocks (WG1 the even ones, WG2 the odd): each issues
    its block's 36 wgmma k-steps chunk by chunk as the chunks land (waiting on chunk c - 1's
    group and freeing its slot after issuing chunk c), so the exponentials, head sums and stores
    of one consumer's block overlap the other consumer's products.
  The ring holds at most two blocks, so ``sValid``'s two slots are never overwritten before the
  consumer of a block has read its own (it reads them right after its block's first chunk lands,
  and the producer can only reach block b + 2 once that chunk's slot was freed).
* Per block epilogue (per thread: 2 key rows x ``tile_heads / 4`` heads):
  ``p = exp2(s * sm_scale * log2(e) - lse_h * log2(e))`` (0 for padded heads), summed over the
  thread's heads, then over the quad (2 butterfly shuffles); the key's ``w`` is stored to the
  target row (fp32) and, if the slot is valid, added to the thread's running sum.
* Normalisation: the consumers' running sums meet in shared memory (a fixed order); then the 256
  consumer threads re-read their CTA's ``w`` row (the named barrier orders the global stores and
  loads), re-derive each slot's validity from the indices, and write ``w / total`` on valid slots
  and 0 elsewhere (also past the last block when ``topk_length`` cuts the row short).
* Long inputs: the tensors' outer strides are 64-bit (``t * topk`` and ``t * H * d_qk`` may pass
  2**31) and gathers form their addresses from ``Int64(row) * d_qk``.
* One compiled kernel serves every T, H <= tile_heads, S and topk (symbolic); the compile key is
  (dtype, d_qk, tile_heads, has topk_length, has positions). Launched on torch's current stream
  through TVM-FFI.

Measured (H200, 2026-12-01, ``bench indexer-target``: bf16, d_qk 576, topk 2048,
S = T, random indices, interleaved with our exact forward in the same run; ms of the target /
of the forward):

======  ===  ===============  ==========  ========
T       H    target ms        forward ms  ratio
======  ===  ===============  ==========  ========
4096    128  2.254 (549 TF)   3.970       0.568
4096    64   1.528 (405 TF)   2.025       0.755
16384   128  8.940 (553 TF)   16.161      0.553
16384   64   5.998 (412 TF)   8.202       0.731
======  ===  ===============  ==========  ========

Loading Q whole before the first product (one mbarrier) instead of chunk by chunk with the first
block was 8-9% slower (2.464 / 9.622 ms at H 128, T 4096 / 16384: 0.614 / 0.589 of the forward
of that run). At H 64 the forward too
gathers each key row once per token, so the ratio is bounded by the gathers rather than by the
FLOPs: the target moves T topk 1152 bytes from L2 (9.7 GB at T 4096) at 6.3 TB/s there, against
4.8 TB/s for the forward (4.3 TB/s for the target at H 128, where the products bound it).
The call allocates only its output (peak memory over the inputs = the ``[T, topk]`` fp32 row).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import BFloat16, Float16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from .host import INDEXER_D_QK as D_QK
from .host import INDEXER_TILE_HEADS as TILE_HEADS
from .common import SMEM_LIMIT, TORCH_TO_CUTE, fake_inputs, sw128_offset_bytes
from .host import LOG2E
from .ptx import cp_async_16, cp_async_wait_all, create_policy

TILE_KEYS = 64  # gathered keys per block (wgmma M)
CHUNK = 64  # columns per ring slot (one 128-byte swizzle atom of 2-byte elements)
NUM_THREADS = 384
REGS_PRODUCER, REGS_CONSUMER = 56, 224  # see the forward: 168 - 56 = 2 x (224 - 168)
BAR_TOTAL = 1  # the consumers' partial sums exchanged (named barrier, 256 threads)
NORM_UNROLL = 8  # slots per consumer thread per step of the normalisation pass


class IndexerTargetSm90:
    """Compile-time configuration of one indexer-target kernel (see the module docstring)."""

    def __init__(self, dtype, d_qk: int, tile_heads: int, has_topk_length: bool,
                 has_positions: bool):
        if dtype not in (BFloat16, Float16):
            raise TypeError(f"indexer_target: sm90 supports bf16/fp16, got {dtype}")
        if d_qk not in D_QK or tile_heads not in TILE_HEADS:
            raise ValueError(f"indexer_target: sm90 needs d_qk in {D_QK} and a head "
                             f"tile in {TILE_HEADS}, got {d_qk}, {tile_heads}")
        self.dtype = dtype
        self.d_qk = d_qk
        self.tile_heads = tile_heads
        self.has_topk_length = has_topk_length
        self.has_positions = has_positions
        self.n_chunks = d_qk // CHUNK
        elem = dtype.width // 8
        self.q_bytes = tile_heads * d_qk * elem
        self.chunk_bytes = TILE_KEYS * CHUNK * elem
        # at most two blocks (see sValid in the module docstring), as many as fit next to Q
        fit = (SMEM_LIMIT - self.q_bytes - 2048) // self.chunk_bytes
        self.ring = min(2 * self.n_chunks, fit)

    def _layouts(self):
        atom = warpgroup.make_smem_layout_atom(
            sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, CHUNK), self.dtype
        )
        sQ = cute.tile_to_shape(atom, (self.tile_heads, self.d_qk), order=(0, 1))
        sK = cute.tile_to_shape(atom, (TILE_KEYS, CHUNK, self.ring), order=(0, 1, 2))
        return sQ, sK

    def _smem_bytes(self):
        # Q, the ring, sValid (2 x 64 int32), the 8 warps' sums, 2 ring + n_chunks Q mbarriers,
        # slack
        return (self.q_bytes + self.ring * self.chunk_bytes + 2 * TILE_KEYS * 4 + 8 * 4
                + (2 * self.ring + self.n_chunks) * 8 + 1024)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, H, d_qk]
        mKV: cute.Tensor,  # [S, d_qk]
        mIdx: cute.Tensor,  # [T, topk] int32
        mTopkLen: cute.Tensor | None,  # [T] int32
        mQPos: cute.Tensor | None,  # [T] int32, causal positions
        mLSE: cute.Tensor,  # [T, H] fp32, natural log
        mTarget: cute.Tensor,  # [T, topk] fp32
        scale_log2: Float32,
        stream,
    ):
        sQ_layout, sK_layout = self._layouts()
        tiled_mma = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_KEYS, self.tile_heads),
        )
        self.kernel(mQ, mKV, mIdx, mTopkLen, mQPos, mLSE, mTarget, scale_log2, sQ_layout,
                    sK_layout, tiled_mma).launch(
            grid=[mQ.shape[0], 1, 1],
            block=[NUM_THREADS, 1, 1],
            smem=self._smem_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor | None,
        mQPos: cute.Tensor | None,
        mLSE: cute.Tensor,
        mTarget: cute.Tensor,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ):
        """Device entry: one CTA per token; the design is the module docstring."""
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4

        num_heads = mQ.shape[1]
        seqlen_kv = mKV.shape[0]
        topk = mIdx.shape[1]
        n_valid = topk
        if const_expr(self.has_topk_length):
            n_valid = cutlass.max(cutlass.min(mTopkLen[t], topk), Int32(0))
        n_blocks = (n_valid + TILE_KEYS - 1) // TILE_KEYS
        pos = Int32(0)
        if const_expr(self.has_positions):
            pos = mQPos[t]

        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, sQ_layout.outer, 1024, swizzle=sQ_layout.inner)
        sK = smem.allocate_tensor(self.dtype, sK_layout.outer, 1024, swizzle=sK_layout.inner)
        # validity (1 / 0) of each key of the blocks of each parity
        sValid = smem.allocate_tensor(Int32, cute.make_layout((TILE_KEYS, 2)), 16)
        sSum = smem.allocate_tensor(Float32, cute.make_layout((8,)), 16)  # per consumer warp
        mbar = smem.allocate_array(Int64, 2 * self.ring + self.n_chunks)
        mbar_full = mbar
        mbar_empty = mbar + self.ring
        mbar_q = mbar + 2 * self.ring  # one per 64-column chunk of Q

        if tidx == 0:
            for s in cutlass.range_constexpr(self.ring):
                # 128 cp.async arrivals + 16 plain ones (the threads that may write sValid)
                cute.arch.mbarrier_init(mbar_full + s, 128 + 16)
                cute.arch.mbarrier_init(mbar_empty + s, 128)
            for c in cutlass.range_constexpr(self.n_chunks):
                cute.arch.mbarrier_init(mbar_q + c, 128)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            # ================= producer: cp.async gathers =================
            cute.arch.setmaxregister_decrease(REGS_PRODUCER)
            vec = tidx % 8
            row_in_pass = tidx // 8
            elem = self.dtype.width // 8
            row_bytes = self.d_qk * elem
            sQ_addr = sQ.iterator.toint()
            sK_addr = sK.iterator.toint()
            q_base = mQ.iterator.toint()
            kv_base = mKV.iterator.toint()
            keep = create_policy(True)  # key rows: read by many tokens
            stream_once = create_policy(False)  # Q: read once
            passes = TILE_KEYS // 16
            idx_next = cute.make_rmem_tensor((passes,), Int32)
            idx_cur = cute.make_rmem_tensor((passes,), Int32)
            self._load_indices(idx_next, mIdx, t, 0, n_valid, row_in_pass)
            for b in cutlass.range(n_blocks, unroll=1):
                for p in cutlass.range_constexpr(passes):
                    idx_cur[p] = idx_next[p]
                # the next block's indices are in flight while this block is issued
                self._load_indices(idx_next, mIdx, t, b + 1, n_valid, row_in_pass)
                for c in cutlass.range_constexpr(self.n_chunks):
                    if b == 0:
                        # Q's chunk c with the first block's: the products start before all of
                        # Q has landed
                        self._copy_q_chunk(sQ_addr, q_base, t, num_heads, row_bytes, c, vec,
                                           row_in_pass, stream_once)
                        cute.arch.cp_async_mbarrier_arrive_noinc(mbar_q + c)
                    g = b * self.n_chunks + c
                    slot = g % self.ring
                    cute.arch.mbarrier_wait(mbar_empty + slot, ((g // self.ring) & 1) ^ 1)
                    for p in cutlass.range_constexpr(passes):
                        r = p * 16 + row_in_pass
                        idx = idx_cur[p]
                        ok = (idx >= 0) & (idx < seqlen_kv)
                        if const_expr(self.has_positions):
                            ok = ok & (idx <= pos)
                        src = cutlass.select_(ok, kv_base + Int64(idx) * row_bytes, kv_base)
                        cp_async_16(
                            sK_addr + sw128_offset_bytes(r, vec, slot),
                            src + (c * CHUNK + vec * 8) * elem,
                            cutlass.select_(ok, Int32(16), Int32(0)),
                            keep,
                        )
                        if const_expr(c == 0):
                            if vec == 0:
                                sValid[r, b % 2] = Int32(ok)
                    if vec == 0:  # publishes sValid (release) with the block's first chunk
                        cute.arch.mbarrier_arrive(mbar_full + slot)
                    cute.arch.cp_async_mbarrier_arrive_noinc(mbar_full + slot)
            cp_async_wait_all()

        else:
            # ================= consumers: even blocks (WG1), odd blocks (WG2) =================
            cute.arch.setmaxregister_increase(REGS_CONSUMER)
            role = wg - 1
            ct = tidx % 128
            lane = ct % 32
            thr = tiled_mma.get_slice(ct)
            tSrK = thr.make_fragment_A(thr.partition_A(sK))
            tSrQ = thr.make_fragment_B(thr.partition_B(sQ))
            acc = cute.make_rmem_tensor(thr.partition_shape_C((TILE_KEYS, self.tile_heads)),
                                        Float32)
            tScS = thr.partition_C(cute.make_identity_tensor((TILE_KEYS, self.tile_heads)))
            rows = (tScS[0][0], tScS[2][0])  # this thread's two key rows of a block

            # lse * log2(e) of this thread's head columns (column (i % 2) + 2 (i // 4) of acc[i])
            lse2 = cute.make_rmem_tensor((self.tile_heads // 4,), Float32)
            for i in cutlass.range_constexpr(cute.size(acc)):
                if const_expr((i // 2) % 2 == 0):
                    h = tScS[i][1]
                    v = Float32(0.0)
                    if h < num_heads:
                        v = mLSE[t, h] * Float32(LOG2E)
                    lse2[(i % 2) + 2 * (i // 4)] = v
            valid = cute.make_rmem_tensor((2,), cutlass.Boolean)
            total = cute.make_rmem_tensor((1,), Float32)
            total[0] = Float32(0.0)

            for blk in cutlass.range(role, n_blocks, 2, unroll=1):
                mma = cute.make_mma_atom(tiled_mma.op)
                mma.set(warpgroup.Field.ACCUMULATE, False)
                for c in cutlass.range_constexpr(self.n_chunks):
                    g = blk * self.n_chunks + c
                    slot = g % self.ring
                    cute.arch.mbarrier_wait(mbar_full + slot, (g // self.ring) & 1)
                    if const_expr(c == 0):
                        for r in cutlass.range_constexpr(2):
                            valid[r] = sValid[rows[r], role] != 0
                    cute.arch.mbarrier_wait(mbar_q + c, 0)  # returns at once after block 0
                    cute.arch.fence_view_async_shared()  # cp.async (generic proxy) -> wgmma
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(CHUNK // 16):
                        cute.gemm(mma, acc, tSrK[None, None, k, slot],
                                  tSrQ[None, None, c * (CHUNK // 16) + k], acc)
                        mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.commit_group()
                    if const_expr(c > 0):
                        # chunk c - 1's products are done: its slot may be refilled
                        warpgroup.wait_group(1)
                        cute.arch.mbarrier_arrive(mbar_empty + (g - 1) % self.ring)
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(
                    mbar_empty + (blk * self.n_chunks + self.n_chunks - 1) % self.ring)
                self._store_weights(acc, lse2, valid, total, tScS, rows, scale_log2, num_heads,
                                    mTarget, t, blk, topk, lane)
            self._normalise(total, sSum, mIdx, mTarget, t, n_valid, seqlen_kv, pos, topk,
                            tidx - 128, lane)

    @cute.jit
    def _copy_q_chunk(self, sQ_addr, q_base, t, num_heads, row_bytes, c: cutlass.Constexpr, vec,
                      row_in_pass, policy):
        """This thread's share of Q's 64-column chunk ``c``: vector ``vec`` of rows
        ``16 p + row_in_pass``; rows of padded heads are zero-filled without a read."""
        elem = self.dtype.width // 8
        for p in cutlass.range_constexpr(self.tile_heads // 16):
            r = p * 16 + row_in_pass
            ok = r < num_heads
            src = cutlass.select_(ok, q_base + (Int64(t) * num_heads + r) * row_bytes, q_base)
            cp_async_16(
                sQ_addr + sw128_offset_bytes(r, vec, 0) + c * (self.tile_heads * 128),
                src + (c * CHUNK + vec * 8) * elem,
                cutlass.select_(ok, Int32(16), Int32(0)),
                policy,
            )

    @cute.jit
    def _load_indices(self, rIdx, mIdx, t, b, n_valid, row_in_pass):
        """The kv rows of this thread's 4 keys of block ``b`` (-1 for slots past ``n_valid``)."""
        for p in cutlass.range_constexpr(TILE_KEYS // 16):
            j = b * TILE_KEYS + p * 16 + row_in_pass
            idx = Int32(-1)
            if j < n_valid:
                idx = mIdx[t, j]
            rIdx[p] = idx

    @cute.jit
    def _store_weights(self, acc, lse2, valid, total, tScS, rows, scale_log2, num_heads, mTarget,
                       t, blk, topk, lane):
        """``w`` of this thread's two keys: ``exp2(s * scale_log2 - lse2)`` summed over its heads
        (padded heads dropped) and the quad's; stored to ``mTarget[t, key]`` by the quad's first
        lane and, on a valid slot, added to ``total``."""
        part = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
        for i in cutlass.range_constexpr(cute.size(acc)):
            r = (i // 2) % 2
            p = cute.math.exp2(acc[i] * scale_log2 - lse2[(i % 2) + 2 * (i // 4)], fastmath=True)
            p = cutlass.select_(tScS[i][1] < num_heads, p, Float32(0.0))
            part[r + 2 * (i % 2)] = part[r + 2 * (i % 2)] + p
        for r in cutlass.range_constexpr(2):
            w = part[r] + part[r + 2]
            w = w + cute.arch.shuffle_sync_bfly(w, offset=1)
            w = w + cute.arch.shuffle_sync_bfly(w, offset=2)
            j = blk * TILE_KEYS + rows[r]
            if lane % 4 == 0:
                if j < topk:
                    mTarget[t, j] = w
                    if valid[r]:
                        total[0] = total[0] + w

    @cute.jit
    def _normalise(self, total, sSum, mIdx, mTarget, t, n_valid, seqlen_kv, pos, topk, tid, lane):
        """The row's sum over both consumers (8 warps, fixed order), then ``mTarget[t, :]`` =
        ``w / sum`` on valid slots (re-derived from the indices) when the sum is not 0, else 0;
        ``tid`` in 0..255."""
        s = total[0]
        for k in cutlass.range_constexpr(3):  # lanes 4k hold the sums (the others hold 0)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=16 >> k)
        if lane == 0:
            sSum[tid // 32] = s
        cute.arch.barrier(barrier_id=BAR_TOTAL, number_of_threads=256)
        row_sum = sSum[0]
        for k in cutlass.range_constexpr(1, 8):
            row_sum = row_sum + sSum[k]
        # NORM_UNROLL slots per thread at a time: their index and w loads are all in flight
        # together (one slot at a time would wait a load latency per slot)
        for base in cutlass.range(0, topk, 256 * NORM_UNROLL, unroll=1):
            idx = cute.make_rmem_tensor((NORM_UNROLL,), Int32)
            w = cute.make_rmem_tensor((NORM_UNROLL,), Float32)
            for u in cutlass.range_constexpr(NORM_UNROLL):
                j = base + u * 256 + tid
                idx[u] = Int32(-1)
                w[u] = Float32(0.0)
                if j < n_valid:
                    idx[u] = mIdx[t, j]
                    w[u] = mTarget[t, j]
            for u in cutlass.range_constexpr(NORM_UNROLL):
                j = base + u * 256 + tid
                ok = (idx[u] >= 0) & (idx[u] < seqlen_kv) & (row_sum != 0.0)
                if const_expr(self.has_positions):
                    ok = ok & (idx[u] <= pos)
                if j < topk:
                    mTarget[t, j] = cutlass.select_(ok, w[u] / row_sum, Float32(0.0))


# ------------------------------------------------------------------------------------------------
# compiling (the launcher is in indexer_target_host.py)
# ------------------------------------------------------------------------------------------------

def compile_target(dtype_name: str, d_qk: int, tile_heads: int, has_topk_length: bool,
                   has_positions: bool):
    """Compile one indexer-target kernel (no GPU needed when ``CUTE_DSL_ARCH`` is set).

    T, H (<= ``tile_heads``), S and topk are symbolic. Returns the TVM-FFI callable ``fn(q, kv,
    indices, topk_length_or_None, q_positions_or_None, lse, target, scale_log2)``.
    """
    dtype = TORCH_TO_CUTE[dtype_name]
    kernel = IndexerTargetSm90(dtype, d_qk, tile_heads, has_topk_length, has_positions)
    x = fake_inputs(dtype, d_qk, has_topk_length, has_positions)
    target = cute.runtime.make_fake_compact_tensor(Float32, (x.n_tok, x.n_topk),
                                                   stride_order=(1, 0), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, x.q, x.kv, x.indices, x.topk_length, x.q_positions, x.lse,
                        target, Float32(1.0), stream, options="--enable-tvm-ffi")
