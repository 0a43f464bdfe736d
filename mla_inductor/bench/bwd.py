"""bwd: the SM90 sparse-MLA backward against cuDNN's and the PyTorch reference's.

TFLOPS use ``2 * T * H * topk * (3 * d_qk + 2 * d_v)`` (invalid slots counted), the convention
of the cuDNN frontend and TileLang. Times are medians of the whole backward (preprocess, kernel,
cast), next to the PyTorch reference backend on the same inputs
(:func:`mla_inductor.bench.timing.time_ms`) and, when ``nvidia-cudnn-frontend`` is importable,
its SM90 DSA backward (attention sink of -inf per head, i.e. no sink) with the ratio ours /
cuDNN; ours and cuDNN's are timed in interleaved rounds
(:func:`mla_inductor.bench.timing.time_ms_interleaved`), so that both see the same clock drift;
with ``--protocol cooled`` both are timed as FlashMLA's benchmark times kernels
(:func:`mla_inductor.bench.timing.time_ms_cooled`, means). With ``--deterministic`` the
deterministic backward (dkv in 64-bit fixed point, what ``torch.use_deterministic_algorithms(True)``
selects) is timed in the same rounds, with its time against the default one's and its extra
memory (the int64 accumulator's 4 more bytes per dkv entry).
"""

from __future__ import annotations

import argparse

import torch

from ..kernels import reference
from .fwd import feature_arguments
from .problems import KV_LENGTHS, add_shape_arguments, make_indices, require_sm90
from .timing import PROTOCOLS, add_protocol_argument, time_ms


def _cudnn_backward():
    """cuDNN frontend's DSA backward wrapper, or None when the package is not importable."""
    try:
        from cudnn.deepseek_sparse_attention import sparse_attention_backward_wrapper
    except Exception:  # not installed, or no compatible build for this machine
        return None
    return sparse_attention_backward_wrapper


def _rel_l2(a, b, rows=4096):
    """Relative L2 distance of ``a`` from ``b`` in fp64, ``rows`` leading rows at a time (a
    long-context dq in fp64 would not fit next to the problem)."""
    diff = ref = 0.0
    for r0 in range(0, a.shape[0], rows):
        x, y = a[r0:r0 + rows].double(), b[r0:r0 + rows].double()
        diff += (x - y).square().sum().item()
        ref += y.square().sum().item()
    return (diff / max(ref, 1e-300)) ** 0.5


