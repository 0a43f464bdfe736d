"""lightning: the lightning indexer (scores + top-k selection) against cuDNN frontend's SM90 pair.

For every T (S = T, causal: token t sees keys 0..t), ``--H`` index heads of ``--D`` (DeepSeek-V3.2:
64 of 128) and ``--topk`` (2048), bf16: times :func:`mla_inductor.lightning_indexer` (``causal``)
and, where cuDNN frontend is installed and its dense scores fit, its ``indexer_forward_wrapper``
(dense ``[T, S]`` float32 scores, causal mask) followed by ``indexer_top_k_wrapper`` (radix top-k),
in the same interleaved rounds (:func:`mla_inductor.bench.timing.time_ms_interleaved`). Reports
milliseconds, TFLOPS on the causal score FLOPs ``T·S/2·H·D·2``, the peak memory each call
allocates on top of its inputs, ``ours / cuDNN speed`` (cuDNN's ms over ours: above 1, ours is
faster), and the agreement of the two selections: the fraction of cuDNN's
keys that ours also selects, over the last rows (they see the most keys). cuDNN is given
``sm_scale = D**-0.5`` and ours the same scale folded into the weights (``relu(a·x) = a·relu(x)``
for ``a > 0``). ``--tiny`` runs small problems on the CPU (the reference backend, one CPU
thread), without cuDNN: the median of ``--rounds`` calls, each timed alone, after one untimed
call (the first call of the op costs far more than the next ones).

``--fp8``: the fp8 indexer of DeepSeek-V3.2-Exp's inference code. q and k are quantised per row
by :func:`mla_inductor.quantize_fp8` (``q_scale [T, H]``, ``k_scale [S]`` float32) and the weights
rounded to bf16 (cuDNN's fp8 path takes them in bf16; ours gets the same values in float32).
Ours is the op on those fp8 inputs; cuDNN's is ``indexer_forward_wrapper(..., precision="fp8",
q_scale [1, T, H], k_scale [1, S, 1])`` and the same top-k. Besides the agreement with cuDNN's
fp8 selection, the table gives the recall of the bf16 selection: the fraction of the keys our
op selects from the unquantised bf16 q and k (same weights) that our fp8 selection keeps, over
the same rows. With ``--tiny`` the unquantised inputs are float32.
"""

from __future__ import annotations

import argparse
import datetime

import torch

from .problems import require_sm90, run_threads
from .timing import peak_bytes, time_ms_calls, time_ms_interleaved

AGREEMENT_ROWS = 256  # rows of the selection compared with cuDNN's (the last ones)


def _cudnn():
    """cuDNN frontend's ``(indexer_forward_wrapper, indexer_top_k_wrapper)``, or None."""
    try:
        from cudnn.deepseek_sparse_attention import indexer_forward_wrapper, indexer_top_k_wrapper
    except ImportError:
        return None
    return indexer_forward_wrapper, indexer_top_k_wrapper


def make_problem(T: int, H: int, D: int, device, dtype, seed: int = 0):
    """Seeded ``(q [T, H, D], k [T, D], weights [T, H] float32)``: normal q and k in ``dtype``, and
    weights ``N(0, 1) · H**-0.5`` (the models' ``weights_proj`` output times ``H**-0.5``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, D, device=device, generator=gen).to(dtype)
    k = torch.randn(T, D, device=device, generator=gen).to(dtype)
    weights = torch.randn(T, H, device=device, generator=gen) * H**-0.5
    return q, k, weights


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The fraction of the valid keys (>= 0) of ``theirs [R, topk]`` that the same row of ``ours``
    also holds, over all rows."""
    hits = total = 0
    for a, b in zip(ours.long(), theirs.long()):
        b = b[b >= 0]
        hits += int(torch.isin(b, a[a >= 0]).sum())
        total += b.numel()
    return hits / max(total, 1)


def _calls(q, k, weights, topk: int, fp8: bool, anchor):
    """``(ours, theirs or None, bf16 selection or None)`` for one problem: zero-argument calls of
    our op, of cuDNN's scores + top-k (None without cuDNN), and (``fp8``) of our op on the
    unquantised q and k, whose selection the fp8 one is compared with (module docstring)."""
    import mla_inductor

    T, D = q.shape[0], q.shape[-1]
    scale = D**-0.5
    w = weights.bfloat16() if fp8 else weights  # cuDNN's fp8 path takes bf16 weights
    ours_w = w.float() * scale
    unquantised, scaled = (q, k), {}
    if fp8:
        (q, q_scale), (k, k_scale) = mla_inductor.quantize_fp8(q), mla_inductor.quantize_fp8(k)
        scaled = dict(q_scale=q_scale, k_scale=k_scale)

    def ours():
        return mla_inductor.lightning_indexer(q, k, ours_w, topk, causal=True, **scaled)

    def bf16():
        return mla_inductor.lightning_indexer(*unquantised, ours_w, topk, causal=True)

    theirs = None
    if anchor is not None:
        scores_fn, topk_fn = anchor
        lens = torch.arange(1, T + 1, device=q.device, dtype=torch.int32)
        extra = {}
        if fp8:
            extra = dict(precision="fp8", q_scale=scaled["q_scale"][None],
                         k_scale=scaled["k_scale"][None, :, None])

        def theirs():
            scores = scores_fn(q[None], k[None, :, None], w[None], ratio=1, sm_scale=scale,
                               **extra)["scores"]
            return topk_fn(scores[0], lens, topk, return_val=False)["indices"]

    return ours, theirs, (bf16 if fp8 else None)


