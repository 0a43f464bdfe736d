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

except for each head row's dominant key j (P_j > 1/2): there ``dP_j - dpsum`` subtracts two
numbers that agree to ``1 - P_j``, which on very peaked rows is below dpsum's precision, so its
dS is formed after the key loop from the row's other keys instead, in fp32::

    dS_j = P_j * (dP_j * (sum_{k != j} P_k + P_sink) - sum_{k != j} P_k dP_k + dlse) * sm_scale

(the loop's dS.K and dS^T.q see 0 for it; its dq and dkv terms, dS_j * kv[j] and dS_j * q, are
added after the loop: :meth:`SparseMlaBackwardSm90.dominant_ds`).

Slots with ``index < 0``, ``index >= S`` or position ``>= topk_length[t]`` are empty: their key is
zero-filled in shared memory (never read from global memory), their P is forced to 0, and their
dkv row is never written (not even with 0.0). Duplicated indices accumulate once per occurrence.
A row with no valid slot (``lse = -inf``) gets finite zero gradients.

Stages (all on torch's current stream, capturable in CUDA graphs):

1. the main kernel below, whose prologue is the preprocess: ``dpsum`` in fp32 from ``dout``,
   ``out`` and ``o_lo`` (4 threads per head row, loads batched so that many are in flight while
   the Q / dO / first-block copies land) and ``lse_log2 = lse * log2(e)`` (+inf for rows with
   ``lse = -inf``, so that every P of such a row is exactly 0); it accumulates dkv into a
   zeroed fp32 buffer ``dkv_accum [S, d_qk]`` whose columns are **interleaved** within aligned
   groups of 16 (column ``8h + 2q + l`` of a group is stored at ``4q + 2h + l``, h, l in {0, 1},
   q in 0..3; rows are not moved), so that the four values a wgmma accumulator thread holds for
   one row (columns c, c+1, c+8, c+9) are one 16-byte ``red.global.add.v4.f32`` (callers may
   pass their own buffer, see :func:`.bwd_host.backward_into`,
   :func:`.bwd_host.dkv_interleave`, :func:`.bwd_host.dkv_deinterleave`);
2. postprocess (torch op, :func:`.bwd_host.dkv_from_accum`): un-interleave and cast to kv's
   dtype in one copy.

The deterministic variant (compile-time ``deterministic``, chosen under
``torch.use_deterministic_algorithms(True)``) accumulates into an int64 ``dkv_accum`` instead:
each term times a power-of-two scale (a ``[1]`` float32 tensor, :func:`.bwd_host.fixed_point_scale`)
is rounded to an integer and added with ``red.global.add.u64``, whose sum is the same in every
order (:meth:`SparseMlaBackwardSm90.scatter_fixed`); its postprocess is
:func:`.bwd_host.dkv_from_fixed`.

The preprocess was three torch ops with fp32 temporaries (about 10 GB of traffic at T = 4096,
H = 128, 2.7 ms of a 17.8 ms backward on the H200); inside the kernel it reads 2.1 GB once and
costs about 0.75 ms (measured against a kernel without it, same run).

Main kernel design (warp-specialised like the cuDNN frontend's SM90 DSA backward; written
independently):

* one CTA = one query token x 64 heads (the wgmma M = 64), 256 threads = 2 warpgroups; heads
  beyond H are zero-filled rows of the tile and never stored;
* Q (64 x d_qk) and dO (64 x d_v) are loaded once into 128-byte-swizzled shared memory with
  16-byte ``cp.async`` (zero-fill for heads >= H);
* the top-k list is walked in 64-key blocks with one K/V buffer; warpgroup 0 gathers a block's
  64 KV rows with 16-byte ``cp.async`` (8 threads per row, source size 0, i.e. zero-fill, for
  empty slots; the indices of block i + 1 are loaded while block i's S/dP run) and records
  each key's kv row (or -1) in a two-stage ``sRow``;
* warpgroup 0, per block i: (after block 0) waits until warpgroup 1's dq of block i - 1 no
  longer reads K/V and gathers block i's columns 256:d_qk (columns 0:256, which only warpgroup
  0 reads, were gathered at the end of block i - 1); S = Q.K^T and dP = dO.V^T (wgmma 64x64x16,
  operands in shared memory; their k-blocks over columns 0:256 are issued before the rest of
  the block has landed); P = exp2(S * sm_scale * log2(e) - lse_log2) (0 for empty slots),
  stored as bf16 as soon as S is done; dS = P (dP - dpsum) sm_scale, stored as bf16;
  dq[:, 0:256] += dS.K and, while it runs, the last dKV chunk (below); once dq is done, the
  gather of block i + 1's columns 0:256. (Taking the gather's first part early and the last
  chunk from warpgroup 1 made the backward 1.5-2% faster on the H200, T 4096, H 128; taking
  two or three chunks was no better: warpgroup 1's own work is not all of the critical path);
* warpgroup 1, per block i, concurrently with warpgroup 0's gather/S/dP/softmax of block i + 1:
  dKV chunk 0 (its P^T.dO part starts before dS is stored), dq[:, 256:d_qk] += dS.K, then
  dKV = P^T.dO + dS^T.Q for the other 64-column chunks but the last; each chunk's wgmma is
  waited and its accumulator scattered into the interleaved ``dkv_accum[idx]`` with
  ``red.global.add.v4.f32``, skipping empty slots; lanes l and l ^ 4 (keys k and k ^ 1) first
  swap one 16-column group with a shuffle, so that every red instruction of a warp covers 4
  keys x one whole 128-byte line (see :meth:`SparseMlaBackwardSm90.scatter`): the same sectors
  as 8 keys x 64 bytes, but half the L2 requests, which is what the atomics are limited by (6%
  faster on the H200); the reds carry an L2 evict_last policy, so that the accumulator's lines
  outlast the gathered kv rows in L2 once both no longer fit (H200, H 128 / 64, topk 2048, same
  interleaved rounds as the plain reds: 2.3-4.1% faster at T 16384-32768, S 32768; within
  noise at T 4096, S 8192; dq bitwise the same); when kv and the accumulator together (``S *
  d_qk * (2 + 4)`` bytes) do not fit in L2 either (``gather_evict_first``, decided by the
  launcher), the gathers carry an L2 evict_first policy, so that the kv rows they stream in make
  way for the accumulator's lines first (H200, same rounds as the plain gathers: 1.3% faster at
  H 128, T 16384-32768, S 32768, 3.2% at H 64, T = S = 32768; when both fit, T 4096, S 8192, H
  128, the policy cost 2%, so the gathers there stay plain);