def bench_row(T, H, topk, pattern, d_qk=576, d_v=512, with_reference=True, protocol="sustained",
              kv_per_token=2, features=False, deterministic=False):
    """Prints one line: the sm90 backward's time (ms) and TFLOPS at ``T`` tokens, S =
    ``kv_per_token`` x T, ``H`` heads, bf16, ``pattern`` indices (see
    :func:`mla_inductor.bench.problems.make_indices`), the same backward without o_lo (dpsum
    from out alone: what reading o_lo costs), next to cuDNN's (when importable) under the same
    ``protocol`` (a key of
    :data:`mla_inductor.bench.timing.PROTOCOLS`) and the reference backend's (sustained). Needs
    a CUDA device where the sm90 kernels run
    (:func:`mla_inductor.bench.problems.require_sm90`)."""
    from ..kernels.sm90 import bwd_host, fwd_host

    g = torch.Generator(device="cuda").manual_seed(0)
    S = kv_per_token * T
    q = torch.randn(T, H, d_qk, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, d_qk, device="cuda", generator=g).bfloat16()
    dout = torch.randn(T, H, d_v, device="cuda", generator=g).bfloat16()
    idx = make_indices(T, S, topk, pattern, g)
    sm_scale = d_qk**-0.5
    out, lse, o_lo, _ = fwd_host.forward(q, kv, idx, None, None, None, sm_scale, d_v, 0.0, True)
    no_o_lo = o_lo.new_empty(0)
    flops = 2 * T * H * topk * (3 * d_qk + 2 * d_v)
    fns = {"sm90": lambda: bwd_host.backward(dout, None, q, kv, idx, None, None, None, out, lse,
                                             o_lo, sm_scale, d_v),
           "sm90, no o_lo": lambda: bwd_host.backward(dout, None, q, kv, idx, None, None, None, out,
                                                      lse, no_o_lo, sm_scale, d_v)}
    if features:  # each DSA feature's backward against the plain one (the same out / lse)
        extra = feature_arguments(T, S, H)
        pos, sink = extra["causal"][0], extra["sink"][1]
        dlse = torch.randn(T, H, device="cuda", generator=g)
        # (q_positions, attn_sink, dlse) of each feature
        for name, (p, s, d) in (("causal", (pos, None, None)), ("sink", (None, sink, None)),
                                ("dlse", (None, None, dlse))):
            fns[f"sm90 + {name}"] = (lambda p=p, s=s, d=d: bwd_host.backward(
                dout, d, q, kv, idx, None, p, s, out, lse, o_lo, sm_scale, d_v))
    cudnn_bwd = _cudnn_backward()
    if deterministic:
        fns["sm90, deterministic"] = lambda: bwd_host.backward(dout, None, q, kv, idx, None, None,
                                                               None, out, lse, o_lo, sm_scale, d_v,
                                                               deterministic=True)
    if cudnn_bwd is not None:
        sink = torch.full((H,), float("-inf"), dtype=torch.float32, device="cuda")
        fns["cudnn"] = lambda: cudnn_bwd(q, kv, out, dout, lse, sink, idx, softmax_scale=sm_scale)
    times = PROTOCOLS[protocol](fns)
    ms = times["sm90"]
    line = f"T={T:6d} S={S:6d} H={H:4d} topk={topk} {pattern}: " \
           f"sm90 {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOPS " \
           f"(without o_lo {flops / times['sm90, no o_lo'] / 1e9:7.1f})"
    if cudnn_bwd is not None:
        cudnn_ms = times["cudnn"]
        ours = bwd_host.backward(dout, None, q, kv, idx, None, None, None, out, lse, o_lo, sm_scale,
                                 d_v)[:2]
        theirs = cudnn_bwd(q, kv, out, dout, lse, sink, idx, softmax_scale=sm_scale)
        agree = max(_rel_l2(ours[0], theirs["dq"]), _rel_l2(ours[1], theirs["dkv"]))
        line += f" | cuDNN {cudnn_ms:8.3f} ms {flops / cudnn_ms / 1e9:7.1f} TFLOPS " \
                f"(ours/cuDNN {cudnn_ms / ms:.2f}x, gradients agree to rel-L2 {agree:.1e})"
    if deterministic:
        det = bwd_host.backward(dout, None, q, kv, idx, None, None, None, out, lse, o_lo, sm_scale,
                                d_v, deterministic=True)[:2]
        again = bwd_host.backward(dout, None, q, kv, idx, None, None, None, out, lse, o_lo,
                                  sm_scale, d_v, deterministic=True)[:2]
        same = all(torch.equal(a, b) for a, b in zip(det, again))
        plain = bwd_host.backward(dout, None, q, kv, idx, None, None, None, out, lse, o_lo,
                                  sm_scale, d_v)[:2]
        line += f" | deterministic {times['sm90, deterministic']:8.3f} ms " \
                f"({times['sm90, deterministic'] / ms:.3f}x time, +{S * d_qk * 4 / 2**20:.0f} MiB, " \
                f"dkv vs default rel-L2 {_rel_l2(det[1], plain[1]):.1e}, " \
                f"{'bitwise equal' if same else 'DIFFERENT'} on a second run)"
    for name in ("causal", "sink", "dlse"):
        if f"sm90 + {name}" in times:
            line += f" | + {name} {times[f'sm90 + {name}'] / ms:.3f}x time"
    if with_reference:
        ref_ms = time_ms(lambda: reference.backward(dout, None, q, kv, idx, None, None, None, out,
                                                    lse, o_lo, sm_scale, d_v))
        line += f" | reference {ref_ms:9.3f} ms {flops / ref_ms / 1e9:6.1f} TFLOPS"
    print(line, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bwd`` subcommand's flags: the shapes, ``--protocol`` and ``--no-reference``."""
    add_shape_arguments(parser)
    add_protocol_argument(parser)
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the (slow) PyTorch reference column")
    parser.add_argument("--features", action="store_true",
                        help="also time the backward with causal positions, a sink (and its "
                             "gradient), and a gradient through lse, each against the plain one")
    parser.add_argument("--deterministic", action="store_true",
                        help="also time the deterministic backward (dkv in 64-bit fixed point, "
                             "chosen by torch.use_deterministic_algorithms(True)) against the "
                             "default one")


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`): one line per T x H x
    pattern (the reference column only for T <= 4096). Exits with a message when the sm90
    kernels cannot run here."""
    require_sm90("backward")
    for T in args.T:
        for H in args.H:
            for pattern in args.indices:
                bench_row(T, H, args.topk, pattern,
                          with_reference=not args.no_reference and T <= 4096,
                          protocol=args.protocol, kv_per_token=KV_LENGTHS[args.S],
                          features=args.features, deterministic=args.deterministic)
