"""Sparse-MLA backward for Hopper (SM90) in CuTe DSL.

Computes, for ``dout [T, H, d_v]``, ``q [T, H, d_qk]``, ``kv [S, d_qk]`` (value = ``kv[:, :d_v]``),
``indices [T, topk]`` int32 and the forward's ``out``, ``lse`` and optional ``o_lo``::

    dpsum = rowsum(dout * (out + o_lo))            (rowsum(dout * out) when o_lo is empty), fp32
    P     = exp(sm_scale * q . k - lse)            recomputed per gathered key, fp32
    dP    = dout . v
    dS    = P * (dP - dpsum) * sm_scale            fp32, rounded to bf16 once
    dq    = dS . K                                 (d_qk wide), in q's dtype
    dkv[idx, :d_v]  += P^T . dout                  fp32 atomics, then a cast to kv's dtype
    dkv[idx, :d_qk] += dS^T . q

Slots with ``index < 0``, ``index >= S`` or position ``>= topk_length[t]`` are empty: their key is
zero-filled in shared memory (never read from global memory), their P is forced to 0, and their
dkv row is never written (not even with 0.0). Duplicated indices accumulate once per occurrence.
A row with no valid slot (``lse = -inf``) gets finite zero gradients.

Stages (all on torch's current stream, capturable in CUDA graphs):

1. preprocess (torch ops): ``dpsum`` in fp32 and ``lse_log2 = lse * log2(e)`` (+inf for rows
   with ``lse = -inf``, so that every P of such a row is exactly 0);
2. the main kernel below, which accumulates dkv into a zeroed fp32 buffer ``dkv_accum [S, d_qk]``
   (callers may pass their own, see :func:`backward_into`);
3. postprocess (torch op): ``dkv = dkv_accum.to(kv.dtype)``.

Main kernel design (after the cuDNN frontend's SM90 DSA backward, summarised in
``shared/docs/study-sparse-mla-kernels.md`` section 4.1; written independently):

* one CTA = one query token x 64 heads (the wgmma M = 64), 256 threads = 2 warpgroups; heads
  beyond H are zero-filled rows of the tile and never stored;
* Q (64 x d_qk) and dO (64 x d_v) are loaded once into 128-byte-swizzled shared memory with
  16-byte ``cp.async`` (zero-fill for heads >= H);
* the top-k list is walked in 64-key blocks; all 256 threads gather a block's 64 KV rows with
  16-byte ``cp.async`` (groups of 8 threads per row; source size 0, i.e. zero-fill, for empty
  slots) into one swizzled 64 x d_qk buffer, and record each key's kv row (or -1) in a
  two-stage ``sRow``;
* per block: warpgroup 0 computes S = Q.K^T while warpgroup 1 computes dP = dO.V^T (wgmma
  64x64x16, both operands in shared memory); warpgroup 1 hands dP over in fp32 through the
  P/dS buffer; warpgroup 0 computes P = exp2(S * sm_scale * log2(e) - lse_log2) (0 for empty
  slots) and dS, and stores both as bf16;
* both warpgroups then run dQ += dS.K (warpgroup 0 owns dq columns [0, 256), warpgroup 1 the
  rest; accumulators stay in registers for the whole top-k walk); once dQ is done with the K/V
  buffer the next block's gather is issued, and it overlaps with
  dKV = P^T.dO + dS^T.Q in 64-column chunks (even chunks on warpgroup 0, odd on warpgroup 1),
  each chunk scattered right after its wgmma with ``red.global.add.v2.f32`` into
  ``dkv_accum[idx]``, skipping empty slots;
* dq is converted to q's dtype and stored straight from registers (heads < H).

Shared memory for d_qk = 576: Q 72 KiB + K/V 72 KiB + dO 64 KiB + P 8 KiB + dS 8 KiB (+ 1 KiB),
which fits the 227 KiB per CTA (one CTA per SM). Offsets are 32-bit: T*H*d_qk and S*d_qk must be
below 2**31 (checked).
"""

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Boolean, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator

from ..cache import KernelCache
from . import SUPPORTED_DIMS
from .fwd import target_arch

