"""lightning-scores: the indexer's scores at given slots and their backward, against cuDNN's.

For every T (S = T; per token ``--topk`` distinct random keys of all S, ascending, no causal
mask), ``--H`` index heads of ``--D`` (DeepSeek-V3.2: 64 of 128), bf16, weights float32 holding
bf16 values: times ours (the ops ``lightning_indexer_scores`` and
``lightning_indexer_scores_bwd`` on the sm90 backend) and, where cuDNN frontend is installed,
its ``sparse_indexer_score_recompute_wrapper`` (the same scores, then a softmax over the slots)
and ``indexer_backward_wrapper`` (the KL loss's score gradient, then the same gradients), in the
same interleaved rounds (:func:`mla_inductor.bench.timing.time_ms_interleaved`): the forward,
the backward and the two in a row. Our backward is given cuDNN's own score gradient (which its
backward writes over its target), so both compute the same dq, dk and dweights. Reports
milliseconds, TFLOPS (forward ``2 T H topk D``; backward 3x that: the logits recomputed, dq and
dk) and the agreement of the values: the relative L2 distance of softmax(ours) to cuDNN's
forward, and of each gradient to cuDNN's (which stores dq, dk and dweights in bf16).
"""

from __future__ import annotations

import argparse
import datetime

import torch

from ..accuracy import rel_l2
from .problems import require_sm90
from .timing import time_ms_interleaved

INDEX_CHUNK_ROWS = 1024  # rows of random keys drawn at once (a [rows, S] float32 draw)


def _cudnn():
    """cuDNN frontend's ``(sparse_indexer_score_recompute_wrapper, indexer_backward_wrapper)``,
    or None when it is not installed."""
    try:
        from cudnn.deepseek_sparse_attention import (
            indexer_backward_wrapper,
            sparse_indexer_score_recompute_wrapper,
        )
    except ImportError:
        return None
    return sparse_indexer_score_recompute_wrapper, indexer_backward_wrapper


def random_indices(T: int, S: int, topk: int, device, gen) -> torch.Tensor:
    """``[1, T, topk]`` int32: per token ``topk`` distinct keys drawn uniformly from ``[0, S)``,
    ascending (``topk <= S``)."""
    rows = []
    for t0 in range(0, T, INDEX_CHUNK_ROWS):
        n = min(INDEX_CHUNK_ROWS, T - t0)
        draw = torch.rand(n, S, device=device, generator=gen)
        rows.append(draw.topk(topk, dim=1).indices.sort(dim=1).values.to(torch.int32))
    return torch.cat(rows)[None]


