"""Sparse-MLA forward for Hopper (SM90a), written in CuTe DSL.

Computes, for every token ``t`` and head ``h``::

    s_j   = sm_scale * q[t, h, :d_qk] . kv[indices[t, j], :d_qk]      (j over valid slots)
    out   = sum_j softmax(s)_j * kv[indices[t, j], :d_v]
    lse   = log(sum_j exp(s_j))                                      (natural log, fp32)
    o_lo  = float32(O_normalised) - float32(out), rounded to out's dtype (optional)

A slot is valid when ``0 <= indices[t, j] < S`` and ``j < topk_length[t]``; invalid slots are
never read (their ``cp.async`` has source size 0, which zero-fills the shared-memory row) and
their scores are set to -inf. A row without valid slots gets ``out = 0``, ``lse = -inf``.

Design (decisions, in the order they were taken)
-------------------------------------------------
* Tile: one token x 64 heads (``H`` is padded to a multiple of 64 inside the kernel: padded Q
  rows are zero-filled, padded output rows are never stored); tile ``i`` is token
  ``i // ceil(H/64)``, so the head tiles of one token are adjacent and share the gathered rows
  in L2. 64 heads is the wgmma M of one warpgroup and what every public Hopper sparse-MLA
  kernel uses.
* Persistent grid: ``num_ctas`` CTAs (the host launches one per SM, or one per tile when there
  are fewer tiles); CTA ``b`` computes tiles ``b, b + num_ctas, ...``. The producer gathers
  the next tile's Q as soon as both consumers' last ``Q K^T`` of the current tile is done (a
  Q-empty barrier), and its first KV blocks as soon as the epilogue's stores are issued, so a
  tile's epilogue and the next tile's loads overlap (with one CTA per tile, every CTA's
  epilogue, exit, launch and first loads were serial). The stage barriers' phases run on over
  the tiles (the pairs this CTA has done). Against one CTA per tile, H200, T 4096, H 128, topk
  2048, S 2T (same run): the training forward 1.060 -> 1.026 of the old exact time, the exact
  forward 1.021 -> 1.004 with the epilogue below, and at T = S = 131072 the exact forward 0.95
  of the old one's time.
* Keys: blocks of 64 gathered rows (full ``d_qk`` width), taken in PAIRS (A, B) walked from the
  LAST block to the FIRST: pair ``it`` is A = block ``2 n_pairs - 1 - 2 it``, B = the block
  before it, and the running max sees A's block before B's (as a sequential walk from the end
  would: the kernels whose numerics we study walk that way, so order-invariance tests bite).
  ``topk`` need not be a multiple of 64 (slots past ``topk`` are empty) nor the block count
  even: with an odd count the first A block lies wholly past ``n_valid`` and is all empty.
* Warp specialisation, 3 warpgroups (384 threads), registers 56 / 224 / 224 via ``setmaxnreg``
  (it only moves registers inside the launch allocation of 168 x 384: 168 - 56 = 2 (224 - 168);
  asking for more than was released hangs the kernel):
  - WG0, producer: gathers Q once (L2 evict_first policy) and then each KV block with 16-byte
    ``cp.async.cg ... L2::cache_hint.L2::256B`` under an L2 evict_last policy (the rows are
    read again by the other head tile and by other tokens); 8 threads per 128-byte row segment,
    4 passes of 16 rows. Each stage (A's block = stage 0, B's = stage 1) is split in two
    QUARTERS with their own full / empty mbarriers: side 0 = columns ``[0, d_v/2)`` (V's left
    half), side 1 = ``[d_v/2, d_qk)`` (V's right half + RoPE). They are loaded in the order
    they are needed and freed as early as their last reader allows: A-left (freed by A after
    its own P V), B-right (freed by B after its own P V), A-right (freed by B after P_A V_R),
    B-left (freed by A after P_B V_L). Both blocks' indices are loaded before the first wait.
    With a stage's first quarter the producer also writes the stage's key validity (``sValid``,
    published by 16 plain arrivals on that quarter's full barrier), which the consumers read
    to mask S.
  - WG1 = consumer A, WG2 = consumer B, balanced (FlashMLA's split): each computes
    ``S = Q K^T`` for its OWN block (64x64, SS wgmma, issued quarter by quarter as they land),
    masks it, runs the softmax on it, and owns HALF of O's columns (A ``[:d_v/2]``, B
    ``[d_v/2:]``), which it multiplies by both blocks' P: its own P from registers (RS wgmma,
    N = 256), the other consumer's P from shared memory (SS wgmma).
  The previous design (one softmax consumer doing S and half of P V, a second doing only the
  other half of P V) left the softmax consumer on the critical path with ~3x the tensor work of
  the other and no tensor work overlapping its softmax; with two symmetric consumers one's
  softmax overlaps the other's products (exact 511 -> 543 TFLOPS, lazy 540 -> 561 on the H200,
  T 4096, H 128, topk 2048).
* Running max across the two consumers (per row, through shared memory and named barriers):
  A folds its block max into the running max -> ``m_a``, publishes it (``BAR_MAX_A``), computes
  ``P_A = exp2(x - m_a)``, rescales O and its row sum, and issues its own P V at once; B waits
  for ``m_a``, folds its block in -> ``m_b`` (the pair's final max), publishes it
  (``BAR_MAX_B``) and proceeds in ``m_b``. A then rescales its fp32 P, its O and row sum by
  ``exp2(m_a - m_b)``, and stores P_A, now in ``m_b``, for B (``BAR_P_A``); B stores P_B for
  A (``BAR_P_B``). Each consumer keeps its own partial row sum (over its own blocks, in the
  shared max); the epilogue adds the two. With the lazy rescale, a rescale whose factors are
  exactly 1 (no row max of the thread moved: the common case) is skipped, which was 1-2% faster
  than rescaling always; with the exact max the rescales are unconditional (the max moves in
  some row of most warps early on, and the branch around them cost 4-5%: H200, T 4096, H 128).
  The running max starts at -1e30 (not -inf), so no factor is ever NaN.
* Shared memory (d_qk = 576): Q 72 KiB + 2 KV stages of 72 KiB + 8 KiB (P_B) = 224 KiB. P_A
  lives in stage 0's RoPE columns (512:576), dead once A's Q K^T is complete (FlashMLA's trick;
  its quarter is only refilled after B's P_A V is done). P_B cannot live in stage 1's RoPE: B
  frees that quarter before A has read P_B. For d_qk = 512 both P tiles get their own 16 KiB.
  All tiles use the 128-byte-swizzled K-major wgmma layout (8 x 64 atoms stacked along rows,
  64-column chunks contiguous); V is the same buffer seen MN-major (transposed view).
* Online softmax in the exp2 domain: ``x = s * sm_scale * log2(e)``. ``rescale_threshold`` is a
  compile-time constant: 0.0 = exact running max (any growth rescales O and the row sum by
  ``exp2(m_old - m_new)``); > 0 = lazy (keep the stale max unless the block max exceeds it by
  more than the threshold, so p <= 2**threshold, which the kernel checks fits bf16/fp16).
  p is fp32; the row sum accumulates the fp32 p; p is rounded to the input dtype for P V.
  Source: FlashAttention-4 ``softmax.py``; the numerics: docs/design.md.
* Epilogue: ``out = O / row_sum`` rounded to the input dtype, ``o_lo = O / row_sum - out``
  rounded to it too (a residual of about 2**-9 of out, kept to about 2**-9 of itself: out + o_lo
  carries O to about 2**-17, and it costs half the bytes of an fp32 o_lo), ``lse = (m +
  log2(row_sum)) * ln 2`` (written by A, rows ``h < H``; -inf when the row sum is 0). out and
  o_lo go from registers to global memory with no shared memory, so the KV stages are free for
  the next tile's gathers at once: the four threads of a quad transpose their accumulator words
  (two butterfly rounds, one shuffle per word) so that each holds 8 adjacent columns, written as one
  16-byte store under an L2 evict_first policy. (Staging them in the dead KV stages, as before,
  kept the stages until the stores were done; persistent, it was within 1% of these stores and
  needs the stages held back.) A sink joins the row sum there (``exp2(sink * log2(e) - m)``);
  the producer gathers the tile's 64 sink logits into shared memory with Q (4-byte
  ``cp.async``, published by Q's barrier) and the consumers copy them to registers before
  they free Q, since a global load in the epilogue stalls it on its latency (H200, T 4096,
  H 128: the sink's cost over the plain call 1.3% -> 0.7%, medians of 21 pairs).
* One compiled kernel serves every ``T``, ``H``, ``S`` and ``topk`` (all symbolic); the compile
  key is (dtype, d_qk, d_v, threshold, o_lo, has topk_length, causal, sink, max_logits). It is
  launched on torch's current stream through TVM-FFI, with ``num_ctas`` from the host.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import BFloat16, Boolean, Float16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum
import torch

from ...thresholds import MAX_RESCALE_THRESHOLD
from .common import SMEM_LIMIT, TORCH_TO_CUTE, fake_inputs, sw128_offset_bytes
from .host import FWD_TILE_H, LN2, LOG2E, SUPPORTED_DIMS
from .ptx import cp_async_4, cp_async_16, cp_async_wait_all, create_policy, st_global_v4_b32

TILE_H = FWD_TILE_H  # heads per tile (wgmma M)
TILE_N = 64  # gathered keys per block
NUM_THREADS = 384
# setmaxnreg moves registers within the launch allocation (168 x 384): 168 - 56 = 2 x (224 - 168)
REGS_PRODUCER, REGS_CONSUMER = 56, 224
# named barriers (0 is __syncthreads); each one is shared by the two consumer warpgroups
BAR_MAX_A = 1  # A's running max of the pair published (A arrives, B waits)
BAR_MAX_B = 2  # the pair's final running max published (B arrives, A waits)
BAR_P_A = 3  # A's P (rescaled to the final max) in shared memory
BAR_P_B = 4  # B's P in shared memory
BAR_EPILOGUE = 5  # partial row sums exchanged
MAX_INIT = -1.0e30  # finite "minus infinity" of the running max: exp2(MAX_INIT - x) is 0, never NaN
# q's torch dtype per CuTe dtype, for the bound on rescale_threshold
_TORCH_DTYPE = {cute_dtype: getattr(torch, name) for name, cute_dtype in TORCH_TO_CUTE.items()}


class SparseMlaFwdSm90:
    """Compile-time configuration of one forward kernel (see the module docstring)."""

    def __init__(self, dtype, d_qk: int, d_v: int, rescale_threshold: float, has_o_lo: bool,
                 has_topk_length: bool, has_positions: bool = False, has_sink: bool = False,
                 has_max_logits: bool = False):
        if dtype not in (BFloat16, Float16):
            raise TypeError(f"sm90 sparse-MLA forward supports bf16/fp16, got {dtype}")
        if (d_qk, d_v) not in SUPPORTED_DIMS:
            raise ValueError(f"need (d_qk, d_v) in {SUPPORTED_DIMS}, got {(d_qk, d_v)}")
        bound = MAX_RESCALE_THRESHOLD[_TORCH_DTYPE[dtype]]
        if not (0.0 <= rescale_threshold < bound):
            raise ValueError(f"rescale_threshold must be >= 0 and below {bound:g} in {dtype} (p or "
                             f"its row sums overflow past it), got {rescale_threshold}")
        self.dtype = dtype
        self.d_qk = d_qk
        self.d_v = d_v
        self.threshold = float(rescale_threshold)
        # skip a rescale whose factors are all 1 (lazy rescale only; see the module docstring)
        self.skip_unit_rescale = self.threshold > 0.0
        self.has_o_lo = has_o_lo
        self.has_topk_length = has_topk_length
        self.has_positions = has_positions  # causal: slots naming a key past q_positions[t] are empty
        self.has_sink = has_sink
        self.has_max_logits = has_max_logits
        # With the exact max (0.0) the final running max is the row's true max (it starts at
        # MAX_INIT: a row whose scores all lie below it counts as empty, as for lse); only the
        # lazy rescale, whose max can be stale, tracks the true max on the side.
        self.track_true_max = has_max_logits and self.threshold > 0.0
        self.n_chunks = d_qk // 64
        self.p_in_rope = d_qk - d_v >= 64  # A's P tile lives in the (dead) RoPE chunk of stage 0
        self.stage_elems = TILE_N * d_qk
        self.d_half = d_v // 2
        self.half_chunks = self.d_half // 64  # 64-column chunks of the left quarter (= V_L)
        self.n_p_tiles = 1 if self.p_in_rope else 2  # P tiles with their own shared memory
        if self._smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"shared memory {self._smem_bytes()} B over the SM90 limit "
                             f"{SMEM_LIMIT} B")

    def _layouts(self):
        atom = warpgroup.make_smem_layout_atom(
            sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, 64), self.dtype
        )
        sQ = cute.tile_to_shape(atom, (TILE_H, self.d_qk), order=(0, 1))
        sKV = cute.tile_to_shape(atom, (TILE_N, self.d_qk, 2), order=(0, 1, 2))
        sP = cute.tile_to_shape(atom, (TILE_H, TILE_N, self.n_p_tiles), order=(0, 1, 2))
        return sQ, sKV, sP

    def _smem_bytes(self):
        e = self.dtype.width // 8
        n = TILE_H * self.d_qk * e + 2 * self.stage_elems * e + self.n_p_tiles * TILE_H * TILE_N * e
        # sMa, sMb (64 fp32 each), sL (2 x 64 fp32), sValid (2 x 64 int32), with the lazy max and
        # max_logits sMaxL (2 x 64 fp32), with a sink sSink (64 fp32); 10 mbarriers; each
        # allocation 16-byte aligned, plus slack
        words = 4 * TILE_H + 2 * TILE_N
        words += 2 * TILE_H if self.track_true_max else 0
        words += TILE_H if self.has_sink else 0
        return n + 4 * words + 10 * 8 + 512

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [T, H, d_qk]
        mKV: cute.Tensor,  # [S, d_qk]
        mIdx: cute.Tensor,  # [T, topk] int32
        mTopkLen: cute.Tensor | None,  # [T] int32
        mO: cute.Tensor,  # [T, H, d_v]
        mLSE: cute.Tensor,  # [T, H] fp32
        mOlo: cute.Tensor | None,  # [T, H, d_v], out's dtype
        mQPos: cute.Tensor | None,  # [T] int32, causal positions
        mSink: cute.Tensor | None,  # [H] fp32, attention sink logits (natural log)
        mMaxLogits: cute.Tensor | None,  # [T, H] fp32
        scale_log2: Float32,
        num_ctas: Int32,  # CTAs launched (each walks tiles num_ctas apart)
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
        self.kernel(
            mQ, mKV, mIdx, mTopkLen, mO, mLSE, mOlo, mQPos, mSink, mMaxLogits, scale_log2,
            sQ_layout, sKV_layout, sP_layout, tiled_mma_qk, tiled_mma_pv_rs, tiled_mma_pv_ss,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[NUM_THREADS, 1, 1],
            smem=self._smem_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.jit
    def _tile(self, tile, n_head_tiles, mTopkLen, topk):
        """Token, first head and pair count of ``tile`` (the head tiles of a token adjacent)."""
        t = tile // n_head_tiles
        h0 = (tile % n_head_tiles) * TILE_H
        n_valid = topk
        if const_expr(self.has_topk_length):
            n_valid = cutlass.max(cutlass.min(mTopkLen[t], topk), Int32(0))
        n_blocks = (n_valid + TILE_N - 1) // TILE_N
        # blocks go in pairs (A, B) = (2 n_pairs - 1 - 2 it, 2 n_pairs - 2 - 2 it); with an odd
        # block count the first A block lies past n_valid: all its slots are empty
        return t, h0, n_valid, (n_blocks + 1) // 2

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
        mQPos: cute.Tensor | None,
        mSink: cute.Tensor | None,
        mMaxLogits: cute.Tensor | None,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv_rs: cute.TiledMma,
        tiled_mma_pv_ss: cute.TiledMma,
    ):
        """Device entry: each CTA walks the (token, 64-head tile) tiles ``bidx, bidx + grid,
        ...``; the design is the module docstring."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4

        num_heads = mQ.shape[1]
        n_head_tiles = (num_heads + TILE_H - 1) // TILE_H
        n_tiles = mQ.shape[0] * n_head_tiles
        n_mine = (n_tiles - bidx + grid_x - 1) // grid_x  # tiles of this CTA
        seqlen_kv = mKV.shape[0]
        topk = mIdx.shape[1]

        # ---- shared memory ----
        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, sQ_layout.outer, 1024, swizzle=sQ_layout.inner)
        sKV = smem.allocate_tensor(self.dtype, sKV_layout.outer, 1024, swizzle=sKV_layout.inner)
        sP_own = smem.allocate_tensor(self.dtype, sP_layout.outer, 1024, swizzle=sP_layout.inner)
        if const_expr(self.p_in_rope):
            # A's P = columns [d_qk - 64, d_qk) of KV stage 0, as a (64 heads, 64 keys) tile
            sP_a = cute.composition(
                sKV,
                cute.make_layout(
                    (TILE_H, (TILE_N, self.n_chunks), 2),
                    stride=(1, (TILE_N, TILE_N * 64), TILE_N * self.d_qk),
                ),
            )[None, (None, self.n_chunks - 1), None]
            sP_b = sP_own
            pa_idx, pb_idx = 0, 0
        else:
            sP_a = sP_own
            sP_b = sP_own
            pa_idx, pb_idx = 0, 1
        # V^T of each stage, split in the two d_v halves: (d_half, keys, stage)
        sVt_all = cute.composition(
            sKV,
            cute.make_layout(
                ((self.d_half, 2), TILE_N, 2),
                stride=((TILE_N, TILE_N * self.d_half), 1, TILE_N * self.d_qk),
            ),
        )
        sMa = smem.allocate_tensor(Float32, cute.make_layout((TILE_H,)), 16)
        sMb = smem.allocate_tensor(Float32, cute.make_layout((TILE_H,)), 16)
        sL = smem.allocate_tensor(Float32, cute.make_layout((TILE_H, 2)), 16)
        # each consumer's true maximum of its blocks' scaled scores (lazy max with max_logits)
        sMaxL = None
        if const_expr(self.track_true_max):
            sMaxL = smem.allocate_tensor(Float32, cute.make_layout((TILE_H, 2)), 16)
        # the sink logits of a tile, gathered by the producer with its Q (a load in the epilogue
        # would stall it on its latency); the consumers copy theirs to registers before they
        # free Q, after which the producer gathers the next tile's
        sSink = None
        if const_expr(self.has_sink):
            sSink = smem.allocate_tensor(Float32, cute.make_layout((TILE_H,)), 16)
        # validity (1 / 0) of each key of each stage, written by the producer with the stage's
        # first quarter (published by that quarter's full barrier)
        sValid = smem.allocate_tensor(Int32, cute.make_layout((TILE_N, 2)), 16)
        # full[q] / empty[q], q = 2 * stage + side; side 0 = columns [0, d_v/2) (= V_L),
        # side 1 = columns [d_v/2, d_qk) (V_R and the RoPE part); Q full / Q empty
        mbar = smem.allocate_array(Int64, 10)
        mbar_full = mbar
        mbar_empty = mbar + 4
        mbar_q = mbar + 8
        mbar_q_empty = mbar + 9

        if tidx == 0:
            for q in cutlass.range_constexpr(4):
                # the first quarter of each stage (q = 0: A's V_L, q = 3: B's right part) also
                # counts one plain arrive of the 16 producer threads that write its validity
                first = (q == 0) or (q == 3)
                cute.arch.mbarrier_init(mbar_full + q, 128 + (16 if first else 0))
                cute.arch.mbarrier_init(mbar_empty + q, 128)
            cute.arch.mbarrier_init(mbar_q, 128)
            cute.arch.mbarrier_init(mbar_q_empty, 256)
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
            row_bytes = self.d_qk * elem
            keep = create_policy(True)  # KV rows: read by both head tiles and many tokens
            stream_once = create_policy(False)  # Q: read once
            pairs_done = Int32(0)  # pairs of this CTA's earlier tiles: the stage barriers' phase
            for k in cutlass.range(n_mine, unroll=1):
                t, h0, n_valid, n_pairs = self._tile(bidx + k * grid_x, n_head_tiles, mTopkLen,
                                                     topk)
                pos = Int32(0)
                if const_expr(self.has_positions):
                    pos = mQPos[t]
                # Q is free once both consumers' last Q K^T of the previous tile is complete
                cute.arch.mbarrier_wait(mbar_q_empty, (k & 1) ^ 1)
                for p in cutlass.range_constexpr(TILE_H // 16):
                    r = p * 16 + row_in_pass
                    ok = h0 + r < num_heads
                    src = q_base + (Int64(t) * num_heads + h0 + r) * row_bytes
                    src = cutlass.select_(ok, src, q_base)
                    self._copy_row(sQ_addr, r, vec, src, ok, 0, self.n_chunks, stream_once)
                if const_expr(self.has_sink):
                    if tidx < TILE_H:  # published with Q by the same arrivals
                        ok = h0 + tidx < num_heads
                        src = mSink.iterator.toint() + Int64(cutlass.select_(ok, h0 + tidx, 0)) * 4
                        cp_async_4(sSink.iterator.toint() + tidx * 4, src,
                                   cutlass.select_(ok, Int32(4), Int32(0)))
                cute.arch.cp_async_mbarrier_arrive_noinc(mbar_q)
                for it in cutlass.range(n_pairs, unroll=1):
                    phase = (pairs_done + it) & 1
                    blk_a = 2 * n_pairs - 1 - 2 * it
                    # both blocks' indices are loaded before the first wait, hiding their latency
                    rows_idx = cute.make_rmem_tensor((2 * (TILE_N // 16),), Int32)
                    for b in cutlass.range_constexpr(2):
                        for p in cutlass.range_constexpr(TILE_N // 16):
                            j = (blk_a - b) * TILE_N + p * 16 + row_in_pass
                            idx = Int32(-1)
                            if j < n_valid:
                                idx = mIdx[t, j]
                            rows_idx[b * (TILE_N // 16) + p] = idx
                    # quarters in the order the consumers need them: A's V_L (its S starts there
                    # and its own P V reads it), B's right part (its S starts there), A's right
                    # part, B's V_L (A's last product of the pair)
                    for b, side in ((0, 0), (1, 1), (0, 1), (1, 0)):
                        q = 2 * b + side
                        cute.arch.mbarrier_wait(mbar_empty + q, phase ^ 1)
                        stage_addr = sKV_addr + b * (self.stage_elems * elem)
                        c_lo = 0 if side == 0 else self.half_chunks
                        c_hi = self.half_chunks if side == 0 else self.n_chunks
                        for p in cutlass.range_constexpr(TILE_N // 16):
                            r = p * 16 + row_in_pass
                            idx = rows_idx[b * (TILE_N // 16) + p]
                            ok = (idx >= 0) & (idx < seqlen_kv)
                            if const_expr(self.has_positions):
                                ok = ok & (idx <= pos)
                            src = kv_base + Int64(idx) * row_bytes
                            src = cutlass.select_(ok, src, kv_base)
                            self._copy_row(stage_addr, r, vec, src, ok, c_lo, c_hi, keep)
                            if const_expr(b == side):  # the stage's first quarter
                                if vec == 0:
                                    sValid[r, b] = Int32(ok)
                        if const_expr(b == side):
                            if vec == 0:  # publishes sValid (release), next to the copies' arrivals
                                cute.arch.mbarrier_arrive(mbar_full + q)
                        cute.arch.cp_async_mbarrier_arrive_noinc(mbar_full + q)
                pairs_done = pairs_done + n_pairs
            cp_async_wait_all()

        else:
            # ================= consumers: A (wg 1, stage 0) and B (wg 2, stage 1) =============
            cute.arch.setmaxregister_increase(REGS_CONSUMER)
            ct = tidx % 128
            lane = ct % 32
            thr_qk = tiled_mma_qk.get_slice(ct)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sKV))
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_H, TILE_N)), Float32)
            tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_H, TILE_N)))
            row0 = tScS[0][0]
            row1 = tScS[2][0]

            thr_rs = tiled_mma_pv_rs.get_slice(ct)
            thr_ss = tiled_mma_pv_ss.get_slice(ct)
            acc_O = cute.make_rmem_tensor(thr_rs.partition_shape_C((TILE_H, self.d_half)), Float32)
            tOrP = thr_rs.make_fragment_A(thr_rs.partition_shape_A((TILE_H, TILE_N)))
            # acc_S seen with the A-fragment layout: (2 cols, 2 rows, 2 col groups), k blocks of 16
            acc_S_as_A = cute.make_tensor(acc_S.iterator, tOrP.layout)
            tOrP_as_C = cute.make_tensor(tOrP.iterator, acc_S.layout)

            row_max = cute.make_rmem_tensor((2,), Float32)
            row_sum = cute.make_rmem_tensor((2,), Float32)
            m_pair = cute.make_rmem_tensor((2,), Float32)
            bmax = cute.make_rmem_tensor((2,), Float32)
            psum = cute.make_rmem_tensor((2,), Float32)
            true_max = cute.make_rmem_tensor((2,), Float32)  # (max_logits: the lazy max is stale)
            sink2 = cute.make_rmem_tensor((2,), Float32)  # the rows' sinks (natural log)
            valid = cute.make_rmem_tensor((16,), Boolean)
            mma_rs = cute.make_mma_atom(tiled_mma_pv_rs.op)
            mma_ss = cute.make_mma_atom(tiled_mma_pv_ss.op)
            mma_rs.set(warpgroup.Field.ACCUMULATE, True)
            mma_ss.set(warpgroup.Field.ACCUMULATE, True)
            pairs_done = Int32(0)

            if wg == 1:
                # ---- A: S of the pair's first block (stage 0), O[:, :d_v/2] ----
                tOrV_rs = thr_rs.make_fragment_B(thr_rs.partition_B(sVt_all[(None, 0), None, None]))
                tOrV_ss = thr_ss.make_fragment_B(thr_ss.partition_B(sVt_all[(None, 0), None, None]))
                tSsP = thr_qk.partition_C(sP_a)[None, None, None, pa_idx]  # own P, for B
                tOsP = thr_ss.make_fragment_A(thr_ss.partition_A(sP_b))  # B's P
                for k in cutlass.range(n_mine, unroll=1):
                    t, h0, n_pairs = self._start_tile(
                        k, bidx + k * grid_x, n_head_tiles, mTopkLen, topk, num_heads, acc_O,
                        row_max, row_sum, true_max, mbar_q, sink2, sSink, row0, row1)
                    for it in cutlass.range(n_pairs, unroll=1):
                        phase = (pairs_done + it) & 1
                        cute.arch.mbarrier_wait(mbar_full + 0, phase)
                        self._load_valid(valid, sValid, 0, tScS)
                        cute.arch.fence_view_async_shared()  # cp.async (generic proxy) -> wgmma
                        warpgroup.fence()
                        self._qk(tiled_mma_qk, acc_S, tSrQ, tSrK, 0, 0, self.half_chunks)
                        warpgroup.commit_group()
                        if it > 0:
                            # the previous pair's B-P x V_L is done: B's left quarter is free
                            warpgroup.wait_group(1)
                            cute.arch.mbarrier_arrive(mbar_empty + 2)
                        cute.arch.mbarrier_wait(mbar_full + 1, phase)
                        cute.arch.fence_view_async_shared()
                        warpgroup.fence()
                        self._qk(tiled_mma_qk, acc_S, tSrQ, tSrK, 0, self.half_chunks,
                                 self.n_chunks, False)
                        warpgroup.commit_group()
                        self._block_max(acc_S, valid, bmax, true_max, scale_log2, mbar_q_empty,
                                        it == n_pairs - 1)
                        # softmax of the own block against the running max, max published to B
                        m_pair[0] = self._new_max(row_max[0], bmax[0])
                        m_pair[1] = self._new_max(row_max[1], bmax[1])
                        if lane % 4 == 0:
                            sMa[row0] = m_pair[0]
                            sMa[row1] = m_pair[1]
                        cute.arch.barrier_arrive(barrier_id=BAR_MAX_A, number_of_threads=256)
                        c0 = cute.math.exp2(row_max[0] - m_pair[0], fastmath=True)
                        c1 = cute.math.exp2(row_max[1] - m_pair[1], fastmath=True)
                        self._softmax_own_pv(acc_S, m_pair, c0, c1, psum, row_sum, acc_O, tOrP,
                                             acc_S_as_A, mma_rs, tOrV_rs, 0, scale_log2)
                        warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(mbar_empty + 0)  # own V_L free

                        # the pair's final max (B folded its block in): rescale own P, O, row sum
                        cute.arch.barrier(barrier_id=BAR_MAX_B, number_of_threads=256)
                        mb0 = sMb[row0]
                        mb1 = sMb[row1]
                        d0 = cute.math.exp2(m_pair[0] - mb0, fastmath=True)
                        d1 = cute.math.exp2(m_pair[1] - mb1, fastmath=True)
                        row_max[0] = mb0
                        row_max[1] = mb1
                        if const_expr(self.skip_unit_rescale):
                            if (d0 != 1.0) | (d1 != 1.0):
                                self._rescale_to_pair_max(acc_S, acc_O, row_sum, tOrP, acc_S_as_A,
                                                          d0, d1)
                        else:
                            self._rescale_to_pair_max(acc_S, acc_O, row_sum, tOrP, acc_S_as_A,
                                                      d0, d1)
                        tSsP.store(tOrP_as_C.load())
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier_arrive(barrier_id=BAR_P_A, number_of_threads=256)

                        # O[:, :d_v/2] += P_B V_B[:, :d_v/2]
                        self._other_pv(mma_ss, acc_O, tOsP, pb_idx, tOrV_ss, 1, BAR_P_B)
                    warpgroup.wait_group(0)
                    if n_pairs == 0:
                        cute.arch.mbarrier_arrive(mbar_q_empty)
                    else:  # the last pair's B-P x V_L is done: B's left quarter is free
                        cute.arch.mbarrier_arrive(mbar_empty + 2)
                    self._epilogue(0, acc_O, row_max, row_sum, true_max, psum, sL, sMaxL, mO,
                                   mLSE, mOlo, mMaxLogits, t, h0, num_heads, row0, row1, lane,
                                   sink2)
                    pairs_done = pairs_done + n_pairs
            else:
                # ---- B: S of the pair's second block (stage 1), O[:, d_v/2:] ----
                tOrV_rs = thr_rs.make_fragment_B(thr_rs.partition_B(sVt_all[(None, 1), None, None]))
                tOrV_ss = thr_ss.make_fragment_B(thr_ss.partition_B(sVt_all[(None, 1), None, None]))
                tSsP = thr_qk.partition_C(sP_b)[None, None, None, pb_idx]  # own P, for A
                tOsP = thr_ss.make_fragment_A(thr_ss.partition_A(sP_a))  # A's P
                for k in cutlass.range(n_mine, unroll=1):
                    t, h0, n_pairs = self._start_tile(
                        k, bidx + k * grid_x, n_head_tiles, mTopkLen, topk, num_heads, acc_O,
                        row_max, row_sum, true_max, mbar_q, sink2, sSink, row0, row1)
                    for it in cutlass.range(n_pairs, unroll=1):
                        phase = (pairs_done + it) & 1
                        cute.arch.mbarrier_wait(mbar_full + 3, phase)
                        self._load_valid(valid, sValid, 1, tScS)
                        cute.arch.fence_view_async_shared()
                        warpgroup.fence()
                        self._qk(tiled_mma_qk, acc_S, tSrQ, tSrK, 1, self.half_chunks,
                                 self.n_chunks)
                        cute.arch.mbarrier_wait(mbar_full + 2, phase)
                        cute.arch.fence_view_async_shared()
                        warpgroup.fence()
                        self._qk(tiled_mma_qk, acc_S, tSrQ, tSrK, 1, 0, self.half_chunks, False)
                        warpgroup.commit_group()
                        self._block_max(acc_S, valid, bmax, true_max, scale_log2, mbar_q_empty,
                                        it == n_pairs - 1)
                        cute.arch.barrier(barrier_id=BAR_MAX_A, number_of_threads=256)
                        m_pair[0] = self._new_max(sMa[row0], bmax[0])
                        m_pair[1] = self._new_max(sMa[row1], bmax[1])
                        if lane % 4 == 0:
                            sMb[row0] = m_pair[0]
                            sMb[row1] = m_pair[1]
                        cute.arch.barrier_arrive(barrier_id=BAR_MAX_B, number_of_threads=256)
                        c0 = cute.math.exp2(row_max[0] - m_pair[0], fastmath=True)
                        c1 = cute.math.exp2(row_max[1] - m_pair[1], fastmath=True)
                        row_max[0] = m_pair[0]
                        row_max[1] = m_pair[1]
                        self._softmax_own_pv(acc_S, m_pair, c0, c1, psum, row_sum, acc_O, tOrP,
                                             acc_S_as_A, mma_rs, tOrV_rs, 1, scale_log2)
                        # own P to shared memory for A while the product runs
                        tSsP.store(tOrP_as_C.load())
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier_arrive(barrier_id=BAR_P_B, number_of_threads=256)

                        # O[:, d_v/2:] += P_A V_A[:, d_v/2:]
                        self._other_pv(mma_ss, acc_O, tOsP, pa_idx, tOrV_ss, 0, BAR_P_A)
                        warpgroup.wait_group(1)
                        cute.arch.mbarrier_arrive(mbar_empty + 3)  # own right quarter free
                        warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(mbar_empty + 1)  # A's right quarter (+ P) free
                    if n_pairs == 0:
                        cute.arch.mbarrier_arrive(mbar_q_empty)
                    self._epilogue(1, acc_O, row_max, row_sum, true_max, psum, sL, sMaxL, mO,
                                   mLSE, mOlo, mMaxLogits, t, h0, num_heads, row0, row1, lane,
                                   sink2)
                    pairs_done = pairs_done + n_pairs

    @cute.jit
    def _start_tile(self, k, tile, n_head_tiles, mTopkLen, topk, num_heads, acc_O, row_max,
                    row_sum, true_max, mbar_q, sink2, sSink, row0, row1):
        """A consumer at the start of its ``k``-th tile ``tile``: per-tile state reset, waits
        for the tile's Q, copies its rows' sinks (natural log; -inf past H) to registers;
        returns the token, the first head and the pair count."""
        t, h0, n_valid, n_pairs = self._tile(tile, n_head_tiles, mTopkLen, topk)
        acc_O.fill(0.0)
        row_max.fill(MAX_INIT)
        row_sum.fill(0.0)
        true_max.fill(-Float32.inf)
        cute.arch.mbarrier_wait(mbar_q, k & 1)
        cute.arch.fence_view_async_shared()
        if const_expr(self.has_sink):
            rows = [row0, row1]
            for r in cutlass.range_constexpr(2):
                sink2[r] = cutlass.select_(h0 + rows[r] < num_heads, sSink[rows[r]],
                                           -Float32.inf)
        return t, h0, n_pairs

    @cute.jit
    def _epilogue(self, role: cutlass.Constexpr, acc_O, row_max, row_sum, true_max, psum, sL,
                  sMaxL, mO, mLSE, mOlo, mMaxLogits, t, h0, num_heads, row0, row1, lane, sink2):
        """Row sums (and true maxima) of both consumers combined; the sink joins the
        denominator; lse and max_logits (written by A), then out / o_lo.

        With a sink ``s2 = sink * log2(e)`` the row's total in the max ``m_e = max(m, s2)`` is
        ``row_sum * exp2(m - m_e) + exp2(s2 - m_e)``: a row without a valid slot gets out 0 and
        lse = sink (-inf only when the sink is -inf too); ``sink2``: the rows' sinks (natural
        log, -inf past H). A +inf ``s2`` (the sink +inf, or finite above ``2**128 * ln 2``) is
        the max with ``exp2(s2 - m_e) = 1`` (not ``exp2(inf - inf)``): out 0, lse the sink. A
        NaN row sum (a NaN or +inf score, a NaN sink) gives NaN out and lse."""
        inv = [Float32(0.0), Float32(0.0)]
        rows = [row0, row1]
        for r in cutlass.range_constexpr(2):
            rs = row_sum[r]
            rs = rs + cute.arch.shuffle_sync_bfly(rs, offset=1)
            rs = rs + cute.arch.shuffle_sync_bfly(rs, offset=2)
            psum[r] = rs
            if lane % 4 == 0:
                sL[rows[r], role] = rs
                if const_expr(self.track_true_max):
                    sMaxL[rows[r], role] = true_max[r]
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=256)
        for r in cutlass.range_constexpr(2):
            rs = psum[r] + sL[rows[r], 1 - role]
            head = h0 + rows[r]
            m = row_max[r]
            scale = Float32(1.0)
            if const_expr(self.has_sink):
                s2 = sink2[r] * Float32(LOG2E)
                m_e = cute.arch.fmax(m, s2)
                scale = cute.math.exp2(m - m_e, fastmath=True)
                rs = rs * scale + cutlass.select_(s2 == Float32.inf, Float32(1.0),
                                                  cute.math.exp2(s2 - m_e, fastmath=True))
                m = m_e
            inv[r] = cutlass.select_(rs == 0.0, Float32(0.0), scale / rs)
            if const_expr(role == 0):
                # -inf only for a row sum of exactly 0 (no valid slot): a NaN row sum (a NaN or
                # +inf score) gives a NaN lse, as the reference's
                lse = m * LN2 + cute.math.log(rs)
                if const_expr(self.has_sink):  # s2 overflowed: from the natural-log sink
                    lse = cutlass.select_(m == Float32.inf, sink2[r] + cute.math.log(rs), lse)
                lse = cutlass.select_(rs == 0.0, -Float32.inf, lse)
                if lane % 4 == 0:
                    if head < num_heads:
                        mLSE[t, head] = lse
                        if const_expr(self.track_true_max):
                            top = cute.arch.fmax(true_max[r], sMaxL[rows[r], 1])
                            mMaxLogits[t, head] = top * Float32(LN2)
                        elif const_expr(self.has_max_logits):
                            top = cutlass.select_(row_max[r] > Float32(MAX_INIT), row_max[r],
                                                  -Float32.inf)
                            mMaxLogits[t, head] = top * Float32(LN2)
        # sL / sMaxL are read: the next tile may write them (its pairs' barriers would order
        # that, but a tile without a valid slot has none)
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=256)
        self._store_o(acc_O, mO, mOlo, t, h0, num_heads, role, inv, row0, row1, lane)


    @cute.jit
    def _copy_row(self, tile_addr, r, vec, src, ok, c_lo: cutlass.Constexpr,
                  c_hi: cutlass.Constexpr, policy):
        """One thread's share of a row copy: 16-byte vector ``vec`` of each 64-column chunk in
        ``[c_lo, c_hi)`` from the global row at byte address ``src`` to row ``r`` of the swizzled
        shared tile at ``tile_addr``; zero-filled without a read when not ``ok``."""
        elem = self.dtype.width // 8
        for c in cutlass.range_constexpr(c_lo, c_hi):
            cp_async_16(
                tile_addr + sw128_offset_bytes(r, vec, c),
                src + (c * 64 + vec * 8) * elem,
                cutlass.select_(ok, Int32(16), Int32(0)),
                policy,
            )

    def _new_max(self, m_old, bm):
        """Running-max update for a block whose scaled max is ``bm`` (the rescale_threshold rule)."""
        if self.threshold == 0.0:
            return cute.arch.fmax(m_old, bm)
        return cutlass.select_(bm - m_old > self.threshold, bm, m_old)

    @cute.jit
    def _load_valid(self, valid, sValid, stage: cutlass.Constexpr, tScS):
        """Validity of this thread's 16 key columns of the block in ``stage`` (from the
        producer's ``sValid``; reading the indices from global memory in every consumer thread
        instead was 3% slower: those loads share the load/store queue with the gathers)."""
        for v in cutlass.range_constexpr(16):
            i = (v % 2) + 4 * (v // 2)
            valid[v] = sValid[tScS[i][1], stage] != 0

    @cute.jit
    def _qk(self, tiled_mma_qk, acc_S, tSrQ, tSrK, stage: cutlass.Constexpr,
            c_lo: cutlass.Constexpr, c_hi: cutlass.Constexpr, zero_init: cutlass.Constexpr = True):
        """Issues S (+)= Q[:, chunks c_lo:c_hi] K[stage][:, chunks c_lo:c_hi]^T (4 k-steps of 16
        per 64-column chunk); the first k-step overwrites S when ``zero_init``."""
        mma = cute.make_mma_atom(tiled_mma_qk.op)
        mma.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(c_lo * 4, c_hi * 4):
            cute.gemm(mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
            mma.set(warpgroup.Field.ACCUMULATE, True)

    @cute.jit
    def _block_max(self, acc_S, valid, bmax, true_max, scale_log2, mbar_q_empty, last):
        """Once the own block's ``S`` is complete: frees Q after the tile's ``last`` pair, masks
        ``S`` and takes its scaled row maxima ``bmax`` (and the true maxima, see
        ``track_true_max``)."""
        warpgroup.wait_group(0)
        if last:
            cute.arch.mbarrier_arrive(mbar_q_empty)  # the tile's last read of Q
        self._mask_rowmax(acc_S, valid, bmax, scale_log2)
        if const_expr(self.track_true_max):
            true_max[0] = cute.arch.fmax(true_max[0], bmax[0])
            true_max[1] = cute.arch.fmax(true_max[1], bmax[1])

    @cute.jit
    def _mask_rowmax(self, acc_S, valid, bmax, scale_log2):
        """Invalid columns of S to -inf; ``bmax`` = the rows' block max times ``scale_log2``."""
        b0 = -Float32.inf
        b1 = -Float32.inf
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            v = (i % 2) + 2 * (i // 4)
            s = cutlass.select_(valid[v], acc_S[i], -Float32.inf)
            acc_S[i] = s
            if const_expr((i // 2) % 2 == 0):
                b0 = cute.arch.fmax(b0, s)
            else:
                b1 = cute.arch.fmax(b1, s)
        b0 = cute.arch.fmax(b0, cute.arch.shuffle_sync_bfly(b0, offset=1))
        b1 = cute.arch.fmax(b1, cute.arch.shuffle_sync_bfly(b1, offset=1))
        b0 = cute.arch.fmax(b0, cute.arch.shuffle_sync_bfly(b0, offset=2))
        b1 = cute.arch.fmax(b1, cute.arch.shuffle_sync_bfly(b1, offset=2))
        bmax[0] = b0 * scale_log2
        bmax[1] = b1 * scale_log2

    @cute.jit
    def _exp_rows(self, acc_S, m, psum, scale_log2):
        """S -> p = exp2(S * scale_log2 - m[row]) in place; ``psum`` = this thread's row sums."""
        s = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            r = (i // 2) % 2
            p = cute.math.exp2(acc_S[i] * scale_log2 - m[r], fastmath=True)
            acc_S[i] = p
            s[r + 2 * (i % 2)] = s[r + 2 * (i % 2)] + p
        psum[0] = s[0] + s[2]
        psum[1] = s[1] + s[3]

    @cute.jit
    def _softmax_own_pv(self, acc_S, m, c0, c1, psum, row_sum, acc_O, tOrP, acc_S_as_A, mma_rs,
                        tOrV_rs, stage: cutlass.Constexpr, scale_log2):
        """The own block's step: P = exp2(S * scale_log2 - m[row]) in place; the row sums and O
        rescaled by ``(c0, c1)`` (see ``skip_unit_rescale``) and the block's row sums added;
        then issues and commits ``O += P V[stage]`` with P from registers (RS wgmma)."""
        self._exp_rows(acc_S, m, psum, scale_log2)
        row_sum[0] = row_sum[0] * c0 + psum[0]
        row_sum[1] = row_sum[1] * c1 + psum[1]
        if const_expr(self.skip_unit_rescale):
            if (c0 != 1.0) | (c1 != 1.0):
                self._rescale(acc_O, c0, c1)
        else:
            self._rescale(acc_O, c0, c1)
        tOrP.store(acc_S_as_A.load().to(self.dtype))
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
            cute.gemm(mma_rs, acc_O, tOrP[None, None, k], tOrV_rs[None, None, k, stage], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _other_pv(self, mma_ss, acc_O, tOsP, p_idx, tOrV_ss, stage: cutlass.Constexpr,
                  bar_p: cutlass.Constexpr):
        """Waits for the other consumer's P (named barrier ``bar_p``), then issues and commits
        ``O += P_other V[stage]`` with P from shared memory (SS wgmma)."""
        cute.arch.barrier(barrier_id=bar_p, number_of_threads=256)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOsP.shape[2])):
            cute.gemm(mma_ss, acc_O, tOsP[None, None, k, p_idx], tOrV_ss[None, None, k, stage],
                      acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _rescale_to_pair_max(self, acc_S, acc_O, row_sum, tOrP, acc_S_as_A, d0, d1):
        """Consumer A, once B has folded its block in: A's fp32 P (and its bf16 copy), row sums
        and O times ``exp2(m_a - m_b)`` per row."""
        self._rescale(acc_S, d0, d1)
        tOrP.store(acc_S_as_A.load().to(self.dtype))
        row_sum[0] = row_sum[0] * d0
        row_sum[1] = row_sum[1] * d1
        self._rescale(acc_O, d0, d1)

    @cute.jit
    def _rescale(self, acc, scale0, scale1):
        """Multiplies this thread's two accumulator rows by their factors."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            if const_expr((i // 2) % 2 == 0):
                acc[i] = acc[i] * scale0
            else:
                acc[i] = acc[i] * scale1

    @cute.jit
    def _store_o(self, acc_O, mO, mOlo, t, h0, num_heads, half: cutlass.Constexpr, inv,
                        row0, row1, lane):
        """out = O * inv rounded to the output dtype and, with o_lo, o_lo = O * inv - out rounded
        to it too, stored from registers (rows < H only), with no shared memory: the producer
        gathers the next tile into the KV stages meanwhile.

        A thread holds, of rows ``row0`` / ``row1``, columns ``8 j + 2 (lane % 4) + {0, 1}`` of
        its half (the wgmma accumulator layout). For each 32 columns the four threads of a quad
        transpose their words (two butterfly shuffles) so that each holds 8 adjacent columns,
        and write them as one 16-byte store, streamed through L2 (evict_first).
        """
        elem = self.dtype.width // 8
        policy = create_policy(False)
        q4 = lane % 4
        rows = [row0, row1]
        for rh in cutlass.range_constexpr(2):
            head = h0 + rows[rh]
            ok = Int32(head < num_heads)
            first = ((Int64(t) * num_heads + head) * self.d_v + half * self.d_half + q4 * 8) * elem
            for m in cutlass.range_constexpr(self.d_half // 32):
                f = cute.make_rmem_tensor((8,), Float32)
                for j in cutlass.range_constexpr(4):
                    for e in cutlass.range_constexpr(2):
                        f[2 * j + e] = acc_O[4 * (4 * m + j) + 2 * rh + e] * inv[rh]
                rounded = cute.make_rmem_tensor((8,), self.dtype)
                rounded.store(f.load().to(self.dtype))
                self._quad_store(cute.recast_tensor(rounded, Int32), q4,
                                 mO.iterator.toint() + first + m * 32 * elem, ok, policy)
                if const_expr(self.has_o_lo):
                    lo = cute.make_rmem_tensor((8,), self.dtype)
                    lo.store((f.load() - rounded.load().to(Float32)).to(self.dtype))
                    self._quad_store(cute.recast_tensor(lo, Int32), q4,
                                     mOlo.iterator.toint() + first + m * 32 * elem, ok, policy)

    @cute.jit
    def _quad_store(self, w, q4, addr, ok, policy):
        """Word ``i`` of thread ``q4`` of a quad = columns ``8 i + 2 q4 + {0, 1}``; after the 4 x 4
        transpose across the quad, thread ``q4`` holds columns ``8 q4 .. 8 q4 + 7`` and stores
        them at ``addr`` (already offset by ``8 q4`` columns) if ``ok``."""
        v = [w[0], w[1], w[2], w[3]]
        for bit in cutlass.range_constexpr(2):
            step = 1 << bit
            upper = (q4 & step) != 0
            for i in cutlass.range_constexpr(4):
                if const_expr(i & step == 0):
                    send = cutlass.select_(upper, v[i], v[i + step])
                    got = cute.arch.shuffle_sync_bfly(send, offset=step)
                    v[i] = cutlass.select_(upper, got, v[i])
                    v[i + step] = cutlass.select_(upper, v[i + step], got)
        st_global_v4_b32(addr, v[0], v[1], v[2], v[3], ok, policy)


# ------------------------------------------------------------------------------------------------
# compiling (the launcher is in fwd_host.py)
# ------------------------------------------------------------------------------------------------

def compile_forward(dtype_name: str, d_qk: int, d_v: int, rescale_threshold: float,
                    has_o_lo: bool, has_topk_length: bool, has_positions: bool = False,
                    has_sink: bool = False, has_max_logits: bool = False):
    """Compile one forward kernel (no GPU needed when ``CUTE_DSL_ARCH`` is set).

    ``dtype_name`` is ``"bfloat16"`` or ``"float16"``. T, H, S and topk are symbolic, so the
    result serves every size. Returns the TVM-FFI callable ``fn(q, kv, indices,
    topk_length_or_None, out, lse, o_lo_or_None, q_positions_or_None, attn_sink_or_None,
    max_logits_or_None, scale_log2, num_ctas)``.
    """
    dtype = TORCH_TO_CUTE[dtype_name]
    kernel = SparseMlaFwdSm90(dtype, d_qk, d_v, rescale_threshold, has_o_lo, has_topk_length,
                              has_positions, has_sink, has_max_logits)
    x = fake_inputs(dtype, d_qk, has_topk_length, has_positions)
    fake = cute.runtime.make_fake_compact_tensor
    out = fake(dtype, (x.n_tok, x.n_head, d_v), stride_order=(2, 1, 0), assumed_align=16)
    o_lo = (fake(dtype, (x.n_tok, x.n_head, d_v), stride_order=(2, 1, 0), assumed_align=16)
            if has_o_lo else None)
    sink = fake(Float32, (x.n_head,), assumed_align=4) if has_sink else None
    max_logits = (fake(Float32, (x.n_tok, x.n_head), stride_order=(1, 0), assumed_align=4)
                  if has_max_logits else None)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, x.q, x.kv, x.indices, x.topk_length, out, x.lse, o_lo,
                        x.q_positions, sink, max_logits, Float32(1.0), Int32(1), stream,
                        options="--enable-tvm-ffi")
