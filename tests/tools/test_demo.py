"""The main job (``python -m mla_inductor.demo``) at a tiny size: compiled training on real text,
the indexer trained by its KL loss in the same graph."""

from __future__ import annotations

import torch

import mla_inductor
from mla_inductor import demo

TINY = dict(
    steps=16,
    batch=2,
    seq_len=32,
    d_model=32,
    d_latent=16,
    d_rope=8,
    heads=2,
    layers=1,
    topk=8,  # < seq_len: early tokens get -1 slots, later ones a real top-k choice
    d_index=8,
    lr=1e-2,
    val_batches=1,
    sample_tokens=8,
    device="cpu",
)


def test_demo_trains_compiled_without_graph_breaks():
    lines = []
    report = demo.run(demo.Config(**TINY), out=lines.append)

    assert report.graph_breaks == 0
    # One dynamo graph for training, one for no_grad evaluation and sampling: no recompiles.
    assert (report.graphs_train, report.graphs_eval) == (1, 1)
    # The policy's choice, read back from its log at each capture.
    assert report.thresholds == {"training": [0.0], "inference": [8.0]}
    assert report.loss_end < report.loss_start, report.losses
    assert len(report.losses) == TINY["steps"]
    assert 0 < report.val_loss < 10
    assert report.sample.startswith(demo.PROMPT.decode())
    assert len(report.sample) > len(demo.PROMPT)
    # The indexer learns from the KL loss: its recall of the dense attention's top-k rises.
    assert len(report.indexer_losses) == TINY["steps"] and report.indexer_trained
    assert all(0 <= loss < 10 for loss in report.indexer_losses)
    assert 0 < report.recall_start < report.recall_end <= 1
    assert report.ok
    assert any("rescale_threshold chosen at capture, training graph: 0.0" in line for line in lines)
    assert any(line.startswith("indexer recall of the dense attention's top-8") for line in lines)


def test_demo_with_an_fp8_indexer_trains_compiled_without_graph_breaks():
    """``--indexer-precision fp8``: the selection from per-row fp8 q and k in the same compiled
    graphs, the indexer still learns (its recall rises), and it selects what the fp8 lightning
    indexer selects on the quantised projections."""
    lines = []
    report = demo.run(demo.Config(**TINY, indexer_precision="fp8"), out=lines.append)
    assert report.graph_breaks == 0 and (report.graphs_train, report.graphs_eval) == (1, 1)
    assert report.loss_end < report.loss_start, report.losses
    assert 0 < report.recall_start < report.recall_end <= 1 and report.ok
    assert any(line.endswith("indexer mla_inductor.kernels.reference (fp8)") for line in lines)


def test_the_fp8_indexer_selects_from_quantised_q_and_k():
    torch.manual_seed(0)
    index = demo.Indexer(16, 8, 2, 5, precision="fp8")
    x = torch.randn(2, 12, 16)
    indices, logits = index(x)
    q = index.wq(x).view(2, 12, 2, 8)
    k = index.wk(x)
    w = index.weights(x).float() * 16**-0.5
    (q8, qs), (k8, ks) = mla_inductor.quantize_fp8(q), mla_inductor.quantize_fp8(k)
    want = mla_inductor.lightning_indexer(q8, k8, w, 5, causal=True, q_scale=qs, k_scale=ks)
    assert torch.equal(indices, want)
    # the logits: the float scores at those slots, differentiable in the indexer's projections
    assert torch.allclose(logits, mla_inductor.lightning_indexer_scores(q, k, w, indices))
    logits.sum().backward()
    assert index.wq.weight.grad.abs().sum() > 0 and index.wk.weight.grad.abs().sum() > 0


def test_parse_args_maps_flags_to_config():
    argv = ["--steps", "7", "--d-latent", "32", "--heads", "2", "--dtype", "bfloat16",
            "--indexer-loss-weight", "0.5", "--indexer-precision", "fp8"]
    cfg = demo.parse_args(argv)
    assert (cfg.steps, cfg.d_latent, cfg.heads, cfg.dtype) == (7, 32, 2, "bfloat16")
    assert cfg.indexer_loss_weight == 0.5 and cfg.indexer_precision == "fp8"
    assert cfg.topk == demo.Config().topk
    assert demo.parse_args([]).indexer_precision == "bf16"


def test_invalid_settings_exit_2_with_reason(capsys):
    assert demo.main(["--steps", "1", "--device", "cpu"]) == 2
    assert "steps must be >= 2" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert demo.main(["--steps", "3", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