def make_problem(T: int, H: int, D: int, topk: int, seed: int = 0):
    """Seeded ``(q [1, T, H, D] bf16, k [1, T, D] bf16, weights [1, T, H] bf16, indices
    [1, T, topk] int32, target [1, T, topk] float32)``: normal q and k, weights ``N(0, 1)
    H**-0.5 D**-0.5`` (the scale folded in), the target a random distribution over each
    token's slots (the KL loss's attention target)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(1, T, H, device="cuda", generator=gen) * (H * D) ** -0.5).to(torch.bfloat16)
    indices = random_indices(T, T, topk, "cuda", gen)
    target = torch.rand(1, T, topk, device="cuda", generator=gen)
    return q, k, w, indices, target / target.sum(-1, keepdim=True)


def bench_lightning_scores(Ts, H: int, D: int, topk: int, rounds: int = 5) -> None:
    """Prints the table of the module docstring for token counts ``Ts``."""
    anchor = _cudnn()
    print(f"# lightning_indexer_scores, S = T, {H} index heads x {D}, topk {topk} random keys, "
          f"bf16, {datetime.date.today()}, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}; TFLOPS on 2*T*H*topk*D (forward), 3x that (backward)"
          + ("" if anchor else "; cuDNN frontend not installed"))
    print("| T | pass | ours ms | ours TFLOPS | cuDNN ms | cuDNN TFLOPS | ours / cuDNN speed "
          "(cuDNN ms / ours ms) | agreement (rel L2 to cuDNN) |")
    print("|---|---|---|---|---|---|---|---|")
    for T in Ts:
        for cells in _rows(T, H, D, topk, anchor, rounds):
            print(f"| {T} | " + " | ".join(cells) + " |", flush=True)
        torch.cuda.empty_cache()


def _rows(T: int, H: int, D: int, topk: int, anchor, rounds: int) -> list:
    """The table's three rows (forward, backward, both) of one T: lists of cells after T."""
    import mla_inductor  # noqa: F401  (registers the ops)

    ops = torch.ops.mla_inductor
    q, k, w16, idx, target = make_problem(T, H, D, topk)
    w = w16.float()
    fwd_flops = 2 * T * H * topk * D
    flops = {"forward": fwd_flops, "backward": 3 * fwd_flops, "forward + backward": 4 * fwd_flops}
    scores = ops.lightning_indexer_scores(q, k, w, idx)
    dscores = torch.randn_like(scores) / (T * topk)
    agree = {}
    fns = {}
    if anchor is not None:
        recompute, backward = anchor
        grad_loss = torch.ones(1, device="cuda")
        predict = recompute(q, k, w16, idx)["predict"]
        signal = target.clone()  # cuDNN's backward writes its score gradient over it
        theirs = backward(q, w16, k, signal, predict, idx, grad_loss)
        dscores = signal.clone()
        ours = ops.lightning_indexer_scores_bwd(dscores, q, k, w, idx)
        agree["forward"] = f"{rel_l2(scores.softmax(-1), predict):.1e}"
        agree["backward"] = ", ".join(
            f"{name} {rel_l2(a, theirs[key]):.1e}"
            for name, a, key in zip(("dq", "dk", "dweights"), ours,
                                    ("d_index_q", "d_index_k", "d_weights")))
        agree["forward + backward"] = agree["backward"]
        buf = target.clone()  # overwritten by every call; its values do not change the time
        fns[("cudnn", "forward")] = lambda: recompute(q, k, w16, idx)
        fns[("cudnn", "backward")] = lambda: backward(q, w16, k, buf, predict, idx, grad_loss)
        fns[("cudnn", "forward + backward")] = lambda: backward(
            q, w16, k, buf, recompute(q, k, w16, idx)["predict"], idx, grad_loss)

    def ours_forward():
        return ops.lightning_indexer_scores(q, k, w, idx)

    def ours_backward():
        return ops.lightning_indexer_scores_bwd(dscores, q, k, w, idx)

    def ours_both():
        ours_forward()
        return ours_backward()

    fns = {("ours", "forward"): ours_forward, ("ours", "backward"): ours_backward,
           ("ours", "forward + backward"): ours_both, **fns}
    times = time_ms_interleaved(fns, rounds=rounds)
    rows = []
    for what, n in flops.items():
        ms = times[("ours", what)]
        cells = [what, f"{ms:.3f}", f"{n / ms / 1e9:.0f}"]
        if anchor is not None:
            cms = times[("cudnn", what)]
            cells += [f"{cms:.3f}", f"{n / cms / 1e9:.0f}", f"{cms / ms:.2f}x", agree[what]]
        else:
            cells += ["-"] * 4
        rows.append(cells)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``lightning-scores`` subcommand's flags: ``--T``, ``--H``, ``--D``, ``--topk``,
    ``--rounds``."""
    parser.add_argument("--T", type=int, nargs="+", default=[16384, 32768, 65536],
                        help="token counts T = S; default: 16384 32768 65536")
    parser.add_argument("--H", type=int, default=64, help="index heads; default: 64")
    parser.add_argument("--D", type=int, default=128, help="index head width; default: 128")
    parser.add_argument("--topk", type=int, default=2048,
                        help="keys selected per token; default: 2048")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved timing rounds; default: 5")


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`). Exits with a message when the
    sm90 kernels cannot run here."""
    require_sm90("lightning indexer scores")
    bench_lightning_scores(args.T, args.H, args.D, args.topk, rounds=args.rounds)
