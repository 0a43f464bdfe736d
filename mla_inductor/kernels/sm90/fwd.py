"""Sparse-MLA forward for Hopper (SM90a), written in CuTe DSL.

Computes, for every token ``t`` and head ``h``::

    s_j   = sm_scale * q[t, h, :d_qk] . kv[indices[t, j], :d_qk]      (j over valid slots)
    out   = sum_j softmax(s)_j * kv[indices[t, j], :d_v]
    lse   = log(sum_j exp(s_j))                                      (natural log, fp32)
    o_lo  = float32(O_normalised) - float32(out)                      (optional)

A slot is valid when ``0 <= indices[t, j] < S`` and ``j < topk_length[t]``; invalid slots are
never read (their ``cp.async`` has source size 0, which zero-fills the shared-memory row) and
their scores are set to -inf. A row without valid slots gets ``out = 0``, ``lse = -inf``.

Design (decisions, in the order they were taken)
-------------------------------------------------
* Tile: one CTA = one token x 64 heads (``H`` is padded to a multiple of 64 inside the kernel:
  padded Q rows are zero-filled, padded output rows are never stored). Grid ``T * ceil(H/64)``
  on ``x``, the head tiles of one token adjacent so that they share the gathered rows in L2.
  64 heads is the wgmma M of one warpgroup and what every public Hopper sparse-MLA kernel uses.
* Keys: blocks of 64 gathered rows (full ``d_qk`` width), walked from the LAST block to the
  FIRST (as the kernels whose numerics we study do, so order-invariance tests bite).
  ``topk`` need not be a multiple of 64: slots past ``topk`` are empty (predicated).
* Warp specialisation, 3 warpgroups (384 threads), registers 56 / 232 / 216 via ``setmaxnreg``:
  - WG0, producer: gathers Q once and then each KV block with 16-byte ``cp.async`` (8 threads
    per 128-byte row segment, 4 passes of 16 rows, ``d_qk / 64`` segments per row), signalling
    ``full[stage]`` with ``cp.async.mbarrier.arrive.noinc``; waits ``empty[stage]`` before reuse.
  - WG1, softmax consumer: ``S = Q K^T`` (64x64, SS wgmma, k = d_qk in 16-wide steps over
    64-column swizzled chunks), masks invalid slots, runs the online softmax (below), writes
    the bf16 P tile and the per-row rescale factor to shared memory for WG2, and accumulates
    ``O[:, :d_v/2] += P V[:, :d_v/2]`` with P from registers (RS wgmma, N = 256).
  - WG2, second consumer: waits for P (named barrier per stage), rescales its half of O and
    accumulates ``O[:, d_v/2:] += P V[:, d_v/2:]`` (SS wgmma, P from shared memory).
  WG1 owns the running max and row sum alone, so the two consumers need no max exchange:
  WG2 only receives WG1's per-row factor. A rescale whose factors are exactly 1 (no row max of
  the thread moved) is skipped.
* Stage release, the key to hiding the gather latency with only two stages: WG1 issues
  ``S`` of block i, then ``wgmma.wait_group(1)`` (groups retire in order, so its ``P V`` of
  block i-1 is done) and releases block i-1's stage while ``S`` still runs; WG2 waits for its
  ``P V`` right after issuing it and releases at once. The producer loads each block's indices
  before waiting for the free stage, so the index load latency hides behind that wait.
* Shared memory (d_qk = 576): Q 72 KiB + 2 KV stages of 72 KiB = 216 KiB. Three stages do not
  fit in 227 KiB, so the pipeline is double-buffered. The 8 KiB P tile of a stage lives in that
  stage's RoPE columns (512:576), which only WG1's Q K^T reads and which are dead once that
  product is complete (FlashMLA's trick). For d_qk = 512 the P tiles get their own 16 KiB.
  All tiles use the 128-byte-swizzled K-major wgmma layout (8 x 64 atoms stacked along rows,
  64-column chunks contiguous); V is the same buffer seen MN-major (transposed view).
* Online softmax in the exp2 domain: ``x = s * sm_scale * log2(e)``. ``rescale_threshold`` is a
  compile-time constant: 0.0 = exact running max (any growth rescales O and the row sum by
  ``exp2(m_old - m_new)``); > 0 = lazy (keep the stale max unless the block max exceeds it by
  more than the threshold, so p <= 2**threshold, which the kernel checks fits bf16/fp16).
  p is fp32; the row sum accumulates the fp32 p; p is rounded to the input dtype for P V.
  Source: FlashAttention-4 ``softmax.py`` and the seed notes (docs/seed-notes.md).
* Epilogue: ``out = O / row_sum`` rounded to the input dtype, ``o_lo = O / row_sum - out`` in
  fp32, ``lse = (m + log2(row_sum)) * ln 2`` (written by WG1, rows ``h < H``). out and o_lo are
  staged row-major (rows padded by 16 bytes where that fits) in the dead KV stages, then written
  by all 256 consumer threads as coalesced 16-byte stores of whole rows ``h < H``.
* One compiled kernel serves every ``T``, ``H``, ``S`` and ``topk`` (all symbolic); the compile
  key is (dtype, d_qk, d_v, threshold, o_lo, has topk_length). It is launched on torch's current
  stream through TVM-FFI.
"""

