"""Benchmark of the SM90 sparse-MLA backward: ``python -m mla_inductor.bench bwd``.

TFLOPS use ``2 * T * H * topk * (3 * d_qk + 2 * d_v)`` (invalid slots counted), the convention
of the cuDNN frontend and TileLang. Times are CUDA-event means over a few launches of the whole
backward (preprocess, kernel, cast), next to the PyTorch reference backend on the same inputs
and, when ``nvidia-cudnn-frontend`` is importable, its SM90 DSA backward (attention sink of -inf
per head, i.e. no sink) with the ratio ours / cuDNN.
"""

from __future__ import annotations

import argparse

import torch

from mla_inductor.kernels import reference
from mla_inductor.kernels.sm90 import bwd


def _indices(T, S, topk, causal, g):
    if not causal:
        return torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32)
    pos = torch.arange(S - T, S)[:, None]  # token t sits at position S - T + t
    idx = (torch.rand(T, topk, generator=g) * (pos + 1)).long()
    idx = torch.where(torch.arange(topk)[None, :] <= pos, idx, -1)
    return idx.int()


def _cudnn_backward():
    """cuDNN frontend's DSA backward wrapper, or None when the package is not importable."""
    try:
        from cudnn.deepseek_sparse_attention import sparse_attention_backward_wrapper
    except Exception:  # not installed, or no compatible build for this machine
        return None
    return sparse_attention_backward_wrapper


def _time(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run(T, H, topk, causal, d_qk=576, d_v=512, iters=5, with_reference=True):
    """Prints one line: the sm90 backward's time (ms) and TFLOPS at ``T`` tokens, S = 2T, ``H``
    heads, bf16, next to cuDNN's (when importable) and the reference backend's."""
    g = torch.Generator().manual_seed(0)
    S = 2 * T
    q = torch.randn(T, H, d_qk, generator=g).bfloat16().cuda()
    kv = torch.randn(S, d_qk, generator=g).bfloat16().cuda()
    dout = torch.randn(T, H, d_v, generator=g).bfloat16().cuda()
    idx = _indices(T, S, topk, causal, g).cuda()
    sm_scale = d_qk**-0.5
    out, lse, o_lo = reference.forward(q, kv, idx, None, sm_scale, d_v, 0.0, True)
    flops = 2 * T * H * topk * (3 * d_qk + 2 * d_v)
    ms = _time(lambda: bwd.backward(dout, q, kv, idx, None, out, lse, o_lo, sm_scale, d_v), iters)
    line = f"T={T:6d} S={S:6d} H={H:4d} topk={topk} {'causal' if causal else 'random'}: " \
           f"sm90 {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOPS"
    cudnn_bwd = _cudnn_backward()
    if cudnn_bwd is not None:
        sink = torch.full((H,), float("-inf"), dtype=torch.float32, device="cuda")
        cudnn_ms = _time(lambda: cudnn_bwd(q, kv, out, dout, lse, sink, idx, softmax_scale=sm_scale), iters)
        line += f" | cuDNN {cudnn_ms:8.3f} ms {flops / cudnn_ms / 1e9:7.1f} TFLOPS " \
                f"(ours/cuDNN {cudnn_ms / ms:.2f}x)"
    if with_reference:
        ref_ms = _time(lambda: reference.backward(dout, q, kv, idx, None, out, lse, o_lo, sm_scale, d_v), 1)
        line += f" | reference {ref_ms:9.3f} ms {flops / ref_ms / 1e9:6.1f} TFLOPS"
    print(line, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mla_inductor.bench bwd", description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--H", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args(argv)
    for T in args.T:
        for H in args.H:
            for causal in (False, True):
                run(T, H, args.topk, causal, with_reference=not args.no_reference and T <= 4096)
