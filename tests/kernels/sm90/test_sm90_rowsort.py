"""GPU tests of the Hopper row sort (mla_inductor.kernels.sm90.rowsort): every row's valid slots
ascending, duplicates kept, then -1, bit for bit against a torch reference written here; rows
already ascending, descending, all empty; every padded width; CUDA-graph replay; the
launcher's checks."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

from mla_inductor.kernels.sm90 import rowsort_host  # noqa: E402

INT32_MAX = 2**31 - 1


def reference(indices, topk_length, S):
    """The rule from torch: valid slots (``0 <= index < S``, position < topk_length) sorted
    ascending with their repeats, then -1."""
    pos = torch.arange(indices.shape[1], device=indices.device)
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        valid &= pos[None, :] < topk_length[:, None].long()
    key = torch.where(valid, indices.long(), INT32_MAX)
    key = torch.sort(key, dim=1).values
    return torch.where(key == INT32_MAX, -1, key).int()


def _rows(T, topk, S, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32)
    idx[:, : topk // 3] = torch.randint(0, 8, (T, topk // 3), generator=g, dtype=torch.int32)
    bad = torch.tensor([-1, -7, S, S + 5, INT32_MAX, -(2**31)], dtype=torch.int32)
    drop = torch.rand(T, topk, generator=g) < 0.15
    idx = torch.where(drop, bad[torch.randint(0, len(bad), (T, topk), generator=g)], idx)
    if T > 3:
        idx[1] = torch.sort(torch.randint(0, S, (topk,), generator=g)).values.int()  # ascending
        idx[2] = torch.sort(torch.randint(0, S, (topk,), generator=g), descending=True).values.int()
        idx[3] = -1  # nothing valid
    return idx.cuda()


@pytest.mark.parametrize("topk", [1, 5, 255, 256, 640, 2048, 2049, 4096, 8192])
@pytest.mark.parametrize("with_len", [False, True])
def test_rows_sorted_bitwise(topk, with_len):
    T, S = 37, 3000
    idx = _rows(T, topk, S, seed=topk)
    length = None
    if with_len:
        g = torch.Generator().manual_seed(1)
        length = torch.randint(-2, topk + 3, (T,), generator=g, dtype=torch.int32).cuda()
    out = rowsort_host.sorted_rows(idx, length, S)
    assert out.dtype == torch.int32 and out.shape == idx.shape and out.is_contiguous()
    assert torch.equal(out, reference(idx, length, S))


def test_sorted_input_and_many_rows():
    """Rows already ascending (the lightning indexer's) come back unchanged; enough rows for
    several waves of CTAs."""
    T, topk, S = 5000, 2048, 32768
    g = torch.Generator().manual_seed(5)
    idx = torch.sort(torch.randint(0, S, (T, topk), generator=g), dim=1).values.int()
    idx[:, -100:] = -1
    idx = idx.cuda()
    assert torch.equal(rowsort_host.sorted_rows(idx, None, S), idx)
    shuffled = idx[:, torch.randperm(topk, generator=g).cuda()].contiguous()
    assert torch.equal(rowsort_host.sorted_rows(shuffled, None, S), idx)


def test_graph_replay():
    T, topk, S = 64, 640, 1000
    idx = _rows(T, topk, S, seed=3)
    rowsort_host.sorted_rows(idx, None, S)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rowsort_host.sorted_rows(idx, None, S)
    idx.copy_(_rows(T, topk, S, seed=4))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, reference(idx, None, S))


def test_launcher_asserts():
    idx = torch.zeros(4, 16, dtype=torch.int32, device="cuda")
    with pytest.raises(AssertionError):
        rowsort_host.sorted_rows(idx.long(), None, 10)
    with pytest.raises(AssertionError):
        rowsort_host.sorted_rows(torch.zeros(2, 8193, dtype=torch.int32, device="cuda"), None, 10)
    with pytest.raises(AssertionError):
        rowsort_host.sorted_rows(idx, torch.zeros(3, dtype=torch.int32, device="cuda"), 10)
    assert rowsort_host.sorted_rows(idx[:0], None, 10).shape == (0, 16)