from __future__ import annotations

import contextlib
import math

import torch

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import BFloat16, Boolean, Float16, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.utils import LayoutEnum

from ..cache import KernelCache
from . import SUPPORTED_DIMS

TILE_H = 64  # heads per CTA (wgmma M)
TILE_N = 64  # gathered keys per block
NUM_STAGES = 2
NUM_THREADS = 384
REGS_PRODUCER, REGS_SOFTMAX, REGS_PV = 56, 232, 216
BAR_P_READY = 1  # named barriers 1, 2: P of stage 0 / 1 ready for WG2
BAR_EPILOGUE = 3  # 1/row_sum published by WG1
BAR_STAGED = 4  # output tile staged in shared memory / staging free again
LN2 = math.log(2.0)
LOG2E = math.log2(math.e)


@dsl_user_op
def _cp_async_16(dst_smem_addr: Int32, src_gmem_addr: Int64, valid: Boolean, *, loc=None, ip=None):
    """16-byte ``cp.async.cg`` whose source size is 0 (pure zero-fill, no read) when not valid."""
    src_size = cutlass.select_(valid, Int32(16), Int32(0))
    llvm.inline_asm(
        None,
        [
            Int32(dst_smem_addr).ir_value(loc=loc, ip=ip),
            Int64(src_gmem_addr).ir_value(loc=loc, ip=ip),
            Int32(src_size).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def _cp_async_wait_all(*, loc=None, ip=None):
    llvm.inline_asm(
        None, [], "cp.async.wait_all;", "", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _sw128_offset_bytes(row, vec, chunk):
    """Byte offset of 16-byte vector ``vec`` (0..7) of ``row`` in 64-column ``chunk`` of a
    2-byte-element tile stored as 128-byte-swizzled K-major wgmma atoms (8 rows x 128 B; rows
    contiguous within a chunk, chunks of 64 rows contiguous): the layout ``_layouts`` builds
    and the wgmma descriptors read (the GPU tests check the two agree)."""
    return chunk * (TILE_N * 128) + row * 128 + ((vec ^ (row & 7)) << 4)


class SparseMlaFwdSm90:
    """Compile-time configuration of one forward kernel (see the module docstring)."""

    def __init__(self, dtype, d_qk: int, d_v: int, rescale_threshold: float, has_o_lo: bool,
                 has_topk_length: bool):
        if dtype not in (BFloat16, Float16):
            raise TypeError(f"sm90 sparse-MLA forward supports bf16/fp16, got {dtype}")
        if (d_qk, d_v) not in SUPPORTED_DIMS:
            raise ValueError(f"need (d_qk, d_v) in {SUPPORTED_DIMS}, got {(d_qk, d_v)}")
        max_exp = 127 if dtype is BFloat16 else 15
        if not (0.0 <= rescale_threshold < max_exp):
            raise ValueError(f"rescale_threshold {rescale_threshold} would overflow p in {dtype}")
        self.dtype = dtype
        self.d_qk = d_qk
        self.d_v = d_v
        self.threshold = float(rescale_threshold)
        self.has_o_lo = has_o_lo
        self.has_topk_length = has_topk_length
        self.n_chunks = d_qk // 64
        self.p_in_rope = d_qk - d_v >= 64  # P tile lives in the (dead) last RoPE chunk
        self.stage_elems = TILE_N * d_qk
        self.d_half = d_v // 2

    def _layouts(self):
        atom = warpgroup.make_smem_layout_atom(
            sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, 64), self.dtype
        )
        sQ = cute.tile_to_shape(atom, (TILE_H, self.d_qk), order=(0, 1))
        sKV = cute.tile_to_shape(atom, (TILE_N, self.d_qk, NUM_STAGES), order=(0, 1, 2))
        sP = cute.tile_to_shape(atom, (TILE_H, TILE_N, NUM_STAGES), order=(0, 1, 2))
        return sQ, sKV, sP

    def _smem_bytes(self):
        e = self.dtype.width // 8
        n = TILE_H * self.d_qk * e + NUM_STAGES * self.stage_elems * e
        if not self.p_in_rope:
            n += NUM_STAGES * TILE_H * TILE_N * e
        return n + (NUM_STAGES + 1) * TILE_H * 4 + 8 * 8 + 4 * 1024

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, H, d_qk]
        mKV: cute.Tensor,  # [S, d_qk]
        mIdx: cute.Tensor,  # [T, topk] int32
        mTopkLen: cute.Tensor | None,  # [T] int32
        mO: cute.Tensor,  # [T, H, d_v]
        mLSE: cute.Tensor,  # [T, H] fp32
        mOlo: cute.Tensor | None,  # [T, H, d_v] fp32
        scale_log2: Float32,
        stream,
    ):
        sQ_layout, sKV_layout, sP_layout = self._layouts()
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_H, TILE_N),
        )
        tiled_mma_pv_rs = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_H, self.d_half),
            a_source=warpgroup.OperandSource.RMEM,
        )
        tiled_mma_pv_ss = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_H, self.d_half),
        )
        n_head_tiles = (mQ.shape[1] + TILE_H - 1) // TILE_H
        self.kernel(
            mQ, mKV, mIdx, mTopkLen, mO, mLSE, mOlo, scale_log2,
            sQ_layout, sKV_layout, sP_layout, tiled_mma_qk, tiled_mma_pv_rs, tiled_mma_pv_ss,
        ).launch(
            grid=[mQ.shape[0] * n_head_tiles, 1, 1],
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
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOlo: cute.Tensor | None,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv_rs: cute.TiledMma,
        tiled_mma_pv_ss: cute.TiledMma,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4

        num_heads = mQ.shape[1]
        n_head_tiles = (num_heads + TILE_H - 1) // TILE_H
        t = bidx // n_head_tiles
        h0 = (bidx % n_head_tiles) * TILE_H
        seqlen_kv = mKV.shape[0]
        topk = mIdx.shape[1]
        n_valid = topk
        if const_expr(self.has_topk_length):
            n_valid = cutlass.max(cutlass.min(mTopkLen[t], topk), Int32(0))
        n_blocks = (n_valid + TILE_N - 1) // TILE_N

        # ---- shared memory ----
        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, sQ_layout.outer, 1024, swizzle=sQ_layout.inner)
        sKV = smem.allocate_tensor(self.dtype, sKV_layout.outer, 1024, swizzle=sKV_layout.inner)
        if const_expr(self.p_in_rope):
            # P of stage s = columns [d_qk - 64, d_qk) of KV stage s, as a (64 heads, 64 keys) tile
            sP = cute.composition(
                sKV,
                cute.make_layout(
                    (TILE_H, (TILE_N, self.n_chunks), NUM_STAGES),
                    stride=(1, (TILE_N, TILE_N * 64), TILE_N * self.d_qk),
                ),
            )[None, (None, self.n_chunks - 1), None]
        else:
            sP = smem.allocate_tensor(self.dtype, sP_layout.outer, 1024, swizzle=sP_layout.inner)
        # V^T of each stage, split in the two d_v halves: (d_half, keys, stage)
        sVt_all = cute.composition(
            sKV,
            cute.make_layout(
                ((self.d_half, 2), TILE_N, NUM_STAGES),
                stride=((TILE_N, TILE_N * self.d_half), 1, TILE_N * self.d_qk),
            ),
        )
        sScale = smem.allocate_tensor(Float32, cute.make_layout((TILE_H, NUM_STAGES)), 16)
        sInv = smem.allocate_tensor(Float32, cute.make_layout((TILE_H,)), 16)
        mbar = smem.allocate_array(Int64, 2 * NUM_STAGES + 1)
        mbar_full = mbar
        mbar_empty = mbar + NUM_STAGES
        mbar_q = mbar + 2 * NUM_STAGES

        if tidx == 0:
            for s in cutlass.range_constexpr(NUM_STAGES):
                cute.arch.mbarrier_init(mbar_full + s, 128)
                cute.arch.mbarrier_init(mbar_empty + s, 256)
            cute.arch.mbarrier_init(mbar_q, 128)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            # ================= producer: cp.async gathers =================
            cute.arch.setmaxregister_decrease(REGS_PRODUCER)
            vec = tidx % 8
            row_in_pass = tidx // 8
            sQ_addr = sQ.iterator.toint()
            sKV_addr = sKV.iterator.toint()
            q_base = mQ.iterator.toint()
            kv_base = mKV.iterator.toint()
            elem = self.dtype.width // 8
            for p in cutlass.range_constexpr(TILE_H // 16):
                r = p * 16 + row_in_pass
                ok = h0 + r < num_heads
                src = q_base + (Int64(t) * num_heads + h0 + r) * (self.d_qk * elem)
                src = cutlass.select_(ok, src, q_base)
                for c in cutlass.range_constexpr(self.n_chunks):
                    _cp_async_16(
                        sQ_addr + _sw128_offset_bytes(r, vec, c),
                        src + (c * 64 + vec * 8) * elem,
                        ok,
                    )
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar_q)
            for it in cutlass.range(n_blocks, unroll=1):
                blk = n_blocks - 1 - it
                stage = it % NUM_STAGES
                # the index loads are issued before the wait, so their latency hides behind it
                rows_idx = cute.make_rmem_tensor((TILE_N // 16,), Int32)
                for p in cutlass.range_constexpr(TILE_N // 16):
                    j = blk * TILE_N + p * 16 + row_in_pass
                    idx = Int32(-1)
                    if j < n_valid:
                        idx = mIdx[t, j]
                    rows_idx[p] = idx
                cute.arch.mbarrier_wait(mbar_empty + stage, ((it // NUM_STAGES) & 1) ^ 1)
                stage_addr = sKV_addr + stage * (self.stage_elems * elem)
                for p in cutlass.range_constexpr(TILE_N // 16):
                    r = p * 16 + row_in_pass
                    idx = rows_idx[p]
                    ok = (idx >= 0) & (idx < seqlen_kv)
                    src = kv_base + Int64(idx) * (self.d_qk * elem)
                    src = cutlass.select_(ok, src, kv_base)
                    for c in cutlass.range_constexpr(self.n_chunks):
                        _cp_async_16(
                            stage_addr + _sw128_offset_bytes(r, vec, c),
                            src + (c * 64 + vec * 8) * elem,
                            ok,
                        )
                cute.arch.cp_async_mbarrier_arrive_noinc(mbar_full + stage)
            _cp_async_wait_all()

        elif wg == 1:
            # ================= softmax consumer: S, softmax, O[:, :d_v/2] =================
            cute.arch.setmaxregister_increase(REGS_SOFTMAX)
            ct = tidx - 128
            lane = ct % 32
            thr_qk = tiled_mma_qk.get_slice(ct)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sKV))
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_H, TILE_N)), Float32)
            tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_H, TILE_N)))
            tSsP = thr_qk.partition_C(sP)
            row0 = tScS[0][0]
            row1 = tScS[2][0]

            thr_pv = tiled_mma_pv_rs.get_slice(ct)
            sVt = sVt_all[(None, 0), None, None]
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_H, self.d_half)), Float32)
            acc_O.fill(0.0)
            tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((TILE_H, TILE_N)))
            # acc_S seen with the A-fragment layout: (2 cols, 2 rows, 2 col groups), k blocks of 16
            acc_S_as_A = cute.make_tensor(acc_S.iterator, tOrP.layout)
            tOrP_as_C = cute.make_tensor(tOrP.iterator, acc_S.layout)

            row_max = cute.make_rmem_tensor((2,), Float32)
            row_sum = cute.make_rmem_tensor((2,), Float32)
            row_max.fill(-Float32.inf)
            row_sum.fill(0.0)
            valid = cute.make_rmem_tensor((16,), Boolean)
            mma_qk = cute.make_mma_atom(tiled_mma_qk.op)
            mma_pv = cute.make_mma_atom(tiled_mma_pv_rs.op)

            cute.arch.mbarrier_wait(mbar_q, 0)
            cute.arch.fence_view_async_shared()
            for it in cutlass.range(n_blocks, unroll=1):
                blk = n_blocks - 1 - it
                stage = it % NUM_STAGES
                # validity of this thread's 16 columns (loaded before the data wait)
                for v in cutlass.range_constexpr(16):
                    i = (v % 2) + 4 * (v // 2)
                    j = blk * TILE_N + tScS[i][1]
                    idx = Int32(-1)
                    if j < n_valid:
                        idx = mIdx[t, j]
                    valid[v] = (idx >= 0) & (idx < seqlen_kv)
                cute.arch.mbarrier_wait(mbar_full + stage, (it // NUM_STAGES) & 1)
                cute.arch.fence_view_async_shared()  # cp.async (generic proxy) -> wgmma reads
                warpgroup.fence()
                mma_qk.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tSrQ.shape[2])):
                    cute.gemm(mma_qk, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
                    mma_qk.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                if it > 0:
                    # groups complete in order: our P V of the previous block is done once at
                    # most this S is pending, so its stage can be refilled while S runs
                    warpgroup.wait_group(1)
                    cute.arch.mbarrier_arrive(mbar_empty + (1 - stage))
                warpgroup.wait_group(0)

                # ---- online softmax (exp2 domain) ----
                bmax0 = -Float32.inf
                bmax1 = -Float32.inf
                for i in cutlass.range_constexpr(cute.size(acc_S)):
                    v = (i % 2) + 2 * (i // 4)
                    s = cutlass.select_(valid[v], acc_S[i], -Float32.inf)
                    acc_S[i] = s
                    if const_expr((i // 2) % 2 == 0):
                        bmax0 = cute.arch.fmax(bmax0, s)
                    else:
                        bmax1 = cute.arch.fmax(bmax1, s)
                bmax = [bmax0, bmax1]
                m_use = [Float32(0.0), Float32(0.0)]
                acc_scale = [Float32(1.0), Float32(1.0)]
                for r in cutlass.range_constexpr(2):
                    bm = bmax[r]
                    bm = cute.arch.fmax(bm, cute.arch.shuffle_sync_bfly(bm, offset=1))
                    bm = cute.arch.fmax(bm, cute.arch.shuffle_sync_bfly(bm, offset=2))
                    bm = bm * scale_log2
                    m_old = row_max[r]
                    if const_expr(self.threshold == 0.0):
                        m_new = cute.arch.fmax(m_old, bm)
                    else:
                        m_new = cutlass.select_(bm - m_old > self.threshold, bm, m_old)
                    mu = cutlass.select_(m_new == -Float32.inf, Float32(0.0), m_new)
                    acc_scale[r] = cute.math.exp2(m_old - mu, fastmath=True)
                    m_use[r] = mu
                    row_max[r] = m_new
                rs0 = row_sum[0] * acc_scale[0]
                rs1 = row_sum[1] * acc_scale[1]
                for i in cutlass.range_constexpr(cute.size(acc_S)):
                    if const_expr((i // 2) % 2 == 0):
                        p = cute.math.exp2(acc_S[i] * scale_log2 - m_use[0], fastmath=True)
                        rs0 = rs0 + p
                    else:
                        p = cute.math.exp2(acc_S[i] * scale_log2 - m_use[1], fastmath=True)
                        rs1 = rs1 + p
                    acc_S[i] = p
                row_sum[0] = rs0
                row_sum[1] = rs1
                tOrP.store(acc_S_as_A.load().to(self.dtype))
                # hand P and the row factors to WG2
                tSsP_stage = tSsP[None, None, None, stage]
                tSsP_stage.store(tOrP_as_C.load())
                if lane % 4 == 0:
                    sScale[row0, stage] = acc_scale[0]
                    sScale[row1, stage] = acc_scale[1]
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=BAR_P_READY + stage, number_of_threads=256)
                # O[:, :d_v/2] = O * acc_scale + P V (the rescale is skipped when both factors
                # are exactly 1, i.e. neither of this thread's row maxima moved)
                if (acc_scale[0] != 1.0) | (acc_scale[1] != 1.0):
                    self._rescale(acc_O, acc_scale[0], acc_scale[1])
                warpgroup.fence()
                mma_pv.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
                    cute.gemm(mma_pv, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
                warpgroup.commit_group()
            warpgroup.wait_group(0)

            # ---- epilogue: row sums, lse, 1/row_sum for WG2 ----
            inv = [Float32(0.0), Float32(0.0)]
            rows = [row0, row1]
            for r in cutlass.range_constexpr(2):
                rs = row_sum[r]
                rs = rs + cute.arch.shuffle_sync_bfly(rs, offset=1)
                rs = rs + cute.arch.shuffle_sync_bfly(rs, offset=2)
                m = row_max[r]
                mu = cutlass.select_(m == -Float32.inf, Float32(0.0), m)
                has = rs > 0.0
                inv[r] = cutlass.select_(has, 1.0 / rs, Float32(0.0))
                lse = cutlass.select_(has, mu * LN2 + cute.math.log(rs), -Float32.inf)
                if lane % 4 == 0:
                    sInv[rows[r]] = inv[r]
                    if h0 + rows[r] < num_heads:
                        mLSE[t, h0 + rows[r]] = lse
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=256)
            self._store_o(acc_O, thr_pv, sKV, mO, mOlo, t, h0, num_heads, 0, inv, ct)

        else:
            # ================= second consumer: O[:, d_v/2:] =================
            cute.arch.setmaxregister_increase(REGS_PV)
            ct = tidx - 256
            thr_pv = tiled_mma_pv_ss.get_slice(ct)
            sVt = sVt_all[(None, 1), None, None]
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
            tOsP = thr_pv.make_fragment_A(thr_pv.partition_A(sP))
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_H, self.d_half)), Float32)
            acc_O.fill(0.0)
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((TILE_H, self.d_half)))
            row0 = tOcO[0][0]
            row1 = tOcO[2][0]
            mma_pv = cute.make_mma_atom(tiled_mma_pv_ss.op)
            for it in cutlass.range(n_blocks, unroll=1):
                stage = it % NUM_STAGES
                cute.arch.mbarrier_wait(mbar_full + stage, (it // NUM_STAGES) & 1)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=BAR_P_READY + stage, number_of_threads=256)
                sc0 = sScale[row0, stage]
                sc1 = sScale[row1, stage]
                if (sc0 != 1.0) | (sc1 != 1.0):
                    self._rescale(acc_O, sc0, sc1)
                warpgroup.fence()
                mma_pv.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range_constexpr(cute.size(tOsP.shape[2])):
                    cute.gemm(mma_pv, acc_O, tOsP[None, None, k, stage], tOrV[None, None, k, stage], acc_O)
                warpgroup.commit_group()
                # nothing else to do until the next P: wait and release the stage at once
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(mbar_empty + stage)
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=256)
            inv = [sInv[row0], sInv[row1]]
            self._store_o(acc_O, thr_pv, sKV, mO, mOlo, t, h0, num_heads, 1, inv, ct + 128)

    @cute.jit
    def _rescale(self, acc_O, scale0, scale1):
        """Multiplies this thread's two accumulator rows by their factors."""
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            if const_expr((i // 2) % 2 == 0):
                acc_O[i] = acc_O[i] * scale0
            else:
                acc_O[i] = acc_O[i] * scale1

    @cute.jit
    def _store_o(self, acc_O, thr_pv, sKV, mO, mOlo, t, h0, num_heads,
                 half: cutlass.Constexpr, inv, tid):
        """out = O * inv (rounded to the output dtype) and o_lo = O * inv - out, rows < H only.

        Both consumer warpgroups stage their d_v halves in the (dead) KV stages, rows padded
        against bank conflicts where the space allows, then all 256 consumer threads (``tid``)
        write whole rows with coalesced 16-byte stores: first out, then o_lo.
        """
        self._rescale(acc_O, inv[0], inv[1])
        rounded = acc_O.load().to(self.dtype)
        staging = sKV.iterator.toint()
        sOut = self._staging_tile(staging, self.dtype)
        thr_pv.partition_C(cute.local_tile(sOut, (TILE_H, self.d_half), (0, half))).store(rounded)
        cute.arch.barrier(barrier_id=BAR_STAGED, number_of_threads=256)
        self._copy_rows_out(sOut, mO, t, h0, num_heads, tid, 8)
        if const_expr(self.has_o_lo):
            cute.arch.barrier(barrier_id=BAR_STAGED, number_of_threads=256)
            sOlo = self._staging_tile(staging, Float32)
            thr_pv.partition_C(cute.local_tile(sOlo, (TILE_H, self.d_half), (0, half))).store(
                acc_O.load() - rounded.to(Float32)
            )
            cute.arch.barrier(barrier_id=BAR_STAGED, number_of_threads=256)
            self._copy_rows_out(sOlo, mOlo, t, h0, num_heads, tid, 4)

    def _staging_tile(self, addr, dtype):
        """(64, d_v) row-major tile over the KV stages, rows padded by 16 bytes if it fits."""
        pad = 16 // (dtype.width // 8)
        kv_bytes = NUM_STAGES * self.stage_elems * (self.dtype.width // 8)
        if TILE_H * (self.d_v + pad) * (dtype.width // 8) > kv_bytes:
            pad = 0
        ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=16)
        return cute.make_tensor(ptr, cute.make_layout((TILE_H, self.d_v), stride=(self.d_v + pad, 1)))

    @cute.jit
    def _copy_rows_out(self, sX, mX, t, h0, num_heads, tid, vec: cutlass.Constexpr):
        """Staged (64, d_v) tile -> mX[t, h0:h0+64] in 16-byte vectors, rows < H only."""
        per_row = self.d_v // vec
        rows_per_pass = 256 // per_row
        for k in cutlass.range_constexpr(TILE_H * per_row // 256):
            row = tid // per_row + rows_per_pass * k
            chunk = tid % per_row
            if h0 + row < num_heads:
                src = cute.local_tile(sX[row, None], (vec,), (chunk,))
                dst = cute.local_tile(mX[t, h0 + row, None], (vec,), (chunk,))
                cute.autovec_copy(src, dst)


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------

_TORCH_TO_CUTE = {"bfloat16": BFloat16, "float16": Float16}


def compile_forward(dtype_name: str, d_qk: int, d_v: int, rescale_threshold: float,
                    has_o_lo: bool, has_topk_length: bool):
    """Compile one forward kernel (no GPU needed when ``CUTE_DSL_ARCH`` is set).

    ``dtype_name`` is ``"bfloat16"`` or ``"float16"``. T, H, S and topk are symbolic, so the
    result serves every size. Returns the TVM-FFI callable
    ``fn(q, kv, indices, topk_length_or_None, out, lse, o_lo_or_None, scale_log2)``.
    """
    dtype = _TORCH_TO_CUTE[dtype_name]
    kernel = SparseMlaFwdSm90(dtype, d_qk, d_v, rescale_threshold, has_o_lo, has_topk_length)
    n_tok, n_head, n_kv, n_topk = (cute.sym_int() for _ in range(4))
    fake = cute.runtime.make_fake_compact_tensor
    q = fake(dtype, (n_tok, n_head, d_qk), stride_order=(2, 1, 0), assumed_align=16)
    kv = fake(dtype, (n_kv, d_qk), stride_order=(1, 0), assumed_align=16)
    idx = fake(Int32, (n_tok, n_topk), stride_order=(1, 0), assumed_align=4)
    topk_len = fake(Int32, (n_tok,), assumed_align=4) if has_topk_length else None
    out = fake(dtype, (n_tok, n_head, d_v), stride_order=(2, 1, 0), assumed_align=16)
    lse = fake(Float32, (n_tok, n_head), stride_order=(1, 0), assumed_align=4)
    o_lo = (fake(Float32, (n_tok, n_head, d_v), stride_order=(2, 1, 0), assumed_align=16)
            if has_o_lo else None)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, q, kv, idx, topk_len, out, lse, o_lo, Float32(1.0), stream,
                        options="--enable-tvm-ffi")


_CACHE = KernelCache("mla_sm90_fwd")


def compile_key(dtype: torch.dtype, d_qk: int, d_v: int, rescale_threshold: float,
                has_o_lo: bool, has_topk_length: bool, arch: str = "sm_90a") -> tuple:
    """The static compile key: everything else (T, H, S, topk) is symbolic."""
    return (str(dtype).removeprefix("torch."), int(d_qk), int(d_v), float(rescale_threshold),
            bool(has_o_lo), bool(has_topk_length), arch)


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (see :func:`compile_key`), from the cache or compiled now."""
    return _CACHE.get(key, lambda: compile_forward(*key[:6]))


@contextlib.contextmanager
def target_arch(arch: str):
    """Sets the CuTe DSL target architecture for the duration (compiling without a GPU)."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    previous = envar.arch
    envar.arch = arch
    try:
        yield
    finally:
        envar.arch = previous


def forward(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold, return_o_lo):
    """Sparse-MLA forward on SM90 (protocol of ``mla_inductor.kernels``).

    Args:
        q: ``[T, H, d_qk]`` bf16/fp16 CUDA tensor, 1 <= H (any; padded to 64 inside).
        kv: ``[S, d_qk]`` (or ``[S, 1, d_qk]``), q's dtype.
        indices: ``[T, topk]`` int32; values < 0 or >= S are empty slots (never read).
        topk_length: ``[T]`` int32 or None; slots at positions >= topk_length[t] are empty.
        sm_scale: softmax scale (float). d_v: 512. rescale_threshold: 0.0 (exact running max)
            or a lazy threshold in log2 units (< 127 for bf16, < 15 for fp16).
        return_o_lo: also return ``o_lo = float32(O) - out``.

    Returns:
        ``(out [T, H, d_v] q.dtype, lse [T, H] fp32 natural log, o_lo [T, H, d_v] fp32 or empty)``.

    Raises:
        ValueError / TypeError: unsupported shapes, head dims, device or dtypes.
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    if kv.dim() == 3:
        kv = kv.squeeze(1)
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        raise ValueError("sm90 forward: need q [T, H, d_qk], kv [S, d_qk], indices [T, topk]")
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        raise TypeError(f"sm90 forward: q and kv must both be bf16 or fp16, got {q.dtype}/{kv.dtype}")
    T, H, d_qk = q.shape
    if (d_qk, d_v) not in SUPPORTED_DIMS:
        raise ValueError(f"sm90 forward: supports (d_qk, d_v) in {SUPPORTED_DIMS}, got {(d_qk, d_v)}")
    if not q.is_cuda:
        raise ValueError("sm90 forward: tensors must be on a CUDA device")
    if kv.shape[1] != d_qk or indices.shape[0] != T:
        raise ValueError(f"sm90 forward: shape mismatch q {tuple(q.shape)} kv {tuple(kv.shape)} "
                         f"indices {tuple(indices.shape)}")
    out = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    o_lo = (torch.empty(T, H, d_v, dtype=torch.float32, device=q.device) if return_o_lo
            else q.new_empty(0, dtype=torch.float32))
    if T == 0 or H == 0:
        return out, lse, o_lo
    if indices.shape[1] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        if return_o_lo:
            o_lo.zero_()
        return out, lse, o_lo
    q, kv = _aligned(q), _aligned(kv)
    indices = indices.to(torch.int32).contiguous()
    if topk_length is not None:
        topk_length = topk_length.to(torch.int32).contiguous()
    key = compile_key(q.dtype, d_qk, d_v, rescale_threshold, return_o_lo, topk_length is not None)
    kernel = get_kernel(key)
    kernel(q, kv, indices, topk_length, out, lse, o_lo if return_o_lo else None,
           float(sm_scale) * LOG2E)
    return out, lse, o_lo


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start (the cp.async gathers read 16-byte vectors)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()