def bench_lightning(Ts, H: int, D: int, topk: int, tiny: bool = False, rounds: int = 5,
                    fp8: bool = False) -> None:
    """Prints the table of the module docstring for token counts ``Ts``; ``tiny``: on the CPU in
    float32, ours alone; ``fp8``: the fp8 indexer, with the recall of the bf16 selection.
    ``rounds``: the interleaved rounds on the GPU; with ``tiny``, the timed calls (milliseconds:
    their median, after one untimed call).

    Raises:
        ValueError: ``rounds < 1`` with ``tiny``."""
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    anchor = None if tiny else _cudnn()
    where = "CPU" if tiny else torch.cuda.get_device_name()
    precision = "fp8 e4m3 (per-row scales)" if fp8 else str(dtype).removeprefix('torch.')
    print(f"# lightning indexer, causal, S = T, {H} index heads x {D}, topk {topk}, "
          f"{precision}, {datetime.date.today()}, {where}, torch "
          f"{torch.__version__}; TFLOPS on T*S/2*H*D*2; peak: bytes allocated over the inputs"
          + ("" if anchor or tiny else "; cuDNN frontend not installed"))
    recall = " recall of the bf16 selection |" if fp8 else ""
    print("| T | ours ms | ours TFLOPS | ours peak GiB | cuDNN scores + top-k ms | cuDNN TFLOPS "
          "| cuDNN peak GiB | ours / cuDNN speed (cuDNN ms / ours ms) | agreement with cuDNN |"
          + recall)
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if fp8 else ""))
    for T in Ts:
        q, k, weights = make_problem(T, H, D, device, dtype)
        ours, theirs, bf16 = _calls(q, k, weights, topk, fp8, anchor)
        rows = slice(T - min(T, AGREEMENT_ROWS), T)
        recall = [f"{agreement(ours()[rows], bf16()[rows]):.5f}"] if fp8 else []
        flops = T * T / 2 * H * D * 2
        if tiny:
            ms = time_ms_calls(ours, warmup=1, calls=rounds, device=device)
            print(f"| {T} | {ms:.1f} | {flops / ms / 1e9:.3f} | - | - | - | - | - | - |"
                  + "".join(f" {c} |" for c in recall))
            continue
        fns = {"ours": ours}
        if theirs is not None:
            try:
                torch.cuda.empty_cache()
                theirs()
                fns["cudnn"] = theirs
            except torch.cuda.OutOfMemoryError:
                theirs = None
                torch.cuda.empty_cache()
        times = time_ms_interleaved(fns, rounds=rounds)
        ours_peak = peak_bytes(ours) / 2**30
        ms = times["ours"]
        cells = [f"{ms:.2f}", f"{flops / ms / 1e9:.0f}", f"{ours_peak:.2f}"]
        if theirs is not None:
            cms = times["cudnn"]
            their_peak = peak_bytes(theirs) / 2**30
            agree = agreement(ours()[rows], theirs()[rows])
            cells += [f"{cms:.2f}", f"{flops / cms / 1e9:.0f}", f"{their_peak:.2f}",
                      f"{cms / ms:.2f}x", f"{agree:.5f}"]
        else:
            cells += ["OOM" if anchor is not None else "-"] + ["-"] * 4
        print(f"| {T} | " + " | ".join(cells + recall) + " |", flush=True)
        del q, k, weights, fns, ours, theirs, bf16
        torch.cuda.empty_cache()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``lightning`` subcommand's flags: ``--T``, ``--H``, ``--D``, ``--topk``, ``--rounds``,
    ``--tiny``, ``--fp8``."""
    parser.add_argument("--T", type=int, nargs="+", default=None,
                        help="token counts T = S; default: 16384 32768 65536 131072 (with --tiny: "
                             "128 512)")
    parser.add_argument("--H", type=int, default=None,
                        help="index heads; default: 64 (with --tiny: 4)")
    parser.add_argument("--D", type=int, default=None,
                        help="index head width; default: 128 (with --tiny: 32)")
    parser.add_argument("--topk", type=int, default=None,
                        help="keys selected per token; default: 2048 (with --tiny: 16)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved timing rounds (with --tiny: timed calls, after one "
                             "untimed call); default: 5")
    parser.add_argument("--tiny", action="store_true",
                        help="small problems on the CPU (reference backend, one CPU thread): a "
                             "smoke run")
    parser.add_argument("--fp8", action="store_true",
                        help="q and k quantised per row to e4m3 (quantize_fp8), cuDNN in its fp8 "
                             "precision; adds the recall of the bf16 selection")


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`). Exits with a message when the
    sm90 kernels cannot run here (unless ``--tiny``), or when ``--rounds`` is below 1."""
    if args.rounds < 1:
        raise SystemExit(f"mla_inductor: bench lightning needs --rounds >= 1, got {args.rounds}")
    if not args.tiny:
        require_sm90("lightning indexer", tiny=True)
    tiny = args.tiny
    with run_threads(tiny):
        bench_lightning(args.T or ([128, 512] if tiny else [16384, 32768, 65536, 131072]),
                        args.H or (4 if tiny else 64), args.D or (32 if tiny else 128),
                        args.topk or (16 if tiny else 2048), tiny=tiny, rounds=args.rounds,
                        fp8=args.fp8)