* the hand-offs are named barriers (bar.arrive on one side, bar.sync on the other): P ready /
  dS ready (0 -> 1); P free / dS free (1 -> 0: the next block's P / dS may be stored); K/V free
  (1 -> 0: warpgroup 1's dq is done, the rest of the next block may be gathered);
* wgmma descriptors, gather addresses and the swizzled P/dS store addresses are derived from
  "opaque" shared-memory bases inside the loop (or written as one base plus immediates), so
  the compiler cannot hoist ~100 of them into live registers next to dq's 288 accumulator
  registers (that spilled and made ptxas serialise every wgmma);
* dq is converted to q's dtype and stored straight from registers (heads < H).

Shared memory for d_qk = 576: Q 72 KiB + K/V 72 KiB + dO 64 KiB + P 8 KiB + dS 8 KiB (+ 1 KiB),
which fits the 227 KiB per CTA (one CTA per SM).

Long inputs: every offset that a product of sizes can push past 2**31 is 64-bit. The
``[T, H, d]`` tensors take a 64-bit token stride (a run-time value, so ``token * stride`` is
computed in 64 bits), the indices' row stride is 64-bit, and gathers and dkv atomics form their
addresses from ``Int64(row) * d_qk``. The grid is ``T * ceil(H / 64)`` CTAs on x (limit
2**31 - 1).
"""

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from .common import TORCH_TO_CUTE, kmajor_sw128, transposed
from .host import DKV_GROUP as _GROUP
from .ptx import (cp_async_16, create_policy, opaque_i32, red_add_f32x4, red_add_fixed64,
                  red_add_shared_f32, st_shared_b32)

_TILE_M = 64  # heads per CTA (wgmma M)
_TILE_N = 64  # keys per block
_CHUNK = 64  # columns per dKV chunk (one 128-byte swizzle atom of bf16)
_NUM_THREADS = 256
_WG_THREADS = 128
_LOG2_E = math.log2(math.e)

# Named barriers (0 is __syncthreads). "READY"/"FREE" ones pair one warpgroup's bar.arrive with
# the other's bar.sync, 256 threads each; every use alternates strictly between the two sides.
_BAR_P_READY = 1  # warpgroup 0 stored P of block i -> warpgroup 1 may read it
_BAR_DS_READY = 2  # warpgroup 0 stored dS of block i
_BAR_P_FREE = 3  # warpgroup 1 finished reading P of block i -> P of block i + 1 may be stored
_BAR_DS_FREE = 4  # same for dS
_BAR_KV_FREE = 5  # warpgroup 1's dQ of block i is done -> block i + 1 may be gathered
_BAR_WG0 = 6  # warpgroup 0 alone (128 threads)
_BAR_DOMINANT = 7  # both warpgroups, after the loop: the dominant keys' dS are in shared memory

# A key whose P is above this is its row's dominant key (the P of a row sum to at most 1, so two
# slots can pass it only by rounding, and then only if they name the same key, whose P are
# summed): its dS is formed from the row's other keys after the loop
# (SparseMlaBackwardSm90.dominant_ds) instead of from dP - dpsum.
_DOMINANT_P = 0.5


def _smem_bytes(d_qk: int, d_v: int) -> int:
    """Q, K/V, dO, P, dS tiles (bf16), two stages of row indices, lse_log2, dpsum, the dominant
    keys' P, dP (then dS) and kv rows, 1 KiB slack."""
    tiles = (_TILE_M * d_qk + _TILE_N * d_qk + _TILE_M * d_v + 2 * _TILE_M * _TILE_N) * 2
    return tiles + (2 * _TILE_N + 5 * _TILE_M) * 4 + 1024


class SparseMlaBackwardSm90:
    """Static configuration: dtype, head count, d_qk, d_v, whether topk_length, o_lo,
    causal positions and a gradient of lse are passed and dpsum is written out, and whether the
    gathers carry an L2 evict_first policy (the module docstring says when), whether dkv is
    accumulated in 64-bit fixed point (deterministic), and whether an attention sink is passed
    (its probability is part of the dominant keys' dS)."""

    def __init__(self, dtype, heads: int, d_qk: int, d_v: int, has_topk_length: bool,
                 has_o_lo: bool = True, has_positions: bool = False, has_dlse: bool = False,
                 writes_dpsum: bool = False, gather_evict_first: bool = False,
                 deterministic: bool = False, has_sink: bool = False):
        self.has_o_lo = has_o_lo
        self.has_sink = has_sink
        # dkv in 64-bit fixed point (integer adds, the same sum in every order) instead of
        # float32 atomics: the accumulator is int64 and a [1] float32 tensor holds the scale
        self.deterministic = deterministic
        # causal: slots naming a key past q_positions[t] are empty
        self.has_positions = has_positions
        self.has_dlse = has_dlse  # the backward uses dpsum - dlse
        self.writes_dpsum = writes_dpsum  # dpsum (- dlse) to global, for the sink's gradient
        self.gather_evict_first = gather_evict_first
        self.dtype = dtype
        self.heads = heads
        self.d_qk = d_qk
        self.d_v = d_v
        self.has_topk_length = has_topk_length
        self.head_tiles = (heads + _TILE_M - 1) // _TILE_M
        self.n_chunks = d_qk // _CHUNK
        self.n_chunks_v = d_v // _CHUNK
        # dq columns (start, width): warpgroup 0 owns [0, 256), warpgroup 1 the rest.
        self.dq_parts = ([(0, 256)], [(256, 256)] + ([(512, d_qk - 512)] if d_qk > 512 else []))
        # dKV chunks: warpgroup 1 does [0, n_chunks - 1), warpgroup 0 the last one
        self.wg1_chunks = self.n_chunks - 1

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, H, d_qk]
        mKV: cute.Tensor,  # [S, d_qk]
        mdO: cute.Tensor,  # [T, H, d_v]
        mOut: cute.Tensor,  # [T, H, d_v], the forward's out
        mOlo: Optional[cute.Tensor],  # [T, H, d_v], the forward's o_lo (out's dtype)
        mLSE: cute.Tensor,  # [T, H] fp32, natural log (-inf for rows without a valid slot)
        mIdx: cute.Tensor,  # [T, topk] int32
        mTopkLen: Optional[cute.Tensor],  # [T] int32
        mdQ: cute.Tensor,  # [T, H, d_qk]
        mdKV: cute.Tensor,  # [S, d_qk] fp32 (or int64 fixed-point) accumulator, interleaved columns
        mQPos: Optional[cute.Tensor],  # [T] int32, causal positions
        mdLSE: Optional[cute.Tensor],  # [T, H] fp32, the gradient reaching lse
        mDpsum: Optional[cute.Tensor],  # [T, H] fp32 out: dpsum - dlse
        mScale: Optional[cute.Tensor],  # [1] fp32, the fixed-point scale (deterministic only)
        mSink: Optional[cute.Tensor],  # [H] fp32, the attention sink (natural log units)
        sm_scale: Float32,
        stream: cuda.CUstream,
    ):
        T = mQ.shape[0]
        self.kernel(
            mQ, mKV, mdO, mOut, mOlo, mLSE, mIdx, mTopkLen, mdQ, mdKV, mQPos, mdLSE, mDpsum,
            mScale, mSink, sm_scale,
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
    def dpsum_to_smem(self, mdO: cute.Tensor, mOut: cute.Tensor, mOlo: Optional[cute.Tensor],
                      mdLSE: Optional[cute.Tensor], mDpsum: Optional[cute.Tensor],
                      token: Int32, head0: Int32, sDpsum: cute.Tensor, t: Int32):
        """The preprocess, inside the kernel (thread ``t`` of 256): ``sDpsum[m] = sum(dout *
        (out + o_lo)) - dlse`` over head ``head0 + m``'s row (fp32; without o_lo ``sum(dout *
        out)``, without dlse nothing subtracted; 0 for heads >= H), also written to ``mDpsum``
        when that is passed. The four lanes ``t = 4 m + part`` share a row: lane ``part`` reads
        the 8-column pieces ``4 k + part`` and two butterfly shuffles complete the sum. The
        loads go out in batches of 8 pieces before any arithmetic, so that many are in flight,
        while the Q / dO / first-block copies land."""
        n_parts = 4
        m = t // n_parts
        part = t % n_parts
        ok = head0 + m < self.heads
        head = head0 + m if ok else Int32(0)
        acc = Float32(0.0)
        batch = 8
        for b in cutlass.range_constexpr(self.d_v // (8 * n_parts * batch)):
            r_do, r_out, r_lo = [], [], []
            for k in cutlass.range_constexpr(batch):
                piece = (b * batch + k) * n_parts + part
                r_do.append(cute.make_rmem_tensor((8,), self.dtype))
                r_out.append(cute.make_rmem_tensor((8,), self.dtype))
                cute.autovec_copy(cute.local_tile(mdO[token, head, None], (8,), (piece,)), r_do[k])
                cute.autovec_copy(cute.local_tile(mOut[token, head, None], (8,), (piece,)), r_out[k])
                if const_expr(self.has_o_lo):
                    r_lo.append(cute.make_rmem_tensor((8,), self.dtype))
                    cute.autovec_copy(cute.local_tile(mOlo[token, head, None], (8,), (piece,)), r_lo[k])
            for k in cutlass.range_constexpr(batch):
                o = r_out[k].load().to(Float32)
                if const_expr(self.has_o_lo):
                    o = o + r_lo[k].load().to(Float32)
                acc = acc + (r_do[k].load().to(Float32) * o).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=1)
        acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=2)
        if part == 0:
            if ok:
                if const_expr(self.has_dlse):
                    acc = acc - mdLSE[token, head]
                if const_expr(self.writes_dpsum):
                    mDpsum[token, head] = acc
            sDpsum[m] = acc if ok else Float32(0.0)

    @cute.jit
    def load_indices(
        self, blk: Int32, token: Int32, n_valid: Int32, mIdx: cute.Tensor,
        mQPos: Optional[cute.Tensor], S: Int32, rIdx: cute.Tensor, t: Int32,
    ):
        """kv row (or -1 for an empty slot) of the keys of block ``blk`` that warpgroup-0 thread
        ``t`` gathers: rows ``r * 16 + t // 8``, r = 0..3. With causal positions the token's
        position is read here each time (L1-resident) rather than held in a register across
        the loop."""
        pos = S
        if const_expr(self.has_positions):
            pos = mQPos[token]
        for r in cutlass.range_constexpr(_TILE_N // 16):
            slot = blk * _TILE_N + r * 16 + t // 8
            idx = Int32(-1)
            if slot < n_valid:
                idx = mIdx[token, slot]
            ok = idx >= 0 and idx < S
            if const_expr(self.has_positions):
                ok = ok and idx <= pos
            rIdx[r] = idx if ok else Int32(-1)

    @cute.jit
    def gather(
        self, stage: Int32, mKV: cute.Tensor, rIdx: cute.Tensor, sKV: cute.Tensor,
        sRow: cute.Tensor, t: Int32, slab0: cutlass.Constexpr[int] = 0,
        slab1: cutlass.Constexpr[int] = -1,
    ):
        """Warpgroup 0 issues the cp.async gather of the 64-column slabs ``[slab0, slab1)`` of one
        key block (all slabs when ``slab1`` is -1; one commit group, zero-fill for empty slots);
        the call with ``slab0 = 0`` records each key's kv row, or -1, in ``sRow[stage]``. Thread
        t copies 16-byte piece t % 8 of every slab of rows r * 16 + t // 8; addresses are written
        out (128-byte swizzle: piece p of row r sits at 16 * (p ^ (r % 8))) so that they stay
        one base register plus immediates. With ``gather_evict_first`` every copy carries that
        L2 policy."""
        policy = None
        if const_expr(self.gather_evict_first):
            policy = create_policy(False)
        lane8 = t % 8
        row0 = t // 8
        dst0 = sKV.iterator.toint() + row0 * 128 + ((lane8 ^ (row0 % 8)) * 16)
        src0 = mKV.iterator.toint() + lane8 * 16
        for r in cutlass.range_constexpr(_TILE_N // 16):
            idx = rIdx[r]
            ok = idx >= 0
            src = src0 + Int64(idx if ok else Int32(0)) * (self.d_qk * 2)
            nbytes = Int32(16) if ok else Int32(0)
            for i in cutlass.range_constexpr(slab0, self.d_qk // 64 if slab1 < 0 else slab1):
                cp_async_16(dst0 + (i * _TILE_N * 128 + r * 16 * 128), src + i * 128, nbytes,
                            policy)
            if const_expr(slab0 == 0):
                if lane8 == 0:
                    sRow[stage * _TILE_N + r * 16 + row0] = idx
        cute.arch.cp_async_commit_group()

    @cute.jit
    def gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor):
        """acc += A . B over all k-blocks (no fence, no commit)."""
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)

    def make_mma(self, a_major, b_major, n):
        """A one-warpgroup 64 x ``n`` wgmma (fp32 accumulate, ACCUMULATE on) of the input dtype."""
        tiled = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, a_major, b_major, Float32, (1, 1, 1), (_TILE_M, n)
        )
        tiled.set(warpgroup.Field.ACCUMULATE, True)
        return tiled

    def opaque(self, t, rows: int, cols: int):
        """The K-major SW128 shared tile ``t`` ([rows, cols]) seen through an opaque base address:
        wgmma descriptors derived from it are computed where they are used (a few uniform-datapath
        instructions) instead of being hoisted out of the loop into ~100 live registers."""
        lay = kmajor_sw128(self.dtype, rows, cols)
        ptr = cute.make_ptr(self.dtype, opaque_i32(t.iterator.toint()), cute.AddressSpace.smem,
                            assumed_align=1024)
        return cute.make_tensor(cute.recast_ptr(ptr, lay.inner, self.dtype), lay.outer)

    def cols(self, t, c0, width):
        """Columns [c0, c0 + width) of a K-major SW128 tile (64-column slabs are contiguous)."""
        return cute.make_tensor(
            t.iterator + c0 * _TILE_M, kmajor_sw128(self.dtype, _TILE_M, width).outer
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mdO: cute.Tensor,
        mOut: cute.Tensor,
        mOlo: Optional[cute.Tensor],
        mLSE: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: Optional[cute.Tensor],
        mdQ: cute.Tensor,
        mdKV: cute.Tensor,
        mQPos: Optional[cute.Tensor],
        mdLSE: Optional[cute.Tensor],
        mDpsum: Optional[cute.Tensor],
        mScale: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        sm_scale: Float32,
    ):
        """Device entry: one CTA per (token, 64-head tile); the design is the module docstring."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // _WG_THREADS)
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
        sP = smem.allocate_tensor(self.dtype, lay_slab.outer, 1024, swizzle=lay_slab.inner)
        sdS = smem.allocate_tensor(self.dtype, lay_slab.outer, 1024, swizzle=lay_slab.inner)
        sRow = smem.allocate_tensor(Int32, cute.make_layout((2 * _TILE_N,)), 16)
        sLSE2 = smem.allocate_tensor(Float32, cute.make_layout((_TILE_M,)), 16)
        sDpsum = smem.allocate_tensor(Float32, cute.make_layout((_TILE_M,)), 16)
        # per head row: the dominant key's P (summed over its slots), its dP and then its dS
        # (0: no dominant key), its kv row
        sDomP = smem.allocate_tensor(Float32, cute.make_layout((_TILE_M,)), 16)
        sDomDS = smem.allocate_tensor(Float32, cute.make_layout((_TILE_M,)), 16)
        sDomRow = smem.allocate_tensor(Int32, cute.make_layout((_TILE_M,)), 16)

        # ---- valid top-k length of this token ----
        n_valid = topk
        if const_expr(self.has_topk_length):
            n_valid = cutlass.max(cutlass.min(mTopkLen[token], topk), Int32(0))
        n_blocks = (n_valid + (_TILE_N - 1)) // _TILE_N

        # ---- Q, dO (zero rows for heads >= H), lse_log2, dpsum; warpgroup 0 gathers block 0 ----
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
        rIdx = cute.make_rmem_tensor(cute.make_layout((_TILE_N // 16,)), Int32)
        if wg == 0:
            if n_blocks > 0:
                self.load_indices(Int32(0), token, n_valid, mIdx, mQPos, mKV.shape[0], rIdx, tidx)
                self.gather(Int32(0), mKV, rIdx, sKV, sRow, tidx)
        # the preprocess: lse in log2 units, +inf for a row without a valid slot (lse = -inf),
        # so that every P of that row is exactly 0; dpsum
        if tidx < _TILE_M:
            lse2 = Float32.inf
            if head0 + tidx < self.heads:
                lse = mLSE[token, head0 + tidx]
                lse2 = cutlass.select_(lse == -Float32.inf, Float32.inf, lse * Float32(_LOG2_E))
            sLSE2[tidx] = lse2
            sDomP[tidx] = Float32(0.0)
            sDomDS[tidx] = Float32(0.0)
            sDomRow[tidx] = Int32(-1)
        self.dpsum_to_smem(mdO, mOut, mOlo, mdLSE, mDpsum, token, head0, sDpsum, tidx)
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()  # Q, dO, lse, dpsum, block 0 and sRow[0] ready

        if wg == 0:
            self.wg0_body(
                tidx, token, head0, n_valid, n_blocks, sm_scale, mKV, mIdx, mQPos, mdQ, mdKV,
                mScale, mSink, mdLSE, sQ, sKV, sdO, sP, sdS, sRow, sLSE2, sDpsum, rIdx,
                (sDomP, sDomDS, sDomRow),
            )
        if wg == 1:
            self.wg1_body(
                tidx - _WG_THREADS, token, head0, n_blocks, mKV, mdQ, mdKV, mScale, sQ, sKV, sdO,
                sP, sdS, sRow, (sDomP, sDomDS, sDomRow),
            )
        # the dominant keys' dkv terms, dS * q of their rows, from all 256 threads
        self.add_dominant_dkv(sQ, mdKV, mScale, sDomDS, sDomRow, tidx)

    @cute.jit
    def wg0_body(
        self,
        t: Int32,
        token: Int32,
        head0: Int32,
        n_valid: Int32,
        n_blocks: Int32,
        sm_scale: Float32,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mQPos: Optional[cute.Tensor],
        mdQ: cute.Tensor,
        mdKV: cute.Tensor,
        mScale: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        mdLSE: Optional[cute.Tensor],
        sQ: cute.Tensor,
        sKV: cute.Tensor,
        sdO: cute.Tensor,
        sP: cute.Tensor,
        sdS: cute.Tensor,
        sRow: cute.Tensor,
        sLSE2: cute.Tensor,
        sDpsum: cute.Tensor,
        rIdx: cute.Tensor,
        sDom: tuple,
    ):
        """Warpgroup 0, per key block: the gather (block 0 is gathered before the loop; a block's
        columns 0:256 at the end of the one before), S = Q.K^T and dP = dO.V^T, P and dS (stored
        as bf16 for both warpgroups), dq[:, 0:256] += dS.K and the last dKV chunk; after the
        loop, the dominant keys' dS (:meth:`dominant_ds`) and their dq terms."""
        sDomP, sDomDS, sDomRow = sDom
        scale_log2 = sm_scale * Float32(_LOG2_E)
        S_rows = mKV.shape[0]
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN

        mma_sp = self.make_mma(K_MAJOR, K_MAJOR, _TILE_N)
        thr_sp = mma_sp.get_slice(t)
        c_sp = thr_sp.partition_C(cute.make_identity_tensor((_TILE_M, _TILE_N)))

        c0, w = self.dq_parts[0][0]
        mma_dq = self.make_mma(K_MAJOR, MN_MAJOR, w)
        thr_dq = mma_dq.get_slice(t)
        acc_dq = cute.make_rmem_tensor(mma_dq.partition_shape_C((_TILE_M, w)), Float32)
        acc_dq.fill(0.0)

        mma_kv, thr_kv, acc_kv, rRow = self.dkv_chunk_parts(t)
        ops = (thr_kv, sQ, sdO, sP, sdS)
        dkv_base = mdKV.iterator.toint()

        # per head row m0 + 8 h of this thread (m0 = 16 warp + lane // 4): the sums over its
        # other keys of P * dP (entry h) and of P (entry 2 + h), for the dominant key's dS
        rRest = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        rRest.fill(0.0)
        dom_p_base = sDomP.iterator.toint()

        early = (c0 + w) // _CHUNK  # K/V slabs [0, early) are read by warpgroup 0 only
        early_k = early * (_CHUNK // 16)  # their k-blocks in S and dP (16 columns each)
        for blk in cutlass.range(n_blocks, unroll=1):
            stage = blk % 2
            if blk > 0:  # slabs [0, early) of this block were gathered at the end of the last one
                cute.arch.barrier(barrier_id=_BAR_KV_FREE, number_of_threads=_NUM_THREADS)
                self.gather(stage, mKV, rIdx, sKV, sRow, t, early)
                cute.arch.cp_async_wait_group(1)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=_BAR_WG0, number_of_threads=_WG_THREADS)

            oQ = self.opaque(sQ, _TILE_M, self.d_qk)
            oKV = self.opaque(sKV, _TILE_N, self.d_qk)
            odO = self.opaque(sdO, _TILE_M, self.d_v)
            tA_q = thr_sp.make_fragment_A(thr_sp.partition_A(oQ))
            tB_k = thr_sp.make_fragment_B(thr_sp.partition_B(oKV))
            tA_do = thr_sp.make_fragment_A(thr_sp.partition_A(odO))
            tB_v = thr_sp.make_fragment_B(thr_sp.partition_B(self.cols(oKV, 0, self.d_v)))
            acc_s = cute.make_rmem_tensor(mma_sp.partition_shape_C((_TILE_M, _TILE_N)), Float32)
            acc_dp = cute.make_rmem_tensor(mma_sp.partition_shape_C((_TILE_M, _TILE_N)), Float32)
            acc_s.fill(0.0)
            acc_dp.fill(0.0)
            warpgroup.fence()
            for k in cutlass.range_constexpr(early_k):
                cute.gemm(mma_sp, acc_s, tA_q[None, None, k], tB_k[None, None, k], acc_s)
            for k in cutlass.range_constexpr(early_k):
                cute.gemm(mma_sp, acc_dp, tA_do[None, None, k], tB_v[None, None, k], acc_dp)
            if blk > 0:  # the other slabs
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=_BAR_WG0, number_of_threads=_WG_THREADS)
            for k in cutlass.range_constexpr(early_k, cute.size(tA_q.shape[2])):
                cute.gemm(mma_sp, acc_s, tA_q[None, None, k], tB_k[None, None, k], acc_s)
            warpgroup.commit_group()
            for k in cutlass.range_constexpr(early_k, cute.size(tA_do.shape[2])):
                cute.gemm(mma_sp, acc_dp, tA_do[None, None, k], tB_v[None, None, k], acc_dp)
            warpgroup.commit_group()
            if blk + 1 < n_blocks:  # the next block's indices, while the tensor cores work
                self.load_indices(blk + 1, token, n_valid, mIdx, mQPos, S_rows, rIdx, t)

            warpgroup.wait_group(1)  # S done
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                m, n = c_sp[i]
                p = cute.math.exp2(acc_s[i] * scale_log2 - sLSE2[m], fastmath=True)
                if sRow[stage * _TILE_N + n] < 0:
                    p = Float32(0.0)
                acc_s[i] = p
            self.hand_over(acc_s, sP, t, blk, _BAR_P_FREE, _BAR_P_READY)

            warpgroup.wait_group(0)  # dP done
            any_dominant = Boolean(False)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                # register 4 j + 2 h + e is row m0 + 8 h (see store_tile)
                h = (i // 2) % 2
                m, n = c_sp[i]
                p, dp = acc_s[i], acc_dp[i]
                dominant = p > Float32(_DOMINANT_P)
                any_dominant = any_dominant or dominant
                rest = cutlass.select_(dominant, Float32(0.0), p)
                rRest[h] = rRest[h] + rest * dp
                rRest[2 + h] = rRest[2 + h] + rest
                # a dominant key keeps its dP here until it is recorded below
                acc_dp[i] = cutlass.select_(dominant, dp, p * (dp - sDpsum[m]) * sm_scale)
            if any_dominant:  # rare: record it (its dS after the loop; P summed over its slots)
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    m, n = c_sp[i]
                    if acc_s[i] > Float32(_DOMINANT_P):
                        red_add_shared_f32(dom_p_base + m * 4, acc_s[i])
                        sDomDS[m] = acc_dp[i]
                        sDomRow[m] = sRow[stage * _TILE_N + n]
                        acc_dp[i] = Float32(0.0)  # the loop's dS.K and dS^T.q see 0
            self.hand_over(acc_dp, sdS, t, blk, _BAR_DS_FREE, _BAR_DS_READY)
            cute.arch.barrier(barrier_id=_BAR_WG0, number_of_threads=_WG_THREADS)  # all of dS

            oKV = self.opaque(sKV, _TILE_N, self.d_qk)
            tA_ds = thr_dq.make_fragment_A(thr_dq.partition_A(self.opaque(sdS, _TILE_M, _TILE_N)))
            tB_kt = thr_dq.make_fragment_B(thr_dq.partition_B(transposed(self.cols(oKV, c0, w))))
            warpgroup.fence()
            self.gemm(mma_dq, acc_dq, tA_ds, tB_kt)
            warpgroup.commit_group()
            self.load_rows(rRow, sRow, stage, t)
            self.issue_chunk(mma_kv, acc_kv, self.wg1_chunks, ops)  # the last dKV chunk
            warpgroup.wait_group(1)  # dq done: warpgroup 0 no longer reads K/V
            if blk + 1 < n_blocks:  # slabs [0, early) of the next block (warpgroup 1 never reads them)
                self.gather((blk + 1) % 2, mKV, rIdx, sKV, sRow, t, 0, early)
            warpgroup.wait_group(0)
            self.add_chunk(acc_kv, self.wg1_chunks, rRow, dkv_base, mScale, t)

        self.dominant_ds(rRest, t, token, head0, sm_scale, mSink, mdLSE, sLSE2, sDomP, sDomDS)
        cute.arch.barrier(barrier_id=_BAR_DOMINANT, number_of_threads=_NUM_THREADS)
        self.add_dominant_dq(acc_dq, thr_dq, c0, w, mKV, sDomDS, sDomRow, t)
        self.store_dq(mdQ, token, head0, thr_dq, acc_dq, c0, w)

    @cute.jit
    def dominant_ds(self, rRest: cute.Tensor, t: Int32, token: Int32, head0: Int32,
                    sm_scale: Float32, mSink: Optional[cute.Tensor], mdLSE: Optional[cute.Tensor],
                    sLSE2: cute.Tensor, sDomP: cute.Tensor, sDomDS: cute.Tensor):
        """Warpgroup 0, after the loop: the dS of each head row's dominant key ``j`` (``P_j`` above
        ``_DOMINANT_P``) from the row's other keys, ``dS_j = P_j (dP_j * mass - sum_{k != j} P_k
        dP_k + dlse) * sm_scale`` with ``mass = sum_{k != j} P_k + P_sink``, written over its dP
        in ``sDomDS`` (0 for a row without one). The dpsum form ``P_j (dP_j - dpsum)`` subtracts
        two numbers that agree to ``1 - P_j``: once that is below the precision of dpsum (from
        ``out + o_lo``, about 2**-17), dS_j is rounding noise, and with it the row's dq and
        ``dkv[j]`` (the peakedness ladder of :mod:`mla_inductor.numerics`). This is the same
        form as :func:`mla_inductor.kernels.reference._dominant_from_row`. The four lanes of a
        row hold its sums in parts; two butterfly shuffles add them."""
        lane = t % 32
        for h in cutlass.range_constexpr(2):
            r, mass = rRest[h], rRest[2 + h]
            for off in (1, 2):
                r = r + cute.arch.shuffle_sync_bfly(r, offset=off)
                mass = mass + cute.arch.shuffle_sync_bfly(mass, offset=off)
            m = (t // 32) * 16 + lane // 4 + 8 * h
            if lane % 4 == 0:
                p = sDomP[m]
                ds = Float32(0.0)
                if p > Float32(0.0):  # a dominant key: the head is < H and lse finite
                    head = head0 + m
                    if const_expr(self.has_sink):
                        mass = mass + cute.math.exp2(mSink[head] * Float32(_LOG2_E) - sLSE2[m],
                                                     fastmath=False)
                    x = sDomDS[m] * mass - r
                    if const_expr(self.has_dlse):
                        x = x + mdLSE[token, head]
                    ds = p * x * sm_scale
                sDomDS[m] = ds

    @cute.jit
    def add_dominant_dq(self, acc_dq: cute.Tensor, thr_dq, c0: int, w: int, mKV: cute.Tensor,
                        sDomDS: cute.Tensor, sDomRow: cute.Tensor, t: Int32):
        """dq[:, c0:c0 + w] += dS_j * kv[j] for each of this thread's two head rows that has a
        dominant key ``j`` (:meth:`dominant_ds`; its dS was 0 in the loop's dS.K), read from
        global memory (L2) in the accumulator's own layout."""
        c_dq = thr_dq.partition_C(cute.make_identity_tensor((_TILE_M, w)))
        m0 = (t // 32) * 16 + (t % 32) // 4
        for h in cutlass.range_constexpr(2):
            ds = sDomDS[m0 + 8 * h]
            if ds != Float32(0.0):
                row = sDomRow[m0 + 8 * h]
                gK = cute.make_tensor(mKV.iterator + Int64(row) * self.d_qk,
                                      cute.make_layout((self.d_qk,)))
                for i in cutlass.range_constexpr(cute.size(acc_dq)):
                    if const_expr((i // 2) % 2 == h):
                        _, col = c_dq[i]
                        acc_dq[i] = acc_dq[i] + ds * gK[c0 + col].to(Float32)

    @cute.jit
    def add_dominant_dkv(self, sQ: cute.Tensor, mdKV: cute.Tensor, mScale: Optional[cute.Tensor],
                         sDomDS: cute.Tensor, sDomRow: cute.Tensor, t: Int32):
        """dkv[j] += dS_j * q[head] for each head row with a dominant key ``j``, into the
        accumulator in its column order (float32: the 16-byte reds of :meth:`scatter`; int64:
        the fixed-point adds of :meth:`scatter_fixed`), thread ``t`` of 256 taking the same
        accumulator positions in every row. q is read from its shared tile: read from global
        memory, the dominant keys' terms made the backward 1.154x the time of one without them
        on rows that all have a dominant key, against 1.062x from the tile (H200, T 4096, S
        8192, H 128, topk 2048, 2026-12-02)."""
        keep = create_policy(True)
        dkv_base = mdKV.iterator.toint()
        for m in cutlass.range(_TILE_M, unroll=1):
            ds = sDomDS[m]
            if ds != Float32(0.0):
                gQ = sQ[m, None]
                row_base = dkv_base + Int64(sDomRow[m]) * (self.d_qk * (8 if self.deterministic else 4))
                if const_expr(self.deterministic):
                    scale = mScale[0]
                    for r in cutlass.range_constexpr((self.d_qk + _NUM_THREADS - 1) // _NUM_THREADS):
                        pos = t + r * _NUM_THREADS
                        if pos < self.d_qk:
                            # position 8 jh + 4 e + q of a group holds column 8 jh + 2 q + e
                            within = pos % _GROUP
                            col = (pos - within) + (within // 8) * 8 + (within % 4) * 2 + (within % 8) // 4
                            red_add_fixed64(row_base + pos * 8, ds * gQ[col].to(Float32) * scale,
                                            Int32(1), keep)
                else:
                    if t < self.d_qk // 4:
                        # positions 4 q .. 4 q + 3 of a group hold columns 2 q, 2 q + 1, 2 q + 8, 2 q + 9
                        pos = t * 4
                        col = (pos - pos % _GROUP) + ((pos % _GROUP) // 4) * 2
                        red_add_f32x4(row_base + pos * 4, ds * gQ[col].to(Float32),
                                      ds * gQ[col + 1].to(Float32), ds * gQ[col + 8].to(Float32),
                                      ds * gQ[col + 9].to(Float32), Int32(1), keep)

    @cute.jit
    def hand_over(self, acc: cute.Tensor, sT: cute.Tensor, t: Int32, blk: Int32,
                  bar_free: cutlass.Constexpr[int], bar_ready: cutlass.Constexpr[int]):
        """Hands a 64 x 64 fp32 fragment of warpgroup 0 (P or dS) to warpgroup 1: rounds it to the
        input dtype, waits until warpgroup 1 has released the tile's previous contents
        (``bar_free``, from the second block on), stores it (:meth:`store_tile`) and signals
        ``bar_ready``."""
        r16 = cute.make_rmem_tensor_like(acc, self.dtype)
        r16.store(acc.load().to(self.dtype))
        if blk > 0:
            cute.arch.barrier(barrier_id=bar_free, number_of_threads=_NUM_THREADS)
        self.store_tile(r16, sT, t)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=bar_ready, number_of_threads=_NUM_THREADS)

    @cute.jit
    def store_tile(self, r16: cute.Tensor, sT: cute.Tensor, t: Int32):
        """Stores warpgroup 0's 64 x 64 wgmma accumulator fragment ``r16`` (16-bit, register
        4 j + 2 h + e = row m0 + 8 h, column 8 j + 2 (lane % 4) + e, m0 = 16 warp + lane // 4)
        into the K-major 128-byte-swizzled tile ``sT``: the pair (h, j) goes to byte
        128 row + 16 (j ^ (row % 8)) + 4 (lane % 4). The per-thread base is made opaque so the
        eight XORed addresses are recomputed each time rather than held in registers."""
        lane = t % 32
        g = lane // 4
        base = sT.iterator.toint() + ((t // 32) * 16 + g) * 128 + (lane % 4) * 4 + g * 16
        base = opaque_i32(base)
        r32 = cute.recast_tensor(r16, Int32)
        for j in cutlass.range_constexpr(8):
            a = base ^ (j * 16)
            for h in cutlass.range_constexpr(2):
                st_shared_b32(a + h * 8 * 128, r32[h + 2 * j])

    @cute.jit
    def store_dq(self, mdQ, token, head0, thr_dq, acc_dq, c0, w):
        """dq epilogue: registers -> global, heads < H only. The token's 64-bit offset is formed
        here from an opaque copy of ``token``, so that it is not shared with (and kept live
        from) the prologue's identical offset into q, which cost registers and spills."""
        c_dq = thr_dq.partition_C(cute.make_identity_tensor((_TILE_M, w)))
        gdQ = mdQ[opaque_i32(token), None, None]
        for i in cutlass.range_constexpr(cute.size(acc_dq)):
            m, col = c_dq[i]
            head = head0 + m
            if head < self.heads:
                gdQ[head, c0 + col] = acc_dq[i].to(mdQ.element_type)

    @cute.jit
    def wg1_body(
        self,
        t: Int32,
        token: Int32,
        head0: Int32,
        n_blocks: Int32,
        mKV: cute.Tensor,
        mdQ: cute.Tensor,
        mdKV: cute.Tensor,
        mScale: Optional[cute.Tensor],
        sQ: cute.Tensor,
        sKV: cute.Tensor,
        sdO: cute.Tensor,
        sP: cute.Tensor,
        sdS: cute.Tensor,
        sRow: cute.Tensor,
        sDom: tuple,
    ):
        """Warpgroup 1, per key block: dq[:, 256:] += dS.K, and dKV = P^T.dO + dS^T.Q in 64-column
        chunks, each waited and scattered (one accumulator: a second one does not fit next to
        dq's 160 registers; ptxas then spills and serialises the wgmmas); after the loop, the
        dominant keys' dq terms (:meth:`add_dominant_dq`)."""
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN

        dq_parts = self.dq_parts[1]
        mma_dq = [self.make_mma(K_MAJOR, MN_MAJOR, w) for (_, w) in dq_parts]
        thr_dq = [m.get_slice(t) for m in mma_dq]
        acc_dq = [
            cute.make_rmem_tensor(mma_dq[j].partition_shape_C((_TILE_M, w)), Float32)
            for j, (_, w) in enumerate(dq_parts)
        ]
        for j in cutlass.range_constexpr(len(acc_dq)):
            acc_dq[j].fill(0.0)
        mma_kv, thr_kv, acc_kv, rRow = self.dkv_chunk_parts(t)
        dkv_base = mdKV.iterator.toint()

        last_p_chunk = min(self.n_chunks_v, self.wg1_chunks) - 1
        last_chunk = self.wg1_chunks - 1

        for blk in cutlass.range(n_blocks, unroll=1):
            stage = blk % 2
            more = blk + 1 < n_blocks
            cute.arch.barrier(barrier_id=_BAR_P_READY, number_of_threads=_NUM_THREADS)
            self.load_rows(rRow, sRow, stage, t)

            oQ = self.opaque(sQ, _TILE_M, self.d_qk)
            odO = self.opaque(sdO, _TILE_M, self.d_v)
            oKV = self.opaque(sKV, _TILE_N, self.d_qk)
            odS = self.opaque(sdS, _TILE_M, _TILE_N)
            tA_ds = [m.make_fragment_A(m.partition_A(odS)) for m in thr_dq]
            tB_kt = [
                thr_dq[j].make_fragment_B(thr_dq[j].partition_B(transposed(self.cols(oKV, c0, w))))
                for j, (c0, w) in enumerate(dq_parts)
            ]
            tA_pt = thr_kv.make_fragment_A(thr_kv.partition_A(transposed(self.opaque(sP, _TILE_M, _TILE_N))))
            tA_dst = thr_kv.make_fragment_A(thr_kv.partition_A(transposed(odS)))
            tB_dot0 = thr_kv.make_fragment_B(thr_kv.partition_B(transposed(self.cols(odO, 0, _CHUNK))))
            tB_qt0 = thr_kv.make_fragment_B(thr_kv.partition_B(transposed(self.cols(oQ, 0, _CHUNK))))
            ops = (thr_kv, sQ, sdO, sP, sdS)

            # chunk 0 (P part, then the dS part once dS is stored), then dq
            acc_kv.fill(0.0)
            warpgroup.fence()
            self.gemm(mma_kv, acc_kv, tA_pt, tB_dot0)
            cute.arch.barrier(barrier_id=_BAR_DS_READY, number_of_threads=_NUM_THREADS)
            self.gemm(mma_kv, acc_kv, tA_dst, tB_qt0)
            warpgroup.commit_group()
            for j in cutlass.range_constexpr(len(dq_parts)):
                self.gemm(mma_dq[j], acc_dq[j], tA_ds[j], tB_kt[j])
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # chunk 0 done (dq may still run)
            self.add_chunk(acc_kv, 0, rRow, dkv_base, mScale, t)
            for c in cutlass.range_constexpr(1, self.wg1_chunks):
                self.issue_chunk(mma_kv, acc_kv, c, ops)
                warpgroup.wait_group(0)  # chunk c (and dq) done
                if const_expr(c == 1):
                    if more:  # K/V no longer needed by warpgroup 1
                        cute.arch.barrier_arrive(barrier_id=_BAR_KV_FREE, number_of_threads=_NUM_THREADS)
                if const_expr(c == last_p_chunk):
                    if more:
                        cute.arch.barrier_arrive(barrier_id=_BAR_P_FREE, number_of_threads=_NUM_THREADS)
                if const_expr(c == last_chunk):
                    if more:
                        cute.arch.barrier_arrive(barrier_id=_BAR_DS_FREE, number_of_threads=_NUM_THREADS)
                self.add_chunk(acc_kv, c, rRow, dkv_base, mScale, t)

        _, sDomDS, sDomRow = sDom
        cute.arch.barrier(barrier_id=_BAR_DOMINANT, number_of_threads=_NUM_THREADS)
        for j in cutlass.range_constexpr(len(dq_parts)):
            c0, w = dq_parts[j]
            self.add_dominant_dq(acc_dq[j], thr_dq[j], c0, w, mKV, sDomDS, sDomRow, t)
            self.store_dq(mdQ, token, head0, thr_dq[j], acc_dq[j], c0, w)

    def dkv_chunk_parts(self, t):
        """The dKV chunk wgmma (64 keys x 64 columns: A = P^T or dS^T, B = dO or Q columns, both
        MN-major), warpgroup thread ``t``'s slice of it, its fp32 accumulator, and the 4-entry
        register tensor of kv rows that :meth:`load_rows` fills for :meth:`scatter`."""
        mma_kv = self.make_mma(cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.MN,
                               _CHUNK)
        thr_kv = mma_kv.get_slice(t)
        acc_kv = cute.make_rmem_tensor(mma_kv.partition_shape_C((_TILE_N, _CHUNK)), Float32)
        return mma_kv, thr_kv, acc_kv, cute.make_rmem_tensor(cute.make_layout((4,)), Int32)

    @cute.jit
    def load_rows(self, rRow: cute.Tensor, sRow: cute.Tensor, stage: Int32, t: Int32):
        """kv rows (-1: empty slot) of the keys whose dKV accumulator rows warpgroup thread ``t``
        holds in block stage ``stage``: a 64 x 64 chunk accumulator gives thread (warp w, lane
        l) keys k0 = 16 w + l // 4 and k0 + 8 (register 4 j + 2 h + e is key k0 + 8 h, column
        8 j + 2 (l % 4) + e); ``rRow`` = rows of k0, k0 + 8 and of their scatter partners
        k0 ^ 1, (k0 + 8) ^ 1."""
        k0 = (t // 32) * 16 + (t % 32) // 4
        for h in cutlass.range_constexpr(2):
            rRow[h] = sRow[stage * _TILE_N + k0 + 8 * h]
            rRow[2 + h] = sRow[stage * _TILE_N + ((k0 + 8 * h) ^ 1)]

    @cute.jit
    def issue_chunk(self, mma_kv, acc, c: cutlass.Constexpr[int], ops):
        """acc = P^T.dO[:, chunk c] + dS^T.Q[:, chunk c] (one committed wgmma group); the
        descriptors are built here, from opaque bases, so that none stays live across chunks."""
        thr_kv, sQ, sdO, sP, sdS = ops
        acc.fill(0.0)
        warpgroup.fence()
        if const_expr(c < self.n_chunks_v):
            tA_pt = thr_kv.make_fragment_A(thr_kv.partition_A(transposed(self.opaque(sP, _TILE_M, _TILE_N))))
            odO = self.opaque(sdO, _TILE_M, self.d_v)
            tB_dot = thr_kv.make_fragment_B(thr_kv.partition_B(transposed(self.cols(odO, c * _CHUNK, _CHUNK))))
            self.gemm(mma_kv, acc, tA_pt, tB_dot)
        tA_dst = thr_kv.make_fragment_A(thr_kv.partition_A(transposed(self.opaque(sdS, _TILE_M, _TILE_N))))
        oQ = self.opaque(sQ, _TILE_M, self.d_qk)
        tB_qt = thr_kv.make_fragment_B(thr_kv.partition_B(transposed(self.cols(oQ, c * _CHUNK, _CHUNK))))
        self.gemm(mma_kv, acc, tA_dst, tB_qt)
        warpgroup.commit_group()

    @cute.jit
    def add_chunk(self, acc, c: cutlass.Constexpr[int], rRow, dkv_base, mScale, t: Int32):
        """Adds a finished 64 x 64 dKV chunk into the accumulator: float32 atomics
        (:meth:`scatter`), or 64-bit fixed point when deterministic (:meth:`scatter_fixed`)."""
        if const_expr(self.deterministic):
            self.scatter_fixed(acc, c, rRow, dkv_base, mScale[0], t)
        else:
            self.scatter(acc, c, rRow, dkv_base, t % 32)

    @cute.jit
    def scatter_fixed(self, acc, c: cutlass.Constexpr[int], rRow, dkv_base, scale: Float32,
                      t: Int32):
        """The deterministic scatter: adds a finished 64 x 64 dKV chunk, times ``scale``, into the
        int64 accumulator (:func:`.ptx.red_add_fixed64`), skipping empty slots.

        Thread (warp w, lane l) holds, per key k0 + 8 h (k0 = 16 w + l // 4) and 16-column group
        g, four values ``v[i]`` (i = 2 jh + e: register 8 g + 4 jh + 2 h + e, column 8 jh +
        2 (l % 4) + e of the group). Two butterfly exchanges (shuffle xor 4 over bit 0 of i, xor
        8 over bit 1) leave in slot i of lane l the value of key ``16 w + 8 h + 4 (l // 16) + i``
        at group column ``8 jh + 2 (l % 4) + e`` with ``(jh, e)`` = bits 3, 2 of l; it is stored
        at position ``8 jh + 4 e + l % 4 = l % 16`` of the group, so each red instruction of a
        warp writes two keys x 16 consecutive int64 (two whole 128-byte lines; the column order
        is :func:`.bwd_host.dkv_fixed_interleave`). The kv row of that key is ``rRow[h]`` of lane
        ``16 (l // 16) + 4 i`` (:meth:`load_rows`), fetched with a shuffle: ``sRow`` itself may
        already hold the next block's rows by the last chunk."""
        lane = t % 32
        src0 = 16 * (lane // 16)
        b0 = (lane // 4) % 2 == 1
        b1 = (lane // 8) % 2 == 1
        keep = create_policy(True)
        for h in cutlass.range_constexpr(2):
            vals = []
            for g in cutlass.range_constexpr(_CHUNK // _GROUP):
                v = [acc[8 * g + 4 * (i // 2) + 2 * h + i % 2] for i in range(4)]
                for bit, flag, off in ((1, b0, 4), (2, b1, 8)):
                    for lo in [i for i in range(4) if not i & bit]:
                        hi = lo | bit
                        recv = cute.arch.shuffle_sync_bfly(
                            cutlass.select_(flag, v[lo], v[hi]), offset=off)
                        v_lo = cutlass.select_(flag, recv, v[lo])
                        v_hi = cutlass.select_(flag, v[hi], recv)
                        v[lo], v[hi] = v_lo, v_hi
                vals.append(v)
            for i in cutlass.range_constexpr(4):
                row = cute.arch.shuffle_sync(rRow[h], src0 + 4 * i)
                ok = Int32(row >= 0)
                addr = dkv_base + (Int64(row) * self.d_qk + (c * _CHUNK + lane % 16)) * 8
                for g in cutlass.range_constexpr(_CHUNK // _GROUP):
                    red_add_fixed64(addr + g * _GROUP * 8, vals[g][i] * scale, ok, keep)

    @cute.jit
    def scatter(self, acc, c: cutlass.Constexpr[int], rRow, dkv_base, lane):
        """Adds a finished 64 x 64 dKV chunk into the interleaved fp32 accumulator, skipping
        empty slots, so that every red instruction of a warp writes 4 keys x one whole 128-byte
        line (32 columns): lanes l and l ^ 4 hold keys k and k ^ 1 (``par`` 0 / 1) and each
        sends the other its upper 16-column group of the line with a shuffle; then the first
        red writes key k's line (the par-0 lanes its lower group, the par-1 lanes the received
        upper one) and the second red key k ^ 1's line the other way round. Whole-line reds
        were 6% faster than 64-byte ones (same sectors, half the L2 requests; H200, T 4096).
        Every red carries the L2 evict_last policy (the module docstring says why)."""
        par = (lane // 4) % 2
        col = c * _CHUNK + (lane % 4) * 4  # interleaved column of this lane in the lower group
        for h in cutlass.range_constexpr(2):
            own, other = rRow[h], rRow[2 + h]
            own_addr = dkv_base + (Int64(own) * self.d_qk + col) * 4
            other_addr = dkv_base + (Int64(other) * self.d_qk + (col + _GROUP)) * 4
            own_ok, other_ok = Int32(own >= 0), Int32(other >= 0)
            addr_a = cutlass.select_(par == 1, other_addr, own_addr)
            addr_b = cutlass.select_(par == 1, own_addr, other_addr)
            ok_a = cutlass.select_(par == 1, other_ok, own_ok)
            ok_b = cutlass.select_(par == 1, own_ok, other_ok)
            for L in cutlass.range_constexpr(_CHUNK // (2 * _GROUP)):
                # 16-column group g of key k0 + 8 h: registers 8 g + 2 h + {0, 1}, 8 g + 4 + 2 h + {0, 1}
                g_lo = [acc[8 * (2 * L) + 2 * h + e] for e in (0, 1)] + \
                       [acc[8 * (2 * L) + 4 + 2 * h + e] for e in (0, 1)]
                g_hi = [acc[8 * (2 * L + 1) + 2 * h + e] for e in (0, 1)] + \
                       [acc[8 * (2 * L + 1) + 4 + 2 * h + e] for e in (0, 1)]
                recv = [cute.arch.shuffle_sync_bfly(g_hi[k], offset=4) for k in range(4)]
                va = [cutlass.select_(par == 1, recv[k], g_lo[k]) for k in range(4)]
                vb = [cutlass.select_(par == 1, g_lo[k], recv[k]) for k in range(4)]
                line = L * 2 * _GROUP * 4
                keep = create_policy(True)  # per line pair: once per chunk was no faster
                red_add_f32x4(addr_a + line, va[0], va[1], va[2], va[3], ok_a, keep)
                red_add_f32x4(addr_b + line, vb[0], vb[1], vb[2], vb[3], ok_b, keep)


def compile_backward(dtype_name: str, heads: int, d_qk: int, d_v: int, has_topk_length: bool,
                     has_o_lo: bool = True, has_positions: bool = False, has_dlse: bool = False,
                     writes_dpsum: bool = False, gather_evict_first: bool = False,
                     deterministic: bool = False, has_sink: bool = False):
    """Compiles the main kernel for one static configuration (no GPU needed inside
    :func:`.common.target_arch`). The returned TVM-FFI function takes ``(q, kv, dout, out,
    o_lo_or_None, lse, indices, topk_length_or_None, dq, dkv_accum, q_positions_or_None,
    dlse_or_None, dpsum_or_None, scale_or_None, attn_sink_or_None, sm_scale)`` as torch tensors
    and a float, and runs on torch's current stream; ``dkv_accum`` is float32, or int64 with a
    ``[1]`` float32 fixed-point ``scale`` when ``deterministic``; ``attn_sink`` is ``[heads]``
    float32 when ``has_sink``."""
    cdtype = TORCH_TO_CUTE[dtype_name]
    T, S, K = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def fake(dt, shape, align):
        order = tuple(range(len(shape) - 1, -1, -1))
        return cute.runtime.make_fake_compact_tensor(dt, shape, stride_order=order, assumed_align=align)

    def per_token(dt, d):
        # [T, heads, d] with a run-time 64-bit token stride (= heads * d): with the static
        # stride heads * d, token * stride would be 32-bit arithmetic and wrap past 2**31
        stride = cute.sym_int(64, divisibility=heads * d)
        return cute.runtime.make_fake_tensor(dt, (T, heads, d), (stride, d, 1), assumed_align=16)

    args = (
        per_token(cdtype, d_qk),  # q
        fake(cdtype, (S, d_qk), 16),  # kv
        per_token(cdtype, d_v),  # dout
        per_token(cdtype, d_v),  # out
        per_token(cdtype, d_v) if has_o_lo else None,  # o_lo
        fake(cutlass.Float32, (T, heads), 4),  # lse
        fake(cutlass.Int32, (T, K), 4),  # indices
        fake(cutlass.Int32, (T,), 4) if has_topk_length else None,  # topk_length
        per_token(cdtype, d_qk),  # dq
        fake(cutlass.Int64 if deterministic else cutlass.Float32, (S, d_qk), 16),  # dkv_accum
        fake(cutlass.Int32, (T,), 4) if has_positions else None,  # q_positions
        fake(cutlass.Float32, (T, heads), 4) if has_dlse else None,  # dlse
        fake(cutlass.Float32, (T, heads), 4) if writes_dpsum else None,  # dpsum out
        fake(cutlass.Float32, (1,), 4) if deterministic else None,  # fixed-point scale
        fake(cutlass.Float32, (heads,), 4) if has_sink else None,  # attn_sink
        cutlass.Float32(1.0),  # sm_scale
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )
    kernel = SparseMlaBackwardSm90(cdtype, heads, d_qk, d_v, has_topk_length, has_o_lo,
                                   has_positions, has_dlse, writes_dpsum, gather_evict_first,
                                   deterministic, has_sink)
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")
