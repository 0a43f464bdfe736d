"""The benchmarks' timers, in one place: every table of :mod:`mla_inductor.bench` is timed by
one of them.

- :func:`time_ms`: the median of one ``triton.testing.do_bench`` run (CUDA events, L2 flushed).
- :func:`time_ms_interleaved` (protocol ``sustained``): the contenders of one row timed in
  interleaved rounds, so that they see the same clock drift.
- :func:`time_ms_cooled` (protocol ``cooled``): FlashMLA's benchmark protocol.
- :func:`time_ms_calls`: a fixed number of calls, for functions too slow for ``do_bench``'s
  budget (hundreds of ms a call) and for CPU smoke runs.
- :func:`paired_ratios`: the time of each variant over a base function's, from adjacent pairs,
  for costs of a percent or less.

All take zero-argument callables and return milliseconds (float); all but :func:`time_ms_calls`
time CUDA work only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_ms(fn, grad_to_none=None) -> float:
    """Median milliseconds of ``fn()`` by ``triton.testing.do_bench`` (CUDA events; ``.grad`` of
    the tensors in ``grad_to_none`` reset before each call), or, when triton is not installed,
    of 20 CUDA-event timings after one untimed call (:func:`time_ms_calls`)."""
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")
    except ImportError:
        def reset():
            for t in grad_to_none or ():
                t.grad = None

        return time_ms_calls(fn, 1, 20, torch.device("cuda"), before=reset)


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


def time_ms_calls(fn, warmup: int, calls: int, device: torch.device, before=None) -> float:
    """Median milliseconds of ``calls`` calls of ``fn()`` after ``warmup`` untimed ones, each call
    timed alone: CUDA events on a CUDA ``device``, ``time.perf_counter`` otherwise. ``before()``,
    if given, runs untimed before every call (warm-up ones too), e.g. a barrier that lines up
    the ranks of a process group so that each call starts on all of them at once.

    For calls of hundreds of milliseconds (``do_bench`` makes 5 estimation calls, then as many
    as fit in 200 ms: at least one, whatever the cost) and for runs on the CPU, which the other
    timers do not time. No L2 flush: a call that long evicts L2 itself.

    Raises:
        ValueError: ``calls < 1`` or ``warmup < 0``. Whatever ``fn`` raises.
    """
    if calls < 1 or warmup < 0:
        raise ValueError(f"time_ms_calls: needs calls >= 1 and warmup >= 0, got {calls}, {warmup}")
    before = before or (lambda: None)
    for _ in range(warmup):
        before()
        fn()
    times = []
    for _ in range(calls):
        before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def paired_ratios(base, variants: dict, rounds: int = 21, timer=None) -> dict:
    """The cost of each variant relative to ``base``, from pairs timed back to back.

    Each round times ``base`` and then each variant right after it, and takes their ratio; the
    result is the median and the quartiles of each variant's ratios over the rounds. A clock
    drift slower than one pair cancels in its ratio, which the medians of
    :func:`time_ms_interleaved` only average out: on the H200 the same kernel read up to 2.5%
    apart between two such medians of one run (README, "DSA features: what they cost").

    Args:
        base: the reference ``fn()``; variants: ``{name: fn}``.
        rounds: pairs per variant (at least 1).
        timer: ``timer(fn) -> ms`` for one measurement; default a short
            ``triton.testing.do_bench`` median (10 ms warm-up, 60 ms timed; CUDA work).

    Returns:
        ``{name: (median, p25, p75)}`` of ``time(variant) / time(base)``, in ``variants``' order.

    Raises:
        ValueError: ``rounds < 1``. Whatever a function raises (each is called once first).
    """
    if rounds < 1:
        raise ValueError(f"paired_ratios: needs rounds >= 1, got {rounds}")
    if timer is None:
        from triton.testing import do_bench

        def timer(fn):
            return do_bench(fn, warmup=10, rep=60, return_mode="median")

    base()
    for fn in variants.values():
        fn()
    ratios = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            reference = timer(base)
            ratios[name].append(timer(fn) / reference)
    out = {}
    for name, r in ratios.items():
        q1, _, q3 = statistics.quantiles(r, n=4) if len(r) > 1 else (r[0], None, r[0])
        out[name] = (statistics.median(r), q1, q3)
    return out


PROTOCOLS = {"sustained": time_ms_interleaved, "cooled": time_ms_cooled}


def add_protocol_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--protocol {sustained,cooled}`` (a key of :data:`PROTOCOLS`, default
    ``sustained``) to a subcommand's parser."""
    parser.add_argument("--protocol", choices=list(PROTOCOLS), default="sustained",
                        help="sustained: interleaved do_bench medians (time_ms_interleaved); "
                             "cooled: FlashMLA's protocol (time_ms_cooled); default: sustained")


def peak_bytes(fn) -> int:
    """Bytes ``fn()`` allocates on the current CUDA device at its peak, on top of what was
    allocated before it (its result included while it is alive)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak
