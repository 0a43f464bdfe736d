"""The lightning indexer's scores at the selected slots, forward and backward, for Hopper (SM90a),
written in CuTe DSL (the op :mod:`mla_inductor.ops.lightning_indexer_scores`; launchers in
:mod:`.lightning_selected_slots_host`).

For the flattened rows ``r = b * T + t`` (``q [R, H, D]``, ``weights [R, H]`` float32,
``indices [R, topk]`` int32 local to batch element ``b``, ``k [B S, D]``), with
``L[h, j] = q[r, h] . k[b S + indices[r, j]]`` in float32::

    forward:   scores[r, j]  = sum_h weights[r, h] * relu(L[h, j])          (0 on empty slots)
    backward:  dS[h, j]      = weights[r, h] * dscores[r, j] * [L[h, j] > 0]
               dweights[r, h] = sum_j dscores[r, j] * relu(L[h, j])
               dq[r, h]      = sum_j dS[h, j] * k_j
               dk[b S + indices[r, j]] += sum_h dS[h, j] * q[r, h]          (per occurrence)

A slot is empty when its index is < 0 or >= S: its key row is zero-filled in shared memory
(``cp.async`` with source size 0: never read), its logits are forced to 0, its score is stored
as exactly 0, its ``dscores`` is ignored and its dk row never written. relu keeps a NaN
(``max.NaN``), as ``torch.relu`` does; relu's gradient is 0 at exactly 0 and at NaN.

Design
------
* One CTA per row (token), one warpgroup (128 threads); the row's ``topk`` slots are walked in
  blocks of :data:`TILE_KEYS` = 64 keys. Per block the work is the gathered GEMM ``[64 keys x
  128] x [128 x 64 heads]``; the heads are padded to :data:`HEAD_TILE` = 64 with zero rows of Q
  (1..64 index heads), and the padded heads' columns are selected away (never multiplied by a
  zero weight: ``0 * inf`` would be NaN).
* The TRANSPOSED logits ``L^T = K Q^T`` (wgmma m64n64k16, A = the key block, B = Q, both K-major
  128-byte-swizzled tiles in shared memory, 8 k-steps over D = 128): the heads lie along the
  accumulator's N, so the head sum of the forward runs inside a thread (16 of its columns) and
  then over its quad (2 butterfly shuffles); no shared memory and no cross-warp reduction.
* Key blocks stream through a ring of :data:`FWD_STAGES` (forward) or :data:`BWD_STAGES`
  (backward) 16 KiB stages, filled with 16-byte ``cp.async.cg`` (16 threads per 256-byte key
  row, 64-bit source addresses ``(b S + index) D``), one commit group per block; block ``i +
  stages - 1`` is issued while block ``i`` is computed. The indices a thread gathers are loaded
  into registers one block before their gather, so that no load's latency is exposed at the
  top of a block; the forward also loads the indices of the accumulator's key rows before the
  logits' wait (the backward loads them after it, with their ``dscores`` read whatever the index
  so that the two loads do not wait on each other: loaded before the wait, they made ptxas
  serialise the backward's wgmmas at its 254 registers). Every thread loads and computes (no warp
  specialisation): three CTAs per SM (forward) or two (backward, bounded by its registers)
  overlap one another's gathers and MMAs. (H200, T 16384, 64 heads, topk 2048, 2026-12-02: the
  early index loads took the forward from 2.51 to 2.06 ms and the backward from 6.96 to 6.57
  ms; 3 stages and three CTAs per SM instead of 5 and two took the forward to 1.76 ms.)
* Backward, per block: the logits as above; ``dS^T`` (fp32, from the weights and the block's
  ``dscores``) and the ``dweights`` partial sums in registers; ``dS^T`` rounded to q's dtype
  once and stored to a swizzled 64 x 64 tile; then two wgmmas read it: ``dq += dS K`` (m64n128,
  A = the tile transposed, B = the key block transposed; dq's accumulator stays in registers
  over all blocks) and ``dk_block = dS^T Q`` (m64n128, A = the tile, B = Q transposed). The
  block's dk rows are added into a zeroed ``[B S, D]`` accumulator in global memory:
  float32 ``red.global.add.v4.f32`` into an accumulator whose columns are interleaved within
  groups of 16 (:data:`.host.DKV_GROUP`, the sparse-MLA backward's order: the 4 values a thread
  holds of one row are adjacent), or, in the deterministic variant, ``round(value * scale)``
  added as 64-bit integers (``red.global.add.u64``, plain column order), whose sum is the same in
  every order. ``dweights`` is reduced over the key rows at the end: shuffles over the lanes of
  equal quad position, then the 4 warps through shared memory in a fixed order (deterministic).
* float16 only: ``dS`` is rounded to float16 after a per-row power-of-two scale (a prepass over
  the row's valid ``dscores`` and its weights: ``2**(13 - e)`` for ``2**e <= max|dscores| *
  max|weights| < 2**(e + 1)``, e clamped to [-100, 100]), undone in float32 on dq and on the dk
  values before their reds: a KL loss's ``dscores`` (about ``1 / (B T topk)``) times weights of
  about 0.01 are far below float16's smallest subnormal, 2**-24, and would round to 0. bfloat16
  has float32's range and is not scaled.
* Long inputs: the row strides of ``q``, ``weights``, ``indices``, ``scores`` and their
  gradients are 64-bit run-time values, and key and accumulator addresses are formed in 64 bits.
* One compiled kernel serves every B, T, H <= 64, S and topk (symbolic); the compile key is the
  dtype (and, for the backward, whether it is deterministic).

The design follows this package's lightning-indexer score kernel (:mod:`.lightning_every_key`: the
transposed product, the in-quad head sum) and sparse-MLA backward (:mod:`.bwd`: the gathered
key blocks, the swizzled ``dS`` tile, the interleaved dk accumulator and its reds, the 64-bit
fixed point).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup

from .common import TORCH_TO_CUTE, kmajor_sw128, sw128_offset_bytes, transposed
from .host import DKV_GROUP
from .ptx import (
    cp_async_16,
    create_policy,
    f32_bits,
    f32_from_bits,
    opaque_i32,
    red_add_f32x4,
    red_add_fixed64,
    relu_nan,
    st_shared_b32,
)

D = 128  # the index head width
TILE_KEYS = 64  # keys per block (wgmma M of the logits)
HEAD_TILE = 64  # heads per CTA, padded (wgmma N of the logits, M of dq)
NUM_THREADS = 128  # one warpgroup
FWD_STAGES = 3  # key blocks in flight, forward: 16 + 3 x 16 KiB, three CTAs per SM
BWD_STAGES = 4  # backward: 16 + 8 + 4 x 16 KiB (+ 1 KiB), two CTAs per SM
FP16_DS_EXPONENT = 14  # float16 dS is scaled per row into [2**13, 2**14) at its largest
TILE_BYTES = TILE_KEYS * D * 2  # one key block (and the Q tile) in shared memory
DS_BYTES = TILE_KEYS * HEAD_TILE * 2  # the dS^T tile
_K_STEPS = D // 16


def _tile(dtype, addr, rows: int, cols: int):
    """The K-major 128-byte-swizzled ``[rows, cols]`` shared tile at byte address ``addr``
    (1024-aligned), through an opaque copy of the address: descriptors derived from it are
    recomputed where they are used rather than kept live across the loop."""
    lay = kmajor_sw128(dtype, rows, cols)
    ptr = cute.make_ptr(dtype, opaque_i32(addr), cute.AddressSpace.smem, assumed_align=1024)
    return cute.make_tensor(cute.recast_ptr(ptr, lay.inner, dtype), lay.outer)


def _mma(dtype, a_major, b_major, n: int):
    """A one-warpgroup 64 x ``n`` wgmma of ``dtype`` with fp32 accumulation, ACCUMULATE on."""
    tiled = sm90_utils.make_trivial_tiled_mma(dtype, dtype, a_major, b_major, Float32, (1, 1, 1),
                                              (TILE_KEYS, n))
    tiled.set(warpgroup.Field.ACCUMULATE, True)
    return tiled


class _ScoresTile:
    """What the forward and backward kernels share: the static dtype, the Q tile load, the key
    block gather, the logits wgmma and the per-thread slot and weight bookkeeping."""

    def __init__(self, dtype, stages: int):
        if dtype not in (BFloat16, Float16):
            raise TypeError(f"lightning_indexer_scores: sm90 kernels support bf16/fp16, got "
                            f"{dtype}")
        self.dtype = dtype
        self.stages = stages

    @cute.jit
    def load_q(self, mQ: cute.Tensor, row: Int32, num_heads: Int32, sq_addr, t: Int32):
        """Issues the ``cp.async`` copies of row ``row``'s Q ``[H, D]`` into the 64-row swizzled
        tile at ``sq_addr``; rows ``h >= H`` are zero-filled (no read). No commit."""
        v = t % 16
        q_base = mQ.iterator.toint()
        q_row = Int64(row) * num_heads
        for p in cutlass.range_constexpr(HEAD_TILE // 8):
            h = p * 8 + t // 16
            ok = h < num_heads
            src = cutlass.select_(ok, q_base + ((q_row + h) * D + v * 8) * 2, q_base)
            cp_async_16(sq_addr + sw128_offset_bytes(h, v % 8, v // 8), src,
                        cutlass.select_(ok, Int32(16), Int32(0)))

    @cute.jit
    def block_indices(self, mIdx: cute.Tensor, row: Int32, topk: Int32, blk: Int32,
                      nidx: cute.Tensor, t: Int32):
        """Loads into ``nidx[p]`` the index of slot ``64 blk + 8 p + t // 16``, the key rows that
        thread ``t`` gathers of block ``blk`` (-1 past topk, not read). Loaded one block before
        the gather that uses them, so that their latency hides behind a block's MMAs."""
        for p in cutlass.range_constexpr(TILE_KEYS // 8):
            slot = blk * TILE_KEYS + p * 8 + t // 16
            idx = Int32(-1)
            if slot < topk:
                idx = mIdx[row, slot]
            nidx[p] = idx

    @cute.jit
    def gather(self, mK: cute.Tensor, k_row0: Int64, seq_k: Int32, nidx: cute.Tensor,
               stage_addr, t: Int32):
        """Issues the ``cp.async`` gather of a key block into the stage at ``stage_addr``: thread
        ``t`` copies 16-byte vector ``t % 16`` of the block's key rows ``8 p + t // 16``, whose
        indices are ``nidx[p]`` (:meth:`block_indices`); empty slots (and -1) are zero-filled
        without a read. No commit."""
        v = t % 16
        k_base = mK.iterator.toint()
        for p in cutlass.range_constexpr(TILE_KEYS // 8):
            r = p * 8 + t // 16
            idx = nidx[p]
            ok = (idx >= 0) & (idx < seq_k)
            src = cutlass.select_(ok, k_base + ((k_row0 + Int64(idx)) * D + v * 8) * 2, k_base)
            cp_async_16(stage_addr + sw128_offset_bytes(r, v % 8, v // 8), src,
                        cutlass.select_(ok, Int32(16), Int32(0)))

    @cute.jit
    def prologue(self, mQ, mK, mIdx, row, k_row0, num_heads, seq_k, topk, n_blocks, sq_addr,
                 ring_addr, nidx, t):
        """Q and the first ``stages - 1`` key blocks, one commit group per block (Q in the
        first); a block past the row's last is an empty group, so that the main loop's
        ``cp.async.wait_group`` count is the same in every iteration. Leaves the indices of
        block ``stages - 1`` in ``nidx``."""
        self.load_q(mQ, row, num_heads, sq_addr, t)
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < n_blocks:
                self.block_indices(mIdx, row, topk, Int32(s), nidx, t)
                self.gather(mK, k_row0, seq_k, nidx, ring_addr + s * TILE_BYTES, t)
            cute.arch.cp_async_commit_group()
        self.block_indices(mIdx, row, topk, Int32(self.stages - 1), nidx, t)

    @cute.jit
    def next_block(self, mK, mIdx, row, k_row0, seq_k, topk, blk, n_blocks, ring_addr, nidx, t):
        """Start of iteration ``blk``: waits until block ``blk`` has landed in every thread's
        copies (and every thread is done with block ``blk - 1``), then issues block
        ``blk + stages - 1`` (indices in ``nidx``) into the stage block ``blk - 1`` used (or an
        empty group), and loads the next block's indices into ``nidx``."""
        cute.arch.cp_async_wait_group(self.stages - 2)
        cute.arch.fence_view_async_shared()  # cp.async (generic proxy) -> wgmma (async proxy)
        cute.arch.sync_threads()
        ahead = blk + self.stages - 1
        if ahead < n_blocks:
            self.gather(mK, k_row0, seq_k, nidx, ring_addr + (ahead % self.stages) * TILE_BYTES,
                        t)
        cute.arch.cp_async_commit_group()
        self.block_indices(mIdx, row, topk, ahead + 1, nidx, t)

    @cute.jit
    def logits(self, acc: cute.Tensor, stage_addr, sq_addr, t: Int32):
        """``acc = K_block Q^T`` (64 keys x 64 heads, fp32): issued, committed and waited."""
        mma = _mma(self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                   HEAD_TILE)
        thr = mma.get_slice(t)
        tA = thr.make_fragment_A(thr.partition_A(_tile(self.dtype, stage_addr, TILE_KEYS, D)))
        tB = thr.make_fragment_B(thr.partition_B(_tile(self.dtype, sq_addr, HEAD_TILE, D)))
        acc.fill(0.0)
        warpgroup.fence()
        for k in cutlass.range_constexpr(_K_STEPS):
            cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def slot_of(self, mIdx: cute.Tensor, row: Int32, seq_k: Int32, topk: Int32, blk: Int32,
                hh: cutlass.Constexpr[int], t: Int32):
        """``(slot, index, valid)`` of this thread's key row ``hh`` of block ``blk``: the
        accumulator gives thread (warp w, lane l) the key rows ``16 w + l // 4`` (hh 0) and
        ``+ 8`` (hh 1); ``valid`` when ``slot < topk`` and ``0 <= index < S``."""
        slot = blk * TILE_KEYS + (t // 32) * 16 + (t % 32) // 4 + 8 * hh
        idx = Int32(-1)
        if slot < topk:
            idx = mIdx[row, slot]
        return slot, idx, (idx >= 0) & (idx < seq_k)

    @cute.jit
    def load_weights(self, mW: cute.Tensor, row: Int32, num_heads: Int32, wr: cute.Tensor,
                     t: Int32):
        """``wr[2 j + e]`` = the weight of this thread's head column ``8 j + 2 (t % 4) + e``
        (0 for a padded head, whose column every use also selects away)."""
        for j in cutlass.range_constexpr(HEAD_TILE // 8):
            for e in cutlass.range_constexpr(2):
                h = 8 * j + 2 * (t % 4) + e
                w = Float32(0.0)
                if h < num_heads:
                    w = mW[row, h]
                wr[2 * j + e] = w


class LightningScoresForwardSm90(_ScoresTile):
    """The forward kernel: ``scores [R, topk]`` float32 (module docstring). Static: the dtype."""

    def __init__(self, dtype):
        super().__init__(dtype, FWD_STAGES)

    def smem_bytes(self) -> int:
        """Q, the ring, alignment slack."""
        return TILE_BYTES + self.stages * TILE_BYTES + 1024

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor,
                 mScores: cute.Tensor, seq_q: Int32, seq_k: Int32, stream):
        self.kernel(mQ, mK, mW, mIdx, mScores, seq_q, seq_k).launch(
            grid=[mQ.shape[0], 1, 1], block=[NUM_THREADS, 1, 1], smem=self.smem_bytes(),
            stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor,
               mScores: cute.Tensor, seq_q: Int32, seq_k: Int32):
        """Device entry: one CTA per row ``r = b T + t``."""
        t, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        num_heads = mQ.shape[1]
        topk = mIdx.shape[1]
        n_blocks = (topk + TILE_KEYS - 1) // TILE_KEYS
        k_row0 = Int64(row // seq_q) * seq_k

        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, cute.make_layout((HEAD_TILE * D,)), 1024)
        sRing = smem.allocate_tensor(self.dtype, cute.make_layout((self.stages * TILE_KEYS * D,)),
                                     1024)
        sq_addr = sQ.iterator.toint()
        ring_addr = sRing.iterator.toint()

        nidx = cute.make_rmem_tensor((TILE_KEYS // 8,), Int32)
        self.prologue(mQ, mK, mIdx, row, k_row0, num_heads, seq_k, topk, n_blocks, sq_addr,
                      ring_addr, nidx, t)
        wr = cute.make_rmem_tensor((HEAD_TILE // 4,), Float32)
        self.load_weights(mW, row, num_heads, wr, t)
        mma = _mma(self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                   HEAD_TILE)
        acc = cute.make_rmem_tensor(mma.partition_shape_C((TILE_KEYS, HEAD_TILE)), Float32)
        quad = t % 4
        for blk in cutlass.range(n_blocks, unroll=1):
            self.next_block(mK, mIdx, row, k_row0, seq_k, topk, blk, n_blocks, ring_addr, nidx,
                            t)
            # this thread's two key rows, loaded before the MMA's wait hides their latency
            slots = tuple(self.slot_of(mIdx, row, seq_k, topk, blk, hh, t) for hh in range(2))
            self.logits(acc, ring_addr + (blk % self.stages) * TILE_BYTES, sq_addr, t)
            for hh in cutlass.range_constexpr(2):
                part = Float32(0.0)
                for j in cutlass.range_constexpr(HEAD_TILE // 8):
                    for e in cutlass.range_constexpr(2):
                        h = 8 * j + 2 * quad + e
                        term = relu_nan(acc[4 * j + 2 * hh + e]) * wr[2 * j + e]
                        part = part + cutlass.select_(h < num_heads, term, Float32(0.0))
                part = part + cute.arch.shuffle_sync_bfly(part, offset=1)
                part = part + cute.arch.shuffle_sync_bfly(part, offset=2)
                slot, _, valid = slots[hh]
                if (quad == hh) & (slot < topk):
                    mScores[row, slot] = cutlass.select_(valid, part, Float32(0.0))


class LightningScoresBackwardSm90(_ScoresTile):
    """The backward kernel: ``dq [R, H, D]``, ``dweights [R, H]`` and the dk accumulator's
    additions (module docstring). Static: the dtype and ``deterministic`` (the accumulator is
    int64 fixed point, plain column order, with a ``[1]`` float32 scale; else float32 in the
    interleaved order of :func:`.bwd_host.dkv_interleave`)."""

    def __init__(self, dtype, deterministic: bool):
        super().__init__(dtype, BWD_STAGES)
        self.deterministic = deterministic

    def smem_bytes(self) -> int:
        """Q, the ring, the dS^T tile, the dweights exchange (4 warps x 64 heads), slack."""
        return TILE_BYTES + self.stages * TILE_BYTES + DS_BYTES + 4 * HEAD_TILE * 4 + 1024

    @cute.jit
    def __call__(self, mdS: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor,
                 mIdx: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor, mdW: cute.Tensor,
                 mScale: cute.Tensor | None, seq_q: Int32, seq_k: Int32, stream):
        self.kernel(mdS, mQ, mK, mW, mIdx, mdQ, mdK, mdW, mScale, seq_q, seq_k).launch(
            grid=[mQ.shape[0], 1, 1], block=[NUM_THREADS, 1, 1], smem=self.smem_bytes(),
            stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mdS: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor,
               mIdx: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor, mdW: cute.Tensor,
               mScale: cute.Tensor | None, seq_q: Int32, seq_k: Int32):
        """Device entry: one CTA per row ``r = b T + t``."""
        t, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        num_heads = mQ.shape[1]
        topk = mIdx.shape[1]
        n_blocks = (topk + TILE_KEYS - 1) // TILE_KEYS
        k_row0 = Int64(row // seq_q) * seq_k
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN

        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, cute.make_layout((HEAD_TILE * D,)), 1024)
        sRing = smem.allocate_tensor(self.dtype, cute.make_layout((self.stages * TILE_KEYS * D,)),
                                     1024)
        sDS = smem.allocate_tensor(self.dtype, cute.make_layout((TILE_KEYS * HEAD_TILE,)), 1024)
        sDW = smem.allocate_tensor(Float32, cute.make_layout((4, HEAD_TILE), stride=(HEAD_TILE, 1)),
                                   16)
        sq_addr = sQ.iterator.toint()
        ring_addr = sRing.iterator.toint()
        ds_addr = sDS.iterator.toint()

        nidx = cute.make_rmem_tensor((TILE_KEYS // 8,), Int32)
        self.prologue(mQ, mK, mIdx, row, k_row0, num_heads, seq_k, topk, n_blocks, sq_addr,
                      ring_addr, nidx, t)
        wr = cute.make_rmem_tensor((HEAD_TILE // 4,), Float32)
        self.load_weights(mW, row, num_heads, wr, t)
        dw = cute.make_rmem_tensor((HEAD_TILE // 4,), Float32)
        dw.fill(0.0)
        scale, inverse = Float32(1.0), Float32(1.0)
        if const_expr(self.dtype == Float16):
            scale, inverse = self.ds_scale(mdS, mIdx, row, seq_k, topk, wr, sDW, t)

        mma_s = _mma(self.dtype, K_MAJOR, K_MAJOR, HEAD_TILE)
        acc = cute.make_rmem_tensor(mma_s.partition_shape_C((TILE_KEYS, HEAD_TILE)), Float32)
        mma_dq = _mma(self.dtype, MN_MAJOR, MN_MAJOR, D)
        thr_dq = mma_dq.get_slice(t)
        acc_dq = cute.make_rmem_tensor(mma_dq.partition_shape_C((HEAD_TILE, D)), Float32)
        acc_dq.fill(0.0)
        mma_dk = _mma(self.dtype, K_MAJOR, MN_MAJOR, D)
        thr_dk = mma_dk.get_slice(t)
        acc_dk = cute.make_rmem_tensor(mma_dk.partition_shape_C((TILE_KEYS, D)), Float32)
        rows = cute.make_rmem_tensor((2,), Int32)  # the dk row of key row hh, -1: empty
        quad = t % 4

        for blk in cutlass.range(n_blocks, unroll=1):
            self.next_block(mK, mIdx, row, k_row0, seq_k, topk, blk, n_blocks, ring_addr, nidx,
                            t)
            stage_addr = ring_addr + (blk % self.stages) * TILE_BYTES
            # this thread's two key rows and their dscores (read whatever the index, then
            # selected: no load waits on another), loaded before the MMA's wait
            self.logits(acc, stage_addr, sq_addr, t)
            for hh in cutlass.range_constexpr(2):
                slot, idx, valid = self.slot_of(mIdx, row, seq_k, topk, blk, hh, t)
                g = cutlass.select_(valid, self.slot_grad(mdS, row, topk, slot), Float32(0.0))
                g_scaled = g * scale
                rows[hh] = cutlass.select_(valid, idx, Int32(-1))
                for j in cutlass.range_constexpr(HEAD_TILE // 8):
                    for e in cutlass.range_constexpr(2):
                        i = 4 * j + 2 * hh + e
                        h = 8 * j + 2 * quad + e
                        s = cutlass.select_(valid, acc[i], Float32(0.0))
                        dw[2 * j + e] = dw[2 * j + e] + g * relu_nan(s)
                        acc[i] = cutlass.select_((s > Float32(0.0)) & (h < num_heads),
                                                 g_scaled * wr[2 * j + e], Float32(0.0))
            self.store_ds(acc, ds_addr, t)
            cute.arch.fence_view_async_shared()  # st.shared (generic) -> wgmma (async proxy)
            cute.arch.sync_threads()

            ds_tile = _tile(self.dtype, ds_addr, TILE_KEYS, HEAD_TILE)
            k_tile = _tile(self.dtype, stage_addr, TILE_KEYS, D)
            q_tile = _tile(self.dtype, sq_addr, HEAD_TILE, D)
            tA_dq = thr_dq.make_fragment_A(thr_dq.partition_A(transposed(ds_tile)))
            tB_dq = thr_dq.make_fragment_B(thr_dq.partition_B(transposed(k_tile)))
            tA_dk = thr_dk.make_fragment_A(thr_dk.partition_A(ds_tile))
            tB_dk = thr_dk.make_fragment_B(thr_dk.partition_B(transposed(q_tile)))
            acc_dk.fill(0.0)
            warpgroup.fence()
            for k in cutlass.range_constexpr(TILE_KEYS // 16):
                cute.gemm(mma_dq, acc_dq, tA_dq[None, None, k], tB_dq[None, None, k], acc_dq)
            for k in cutlass.range_constexpr(HEAD_TILE // 16):
                cute.gemm(mma_dk, acc_dk, tA_dk[None, None, k], tB_dk[None, None, k], acc_dk)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if const_expr(self.dtype == Float16):
                for i in cutlass.range_constexpr(cute.size(acc_dk)):
                    acc_dk[i] = acc_dk[i] * inverse
            if const_expr(self.deterministic):
                self.scatter_fixed(acc_dk, rows, mdK, mScale[0], k_row0, t)
            else:
                self.scatter(acc_dk, rows, mdK, k_row0, t)

        if const_expr(self.dtype == Float16):
            for i in cutlass.range_constexpr(cute.size(acc_dq)):
                acc_dq[i] = acc_dq[i] * inverse
        self.store_dq(acc_dq, thr_dq, mdQ, row, num_heads)
        self.store_dweights(dw, sDW, mdW, row, num_heads, t)

    @cute.jit
    def slot_grad(self, mdS: cute.Tensor, row: Int32, topk: Int32, slot: Int32):
        """``dscores[row, slot]`` (0 past topk, not read)."""
        g = Float32(0.0)
        if slot < topk:
            g = mdS[row, slot]
        return g

    @cute.jit
    def ds_scale(self, mdS: cute.Tensor, mIdx: cute.Tensor, row: Int32, seq_k: Int32,
                 topk: Int32, wr: cute.Tensor, sRed: cute.Tensor, t: Int32):
        """``(scale, inverse)``, powers of two: the float16 dS scale of the row (module
        docstring), from the largest ``|dscores|`` of its valid slots (every thread reads every
        128th slot; a warp maximum by shuffles, the 4 warps through ``sRed[:, 0]``) times the
        largest ``|weight|`` (the thread's 16 columns, then its quad's)."""
        m = Float32(0.0)
        for i in cutlass.range(t, topk, NUM_THREADS, unroll=1):
            idx = mIdx[row, i]
            if (idx >= 0) & (idx < seq_k):
                g = mdS[row, i]
                m = cute.arch.fmax(m, cutlass.select_(g < Float32(0.0), -g, g))
        for off in cutlass.range_constexpr(5):
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1 << off))
        if t % 32 == 0:
            sRed[t // 32, 0] = m
        wm = Float32(0.0)
        for c in cutlass.range_constexpr(HEAD_TILE // 4):
            wm = cute.arch.fmax(wm, cutlass.select_(wr[c] < Float32(0.0), -wr[c], wr[c]))
        for off in cutlass.range_constexpr(2):
            wm = cute.arch.fmax(wm, cute.arch.shuffle_sync_bfly(wm, offset=1 << off))
        cute.arch.sync_threads()
        m = cute.arch.fmax(cute.arch.fmax(sRed[0, 0], sRed[1, 0]),
                           cute.arch.fmax(sRed[2, 0], sRed[3, 0]))
        e = ((f32_bits(m * wm) >> 23) & 0xFF) - 127
        e = cutlass.max(cutlass.min(e, Int32(100)), Int32(-100))
        scale = f32_from_bits((127 + FP16_DS_EXPONENT - 1 - e) << 23)
        inverse = f32_from_bits((127 - FP16_DS_EXPONENT + 1 + e) << 23)
        return scale, inverse

    @cute.jit
    def store_ds(self, acc: cute.Tensor, ds_addr, t: Int32):
        """Rounds the 64 x 64 fp32 fragment ``acc`` (register ``4 j + 2 hh + e`` = key row
        ``16 warp + lane // 4 + 8 hh``, head column ``8 j + 2 (lane % 4) + e``) to the input dtype
        and stores it into the K-major 128-byte-swizzled tile at ``ds_addr``: the pair ``(hh, j)``
        goes to byte ``128 key + 16 (j ^ (key % 8)) + 4 (lane % 4)``."""
        r16 = cute.make_rmem_tensor_like(acc, self.dtype)
        r16.store(acc.load().to(self.dtype))
        r32 = cute.recast_tensor(r16, Int32)
        lane = t % 32
        g = lane // 4
        base = ds_addr + ((t // 32) * 16 + g) * 128 + (lane % 4) * 4
        for j in cutlass.range_constexpr(HEAD_TILE // 8):
            a = base + ((g ^ j) * 16)
            for hh in cutlass.range_constexpr(2):
                st_shared_b32(a + hh * 8 * 128, r32[2 * j + hh])

    @cute.jit
    def scatter(self, acc: cute.Tensor, rows: cute.Tensor, mdK: cute.Tensor, k_row0: Int64,
                t: Int32):
        """Adds the block's dk rows (64 keys x 128, fp32; register ``4 j + 2 hh + e`` = key row
        ``hh``, column ``8 j + 2 (lane % 4) + e``) into the interleaved float32 accumulator:
        per key row and 16-column group ``c``, the thread's four values (columns ``16 c + 2 q +
        {0, 1}`` and ``+ 8``) sit at ``16 c + 4 q .. + 3`` and go out as one 16-byte
        ``red.global.add.v4.f32`` (L2 evict_last), skipped for an empty slot."""
        base = mdK.iterator.toint()
        keep = create_policy(True)
        quad = t % 4
        for hh in cutlass.range_constexpr(2):
            idx = rows[hh]
            ok = Int32(idx >= 0)
            addr = base + ((k_row0 + Int64(cutlass.max(idx, Int32(0)))) * D + 4 * quad) * 4
            for c in cutlass.range_constexpr(D // DKV_GROUP):
                red_add_f32x4(addr + c * DKV_GROUP * 4, acc[8 * c + 2 * hh],
                              acc[8 * c + 2 * hh + 1], acc[8 * c + 4 + 2 * hh],
                              acc[8 * c + 4 + 2 * hh + 1], ok, keep)

    @cute.jit
    def scatter_fixed(self, acc: cute.Tensor, rows: cute.Tensor, mdK: cute.Tensor,
                      scale: Float32, k_row0: Int64, t: Int32):
        """The deterministic scatter: each of the block's dk values times ``scale``, rounded to
        an integer and added to the int64 accumulator (plain column order) with
        :func:`.ptx.red_add_fixed64`; skipped for an empty slot."""
        base = mdK.iterator.toint()
        keep = create_policy(True)
        quad = t % 4
        for hh in cutlass.range_constexpr(2):
            idx = rows[hh]
            ok = Int32(idx >= 0)
            addr = base + ((k_row0 + Int64(cutlass.max(idx, Int32(0)))) * D + 2 * quad) * 8
            for j in cutlass.range_constexpr(D // 8):
                for e in cutlass.range_constexpr(2):
                    red_add_fixed64(addr + (8 * j + e) * 8, acc[4 * j + 2 * hh + e] * scale, ok,
                                    keep)

    @cute.jit
    def store_dq(self, acc_dq: cute.Tensor, thr_dq, mdQ: cute.Tensor, row: Int32,
                 num_heads: Int32):
        """dq ``[H, D]`` of the row from its accumulator (heads < H), in q's dtype."""
        coords = thr_dq.partition_C(cute.make_identity_tensor((HEAD_TILE, D)))
        for i in cutlass.range_constexpr(cute.size(acc_dq)):
            h, col = coords[i]
            if h < num_heads:
                mdQ[row, h, col] = acc_dq[i].to(mdQ.element_type)

    @cute.jit
    def store_dweights(self, dw: cute.Tensor, sDW: cute.Tensor, mdW: cute.Tensor, row: Int32,
                       num_heads: Int32, t: Int32):
        """dweights of the row: the thread's partial sums over its key rows, summed over the 8
        lanes of equal quad position (butterfly shuffles), then over the 4 warps through shared
        memory in warp order (the same order in every run)."""
        lane = t % 32
        for c in cutlass.range_constexpr(HEAD_TILE // 4):
            x = dw[c]
            for off in cutlass.range_constexpr(3):
                x = x + cute.arch.shuffle_sync_bfly(x, offset=4 << off)
            dw[c] = x
        if lane < 4:
            for j in cutlass.range_constexpr(HEAD_TILE // 8):
                for e in cutlass.range_constexpr(2):
                    sDW[t // 32, 8 * j + 2 * lane + e] = dw[2 * j + e]
        cute.arch.sync_threads()
        if t < num_heads:
            total = sDW[0, t] + sDW[1, t]
            total = total + sDW[2, t]
            total = total + sDW[3, t]
            mdW[row, t] = total


# ------------------------------------------------------------------------------------------------
# compiling (the launchers are in lightning_selected_slots_host.py)
# ------------------------------------------------------------------------------------------------

def _per_row(dtype, n_rows, inner: tuple, align: int):
    """A fake ``[R, *inner]`` tensor, rows contiguous, with a 64-bit run-time row stride (``r *
    stride`` in 64 bits: it passes 2**31 for long inputs)."""
    stride = (cute.sym_int(64),)
    for i in range(len(inner)):
        stride += (1 if i == len(inner) - 1 else inner[i + 1],)
    return cute.runtime.make_fake_tensor(dtype, (n_rows, *inner), stride, assumed_align=align)


def compile_forward(dtype_name: str):
    """Compiles the forward kernel for ``dtype_name`` (``"bfloat16"`` / ``"float16"``; no GPU
    needed inside :func:`.common.target_arch`). R = B T, H, B S and topk are symbolic. Returns
    the TVM-FFI callable ``fn(q [R, H, D], k [B S, D], weights [R, H], indices [R, topk],
    scores [R, topk], T, S)`` on torch's current stream."""
    dtype = TORCH_TO_CUTE[dtype_name]
    n_rows, n_head, n_keys, n_topk = (cute.sym_int() for _ in range(4))
    fake = cute.runtime.make_fake_compact_tensor
    args = (
        _per_row(dtype, n_rows, (n_head, D), 16),  # q
        fake(dtype, (n_keys, D), stride_order=(1, 0), assumed_align=16),  # k
        _per_row(Float32, n_rows, (n_head,), 4),  # weights
        _per_row(Int32, n_rows, (n_topk,), 4),  # indices
        _per_row(Float32, n_rows, (n_topk,), 4),  # scores
        Int32(1), Int32(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    return cute.compile(LightningScoresForwardSm90(dtype), *args, options="--enable-tvm-ffi")


def compile_backward(dtype_name: str, deterministic: bool):
    """Compiles the backward kernel (no GPU needed inside :func:`.common.target_arch`). Returns
    the TVM-FFI callable ``fn(dscores [R, topk], q, k, weights, indices, dq [R, H, D],
    dk_accum [B S, D], dweights [R, H], scale_or_None [1], T, S)``: ``dk_accum`` float32
    (interleaved columns), or int64 with a float32 ``scale`` when ``deterministic``."""
    dtype = TORCH_TO_CUTE[dtype_name]
    n_rows, n_head, n_keys, n_topk = (cute.sym_int() for _ in range(4))
    fake = cute.runtime.make_fake_compact_tensor
    accum = Int64 if deterministic else Float32
    args = (
        _per_row(Float32, n_rows, (n_topk,), 4),  # dscores
        _per_row(dtype, n_rows, (n_head, D), 16),  # q
        fake(dtype, (n_keys, D), stride_order=(1, 0), assumed_align=16),  # k
        _per_row(Float32, n_rows, (n_head,), 4),  # weights
        _per_row(Int32, n_rows, (n_topk,), 4),  # indices
        _per_row(dtype, n_rows, (n_head, D), 16),  # dq
        fake(accum, (n_keys, D), stride_order=(1, 0), assumed_align=16),  # dk accumulator
        _per_row(Float32, n_rows, (n_head,), 4),  # dweights
        fake(Float32, (1,), assumed_align=4) if deterministic else None,  # fixed-point scale
        Int32(1), Int32(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    kernel = LightningScoresBackwardSm90(dtype, deterministic)
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")