_TILE_M = 64  # heads per CTA (wgmma M)
_TILE_N = 64  # keys per block
_CHUNK = 64  # columns per dQ / dKV chunk (one 128-byte swizzle atom of bf16)
_NUM_THREADS = 256
_LOG2_E = math.log2(math.e)


def _smem_bytes(d_qk: int, d_v: int) -> int:
    """Q, K/V, dO, P, dS tiles (bf16), two stages of row indices, lse_log2, dpsum, 1 KiB slack."""
    tiles = (_TILE_M * d_qk + _TILE_N * d_qk + _TILE_M * d_v + 2 * _TILE_M * _TILE_N) * 2
    return tiles + (2 * _TILE_N + 2 * _TILE_M) * 4 + 1024


@dsl_user_op
def red_add_f32x2(addr: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """``red.global.add.v2.f32``: fire-and-forget fp32 add of two adjacent words (8-byte aligned)."""
    llvm.inline_asm(
        None,
        [
            Int64(addr).ir_value(loc=loc, ip=ip),
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
        ],
        "red.relaxed.gpu.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def transposed(t):
    """View of a 2-D shared-memory tensor with its two modes swapped."""
    return cute.composition(
        t, cute.make_ordered_layout((t.shape[1], t.shape[0]), order=(1, 0))
    )


def kmajor_sw128(dtype, rows: int, cols: int):
    """K-major 128-byte-swizzled layout; 64-column slabs are contiguous (rows first)."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))


class SparseMlaBackwardSm90:
    """Static configuration: dtype, head count, d_qk, d_v, topk_length present or not."""

    def __init__(self, dtype, heads: int, d_qk: int, d_v: int, has_topk_length: bool):
        self.dtype = dtype
        self.heads = heads
        self.d_qk = d_qk
        self.d_v = d_v
        self.has_topk_length = has_topk_length
        self.head_tiles = (heads + _TILE_M - 1) // _TILE_M
        self.n_chunks_v = d_v // _CHUNK
        # dq columns (start, width) per warpgroup: [0, 256) and the rest (one wgmma per part).
        self.dq_parts = ([(0, 256)], [(256, 256)] + ([(512, d_qk - 512)] if d_qk > 512 else []))
        # dkv 64-column chunks per warpgroup: even / odd.
        chunks = range(d_qk // _CHUNK)
        self.dkv_chunks = ([c for c in chunks if c % 2 == 0], [c for c in chunks if c % 2 == 1])

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, H, d_qk]
        mKV: cute.Tensor,  # [S, d_qk]
        mdO: cute.Tensor,  # [T, H, d_v]
        mLSE2: cute.Tensor,  # [T, H] fp32, lse * log2(e) (+inf for empty rows)
        mDpsum: cute.Tensor,  # [T, H] fp32
        mIdx: cute.Tensor,  # [T, topk] int32
        mTopkLen: Optional[cute.Tensor],  # [T] int32
        mdQ: cute.Tensor,  # [T, H, d_qk]
        mdKV: cute.Tensor,  # [S, d_qk] fp32 accumulator
        sm_scale: Float32,
        stream: cuda.CUstream,
    ):
        T = mQ.shape[0]
        self.kernel(
            mQ, mKV, mdO, mLSE2, mDpsum, mIdx, mTopkLen, mdQ, mdKV, sm_scale,
        ).launch(
            grid=[T * self.head_tiles, 1, 1],
            block=[_NUM_THREADS, 1, 1],
            smem=_smem_bytes(self.d_qk, self.d_v),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.jit
    def copy_row(
        self,
        g_row: cute.Tensor,  # [C] global
        s_row: cute.Tensor,  # [C] shared (swizzled)
        valid: Boolean,
        n_cols: cutlass.Constexpr[int],
        lane8: Int32,
    ):
        """8 threads copy one row in 16-byte pieces; an invalid row is zero-filled (source size 0)."""
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=128,
        )
        thr = cute.make_tiled_copy_tv(atom, cute.make_layout((1,)), cute.make_layout((8,))).get_slice(0)
        g_pieces = cute.flat_divide(g_row, (8,))
        s_pieces = cute.flat_divide(s_row, (8,))
        for i in cutlass.range_constexpr(n_cols // 64):
            piece = i * 8 + lane8
            tg = thr.partition_S(g_pieces[None, piece])
            ts = thr.partition_D(s_pieces[None, piece])
            pred = cute.make_fragment_like(ts[(0, None), None], Boolean)
            pred.fill(valid)
            cute.copy(atom, tg, ts, pred=pred)

    @cute.jit
    def gather(
        self,
        blk: Int32,
        stage: Int32,
        token: Int32,
        n_valid: Int32,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        sKV: cute.Tensor,
        sRow: cute.Tensor,
        tidx: Int32,
    ):
        """All 256 threads issue the cp.async gather of key block ``blk`` (one commit group) and
        record each key's kv row, or -1 for an empty slot, in ``sRow[stage]``."""
        lane8 = tidx % 8
        group = tidx // 8  # 32 groups of 8 threads, 2 rows each
        S = mKV.shape[0]
        for r in cutlass.range_constexpr(_TILE_N // 32):
            row = r * 32 + group
            slot = blk * _TILE_N + row
            idx = Int32(-1)
            if slot < n_valid:
                idx = mIdx[token, slot]
            ok = idx >= 0 and idx < S
            idx_c = idx if ok else Int32(0)
            self.copy_row(mKV[idx_c, None], sKV[row, None], ok, self.d_qk, lane8)
            if lane8 == 0:
                sRow[stage * _TILE_N + row] = idx if ok else Int32(-1)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor):
        """acc += A . B over all k-blocks (one wgmma group, committed, not waited)."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)
        warpgroup.commit_group()

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE2: cute.Tensor,
        mDpsum: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: Optional[cute.Tensor],
        mdQ: cute.Tensor,
        mdKV: cute.Tensor,
        sm_scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        token = bidx // self.head_tiles
        head0 = (bidx - token * self.head_tiles) * _TILE_M
        topk = mIdx.shape[1]

        # ---- shared memory ----
        lay_q = kmajor_sw128(self.dtype, _TILE_M, self.d_qk)
        lay_do = kmajor_sw128(self.dtype, _TILE_M, self.d_v)
        lay_slab = kmajor_sw128(self.dtype, _TILE_M, _CHUNK)
        smem = SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, lay_q.outer, 1024, swizzle=lay_q.inner)
        sKV = smem.allocate_tensor(self.dtype, lay_q.outer, 1024, swizzle=lay_q.inner)
        sdO = smem.allocate_tensor(self.dtype, lay_do.outer, 1024, swizzle=lay_do.inner)
        # P and dS (bf16, 8 KiB each); the same 16 KiB hold dP in fp32 before P and dS exist.
        raw_pds = smem.allocate_array(Float32, _TILE_M * _TILE_N, byte_alignment=1024)
        sP = cute.make_tensor(cute.recast_ptr(raw_pds, lay_slab.inner, self.dtype), lay_slab.outer)
        sdS = cute.make_tensor(
            cute.recast_ptr(raw_pds + _TILE_M * _TILE_N // 2, lay_slab.inner, self.dtype),
            lay_slab.outer,
        )
        sdP = cute.make_tensor(raw_pds, cute.make_layout((_TILE_M * _TILE_N,)))
        sRow = smem.allocate_tensor(Int32, cute.make_layout((2 * _TILE_N,)), 16)
        sLSE2 = smem.allocate_tensor(Float32, cute.make_layout((_TILE_M,)), 16)
        sDpsum = smem.allocate_tensor(Float32, cute.make_layout((_TILE_M,)), 16)

        # ---- valid top-k length of this token ----
        n_valid = topk
        if const_expr(self.has_topk_length):
            n_valid = cutlass.max(cutlass.min(mTopkLen[token], topk), Int32(0))
        n_blocks = (n_valid + (_TILE_N - 1)) // _TILE_N

        # ---- Q, dO (zero rows for heads >= H), lse_log2, dpsum; then the first key block ----
        lane8 = tidx % 8
        group = tidx // 8
        for r in cutlass.range_constexpr(_TILE_M // 32):
            row = r * 32 + group
            head = head0 + row
            ok = head < self.heads
            head_c = head if ok else Int32(0)
            self.copy_row(mQ[token, head_c, None], sQ[row, None], ok, self.d_qk, lane8)
            self.copy_row(mdO[token, head_c, None], sdO[row, None], ok, self.d_v, lane8)
        cute.arch.cp_async_commit_group()
        if tidx < _TILE_M:
            head = head0 + tidx
            lse2 = Float32.inf
            dps = Float32(0.0)
            if head < self.heads:
                lse2 = mLSE2[token, head]
                dps = mDpsum[token, head]
            sLSE2[tidx] = lse2
            sDpsum[tidx] = dps
        if n_blocks > 0:
            self.gather(Int32(0), Int32(0), token, n_valid, mKV, mIdx, sKV, sRow, tidx)

        if wg == 0:
            self.warpgroup_body(
                0, tidx, token, head0, n_valid, n_blocks, sm_scale,
                mKV, mIdx, mdQ, mdKV, sQ, sKV, sdO, sP, sdS, sdP, sRow, sLSE2, sDpsum,
            )
        else:
            self.warpgroup_body(
                1, tidx, token, head0, n_valid, n_blocks, sm_scale,
                mKV, mIdx, mdQ, mdKV, sQ, sKV, sdO, sP, sdS, sdP, sRow, sLSE2, sDpsum,
            )
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def warpgroup_body(
        self,
        wg: cutlass.Constexpr[int],
        tidx: Int32,
        token: Int32,
        head0: Int32,
        n_valid: Int32,
        n_blocks: Int32,
        sm_scale: Float32,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mdQ: cute.Tensor,
        mdKV: cute.Tensor,
        sQ: cute.Tensor,
        sKV: cute.Tensor,
        sdO: cute.Tensor,
        sP: cute.Tensor,
        sdS: cute.Tensor,
        sdP: cute.Tensor,
        sRow: cute.Tensor,
        sLSE2: cute.Tensor,
        sDpsum: cute.Tensor,
    ):
        """The block loop of one warpgroup. Warpgroup 0 computes S and then P and dS; warpgroup 1
        computes dP (handed over in fp32 through shared memory); both then run their dQ and dKV
        parts. The next block's gather is issued once dQ no longer needs the K/V buffer."""
        wg_tidx = tidx % 128
        scale_log2 = sm_scale * Float32(_LOG2_E)

        def mma(a_major, b_major, n):
            tiled = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, a_major, b_major, Float32, (1, 1, 1), (_TILE_M, n)
            )
            tiled.set(warpgroup.Field.ACCUMULATE, True)
            return tiled

        def cols(t, c0, width):
            """Columns [c0, c0 + width) of a K-major SW128 tile (64-column slabs are contiguous)."""
            return cute.make_tensor(
                t.iterator + c0 * _TILE_M, kmajor_sw128(self.dtype, _TILE_M, width).outer
            )

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN

        # S = Q.K^T (warpgroup 0) or dP = dO.V^T (warpgroup 1), 64 x 64 per block
        mma_sp = mma(K_MAJOR, K_MAJOR, _TILE_N)
        thr_sp = mma_sp.get_slice(wg_tidx)
        if const_expr(wg == 0):
            tA_sp = thr_sp.make_fragment_A(thr_sp.partition_A(sQ))
            tB_sp = thr_sp.make_fragment_B(thr_sp.partition_B(sKV))
        else:
            tA_sp = thr_sp.make_fragment_A(thr_sp.partition_A(sdO))
            tB_sp = thr_sp.make_fragment_B(thr_sp.partition_B(cols(sKV, 0, self.d_v)))
        c_sp = thr_sp.partition_C(cute.make_identity_tensor((_TILE_M, _TILE_N)))
        thr_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32),
            mma_sp,
        ).get_slice(wg_tidx)

        # dQ += dS.K for this warpgroup's columns; accumulators live for the whole walk
        dq_parts = self.dq_parts[wg]
        mma_dq = [mma(K_MAJOR, MN_MAJOR, w) for (_, w) in dq_parts]
        thr_dq = [m.get_slice(wg_tidx) for m in mma_dq]
        acc_dq = [
            cute.make_rmem_tensor(mma_dq[j].partition_shape_C((_TILE_M, w)), Float32)
            for j, (_, w) in enumerate(dq_parts)
        ]
        for j in cutlass.range_constexpr(len(acc_dq)):
            acc_dq[j].fill(0.0)
        tA_dS = [t.make_fragment_A(t.partition_A(sdS)) for t in thr_dq]
        tB_K = [
            thr_dq[j].make_fragment_B(thr_dq[j].partition_B(transposed(cols(sKV, c0, w))))
            for j, (c0, w) in enumerate(dq_parts)
        ]

        # dKV = P^T.dO + dS^T.Q in 64-column chunks
        mma_dkv = mma(MN_MAJOR, MN_MAJOR, _CHUNK)
        thr_dkv = mma_dkv.get_slice(wg_tidx)
        tA_Pt = thr_dkv.make_fragment_A(thr_dkv.partition_A(transposed(sP)))
        tA_dSt = thr_dkv.make_fragment_A(thr_dkv.partition_A(transposed(sdS)))
        dkv_chunks = self.dkv_chunks[wg]
        tB_dO = [
            thr_dkv.make_fragment_B(thr_dkv.partition_B(transposed(cols(sdO, c * _CHUNK, _CHUNK))))
            if c < self.n_chunks_v else None
            for c in dkv_chunks
        ]
        tB_Q = [
            thr_dkv.make_fragment_B(thr_dkv.partition_B(transposed(cols(sQ, c * _CHUNK, _CHUNK))))
            for c in dkv_chunks
        ]
        c_dkv = thr_dkv.partition_C(cute.make_identity_tensor((_TILE_N, _CHUNK)))
        dkv_base = mdKV.iterator.toint()

        for blk in cutlass.range(n_blocks, unroll=1):
            stage = blk % 2
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()  # K/V block, sRow[stage] (and Q, dO, lse, dpsum) ready

            acc = cute.make_rmem_tensor(mma_sp.partition_shape_C((_TILE_M, _TILE_N)), Float32)
            acc.fill(0.0)
            self.gemm(mma_sp, acc, tA_sp, tB_sp)
            warpgroup.wait_group(0)
            if const_expr(wg == 1):
                # dP -> shared memory, fp32, columns XOR-swizzled by row against bank conflicts
                for i in cutlass.range_constexpr(cute.size(acc)):
                    m, n = c_sp[i]
                    sdP[m * _TILE_N + (n ^ ((m % 8) * 8))] = acc[i]
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
            else:
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                ds = cute.make_rmem_tensor_like(acc)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    m, n = c_sp[i]
                    p = cute.math.exp2(acc[i] * scale_log2 - sLSE2[m], fastmath=True)
                    if sRow[stage * _TILE_N + n] < 0:
                        p = Float32(0.0)
                    dp = sdP[m * _TILE_N + (n ^ ((m % 8) * 8))]
                    ds[i] = p * (dp - sDpsum[m]) * sm_scale
                    acc[i] = p
                cute.arch.barrier(barrier_id=2, number_of_threads=128)  # dP fully read
                rP = cute.make_rmem_tensor_like(acc, self.dtype)
                rP.store(acc.load().to(self.dtype))
                rdS = cute.make_rmem_tensor_like(ds, self.dtype)
                rdS.store(ds.load().to(self.dtype))
                cute.copy(thr_store, thr_store.retile(rP), thr_store.partition_D(sP))
                cute.copy(thr_store, thr_store.retile(rdS), thr_store.partition_D(sdS))
                cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()  # P, dS ready

            for j in cutlass.range_constexpr(len(dq_parts)):
                self.gemm(mma_dq[j], acc_dq[j], tA_dS[j], tB_K[j])
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # K/V buffer free
            if blk + 1 < n_blocks:
                self.gather(blk + 1, 1 - stage, token, n_valid, mKV, mIdx, sKV, sRow, tidx)

            for j in cutlass.range_constexpr(len(dkv_chunks)):
                c = dkv_chunks[j]
                acc_kv = cute.make_rmem_tensor(mma_dkv.partition_shape_C((_TILE_N, _CHUNK)), Float32)
                acc_kv.fill(0.0)
                if const_expr(c < self.n_chunks_v):
                    self.gemm(mma_dkv, acc_kv, tA_Pt, tB_dO[j])
                self.gemm(mma_dkv, acc_kv, tA_dSt, tB_Q[j])
                warpgroup.wait_group(0)
                for i in cutlass.range_constexpr(cute.size(acc_kv) // 2):
                    n, col = c_dkv[2 * i]
                    kv_row = sRow[stage * _TILE_N + n]
                    if kv_row >= 0:
                        off = (Int64(kv_row) * self.d_qk + (c * _CHUNK + col)) * 4
                        red_add_f32x2(dkv_base + off, acc_kv[2 * i], acc_kv[2 * i + 1])

        # ---- dq epilogue: registers -> global, heads < H only ----
        for j in cutlass.range_constexpr(len(dq_parts)):
            c0, w = dq_parts[j]
            c_dq = thr_dq[j].partition_C(cute.make_identity_tensor((_TILE_M, w)))
            for i in cutlass.range_constexpr(cute.size(acc_dq[j])):
                m, col = c_dq[i]
                head = head0 + m
                if head < self.heads:
                    mdQ[token, head, c0 + col] = acc_dq[j][i].to(mdQ.element_type)


_CACHE = KernelCache("mla_sm90_bwd")
_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def compile_key(dtype: torch.dtype, heads: int, d_qk: int, d_v: int, has_topk_length: bool,
                arch: str = "sm_90a") -> tuple:
    """The static compile key: T, S and topk are symbolic; the head count is static."""
    return (str(dtype).removeprefix("torch."), int(heads), int(d_qk), int(d_v),
            bool(has_topk_length), arch)


def compile_backward(dtype_name: str, heads: int, d_qk: int, d_v: int, has_topk_length: bool):
    """Compiles the main kernel for one static configuration (no GPU needed inside
    :func:`target_arch`). The returned TVM-FFI function takes ``(q, kv, dout, lse_log2, dpsum,
    indices, topk_length_or_None, dq, dkv_accum, sm_scale)`` as torch tensors and a float, and
    runs on torch's current stream."""
    cdtype = _DTYPES[dtype_name]
    T, S, K = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def fake(dt, shape, align):
        order = tuple(range(len(shape) - 1, -1, -1))
        return cute.runtime.make_fake_compact_tensor(dt, shape, stride_order=order, assumed_align=align)

    args = (
        fake(cdtype, (T, heads, d_qk), 16),  # q
        fake(cdtype, (S, d_qk), 16),  # kv
        fake(cdtype, (T, heads, d_v), 16),  # dout
        fake(cutlass.Float32, (T, heads), 4),  # lse_log2
        fake(cutlass.Float32, (T, heads), 4),  # dpsum
        fake(cutlass.Int32, (T, K), 4),  # indices
        fake(cutlass.Int32, (T,), 4) if has_topk_length else None,  # topk_length
        fake(cdtype, (T, heads, d_qk), 16),  # dq
        fake(cutlass.Float32, (S, d_qk), 16),  # dkv_accum
        cutlass.Float32(1.0),  # sm_scale
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    kernel = SparseMlaBackwardSm90(cdtype, heads, d_qk, d_v, has_topk_length)
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (see :func:`compile_key`), from the cache or compiled now
    (raises :class:`~mla_inductor.kernels.cache.CompileDuringCaptureError` during capture)."""
    return _CACHE.get(key, lambda: compile_backward(*key[:5]))


def precompile_backward(arch: str = "sm_90a", *, dtypes=(torch.bfloat16,), heads=(128,),
                        d_qk: int = 576, d_v: int = 512, topk_length=(False, True)) -> dict:
    """Compiles the backward kernel for ``arch`` without a GPU, for every combination of
    ``dtypes`` x ``heads`` x ``topk_length``; returns ``{compile_key: fn}`` (also cached).

    Raises:
        ValueError: for an arch other than ``sm_90a``.
    """
    if arch != "sm_90a":
        raise ValueError(f"sm90 backward: cannot compile for {arch!r}; use 'sm_90a'")
    compiled = {}
    with target_arch(arch):
        for dtype in dtypes:
            for h in heads:
                for with_len in topk_length:
                    key = compile_key(dtype, h, d_qk, d_v, with_len, arch)
                    compiled[key] = get_kernel(key)
    return compiled


def preprocess(dout, out, lse, o_lo):
    """``(dpsum, lse_log2)`` as ``[T, H]`` float32: ``dpsum = rowsum(dout * (out + o_lo))``
    (``o_lo`` empty: ``rowsum(dout * out)``); ``lse_log2 = lse * log2(e)``, +inf where lse = -inf."""
    o = out.float()
    if o_lo.numel() > 0:
        o = o + o_lo
    dpsum = (dout.float() * o).sum(-1)
    lse_log2 = torch.where(torch.isneginf(lse), math.inf, lse * _LOG2_E).float()
    return dpsum.contiguous(), lse_log2.contiguous()


def backward_into(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v, dkv_accum):
    """Runs the preprocess and the main kernel; returns ``dq [T, H, d_qk]`` (q's dtype) and adds
    the dkv gradient into ``dkv_accum`` (``[S, d_qk]`` float32, contiguous, 16-byte aligned;
    rows of empty slots are never touched).

    Raises:
        ValueError: unsupported shapes/dtypes, or a misaligned/non-contiguous ``dkv_accum``.
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    if (d_qk, d_v) not in SUPPORTED_DIMS:
        raise ValueError(f"sm90 backward supports (d_qk, d_v) in {SUPPORTED_DIMS}, got {(d_qk, d_v)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype or dout.dtype != q.dtype:
        raise ValueError(f"sm90 backward needs q, kv, dout of one dtype, bf16 or fp16; got "
                         f"{q.dtype}, {kv.dtype}, {dout.dtype}")
    if kv.dim() != 2 or kv.shape[1] != d_qk or tuple(dout.shape) != (T, H, d_v) \
            or tuple(lse.shape) != (T, H):
        raise ValueError(f"shapes: q {tuple(q.shape)}, kv {tuple(kv.shape)} (need [S, d_qk]), dout "
                         f"{tuple(dout.shape)} (need [T, H, d_v]), lse {tuple(lse.shape)} (need [T, H])")
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"indices must be int32 [T, topk], got {indices.dtype} {tuple(indices.shape)}")
    if (dkv_accum.dtype != torch.float32 or tuple(dkv_accum.shape) != (S, d_qk)
            or not dkv_accum.is_contiguous() or dkv_accum.data_ptr() % 16 != 0):
        raise ValueError("dkv_accum must be a contiguous, 16-byte aligned float32 [S, d_qk] tensor")
    if T * H * d_qk >= 2**31 or S * d_qk >= 2**31:
        raise ValueError("sm90 backward indexes with 32-bit offsets: T*H*d_qk and S*d_qk must be < 2**31")
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0 or H == 0:
        return dq
    dpsum, lse_log2 = preprocess(dout, out, lse, o_lo)
    tlen = None if topk_length is None else topk_length.to(torch.int32).contiguous()
    fn = get_kernel(compile_key(q.dtype, H, d_qk, d_v, tlen is not None))
    fn(q.contiguous(), kv.contiguous(), dout.contiguous(), lse_log2, dpsum,
       indices.contiguous(), tlen, dq, dkv_accum, float(sm_scale))
    return dq


def backward(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v):
    """Backend-protocol backward (see :mod:`mla_inductor.kernels`): returns ``(dq, dkv)``,
    ``dq [T, H, d_qk]`` in q's dtype and ``dkv [S, d_qk]`` in kv's dtype (fp32 accumulation,
    empty slots never written).

    Raises:
        ValueError: as :func:`backward_into`.
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    dkv_accum = torch.zeros(kv.shape[0], q.shape[2], dtype=torch.float32, device=kv.device)
    dq = backward_into(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v, dkv_accum)
    return dq, dkv_accum.to(kv.dtype)
