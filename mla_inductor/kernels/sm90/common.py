"""What the SM90 kernels share: the shared-memory limit of one CTA, the CuTe DSL type of each
torch dtype they take, the byte offsets of the 128-byte-swizzled tiles their producers fill with
``cp.async`` and the layouts and transposed views of such tiles that their wgmma operands take,
the CuTe DSL target-architecture switch for compiling without a GPU, and the symbolic fake
inputs the gather kernels compile against. It imports the CuTe DSL; what the launchers share is
in :mod:`.host`.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import warpgroup

SWIZZLE_CHUNK_ROWS = 64  # rows of one 64-column chunk of a swizzled tile
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may use on SM90
# the CuTe DSL type of each 16-bit dtype the kernels take, by its torch name (the compile keys')
TORCH_TO_CUTE = {"bfloat16": BFloat16, "float16": Float16}


def sw128_offset_bytes(row, vec, chunk):
    """Byte offset of 16-byte vector ``vec`` (0..7) of ``row`` in 64-column ``chunk`` of a
    2-byte-element tile stored as 128-byte-swizzled K-major wgmma atoms (8 rows x 128 B; rows
    contiguous within a chunk, chunks of 64 rows contiguous): the layout the kernels' ``_layouts``
    build and the wgmma descriptors read (the GPU tests check the two agree)."""
    return chunk * (SWIZZLE_CHUNK_ROWS * 128) + row * 128 + ((vec ^ (row & 7)) << 4)


def transposed(t):
    """View of a 2-D shared-memory tensor with its two modes swapped."""
    return cute.composition(
        t, cute.make_ordered_layout((t.shape[1], t.shape[0]), order=(1, 0))
    )


def kmajor_sw128(dtype, rows: int, cols: int):
    """K-major 128-byte-swizzled layout; 64-column slabs are contiguous (rows first)."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))


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


class FakeInputs(NamedTuple):
    """Symbolic sizes and fake tensors of a gather kernel's inputs, for ``cute.compile``."""

    n_tok: object  # T
    n_head: object  # H
    n_topk: object  # topk
    q: object  # [T, H, d_qk]
    kv: object  # [S, d_qk]
    indices: object  # [T, topk] int32
    topk_length: Optional[object]  # [T] int32
    q_positions: Optional[object]  # [T] int32
    lse: object  # [T, H] float32


def fake_inputs(dtype, d_qk: int, has_topk_length: bool, has_positions: bool) -> FakeInputs:
    """Compact fake tensors with symbolic T, H, S and topk (one compiled kernel serves every
    size): q, kv 16-byte aligned in ``dtype`` (a CuTe DSL type), the int32 indices, topk_length
    and positions (None when absent) and the float32 lse."""
    n_tok, n_head, n_kv, n_topk = (cute.sym_int() for _ in range(4))
    fake = cute.runtime.make_fake_compact_tensor
    return FakeInputs(
        n_tok, n_head, n_topk,
        q=fake(dtype, (n_tok, n_head, d_qk), stride_order=(2, 1, 0), assumed_align=16),
        kv=fake(dtype, (n_kv, d_qk), stride_order=(1, 0), assumed_align=16),
        indices=fake(Int32, (n_tok, n_topk), stride_order=(1, 0), assumed_align=4),
        topk_length=fake(Int32, (n_tok,), assumed_align=4) if has_topk_length else None,
        q_positions=fake(Int32, (n_tok,), assumed_align=4) if has_positions else None,
        lse=fake(Float32, (n_tok, n_head), stride_order=(1, 0), assumed_align=4),
    )
