# docs-test: torchrun 2
"""Tensor parallel over heads and context parallel over tokens on DTensor, each against one process.

    torchrun --standalone --nproc-per-node 2 examples/dtensor_parallel.py

One process per GPU (NCCL) or, without GPUs, two CPU processes on gloo (docs/integrations.md,
"Distributed (DTensor)").
"""

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput,
                                               RowwiseParallel, parallelize_module)

import mla_inductor

cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
dist.init_process_group("nccl" if cuda else "gloo")
mesh = init_device_mesh(device.type, (dist.get_world_size(),))
torch.manual_seed(0)                        # the same weights and inputs on every rank
dim, T, H, d_qk, d_v, topk = 64, 32, 4, 48, 32, 8   # H and T divisible by the world size
x = torch.randn(T, dim, device=device)
t = torch.arange(T, device=device)
indices = (t[:, None] - torch.arange(topk, device=device)).int()   # < 0: an empty slot


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(dim, H * d_qk, bias=False)
        self.wkv = nn.Linear(dim, d_qk, bias=False)
        self.wo = nn.Linear(H * d_v, dim, bias=False)
        self.sink = nn.Parameter(torch.randn(H))

    def forward(self, x, indices):
        q = self.wq(x).view(*x.shape[:-1], -1, d_qk)   # -1: the global heads on a DTensor
        out = mla_inductor.sparse_mla(q, self.wkv(x), indices, d_v=d_v, causal=True,
                                      attn_sink=self.sink)
        return self.wo(out.flatten(-2))


# Tensor parallel over heads
layer = Attention().to(device)
tp = parallelize_module(copy.deepcopy(layer), mesh, {
    "wq": ColwiseParallel(use_local_output=False),                  # q sharded on heads
    "wkv": PrepareModuleOutput(output_layouts=Replicate(),          # latent kv replicated
                               desired_output_layouts=Replicate(), use_local_output=False),
    "wo": RowwiseParallel(),                                        # a plain tensor: the sum
})
tp.sink = nn.Parameter(distribute_tensor(tp.sink.data, mesh, [Shard(0)]))
single = layer(x, indices)                                          # one process
single.square().sum().backward()
out = tp(x, distribute_tensor(indices, mesh, [Replicate()]))
out.square().sum().backward()
torch.testing.assert_close(out, single)
for name, p in tp.named_parameters():                               # DTensors where sharded
    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    torch.testing.assert_close(grad, layer.get_parameter(name).grad)

# Context parallel over tokens
q = torch.randn(T, H, d_qk, device=device, requires_grad=True)
kv = torch.randn(T, d_qk, device=device, requires_grad=True)
out = mla_inductor.sparse_mla(q, kv, indices, d_v=d_v, causal=True)          # one process
out.square().sum().backward()
q_s, kv_s = (distribute_tensor(a.detach(), mesh, [Shard(0)]).requires_grad_() for a in (q, kv))
out_s = mla_inductor.sparse_mla(q_s, kv_s, distribute_tensor(indices, mesh, [Shard(0)]),
                                d_v=d_v, causal=True)                        # Shard(0)
out_s.square().sum().backward()                        # dkv reduce-scattered back to Shard(0)
for sharded, single in ((out_s, out), (q_s.grad, q.grad), (kv_s.grad, kv.grad)):
    torch.testing.assert_close(sharded.full_tensor(), single)
if dist.get_rank() == 0:
    print("tensor and context parallel match one process")
dist.destroy_process_group()
