"""torch.compile on the GPU: fullgraph training on the kernels `auto` picks, dynamic T, CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from mla_inductor import backends, sparse_mla, use_backend

pytestmark = pytest.mark.cuda
H, D_QK, D_V, TOPK = 64, 576, 512, 128


class Layer(torch.nn.Module):
    def __init__(self, d_model=256):
        super().__init__()
        self.wq = torch.nn.Linear(d_model, H * D_QK, bias=False)
        self.wkv = torch.nn.Linear(d_model, D_QK, bias=False)
        self.wo = torch.nn.Linear(H * D_V, d_model, bias=False)

    def forward(self, x, indices):
        q = self.wq(x).view(x.shape[0], H, D_QK)
        return self.wo(sparse_mla(q, self.wkv(x), indices, d_v=D_V).flatten(1))


def _causal(T, device):
    g = torch.Generator().manual_seed(T)
    pos = torch.arange(T)[:, None]
    idx = pos - torch.randint(0, 4 * TOPK, (T, TOPK), generator=g)
    idx[:, 0] = pos[:, 0]
    return torch.where(idx < 0, -1, idx).to(device=device, dtype=torch.int32)


def test_auto_backend_on_this_gpu_is_a_kernel_backend():
    chosen = backends.select(torch.device("cuda"), torch.bfloat16, "forward").__name__
    major, _ = torch.cuda.get_device_capability()
    expected = {9: "mla_inductor.kernels.sm90", 10: "mla_inductor.kernels.sm100"}.get(major)
    if expected is None:
        pytest.skip(f"no kernel backend for sm_{major}x")
    assert chosen == expected


def test_fullgraph_training_on_kernels_matches_reference_backend():
    torch.manual_seed(0)
    model = Layer().cuda().bfloat16()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    idx = _causal(512, "cuda")
    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(model, backend=counter, fullgraph=True)
    out = fn(x, idx)
    out.float().square().mean().backward()
    grads = [p.grad.float().clone() for p in model.parameters()]
    model.zero_grad()
    with use_backend("reference"):
        ref = model(x, idx)
        ref.float().square().mean().backward()
    assert counter.frame_count == 1
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
    for p, g in zip(model.parameters(), grads):
        assert ((g - p.grad.float()).norm() / p.grad.float().norm()).item() < 3e-2


def test_reduce_overhead_cuda_graphs_dynamic_tokens():
    torch.manual_seed(0)
    model = Layer().cuda().bfloat16()
    counters.clear()
    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(model, backend=counter, fullgraph=True)
    cg = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for T in (256, 256, 384, 384, 256):
            x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
            idx = _causal(T, "cuda")
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(idx, 0)
            got = cg(x, idx).clone()
            torch.testing.assert_close(got, fn(x, idx), atol=0, rtol=0)
    assert counter.frame_count == 1
    assert not counters["inductor"].get("cudagraph_skips", 0)


def test_reduce_overhead_training_step():
    torch.manual_seed(0)
    model = Layer().cuda().bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    counters.clear()

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def loss_fn(x, idx):
        return model(x, idx).float().square().mean()

    losses = []
    for step in range(4):
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(step))
        loss = loss_fn(x, _causal(256, "cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not counters["inductor"].get("cudagraph_skips", 0)
