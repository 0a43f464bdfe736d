"""The lightning indexer's scores of every key for Hopper (SM90a), written in CuTe DSL.

Computes, for the flattened rows ``r = b * T + t`` of one chunk ``[r0, r1)`` and every key ``s``
the row may see (the op :mod:`mla_inductor.ops.lightning_indexer`)::

    buf[r - r0, s] = sum_h weights[b, t, h] * relu(q[b, t, h, :] . k[b, s, :])      (fp32)

(in fp8, ``relu((q[b, t, h, :] . k[b, s, :]) * q_scale[b, t, h] * k_scale[b, s])``: the section
"fp8" below) into a bounded buffer ``buf [r1 - r0, ld]`` that the top-k select (:mod:`.topk`)
reads. Entries at ``s >= row_len[r]`` are unspecified (the select never reads them); keys past
the chunk's visible range in whole 64-key blocks are not computed at all.

Design (decisions, in the order they were taken)
-------------------------------------------------
* The TRANSPOSED product ``S^T = K Q^T``: wgmma M = 64 keys (A operand: one key block, 64
  contiguous rows of K, K-major, 128-byte swizzle), N = 256 = ``tokens x head_tile`` (B operand:
  the Q rows of several tokens, padded heads zero-filled, K-major, loaded once per CTA and kept
  stationary), K-dim = D = 128 (8 k-steps of m64n256k16). The head sum then runs along the
  accumulator's N, inside the thread and its quad, and every key block streamed in feeds 256
  columns: 256 FLOP per byte of K read from L2. ``head_tile`` is 64 (33..64 heads: 4 tokens),
  32 (17..32: 8 tokens) or 16 (1..16: 16 tokens), so N is always 256.
* Shared memory: Q 64 KiB, a ring of 8 key blocks of 16 KiB (each block two 64-column swizzle
  chunks, one full / empty mbarrier pair per block), the tile's weights (1 KiB, permuted so that
  each thread's weights of one token are contiguous and load as 16-byte vectors; the four quad
  lanes' rows padded by 16 bytes, so that the 8 lanes of a quarter warp read 4 different bank
  groups: unpadded, the four rows fell on the same banks and these loads took 4x their ideal
  shared-memory wavefronts, more than the wgmmas' operand reads).
* Each consumer thread reads its 64 weights (``tokens x w_per_token``) from shared memory once,
  into registers, and keeps them for every key block. Re-read per block they were 32 KiB of
  shared-memory reads per block next to the wgmmas' 80 KiB (A 16 KiB, B 64 KiB) and the ring's
  16 KiB of writes: 128 KiB per block against the 128 bytes a clock the SM's shared memory
  serves, the same 1024 clocks as the block's MMAs at the dense rate. 128 accumulator and 64
  weight registers fit the consumers' 232 without spills. Measured against the per-block reads
  in the same process (H200, 2026-12-03, interleaved, bf16, H 64, causal, S = T): 3.81 -> 3.75
  ms at T 16384, 15.23 -> 15.02 at 32768, 61.34 -> 59.99 at 65536 (1.4-2.2%), bitwise the same
  scores on five shapes.
* Warp specialisation, 3 warpgroups (384 threads), registers 40 / 232 / 232 (``setmaxnreg``):
  - WG0, producer: Q and the weights (``cp.async``, zero-filled for padded heads and tokens past
    the chunk, one mbarrier), then the CTA's key blocks in order with 16-byte ``cp.async.cg``
    (L2 evict_last: every token tile reads the same keys; 16 threads per 256-byte key row, so the
    reads are whole rows); keys ``>= S`` are zero-filled without a read. A thread's rows of a
    block are fixed byte strides from its first row (same swizzle: row % 8 does not change), so
    a block costs the producer one 64-bit add and its copies, and the per-row bounds check runs
    only in a block that reaches past S. Against a per-row address and check (H100,
    2026-12-06, same process, bitwise the same scores): 0.96-0.97x the op's time at T 16384 and
    32768 in fp8, 0.97x at 16384 in bf16, 1.02x at 65536 in fp8.
  - WG1 and WG2, consumers, ping-pong on key blocks (WG1 the even ones, WG2 the odd), so the
    MMAs of one block run while the other consumer does its epilogue. Two named barriers hand
    the tensor cores over (a consumer issues its block's 8 wgmmas only after the other has
    issued its previous block's), so that the two cannot fall into phase; measured, the
    hand-over made no difference at T = S = 16384, nor did 4 stages instead of 8 (2026-12-02,
    before the weights were padded).
* Epilogue per block and thread (2 key rows x 64 columns of the accumulator): ``relu`` (NaN
  propagating: ``max.NaN``, so a diverged indexer shows in the scores), times the column's
  weight (FMA), summed over the thread's columns of each token (16 per token at head_tile 64),
  then a REDUCE-SCATTER over the quad (2 butterfly steps exchanging half of the remaining
  partial sums: 1.5 x tokens shuffles instead of 4 x tokens for an all-reduce), after which lane
  ``q`` of a quad holds tokens ``[q tokens / 4, (q + 1) tokens / 4)`` of its 2 key rows. A warp's
  store instruction writes 8 consecutive keys of 4 token rows: whole 32-byte sectors.
* Causal (``row_len`` given): a CTA computes only the key blocks below the largest ``row_len``
  of its tokens; the boundary block's scores past a row's own ``row_len`` are the real products
  (no mask), which the select never reads. The token tiles are walked last-first, so that with
  the usual increasing positions the longest rows start first (less tail at the end of a chunk).
* Key splits (grid y): when a chunk has too few token tiles to fill the GPU, the key blocks are
  split into contiguous ranges, one CTA each (the launcher's choice; 1 for long chunks).
* Long inputs: q and k addresses are formed in 64 bits (``(b T + t) H D`` and ``b S D`` may pass
  2**31); the buffer's offsets stay below 2**31 elements (the launcher checks).
* One compiled kernel serves every B, T, H <= head_tile, S, chunk and ``ld`` (symbolic); the
  compile key is (dtype, head_tile, causal).

fp8 (float8_e4m3fn q and k, float32 q_scale and k_scale)
--------------------------------------------------------
The fp8 form of the score (DeepSeek-V3.2-Exp's inference code quantises the indexer's q and k
to e4m3 with one scale per row; DeepGEMM's fp8 MQA logits kernel scores them), compiled from
the same class with the dtype as its static switch: the bf16 / fp16 kernels' PTX is unchanged
(every fp8 step is a ``const_expr`` branch, and the scales are the last tensor arguments, None
there).

* wgmma e4m3 x e4m3 with fp32 accumulation: fp8 wgmma takes both operands K-major
  from shared memory, which the transposed product already has (K rows and Q rows are both
  D-contiguous), so A = the key block, B = the tile's Q rows as in bf16. A 128-byte row of
  D = 128 one-byte elements is one 128-byte swizzle atom (bf16: two 64-column chunks), and the
  K-dim is 4 k-steps of 32. The producer loads a row with 8 threads of 16 bytes (16 rows per
  pass instead of 8), to the same swizzled byte offsets.
* Each block's product in two pieces of 128 columns (m64n128k32; each piece half of the tile's
  tokens; Q's shared memory seen as two tiles of 128 rows, the same bytes), one accumulator
  each (128 registers in all, as for one of 256 columns). A consumer issues both pieces, waits
  for the first and sums its columns (relu and FMA, the fast order) while the second's MMAs
  run; then the second piece, the quad reduction and the stores. With one accumulator of 256
  columns a consumer waited for all its MMAs before its epilogue: ncu (H100, 2026-12-06, T
  16384) found the consumers waiting on their own wgmma for a third of their time, the tensor
  pipe 45% busy and the ALU pipe 40% (fp8 MMAs take half as long as bf16's; the epilogue takes
  as long). The per-element sums, their order and the reduction are unchanged: the scores are
  bitwise those of one piece of 256 columns (H100, 2026-12-06, H 64 / 50 / 32 / 16 / 7, causal
  or not, with and without negative and NaN scales), and the op took 0.88-0.96x its time at T
  16384-65536 (``docs/performance.md``). Four pieces of 64 columns (m64n64k32) were bitwise the
  same and slower than two (1.01-1.09x their time).
* Shared memory: Q 32 KiB and key blocks of 8 KiB, so the same 8-block ring takes 64 KiB and
  the CTA about 102 KiB instead of 195 KiB. The ring was kept at 8 blocks (the bf16 kernel
  measured no difference between 4 and 8); a CTA still needs the whole register file (384
  threads x 168), so the freed shared memory buys no second CTA per SM.
* The scales: the definition applies them BEFORE the relu, ``relu((acc * q_scale[column]) *
  k_scale[row])``, then the column's weight as in bf16. For finite scales >= 0 (every scale
  ``quantize_fp8`` makes) that is ``k_scale[row] * (w * q_scale)[column] * relu(acc)``, so each
  consumer thread multiplies its 64 register weights by their q_scale once per CTA and, per
  block, runs the bf16 epilogue (a ``max.NaN`` and an FMA per accumulator) and one multiply by
  k_scale per row and token. Where one of the thread's q_scales or one of its two rows' k_scales
  is negative, infinite or NaN, that block's epilogue of the thread takes the definition's order
  instead, with w and q_scale read from shared memory (``max.NaN``: a NaN in q, k or a scale
  shows in the scores). Both epilogues run to the stores inside their branch, so no value
  crosses it (an array of partial sums written in both branches went to local memory). The
  folded order took the scores from 0.88-0.96x cuDNN frontend's fp8 pair to the figures in
  docs/performance.md.
* The linear term (head tile 64, i.e. 33 to 64 heads: the fast epilogue's work halved). With
  ``relu(x) = (x + |x|) / 2`` the folded score is ``k_scale / 2 * (sum_h wq_h |x_h| + sum_h
  wq_h x_h)``, ``wq = w * q_scale``. The first sum is one FMA per accumulator (``|x|`` is an
  operand modifier of the FMA, where relu was a ``max`` on the ALU pipe and the FMA); the second
  is linear in q: ``sum_h wq_h (q_h . k) = u . k`` with ``u = sum_h wq_h q_h``, a 128-float
  query per token, so the tensor cores compute it as extra columns. Once per CTA the consumers
  form each token's ``u`` in float32 and split it into 4 e4m3 rows, ``u ~ sum_j 2**e_j a_j``:
  ``2**e_0`` puts ``max |u|`` in [128, 256), each later row rounds the residual of those before
  it at ``e_{j+1} = e_j - 5`` (a residual is at most half an e4m3 step at 256, 8 * 2**e_j), so
  every scaling and residual is exact, no row saturates, and the four leave at most 2**-19 of
  ``max |u|`` (one maximum per token, not one per piece).
  The 16 rows (4 tokens x 4) follow the second piece's 128 head rows in shared memory, so the
  second piece is m64n144k32: the key block is read once for both, and the extra columns cost
  1/16 of the MMAs. Their columns ``128 + 8 (j // 2) + 2 tok + j % 2`` are accumulator values of
  quad lane ``tok``, the lane that holds token ``tok``'s score after the reduce-scatter, so the
  linear term joins each score without a shuffle. The accuracy against the definition: the
  pieces' residual adds at most 2**-19 of ``max |u| sum |k|``, and the final sum of the two
  halves rounds at 2**-24 of ``sum_h |wq_h x_h|``. On random inputs the first is far below
  ``sum_h |wq_h| (|q_h| . |k|)`` (the GPU tests' bound) and the fp8 MMA's own accumulation error
  (below); it is not bounded by it: with head weights 2**24 apart, the heads' q on disjoint
  dimensions and keys only on the small heads' dimensions (a constructed case, evaluated on the
  CPU) it reached 1.6e-2 of that bound. The fast path is chosen per quad (the quad's lanes share
  their key rows and hold all the tile's q_scales between them), since its partial sums are not
  the definition's and cannot meet them in the reduction; a tile also takes the definition's
  order where a token's ``u`` is not finite (an infinite weight; the split would make every
  score of the token NaN, where the definition gives +inf for a positive dot) or has a nonzero
  ``max |u|`` so small that a piece's scale falls below float32's normal range (scale -1). The
  scores are not bitwise those of the relu epilogue; they are as deterministic.
* k_scale is one float per key row: the producer copies the block's 64 with ``cp.async`` next to
  the block (zero for keys ``>= S``, which are never stored) into a ring of 64 floats per stage,
  published by the block's full barrier; each consumer thread reads its two rows' scales before
  it releases the stage. q_scale is one float per accumulator column: the producer copies the
  tile's with the weights, in the weights' permuted, padded layout (zero for padded heads and
  tokens).
* A padded head's column is ``(0 * 0) * k_scale``: a key whose k_scale is infinite or NaN
  scores NaN when H is below the head tile (16, 32, 64). With finite scales the padded columns
  add exactly 0, as in bf16.
* Accuracy: Hopper's fp8 wgmma keeps about 14 bits of the running sum (DeepSeek-V3 report,
  section 3.3.2). On an H100 (2026-12-06, T 4096) the scores were off float64 by 3.0e-5 of
  ``sum_h |w| |q_scale k_scale| (|q| . |k|)`` at 64 heads (with the linear term; 2.2e-5 with the
  relu epilogue, where a negative dot's MMA error was dropped), and 3.2e-5 at 32 heads; cuDNN
  frontend's fp8 indexer on the same inputs, 2.2e-5 and 3.2e-5. The GPU tests hold it to 2**-13
  of that bound.

Measured (H200, torch 2.11, CUDA 13.0, nvidia-cutlass-dsl 4.8.1, 2026-12-03; CUDA events,
medians of 3 interleaved rounds; bf16, H 64, D 128, S = T, causal, TFLOPS on the causal FLOPs
``T S / 2 H D 2``; a dense bf16 matmul 16384 x 8192 x 8192 in the same process; T 32768 in 4
chunks of 8192 rows, the 1 GiB buffer):

=======  =====================  ==============================  ============
T        these scores           the same without the padding    matmul
=======  =====================  ==============================  ============
16384    3.51 ms (627 TF)       5.05 ms (436 TF)                749 TF
32768    15.24 ms (577 TF)      19.23 ms (457 TF)               771 TF
=======  =====================  ==============================  ============

Unpadded, ncu counted 539 M shared-memory wavefronts for the weight loads against 135 M ideal
(T 16384), next to the wgmmas' 337 M, with the L1 / shared pipe 86% busy and the tensor pipe 50%.
cuDNN frontend 1.32's ``indexer_forward_wrapper`` (dense ``[T, S]`` fp32 scores) took 4.81 ms at
T 16384 and 20.28 ms at 32768 (2026-12-02, the same bench).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import BFloat16, Float8E4M3FN, Float16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from .host import LIGHTNING_D as D
from .host import LIGHTNING_HEAD_TILES as HEAD_TILES
from .host import LIGHTNING_TILE_N as TILE_N
from .common import SWIZZLE_CHUNK_ROWS, TORCH_TO_CUTE, sw128_offset_bytes
from .ptx import (cp_async_4, cp_async_16, cp_async_wait_all, create_policy, e4m3x2_from_f32,
                  f32_bits, f32_from_bits, f32_from_e4m3, ld_shared_b32, max_nan, relu_nan,
                  st_shared_u16)

TILE_KEYS = 64  # keys per block (wgmma M)
STAGES = 8  # key blocks in the ring
NUM_THREADS = 384
REGS_PRODUCER, REGS_CONSUMER = 40, 232  # 40 + 2 x 232 = 3 x 168 (the launch allocation)
W_PAD = 4  # floats of padding after each quad lane's row of weights (bank groups)
BAR_TURN = 1  # named barriers BAR_TURN + role: "consumer `role` may issue its next block"
BAR_CONSUMERS = 3  # named barrier of the two consumer warpgroups (the linear term's set-up)
LIN_PIECES = 4  # float8 pieces of a token's linear-term query (section "fp8" of the docstring)
DTYPES = {**TORCH_TO_CUTE, "float8_e4m3fn": Float8E4M3FN}


@cute.jit
def _finite_nonneg(x: Float32):
    """``0 <= x <= FLT_MAX`` (false for NaN)."""
    return (x >= Float32(0.0)) & (x <= Float32(3.4028234663852886e38))


class LightningScoresSm90:
    """Compile-time configuration of one score kernel (see the module docstring)."""

    def __init__(self, dtype, head_tile: int, causal: bool):
        if dtype not in (BFloat16, Float16, Float8E4M3FN):
            raise TypeError(f"lightning_indexer: sm90 scores support bf16/fp16 and "
                            f"float8_e4m3fn, got {dtype}")
        if head_tile not in HEAD_TILES:
            raise ValueError(f"lightning_indexer: sm90 scores need a head tile in {HEAD_TILES}, "
                             f"got {head_tile}")
        self.dtype = dtype
        self.head_tile = head_tile
        self.tokens = TILE_N // head_tile  # tokens per CTA
        self.w_per_token = TILE_N // 4 // self.tokens  # weights of one token per thread
        self.causal = causal
        self.fp8 = dtype is Float8E4M3FN  # q_scale per column, k_scale per key row
        eb = dtype.width // 8  # bytes per element
        self.elem_bytes = eb
        self.chunk = 128 // eb  # columns of one 128-byte swizzle atom: 64 (2 bytes), 128 (fp8)
        self.n_chunks = D // self.chunk  # swizzle chunks per row: 2, or 1 in fp8
        self.mma_k = 32 // eb  # wgmma K: 16, or 32 in fp8
        self.row_vecs = D * eb // 16  # 16-byte vectors per row of Q or K: 16, or 8 in fp8
        self.rows_per_pass = NUM_THREADS // 3 // self.row_vecs  # rows one producer pass loads
        self.q_bytes = TILE_N * D * eb
        # fp8: each block's product in two pieces of columns (one accumulator each), so that a
        # consumer's epilogue of the first runs while the second's MMAs do
        self.parts = 2 if self.fp8 else 1
        self.mma_n = TILE_N // self.parts
        self.tokens_per_part = self.tokens // self.parts
        # fp8 at 64 heads: relu(x) = (x + |x|) / 2, the linear half on the tensor cores as
        # LIN_PIECES extra columns per token after the second piece's head columns
        self.linear = self.fp8 and self.tokens == 4
        self.lin_cols = self.tokens * LIN_PIECES if self.linear else 0
        self.block_bytes = TILE_KEYS * D * eb

    def _layouts(self):
        atom = warpgroup.make_smem_layout_atom(
            sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, self.chunk),
            self.dtype,
        )
        sQ2 = None
        if self.linear:  # the two pieces apart: the second has the linear term's rows too
            sQ = cute.tile_to_shape(atom, (self.mma_n, D), order=(0, 1))
            sQ2 = cute.tile_to_shape(atom, (self.mma_n + self.lin_cols, D), order=(0, 1))
        elif self.parts > 1:  # pieces of mma_n rows (the same bytes as 256 rows)
            sQ = cute.tile_to_shape(atom, (self.mma_n, D, self.parts), order=(0, 1, 2))
        else:
            sQ = cute.tile_to_shape(atom, (TILE_N, D), order=(0, 1))
        sK = cute.tile_to_shape(atom, (TILE_KEYS, self.chunk, self.n_chunks * STAGES),
                                order=(0, 1, 2))
        return sQ, sQ2, sK

    def _smem_bytes(self):
        # Q, the ring, the weights, 2 x STAGES + 1 mbarriers, alignment slack; in fp8 also the
        # tile's q_scale (the weights' layout) and the ring's k_scale (one float per key)
        columns = 4 * (TILE_N // 4 + W_PAD) * 4
        scales = columns + STAGES * TILE_KEYS * 4 if self.fp8 else 0
        # the linear term: its rows of Q (and the second tile's alignment), each consumer
        # warp's maximum of |u| and the tokens' piece scales
        linear = (self.lin_cols * D + 1024 + 8 * 4 + self.tokens * LIN_PIECES * 4
                  if self.linear else 0)
        return (self.q_bytes + STAGES * self.block_bytes + columns
                + (2 * STAGES + 1) * 8 + 2048 + scales + linear)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B T, H, D]
        mK: cute.Tensor,  # [B S, D]
        mW: cute.Tensor,  # [B T, H] fp32
        mRowLen: cute.Tensor | None,  # [B T] int32 (causal only)
        mBuf: cute.Tensor,  # [rows of the chunk, ld] fp32
        mQScale: cute.Tensor | None,  # [B T, H] fp32 (fp8 only)
        mKScale: cute.Tensor | None,  # [B S] fp32 (fp8 only)
        seq_q: Int32,  # T
        seq_k: Int32,  # S
        b0: Int32,  # first batch element of the chunk
        t0: Int32,  # first token of the chunk in each of its batch elements
        n_tok: Int32,  # tokens of the chunk per batch element
        n_batch: Int32,  # batch elements of the chunk
        n_splits: Int32,  # key ranges per token tile
        blocks_per_split: Int32,
        stream,
    ):
        sQ_layout, sQ2_layout, sK_layout = self._layouts()
        tiled_mma = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_KEYS, self.mma_n),
        )
        tiled_mma2 = None
        if const_expr(self.linear):
            tiled_mma2 = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, warpgroup.OperandMajorMode.K,
                warpgroup.OperandMajorMode.K, Float32, atom_layout_mnk=(1, 1, 1),
                tiler_mn=(TILE_KEYS, self.mma_n + self.lin_cols),
            )
        n_tiles = (n_tok + self.tokens - 1) // self.tokens
        self.kernel(mQ, mK, mW, mRowLen, mBuf, mQScale, mKScale, seq_q, seq_k, b0, t0, n_tok,
                    blocks_per_split, sQ_layout, sQ2_layout, sK_layout, tiled_mma,
                    tiled_mma2).launch(
            grid=[n_tiles, n_splits, n_batch],
            block=[NUM_THREADS, 1, 1],
            smem=self._smem_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mW: cute.Tensor,
        mRowLen: cute.Tensor | None,
        mBuf: cute.Tensor,
        mQScale: cute.Tensor | None,
        mKScale: cute.Tensor | None,
        seq_q: Int32,
        seq_k: Int32,
        b0: Int32,
        t0: Int32,
        n_tok: Int32,
        blocks_per_split: Int32,
        sQ_layout: cute.ComposedLayout,
        sQ2_layout: cute.ComposedLayout | None,
        sK_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        tiled_mma2: cute.TiledMma | None,
    ):
        """Device entry: one CTA per (token tile, key range, batch element of the chunk)."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, split, bz = cute.arch.block_idx()
        n_tiles_x, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4
        num_heads = mQ.shape[1]
        tokens = self.tokens

        tile = bx
        if const_expr(self.causal):
            tile = n_tiles_x - 1 - bx  # the longest rows first
        b = b0 + bz
        tok0 = t0 + tile * tokens  # first token of the tile (in batch element b)
        tok_end = cutlass.min(t0 + n_tok, tok0 + tokens)
        row_base = b * seq_q  # flattened row of token 0 of b
        n_keys = seq_k
        if const_expr(self.causal):
            n_keys = Int32(0)
            for j in cutlass.range_constexpr(tokens):
                if tok0 + j < tok_end:
                    n_keys = cutlass.max(n_keys, mRowLen[row_base + tok0 + j])
            n_keys = cutlass.min(n_keys, seq_k)
        n_kb = (n_keys + TILE_KEYS - 1) // TILE_KEYS
        kb0 = split * blocks_per_split
        n_blocks = cutlass.min(kb0 + blocks_per_split, n_kb) - kb0

        if n_blocks > 0:
            smem = cutlass.memory.SmemAllocator()
            sQ = smem.allocate_tensor(self.dtype, sQ_layout.outer, 1024, swizzle=sQ_layout.inner)
            sQ2 = None
            if const_expr(self.linear):
                sQ2 = smem.allocate_tensor(self.dtype, sQ2_layout.outer, 1024,
                                           swizzle=sQ2_layout.inner)
            sK = smem.allocate_tensor(self.dtype, sK_layout.outer, 1024, swizzle=sK_layout.inner)
            # weights, [quad lane q, token, k]: column 8 (k' // 2) + 2 q + k' % 2 of the
            # accumulator, k' = token * w_per_token + k (the thread's k'-th column)
            sW = smem.allocate_tensor(
                Float32,
                cute.make_layout((4, tokens, self.w_per_token),
                                 stride=(TILE_N // 4 + W_PAD, self.w_per_token, 1)),
                16,
            )
            mbar = smem.allocate_array(Int64, 2 * STAGES + 1)
            sQs, sKs = None, None
            if const_expr(self.fp8):
                sQs = smem.allocate_tensor(Float32, sW.layout, 16)  # q_scale, as the weights
                sKs = smem.allocate_tensor(Float32, cute.make_layout((TILE_KEYS, STAGES)), 16)
            sRed, sLinScale = None, None
            if const_expr(self.linear):  # each consumer warp's max |u|; each token's piece scales
                sRed = smem.allocate_tensor(Float32, cute.make_layout((8,)), 16)
                sLinScale = smem.allocate_tensor(
                    Float32, cute.make_layout((LIN_PIECES, self.tokens)), 16)
            mbar_full = mbar
            mbar_empty = mbar + STAGES
            mbar_q = mbar + 2 * STAGES

            if tidx == 0:
                for s in cutlass.range_constexpr(STAGES):
                    cute.arch.mbarrier_init(mbar_full + s, 128)
                    cute.arch.mbarrier_init(mbar_empty + s, 128)
                cute.arch.mbarrier_init(mbar_q, 128)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

            if wg == 0:
                # ================= producer: cp.async loads =================
                cute.arch.setmaxregister_decrease(REGS_PRODUCER)
                v = tidx % self.row_vecs  # 16-byte vector of a row (256 bytes, fp8 128)
                half = v // 8  # its swizzle chunk (0 in fp8)
                vec = v % 8
                rsub = tidx // self.row_vecs  # 0..7 (fp8 0..15)
                sQ_addr = sQ.iterator.toint()
                sK_addr = sK.iterator.toint()
                sW_addr = sW.iterator.toint()
                q_base = mQ.iterator.toint()
                k_base = mK.iterator.toint()
                w_base = mW.iterator.toint()
                keep = create_policy(True)  # keys: read by every token tile
                once = create_policy(False)  # Q: read once
                eb = self.elem_bytes
                for p in cutlass.range_constexpr(TILE_N // self.rows_per_pass):
                    n = p * self.rows_per_pass + rsub
                    t = tok0 + n // self.head_tile
                    h = n % self.head_tile
                    ok = (h < num_heads) & (t < tok_end)
                    src = cutlass.select_(
                        ok, q_base + ((Int64(row_base + t) * num_heads + h) * D + v * (16 // eb))
                        * eb, q_base)
                    dst = sQ_addr + sw128_offset_bytes(n, vec, 0)
                    # (rows_per_pass divides mma_n: a pass's rows are all in one piece)
                    if const_expr(self.linear and p * self.rows_per_pass >= self.mma_n):
                        dst = sQ2.iterator.toint() + sw128_offset_bytes(n - self.mma_n, vec, 0)
                    if const_expr(self.n_chunks > 1):
                        dst = dst + half * (TILE_N * 128)
                    cp_async_16(dst, src, cutlass.select_(ok, Int32(16), Int32(0)), once)
                for p in cutlass.range_constexpr(TILE_N // 128):
                    e = p * 128 + tidx  # (q, k') = (e // 64, e % 64)
                    k = e % (TILE_N // 4)
                    col = 8 * (k // 2) + 2 * (e // (TILE_N // 4)) + k % 2
                    t = tok0 + col // self.head_tile
                    h = col % self.head_tile
                    ok = (h < num_heads) & (t < tok_end)
                    src = cutlass.select_(ok, w_base + (Int64(row_base + t) * num_heads + h) * 4,
                                          w_base)
                    padded = e + e // (TILE_N // 4) * W_PAD  # (q, k') in the padded rows
                    cp_async_4(sW_addr + padded * 4, src, cutlass.select_(ok, Int32(4), Int32(0)))
                    if const_expr(self.fp8):  # q_scale in the weights' layout, zero-filled
                        qs_base = mQScale.iterator.toint()
                        src = cutlass.select_(
                            ok, qs_base + (Int64(row_base + t) * num_heads + h) * 4, qs_base)
                        cp_async_4(sQs.iterator.toint() + padded * 4, src,
                                   cutlass.select_(ok, Int32(4), Int32(0)))
                cute.arch.cp_async_mbarrier_arrive_noinc(mbar_q)

                k_batch = Int64(b) * seq_k
                # the thread's row rsub of the range's first block, and its 16-byte vector: the
                # other rows of a pass and a block are fixed byte strides away (a row's swizzle
                # depends on row % 8, the same for all of them)
                k_src0 = k_base + ((k_batch + kb0 * TILE_KEYS + rsub) * D + v * (16 // eb)) * eb
                k_dst0 = sK_addr + sw128_offset_bytes(rsub, vec, half)
                pass_src = self.rows_per_pass * D * eb
                pass_dst = self.rows_per_pass * 128
                for i in cutlass.range(n_blocks, unroll=1):
                    s = i % STAGES
                    cute.arch.mbarrier_wait(mbar_empty + s, ((i // STAGES) & 1) ^ 1)
                    key0 = (kb0 + i) * TILE_KEYS
                    src = k_src0 + Int64(i) * self.block_bytes
                    dst = k_dst0 + s * (self.n_chunks * SWIZZLE_CHUNK_ROWS * 128)
                    if key0 + TILE_KEYS <= seq_k:  # every row of the block is a key
                        for p in cutlass.range_constexpr(TILE_KEYS // self.rows_per_pass):
                            cp_async_16(dst + p * pass_dst, src + p * pass_src, Int32(16), keep)
                    else:  # rows >= S zero-filled, nothing read
                        for p in cutlass.range_constexpr(TILE_KEYS // self.rows_per_pass):
                            ok = key0 + p * self.rows_per_pass + rsub < seq_k
                            cp_async_16(dst + p * pass_dst,
                                        cutlass.select_(ok, src + p * pass_src, k_base),
                                        cutlass.select_(ok, Int32(16), Int32(0)), keep)
                    if const_expr(self.fp8):  # the block's k_scale, zero-filled past S
                        if tidx < TILE_KEYS:
                            key = key0 + tidx
                            ok = key < seq_k
                            ks_base = mKScale.iterator.toint()
                            src = cutlass.select_(ok, ks_base + (k_batch + key) * 4, ks_base)
                            cp_async_4(sKs.iterator.toint() + (s * TILE_KEYS + tidx) * 4, src,
                                       cutlass.select_(ok, Int32(4), Int32(0)))
                    cute.arch.cp_async_mbarrier_arrive_noinc(mbar_full + s)
                cp_async_wait_all()

            else:
                # ================= consumers: even blocks (WG1), odd blocks (WG2) ============
                cute.arch.setmaxregister_increase(REGS_CONSUMER)
                role = wg - 1
                ct = tidx % 128
                lane = ct % 32
                quad = lane % 4
                thr = tiled_mma.get_slice(ct)
                tSrK = thr.make_fragment_A(thr.partition_A(sK))
                tSrQ = thr.make_fragment_B(thr.partition_B(sQ))
                # one accumulator per piece of columns (fp8: two, 128 registers in all; with
                # the linear term 136)
                accs = [cute.make_rmem_tensor(thr.partition_shape_C((TILE_KEYS, self.mma_n)),
                                              Float32) for _ in range(self.parts)]
                pieces = None  # (tiled MMA, A fragment, B fragment) per piece
                if const_expr(self.linear):
                    thr2 = tiled_mma2.get_slice(ct)
                    n2 = self.mma_n + self.lin_cols
                    accs[1] = cute.make_rmem_tensor(thr2.partition_shape_C((TILE_KEYS, n2)),
                                                    Float32)
                    pieces = [(tiled_mma, tSrK, tSrQ),
                              (tiled_mma2, thr2.make_fragment_A(thr2.partition_A(sK)),
                               thr2.make_fragment_B(thr2.partition_B(sQ2)))]
                elif const_expr(self.parts > 1):
                    pieces = [(tiled_mma, tSrK, tSrQ[None, None, None, h])
                              for h in range(self.parts)]
                tScS = thr.partition_C(cute.make_identity_tensor((TILE_KEYS, self.mma_n)))
                rows = (tScS[0][0], tScS[2][0])  # this thread's two key rows of a block
                # the thread's weights, the same for every key block: read once into registers
                wr = cute.make_rmem_tensor((self.tokens, self.w_per_token), Float32)

                cute.arch.mbarrier_wait(mbar_q, 0)
                for tok in cutlass.range_constexpr(tokens):
                    wr[tok, None].store(sW[quad, tok, None].load())
                q_fast = None
                if const_expr(self.fp8):  # wr = w * q_scale: the fast epilogue's weights
                    qv = cute.make_rmem_tensor((self.w_per_token,), Float32)
                    for tok in cutlass.range_constexpr(tokens):
                        qv.store(sQs[quad, tok, None].load())
                        for kk in cutlass.range_constexpr(self.w_per_token):
                            ok = _finite_nonneg(qv[kk])
                            q_fast = ok if q_fast is None else q_fast & ok
                            wr[tok, kk] = wr[tok, kk] * qv[kk]
                lin_scale = None
                if const_expr(self.linear):
                    # the quad shares its rows and holds all the tile's columns: one path for it
                    fast = cutlass.select_(q_fast, Int32(1), Int32(0))
                    fast = fast & cute.arch.shuffle_sync_bfly(fast, offset=1)
                    fast = fast & cute.arch.shuffle_sync_bfly(fast, offset=2)
                    self._linear_rows(sQ, sQ2, sW, sQs, sRed, sLinScale, tidx - 128)
                    # after the reduce-scatter, quad lane q holds token q: its pieces' scales
                    lin_scale = [sLinScale[j, quad] for j in range(LIN_PIECES)]
                    # a token whose u is not finite (an infinite weight) or too small for
                    # float32's normal range has a scale that is NaN or -1: definition's order
                    for t in cutlass.range_constexpr(tokens):
                        for j in cutlass.range_constexpr(LIN_PIECES):
                            fast = fast & cutlass.select_(_finite_nonneg(sLinScale[j, t]),
                                                          Int32(1), Int32(0))
                    q_fast = fast != 0
                for i in cutlass.range(role, n_blocks, 2, unroll=1):
                    s = i % STAGES
                    cute.arch.mbarrier_wait(mbar_full + s, (i // STAGES) & 1)
                    if i > 0:  # the other consumer has issued block i - 1
                        cute.arch.barrier(barrier_id=BAR_TURN + role, number_of_threads=256)
                    cute.arch.fence_view_async_shared()  # cp.async (generic proxy) -> wgmma
                    warpgroup.fence()
                    if const_expr(self.parts > 1):
                        for h in cutlass.range_constexpr(self.parts):
                            self._mma(pieces[h][0], accs[h], pieces[h][1], pieces[h][2], s)
                    else:
                        self._mma(tiled_mma, accs[0], tSrK, tSrQ, s)
                    if i + 1 < n_blocks:  # the other consumer may issue block i + 1
                        cute.arch.barrier_arrive(barrier_id=BAR_TURN + 1 - role,
                                                 number_of_threads=256)
                    store = (mBuf, rows, lane, (kb0 + i) * TILE_KEYS, tok0, tok_end, t0,
                             bz * n_tok, seq_k, quad)
                    if const_expr(self.fp8):
                        # the k_scale of this thread's two key rows; each piece's sums (fast
                        # order) while the later pieces' MMAs run
                        ks = (sKs[rows[0], s], sKs[rows[1], s])
                        tp = self.tokens_per_part
                        early = []
                        for h in cutlass.range_constexpr(self.parts - 1):
                            warpgroup.wait_group(self.parts - 1 - h)
                            early.append(self._sums(accs[h], wr, None, None,
                                                    None if self.linear else ks, quad, h * tp,
                                                    tp))
                        warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(mbar_empty + s)
                        self._store_fp8(accs, early, wr, sW, sQs, ks, q_fast, quad, store,
                                        lin_scale)
                    else:
                        warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(mbar_empty + s)
                        self._reduce_and_store(self._sums(accs[0], wr, None, None, None, quad),
                                               *store)

    @cute.jit
    def _mma(self, tiled_mma, acc, tSrK, tSrQ, s):
        """Issues and commits ``acc = K[stage s] Q^T`` (the K-dim in its wgmma steps)."""
        steps_per_chunk = self.chunk // self.mma_k
        mma = cute.make_mma_atom(tiled_mma.op)
        mma.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(D // self.mma_k):
            cute.gemm(mma, acc, tSrK[None, None, k % steps_per_chunk,
                                     self.n_chunks * s + k // steps_per_chunk],
                      tSrQ[None, None, k], acc)
            mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _linear_rows(self, sQ, sQ2, sW, sQs, sRed, sLinScale, ct):
        """The linear term's rows of Q (run by the 256 consumer threads, ``ct`` 0..255, once
        per CTA): for each token of the tile ``u = sum_h (w * q_scale)[h] q[h, :]`` in float32
        (q's float8 values exactly), split into LIN_PIECES float8 rows ``u ~ sum_j 2**e_j a_j``
        with ``2**e_0`` the power of two that puts ``max |u|`` in [128, 256) and ``e_{j+1} =
        e_j - 5``: piece j rounds the residual of those before it (at most 8 * 2**e_j, half an
        e4m3 step at 256), so every scaling and residual is exact, no piece saturates, and the
        four leave at most 2**-19 of ``max |u|``. The rows go to the second piece's tile after
        its head rows: token ``tok``'s piece ``j`` at row ``mma_n + 8 (j // 2) + 2 tok + j % 2``,
        the accumulator columns that quad lane ``tok`` holds; ``2**e_j`` goes to
        ``sLinScale[j, tok]``: 0 where it would be below float32's normal range and ``max |u|``
        is 0, -1 there for a nonzero ``max |u|`` and NaN for a non-finite ``u`` (the last two
        send the tile to the definition's order). A pair of threads sums 4 dimensions of one
        token, each over half of the heads; then each of the pair splits 2 of them."""
        tok = ct // (D // 2)
        quad4 = (ct % (D // 2)) // 2  # the pair's 4 dimensions: bytes 4 quad4 .. + 3 of a row
        half = ct % 2  # heads [half * head_tile / 2, ...)
        vec, inb = quad4 // 4, (quad4 % 4) * 4
        nh = self.head_tile // 2
        u = [Float32(0.0)] * 4
        for hh in cutlass.range_constexpr(nh):
            h = half * nh + hh
            n = tok * self.head_tile + h  # the tile's Q row (heads of a token are contiguous)
            base = cutlass.select_(n < self.mma_n, sQ.iterator.toint(),
                                   sQ2.iterator.toint() - self.mma_n * 128)
            word = ld_shared_b32(base + n * 128 + ((vec ^ (hh % 8)) << 4) + inb)
            # head h of the token is accumulator column 8 (k // 2) + 2 q + k % 2 of quad lane
            # q, k = 2 (h // 8) + h % 2 (the weights' permuted layout); nh is a multiple of 8
            q = (hh // 2) % 4
            k = 2 * (half * (nh // 8) + hh // 8) + hh % 2
            wq = sW[q, tok, k] * sQs[q, tok, k]
            lo, hi = word & 0xFFFF, (word >> 16) & 0xFFFF
            u[0] = u[0] + wq * f32_from_e4m3(lo, 0)
            u[1] = u[1] + wq * f32_from_e4m3(lo, 1)
            u[2] = u[2] + wq * f32_from_e4m3(hi, 0)
            u[3] = u[3] + wq * f32_from_e4m3(hi, 1)
        for i in cutlass.range_constexpr(4):  # the two halves of the heads (the same sum in both)
            u[i] = u[i] + cute.arch.shuffle_sync_bfly(u[i], offset=1)
        m = max_nan(max_nan(cute.math.absf(u[0]), cute.math.absf(u[1])),
                    max_nan(cute.math.absf(u[2]), cute.math.absf(u[3])))
        for off in (16, 8, 4, 2):
            m = max_nan(m, cute.arch.shuffle_sync_bfly(m, offset=off))
        if ct % 32 == 0:
            sRed[ct // 32] = m
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=256)
        m = max_nan(sRed[2 * tok], sRed[2 * tok + 1])  # the token's two warps
        e = (f32_bits(m) >> 23) & 0xFF  # biased exponent: 2**(e - 134) puts m in [128, 256)
        u0 = cutlass.select_(half == 0, u[0], u[2])  # this thread's two dimensions
        u1 = cutlass.select_(half == 0, u[1], u[3])
        sQ2_addr = sQ2.iterator.toint() + self.mma_n * 128 + inb + 2 * half
        for j in cutlass.range_constexpr(LIN_PIECES):
            ej = e - 5 * j
            scale = f32_from_bits((ej - 7) << 23)
            inv = f32_from_bits((261 - ej) << 23)
            if ej < 8:  # below float32's normal range: no piece
                scale, inv = Float32(0.0), Float32(0.0)
                if m != Float32(0.0):  # not representable: the tile takes the definition's order
                    scale = Float32(-1.0)
            if e == 0xFF:  # inf or NaN: the scores become NaN
                scale, inv = f32_from_bits(Int32(0x7FC00000)), Float32(0.0)
            a = e4m3x2_from_f32(u1 * inv, u0 * inv)
            u0 = u0 - f32_from_e4m3(a, 0) * scale
            u1 = u1 - f32_from_e4m3(a, 1) * scale
            row = 8 * (j // 2) + 2 * tok + j % 2
            st_shared_u16(sQ2_addr + sw128_offset_bytes(row, vec, 0), a)
            if ct % (D // 2) == 0:
                sLinScale[j, tok] = scale
        cute.arch.fence_view_async_shared()  # st.shared (generic proxy) -> wgmma
        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=256)

    @cute.jit
    def _store_fp8(self, accs, early, wr, sW, sQs, ks, q_fast, quad, store, lin_scale=None):
        """fp8: the block's scores ``sum_h w * relu((acc * q_scale) * k_scale)`` per (key row,
        token), reduce-scattered over the quad and stored (:meth:`_reduce_and_store`). ``accs``
        hold the pieces of columns in token order; ``early`` is the fast-order sums
        (:meth:`_sums`) of all pieces but the last, taken while the later pieces' MMAs ran.

        Where the thread's q_scales (``q_fast``) and both its rows' k_scales are finite and >= 0
        the score is ``k_scale * sum_h (w * q_scale) * relu(acc)`` (``wr`` holds ``w *
        q_scale``): the bf16 epilogue and one multiply per row and token, and ``early`` is used.
        Otherwise (a negative, infinite or NaN scale) every piece is summed again in the
        definition's order, with w and q_scale read from shared memory (``sW``, ``sQs``). Each
        branch runs to the stores, so that no value crosses it.

        With the linear term (``lin_scale``: this lane's token's piece scales) the fast path's
        ``early`` and last-piece sums are ``sum wr |acc|`` without k_scale, and each stored score
        is ``(that sum + sum_j lin_scale[j] acc[piece j's column]) * k_scale / 2``."""
        tp = self.tokens_per_part
        last = self.parts - 1
        if q_fast & _finite_nonneg(ks[0]) & _finite_nonneg(ks[1]):
            if const_expr(self.linear):
                # sum_h wr relu(x) = (sum_h wr |x| + sum_h wr x) / 2: the sums of |x| here
                # (no k_scale yet), the linear half from this lane's token's columns
                final = self._sums(accs[last], wr, None, None, None, quad, last * tp, tp)
                lin = []
                for r in cutlass.range_constexpr(2):
                    total = Float32(0.0)
                    for j in cutlass.range_constexpr(LIN_PIECES - 1, -1, -1):  # small first
                        k = 2 * (self.mma_n // 8 + j // 2) + j % 2
                        total = total + accs[last][4 * (k // 2) + 2 * r + k % 2] * lin_scale[j]
                    lin.append((total, ks[r]))
                self._reduce_and_store(self._merge_parts(early + [final]), *store, lin=lin)
            else:
                final = self._sums(accs[last], wr, None, None, ks, quad, last * tp, tp)
                self._reduce_and_store(self._merge_parts(early + [final]), *store)
        else:
            again = [self._sums(accs[h], None, sW, sQs, ks, quad, h * tp, tp)
                     for h in range(self.parts)]
            self._reduce_and_store(self._merge_parts(again), *store)

    def _merge_parts(self, pieces):
        """The partial scores of the pieces (each ``[row half r][token of the piece]``) as one
        list ``[r][token]``, the layout :meth:`_reduce_and_store` takes."""
        tp = self.tokens_per_part
        return [pieces[tok // tp][r * tp + tok % tp]
                for r in range(2) for tok in range(self.tokens)]

    @cute.jit
    def _sums(self, acc, wr, sW, sQs, ks, quad, tok_lo: cutlass.Constexpr = 0,
              n_tok: cutlass.Constexpr = None):
        """The thread's partial scores ``[row half r][token]`` (a list) of the ``n_tok`` tokens
        from ``tok_lo`` (default: all) whose columns ``acc`` holds: ``sum_k relu(acc) * wr[tok,
        k]`` over its columns k of each token (``|acc|`` in place of ``relu(acc)`` with the
        linear term, whose callers pass no ``ks``), times ``ks[r]`` where given with ``wr``; with
        ``sW`` (fp8, the definition's order) ``sum_k relu((acc * sQs[k]) * ks[r]) * sW[k]``,
        read element by element from shared memory (no registers next to wr)."""
        tokens = self.tokens if const_expr(n_tok is None) else n_tok
        part = [Float32(0.0)] * (2 * tokens)
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(tokens):
                tok = tok_lo + j
                total = Float32(0.0)
                for kk in cutlass.range_constexpr(self.w_per_token):
                    k = j * self.w_per_token + kk
                    x = acc[4 * (k // 2) + 2 * r + k % 2]
                    if const_expr(sW is None and self.linear):
                        total = total + cute.math.absf(x) * wr[tok, kk]
                    elif const_expr(sW is None):
                        total = total + relu_nan(x) * wr[tok, kk]
                    else:
                        total = total + (relu_nan(x * sQs[quad, tok, kk] * ks[r])
                                         * sW[quad, tok, kk])
                if const_expr(sW is None and ks is not None):
                    total = total * ks[r]
                part[r * tokens + j] = total
        return part

    @cute.jit
    def _reduce_and_store(self, part, mBuf, rows, lane, key0, tok0, tok_end, t0, buf_row0, seq_k,
                          quad, lin=None):
        """Reduce-scatters the partial scores ``part`` (:meth:`_sums`) over the quad and stores
        each lane's share; with ``lin`` (the linear term: one token a lane), the score of row
        half ``r`` is ``(sum + lin[r][0]) * lin[r][1] / 2``."""
        tokens = self.tokens
        # reduce-scatter over the quad: lane bit 1 keeps a half of the tokens, bit 0 a quarter
        b1 = (lane & 2) != 0
        b0 = (lane & 1) != 0
        half = tokens // 2
        kept = [Float32(0.0)] * (2 * half)
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(half):
                lo = part[r * tokens + j]
                hi = part[r * tokens + half + j]
                send = cutlass.select_(b1, lo, hi)
                mine = cutlass.select_(b1, hi, lo)
                kept[r * half + j] = mine + cute.arch.shuffle_sync_bfly(send, offset=2)
        quarter = tokens // 4
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(quarter):
                lo = kept[r * half + j]
                hi = kept[r * half + quarter + j]
                send = cutlass.select_(b0, lo, hi)
                mine = cutlass.select_(b0, hi, lo)
                score = mine + cute.arch.shuffle_sync_bfly(send, offset=1)
                if const_expr(lin is not None):
                    score = (score + lin[r][0]) * lin[r][1] * Float32(0.5)
                t = tok0 + quad * quarter + j
                key = key0 + rows[r]
                if (t < tok_end) & (key < seq_k):
                    mBuf[buf_row0 + t - t0, key] = score


# ------------------------------------------------------------------------------------------------
# compiling (the launcher is in lightning_every_key_host.py)
# ------------------------------------------------------------------------------------------------

def compile_scores(dtype_name: str, head_tile: int, causal: bool):
    """Compile one score kernel (no GPU needed when the target arch is set).

    ``dtype_name``: ``"bfloat16"``, ``"float16"`` or ``"float8_e4m3fn"``. B T, H (<=
    ``head_tile``), B S, the chunk's rows and ``ld`` are symbolic. Returns the TVM-FFI callable
    ``fn(q [B T, H, D], k [B S, D], weights [B T, H], row_len_or_None [B T], buf [R, ld],
    q_scale [B T, H], k_scale [B S], T, S, b0, t0, n_tok, n_batch, n_splits,
    blocks_per_split)``; q_scale and k_scale are float32 in fp8 and None otherwise.
    """
    dtype = DTYPES[dtype_name]
    kernel = LightningScoresSm90(dtype, head_tile, causal)
    n_rows, n_head, n_keys, n_buf, ld = (cute.sym_int() for _ in range(5))
    fake = cute.runtime.make_fake_compact_tensor
    q = fake(dtype, (n_rows, n_head, D), stride_order=(2, 1, 0), assumed_align=16)
    k = fake(dtype, (n_keys, D), stride_order=(1, 0), assumed_align=16)
    w = fake(Float32, (n_rows, n_head), stride_order=(1, 0), assumed_align=4)
    q_scale = k_scale = None
    if kernel.fp8:
        q_scale = fake(Float32, (n_rows, n_head), stride_order=(1, 0), assumed_align=4)
        k_scale = fake(Float32, (n_keys,), assumed_align=4)
    row_len = fake(Int32, (n_rows,), assumed_align=4) if causal else None
    buf = fake(Float32, (n_buf, ld), stride_order=(1, 0), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    one = Int32(1)
    return cute.compile(kernel, q, k, w, row_len, buf, q_scale, k_scale, one, one, one, one, one,
                        one, one, one, stream, options="--enable-tvm-ffi")
