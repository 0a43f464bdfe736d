"""Benchmarks of the sparse-MLA kernels on the current GPU.

    python -m mla_inductor.bench fwd [--T 4096 16384] [--H 128 64] [--topk 2048] [--protocol cooled]
    python -m mla_inductor.bench bwd [--T 4096 16384] [--H 128 64] [--topk 2048] [--protocol cooled] [--no-reference]
    python -m mla_inductor.bench train [--T 4096 16384] [--H 128 64] [--topk 2048] [--skip-layer] [--skip-model]

``fwd``: the SM90 forward kernel (``mla_inductor.kernels.sm90``) for every T x H x index pattern
(``random``: uniform over the S = 2T keys; ``causal``: token t sits at position T + t and draws
its keys from positions <= its own, its own key in slot 0) x mode (``exact`` = threshold 0.0,
``train`` = 0.0 with o_lo, ``lazy`` = 8.0), next to a chunked PyTorch implementation measured
in the same run (at the smallest T only: it is slow). TFLOPS = 2·T·H·topk·(d_qk + d_v) / time,
the three modes timed in interleaved rounds (:func:`time_ms_interleaved`: median over rounds of
``triton.testing.do_bench`` medians, CUDA events). Prints a markdown table.
``--protocol cooled`` times every kernel as FlashMLA's benchmark does instead
(:func:`time_ms_cooled`): the protocol of FlashMLA's own benchmark script, at the clock of a GPU
that is not under sustained load.
``bwd`` and ``train``: see :mod:`mla_inductor.bench_bwd` and :mod:`mla_inductor.bench_train`.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import time

import torch

D_QK, D_V = 576, 512
MODES = {"exact": (0.0, False), "train": (0.0, True), "lazy": (8.0, False)}


def make_indices(T: int, S: int, topk: int, pattern: str, generator: torch.Generator) -> torch.Tensor:
    """``indices [T, topk]`` int32 on CUDA: ``random`` (uniform over S) or ``causal`` (token t at
    position S - T + t, its own key in slot 0, -1 past its position)."""
    if pattern == "random":
        return torch.randint(0, S, (T, topk), device="cuda", dtype=torch.int32, generator=generator)
    pos = (S - T) + torch.arange(T, device="cuda")
    idx = (torch.rand(T, topk, device="cuda", generator=generator) * (pos[:, None] + 1)).long()
    idx[:, 0] = pos
    idx = torch.where(torch.arange(topk, device="cuda")[None] <= pos[:, None], idx, -1)
    return idx.int()


def torch_forward(q, kv, indices, sm_scale, d_v=D_V, chunk=256):
    """Chunked PyTorch sparse-MLA forward (bf16 matmuls, fp32 softmax): the baseline."""
    out = torch.empty(q.shape[0], q.shape[1], d_v, dtype=q.dtype, device=q.device)
    S = kv.shape[0]
    for t0 in range(0, q.shape[0], chunk):
        idx = indices[t0:t0 + chunk].long()
        valid = (idx >= 0) & (idx < S)
        keys = kv[torch.where(valid, idx, 0)]
        s = torch.einsum("thd,tkd->thk", q[t0:t0 + chunk], keys).float() * sm_scale
        s.masked_fill_(~valid[:, None, :], -math.inf)
        p = torch.softmax(s, dim=-1).to(q.dtype)
        out[t0:t0 + chunk] = torch.einsum("thk,tkd->thd", p, keys[..., :d_v])
    return out


def time_ms(fn, grad_to_none=None) -> float:
    """Median milliseconds of ``fn()`` by ``triton.testing.do_bench`` (CUDA events; ``.grad`` of
    the tensors in ``grad_to_none`` reset before each call), or by 20 CUDA-event timings when
    triton is not installed."""
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")
    except ImportError:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            for t in grad_to_none or ():
                t.grad = None
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def time_ms_interleaved(fns: dict, rounds: int = 7) -> dict:
    """Median milliseconds of each ``fns[name]()``, timed in interleaved rounds (one short
    ``triton.testing.do_bench`` of every function per round, then the median over rounds).

    For comparisons within one run: under sustained load the GPU's clock drifts (heat, power),
    so functions timed back to back are measured at different clocks (on the H200, a kernel
    timed last in a ten-second run read 6% over its interleaved median); interleaving puts every
    contender under the same drift. Without triton it falls back to :func:`time_ms`.

    Args:
        fns: ``{name: fn}``, each ``fn()`` launching CUDA work on the current stream.
        rounds: how many interleaved rounds (each a ``do_bench`` of 10 ms warm-up, 60 ms timed).

    Returns:
        ``{name: milliseconds}`` (float), in ``fns``' order.

    Raises:
        Whatever a function raises (each is called once before the rounds); a RuntimeError
        from torch without a CUDA device."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return {name: time_ms(fn) for name, fn in fns.items()}
    for fn in fns.values():
        fn()  # compile / warm up outside the rounds
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench(fn, warmup=10, rep=60, return_mode="median"))
    return {name: statistics.median(t) for name, t in times.items()}


def time_ms_cooled(fns: dict, runs: int = 30, pause_s: float = 0.3) -> dict:
    """Mean milliseconds of each ``fns[name]()`` under FlashMLA's benchmark protocol
    (FlashMLA ``tests/kernelkit/bench.py``, ``bench_kineto``, and the 0.3 s pause between cases
    of ``tests/test_flash_mla_sparse_prefill.py``): a pause of ``pause_s`` before each function,
    then ``runs`` calls, each after an 8 GB memset (half the free memory if that is less; it
    flushes L2 and, in FlashMLA's words, gives the GPU "some chill time without full idle") and
    timed alone with CUDA events; the mean over the calls. The memset is longer than a call's
    launch, so the events time GPU work only.

    This measures the clock of a GPU that is not under sustained load: on the H200 our exact
    forward (T 4096, H 128) reads 11% faster (3.62 against 4.02 ms) than under
    :func:`time_ms_interleaved`, which is what back-to-back training steps see. Use it to compare
    with figures published under that protocol, and :func:`time_ms_interleaved` for everything
    else.

    Args:
        fns: ``{name: fn}``, each ``fn()`` launching CUDA work on the current stream.
        runs: timed calls per function.
        pause_s: seconds of sleep before each function's calls.

    Returns:
        ``{name: milliseconds}`` (float), in ``fns``' order.

    Raises:
        Whatever a function raises (each is called once before it is timed); a RuntimeError
        from torch without a CUDA device."""
    free_bytes, _ = torch.cuda.mem_get_info()
    flush = torch.empty(min(8 * 10**9, free_bytes // 2) // 4, dtype=torch.int32, device="cuda")
    times = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        time.sleep(pause_s)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(runs)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times[name] = statistics.fmean(start.elapsed_time(end) for start, end in events)
    return times


PROTOCOLS = {"sustained": time_ms_interleaved, "cooled": time_ms_cooled}


def bench_fwd(Ts, Hs, topk, patterns=("random", "causal"), protocol="sustained"):
    """Prints the forward table (module docstring) for token counts ``Ts`` (S = 2T) and head
    counts ``Hs`` at d_qk 576 / d_v 512, bf16, timed under ``protocol`` (a key of
    :data:`PROTOCOLS`). Exits with a message when sm90 cannot run here."""
    from mla_inductor.kernels import sm90

    require_sm90("forward")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# sparse-MLA forward, {datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, d_qk {D_QK}, d_v {D_V}, topk {topk}, S = 2T, bf16, "
          f"{protocol} timing")
    print("| T | H | indices | mode | ms | TFLOPS | exact/lazy time |")
    print("|---|---|---|---|---|---|---|")
    for T in Ts:
        S = 2 * T
        kv = torch.randn(S, D_QK, device="cuda", generator=gen).bfloat16()
        for H in Hs:
            q = torch.randn(T, H, D_QK, device="cuda", generator=gen).bfloat16()
            flops = 2 * T * H * topk * (D_QK + D_V)
            sm_scale = D_QK**-0.5
            for pattern in patterns:
                indices = make_indices(T, S, topk, pattern, gen)
                times = PROTOCOLS[protocol]({
                    mode: (lambda thr=thr, o_lo=o_lo:
                           sm90.forward(q, kv, indices, None, sm_scale, D_V, thr, o_lo))
                    for mode, (thr, o_lo) in MODES.items()
                })
                for mode, ms in times.items():
                    ratio = f"{times['exact'] / times['lazy']:.3f}" if mode == "exact" else ""
                    print(f"| {T} | {H} | {pattern} | {mode} | {ms:.3f} | "
                          f"{flops / ms / 1e9:.0f} | {ratio} |")
                if T == min(Ts):
                    ref = lambda: torch_forward(q, kv, indices, sm_scale)  # noqa: E731
                    ms = PROTOCOLS[protocol]({"torch": ref})["torch"]
                    print(f"| {T} | {H} | {pattern} | torch (chunked) | {ms:.3f} | "
                          f"{flops / ms / 1e9:.0f} | |")
            del q
        del kv


def shape_parser(prog: str, description: str = None, protocol: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the benches' shared shape flags ``--T``, ``--H``, ``--topk`` and,
    with ``protocol``, ``--protocol`` (a key of :data:`PROTOCOLS`, default ``sustained``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--T", type=int, nargs="+", default=[4096, 16384],
                        help="token counts T (S = 2T); default: 4096 16384")
    parser.add_argument("--H", type=int, nargs="+", default=[128, 64],
                        help="head counts; default: 128 64")
    parser.add_argument("--topk", type=int, default=2048, help="slots per token; default: 2048")
    if protocol:
        parser.add_argument("--protocol", choices=list(PROTOCOLS), default="sustained",
                            help="sustained: interleaved do_bench medians (time_ms_interleaved); "
                                 "cooled: FlashMLA's protocol (time_ms_cooled)")
    return parser


def require_sm90(what: str) -> None:
    """Raises ``SystemExit("sm90 <what> not available here: <reason>")`` unless the SM90 kernels
    can run on this machine."""
    from mla_inductor.kernels import sm90

    ok, why = sm90.available()
    if not ok:
        raise SystemExit(f"sm90 {what} not available here: {why}")


def main(argv=None):
    """``python -m mla_inductor.bench {fwd,bwd,train} ...`` (see the module docstring); exits with
    a usage error for another subcommand."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    what, rest = (argv[0], argv[1:]) if argv else (None, [])
    if what == "bwd":
        from .bench_bwd import main as bench_bwd

        return bench_bwd(rest)
    if what == "train":
        from .bench_train import main as bench_train

        return bench_train(rest)
    if what != "fwd":
        argparse.ArgumentParser(prog="python -m mla_inductor.bench").error(
            f"the first argument must be fwd, bwd or train, got {what!r}")
    args = shape_parser("python -m mla_inductor.bench fwd", "SM90 forward benchmark",
                        protocol=True).parse_args(rest)
    bench_fwd(args.T, args.H, args.topk, protocol=args.protocol)


if __name__ == "__main__":
    main()
