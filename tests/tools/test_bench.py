"""The benchmark command: ``--help`` at every level, usage errors, and on a machine without an
SM90 GPU each subcommand exits with a message naming why (the benchmarks themselves run on an
H200: docs/performance.md); ``hf --tiny``'s CPU smoke run and its layer's modes agreeing;
``dist --tiny`` on 2 gloo ranks (tensor and context parallel equal to one process, their
collectives) and its ``--train`` run (the losses of one process trained here, tensor and context
parallel equal to them); ``start --tiny``'s three fresh processes; on a GPU, the timers."""

import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import rel_l2
from mla_inductor.bench import cli, dist, dist_train, hf, timing


@pytest.mark.parametrize("argv", [[], ["fwd"], ["bwd"], ["train"], ["indexer-target"], ["lightning"],
                                  ["lightning-scores"], ["hf"], ["dist"], ["start"]])
def test_help_at_every_level(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m mla_inductor.bench {' '.join(argv)}".rstrip())
    if argv:
        assert "--topk" in text
    else:
        assert all(name in text for name in cli.SUBCOMMANDS)


def test_indexer_target_parser_defaults_and_flags():
    """``indexer-target`` defaults to DeepSeek-V3.2's shapes (T 4096 16384, H 128 64, topk 2048, S = T,
    random indices) and takes the shared shape flags and the protocol."""
    from mla_inductor.bench import indexer_target

    args = cli.build_parser().parse_args(["indexer-target"])
    assert (args.T, args.H, args.topk, args.S, args.indices, args.protocol) == (
        [4096, 16384], [128, 64], 2048, "T", ["random"], "sustained")
    assert args.run is indexer_target.run
    args = cli.build_parser().parse_args(
        ["indexer-target", "--T", "128", "--H", "16", "--topk", "64", "--S", "2T", "--indices",
         "random", "causal", "--protocol", "cooled"])
    assert (args.T, args.H, args.topk, args.S, args.indices, args.protocol) == (
        [128], [16], 64, "2T", ["random", "causal"], "cooled")
    # the other subcommands keep their defaults
    fwd_args = cli.build_parser().parse_args(["fwd"])
    assert fwd_args.S == "2T" and fwd_args.indices == ["random", "causal"]


def test_module_runs_as_a_command_and_rejects_unknown_subcommands():
    run = [sys.executable, "-m", "mla_inductor.bench"]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0
    assert ("{fwd,bwd,train,indexer-target,lightning,lightning-scores,hf,hf-v4,hf-glm5-next,dist,start}"
            in shown.stdout)
    wrong = subprocess.run([*run, "fw"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "invalid choice: 'fw'" in wrong.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
@pytest.mark.parametrize("what", list(cli.SUBCOMMANDS))
def test_cli_exits_with_reason_without_sm90(what):
    with pytest.raises(SystemExit, match="not available here: sm90: no CUDA device") as exited:
        cli.main([what, "--T", "128"])
    # the subcommands with a CPU smoke test say so
    assert ("--tiny runs a small smoke test on the CPU" in str(exited.value)) == (
        what in ("hf", "hf-v4", "hf-glm5-next", "dist", "start", "lightning"))


def test_lightning_tiny_runs_the_op_and_agreement_counts_shared_keys(capsys):
    """``lightning --tiny``: one row per T from the op on the CPU; ``agreement`` is the fraction
    of the second selection's valid keys that the first holds (order and -1 slots ignored)."""
    from mla_inductor.bench import lightning

    cli.main(["lightning", "--tiny", "--T", "64", "96"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 |")
            or line.startswith("| 96 |")]
    assert len(rows) == 2 and all(float(r.split(" | ")[1]) > 0 for r in rows)
    ours = torch.tensor([[0, 3, 5, -1], [1, 2, 4, 7]])
    theirs = torch.tensor([[5, 3, 0, 2], [7, 6, -1, -1]])
    assert lightning.agreement(ours, theirs) == pytest.approx((3 + 1) / (4 + 2))


def test_lightning_tiny_fp8_reports_the_recall_of_the_float_selection(capsys):
    """``lightning --tiny --fp8``: the last column is the fraction of the float32 selection's
    keys (last rows) that the fp8 selection of the per-row quantised q and k keeps, recomputed
    here with Python sets."""
    import mla_inductor
    from mla_inductor.bench import lightning

    cli.main(["lightning", "--tiny", "--fp8", "--T", "80"])
    out = capsys.readouterr().out
    assert "fp8 e4m3 (per-row scales)" in out and "recall of the bf16 selection" in out
    [row] = [line for line in out.splitlines() if line.startswith("| 80 |")]
    got = float(row.rstrip(" |").split(" | ")[-1])
    q, k, w = lightning.make_problem(80, 4, 32, "cpu", torch.float32)
    w = w.bfloat16().float() * 32**-0.5
    (q8, qs), (k8, ks) = mla_inductor.quantize_fp8(q), mla_inductor.quantize_fp8(k)
    fp8 = mla_inductor.lightning_indexer(q8, k8, w, 16, causal=True, q_scale=qs, k_scale=ks)
    full = mla_inductor.lightning_indexer(q, k, w, 16, causal=True)
    kept = total = 0
    for a, b in zip(fp8.tolist(), full.tolist()):
        want = set(b) - {-1}
        kept, total = kept + len(want & set(a)), total + len(want)
    assert got == pytest.approx(kept / total, abs=1e-5) and 0.9 < got < 1


def test_lightning_tiny_warms_up_and_times_rounds_calls(capsys, monkeypatch):
    """``lightning --tiny --rounds 3``: per T one untimed call, then 3 timed ones; a first call
    of 0.5 s (the op's first call is the slow one) stays out of the first row."""
    import mla_inductor

    calls = []
    op = mla_inductor.lightning_indexer

    def slow_first_call(*args, **kwargs):
        if not calls:
            time.sleep(0.5)
        calls.append(args[0].shape[0])
        return op(*args, **kwargs)

    monkeypatch.setattr(mla_inductor, "lightning_indexer", slow_first_call)
    cli.main(["lightning", "--tiny", "--T", "64", "96", "--rounds", "3"])
    assert calls == [64] * 4 + [96] * 4
    first = next(line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("| 64 |"))
    assert 0 < float(first.split(" | ")[1]) < 250
    with pytest.raises(SystemExit, match="needs --rounds >= 1, got 0"):
        cli.main(["lightning", "--tiny", "--rounds", "0"])


def test_start_tiny_times_three_fresh_processes(capsys):
    """``start --tiny``: three fresh interpreters (cold, warm, warm again) each time their phases;
    the optimizer's construction imports torch._dynamo (not before it), and the reference
    backend never imports the CuTe DSL."""
    cli.main(["start", "--tiny"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| cold", "| warm"))]
    assert [r[0] for r in rows] == ["| cold", "| warm", "| warm again"]
    for r in rows:
        cuda, imp, inputs, optimizer, step, after, ours = (float(x) for x in r[1:8])
        assert min(cuda, imp, optimizer, step) > 0 and inputs >= 0
        assert after == pytest.approx(imp + inputs + optimizer + step, abs=0.021)
        assert ours == pytest.approx(imp + step, abs=0.011)
        assert r[8] == "no |"


def test_the_command_imports_no_transformers():
    """``hf`` imports transformers only when it runs: the other subcommands work without it."""
    code = "import sys, mla_inductor.bench.cli; print('transformers' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "False"


def test_hf_tiny_prints_every_row_on_the_cpu(capsys):
    pytest.importorskip("transformers")
    cli.main(["hf", "--tiny", "--warmup", "1", "--iters", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"# One transformers DeepseekV32Attention layer .* \d{4}-\d\d-\d\d, CPU, torch "
                    r".*, transformers 5\.24\.\d+, hidden 64, 4 heads, .* float32;", lines[0])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[3:]]
    assert [(int(r[0]), r[1]) for r in rows] == [
        (T, mode) for T in (64, 128) for mode in (*hf.DEFAULT_MODES, *hf.INDEXER_ROWS)]
    for T, mode, ms, peak, speedup in rows:
        assert float(ms) > 0 and peak == "-"
        if mode == "patched":
            assert re.fullmatch(r"\d+\.\dx", speedup)
        elif mode == "compiled":
            assert re.fullmatch(r"\d+\.\d\dx patched's time", speedup)
        else:
            assert speedup == ""


def test_hf_tiny_with_the_indexer_loss(capsys):
    """``patched+loss`` times the step with the indexer loss backpropagated too: its last column
    is its time over patched's, and its breakdown charges the loss's scores and target."""
    pytest.importorskip("transformers")
    cli.main(["hf", "--tiny", "--T", "64", "--warmup", "1", "--iters", "2", "--modes", "patched",
              "patched+loss", "--breakdown"])
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines()[3:]]
    assert [r[1].split(",")[0] for r in rows] == ["patched", "patched+loss", "patched",
                                                  "patched+loss", hf.INDEXER_ROWS[1]]
    patched, loss = float(rows[0][2]), float(rows[1][2])
    assert rows[0][4] == ""  # nothing unpatched to compare with
    ratio = re.fullmatch(r"(\d+\.\d\d)x patched's time", rows[1][4])
    assert ratio and float(ratio[1]) == pytest.approx(loss / patched, rel=0.1)  # ms rounded
    parts = {name.strip(): float(ms) for name, ms in
             re.findall(r"([a-z ]+) (-?\d+\.\d)", rows[3][1].split("ms:")[1])}
    assert parts["indexer scores"] > 0 and parts["indexer target"] > 0
    assert float(re.search(r"indexer scores (\d+\.\d)", rows[2][1])[1]) == 0


def test_hf_reports_an_out_of_memory_and_goes_on(monkeypatch, capsys):
    """An eager layer that runs out of memory (simulated: its forward raises as the CUDA caching
    allocator does) prints OOM; the other modes still run, and the speedup is over sdpa."""
    pytest.importorskip("transformers")
    forward = hf.forward

    def eager_runs_out(attn, inputs, mask):
        if attn.config._attn_implementation == "eager":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return forward(attn, inputs, mask)

    monkeypatch.setattr(hf, "forward", eager_runs_out)
    cli.main(["hf", "--tiny", "--T", "64", "--warmup", "0", "--iters", "1"])
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines()[3:]]
    assert rows[0] == ["64", "eager", "OOM", "OOM", ""]
    assert [r[1] for r in rows] == [*hf.DEFAULT_MODES, *hf.INDEXER_ROWS]
    sdpa, patched = float(rows[1][2]), float(rows[2][2])
    assert rows[2][4].endswith("x")
    assert float(rows[2][4][:-1]) == pytest.approx(sdpa / patched, abs=0.1)  # ms printed rounded


def test_hf_breakdown_charges_each_op_to_its_category():
    """``category`` walks a profiler event's stack: the indexer's and the attention's ops outrank
    the GEMMs they launch; a plain GEMM is a projection, the rest is other. ``breakdown`` on the
    CPU sums the ops' self times: an eager matmul step lands in projections, and busy + idle is
    the wall time it was given."""
    from types import SimpleNamespace as Event

    def stack(*names):
        event = None
        for name in names:
            event = Event(name=name, cpu_parent=event)
        return event

    assert hf.category(stack("mla_inductor::lightning_indexer", "aten::mm")) == "indexer"
    assert hf.category(stack("mla_inductor::lightning_indexer_scores_bwd")) == "indexer scores"
    assert hf.category(stack("mla_inductor::indexer_target")) == "indexer target"
    assert hf.category(stack("mla_inductor::sparse_mla_bwd", "aten::mm")) == "attention"
    assert hf.category(stack("autograd::engine::evaluate_function: MmBackward0",
                             "aten::mm")) == "projections"
    assert hf.category(stack("aten::add_")) == "other"
    a = torch.randn(256, 256)
    parts = hf.breakdown(lambda: a @ a @ a, torch.device("cpu"), wall_ms=1000.0)
    assert parts["projections"] > 0 and parts["indexer"] == parts["attention"] == 0
    assert parts["busy"] == pytest.approx(sum(parts[n] for n in
                                              ("indexer", "attention", "projections", "other")))
    assert parts["busy"] + parts["idle"] == pytest.approx(1000.0)


def test_time_ms_calls_times_the_calls_after_the_warmup():
    made = []
    ms = timing.time_ms_calls(lambda: made.append(time.sleep(0.002)), 2, 3, torch.device("cpu"))
    assert len(made) == 5 and 2.0 <= ms < 100
    # before() runs before every call, outside the timed part: a 50 ms one does not show
    order = []
    ms = timing.time_ms_calls(lambda: order.append("fn"), 1, 2, torch.device("cpu"),
                              before=lambda: order.append(time.sleep(0.05)))
    assert order == [None, "fn"] * 3 and ms < 25
    with pytest.raises(ValueError, match="needs calls >= 1"):
        timing.time_ms_calls(lambda: None, 0, 0, torch.device("cpu"))


def test_hf_tiny_layer_modes_agree(monkeypatch):
    """The tiny layer's output and input gradient (T 128, topk 16: the indexer's choice matters)
    on sdpa, patched and compiled against eager, float32, within the integration's own
    tolerances (tests/integrations/test_transformers.py); of the uncompiled modes only patched calls the op."""
    pytest.importorskip("transformers")
    from mla_inductor.integrations import transformers as mla_hf

    calls, op = [], mla_hf.deepseek_v32.sparse_mla
    monkeypatch.setattr(mla_hf.deepseek_v32, "sparse_mla", lambda *a, **k: calls.append(1) or op(*a, **k))
    # 8 index heads: with TINY's 2, many keys score exactly 0 and the op's tie rule (the smaller
    # key index) keeps other tied keys than transformers' torch.topk, without either being wrong
    attn, rotary = hf.build_layer(dict(hf.TINY, index_n_heads=8), 16, torch.device("cpu"),
                                  torch.float32)
    inputs = hf.make_inputs(attn, rotary, 128)
    found = {}
    for mode in hf.DEFAULT_MODES:
        with hf.layer_mode(attn, mode):
            layer = attn
            if mode == "compiled":
                monkeypatch.setattr(mla_hf.deepseek_v32, "sparse_mla", op)
                layer = torch.compile(attn, fullgraph=True)
            out = hf.forward(layer, inputs, hf.causal_mask(attn, inputs))
        grad, = torch.autograd.grad(out, inputs.hidden_states, inputs.grad_output)
        found[mode] = out.detach(), grad, len(calls)
    assert [n for _, _, n in found.values()] == [0, 0, 1, 1]
    out, grad, _ = found["eager"]
    for mode in ("sdpa", "patched", "compiled"):
        assert rel_l2(found[mode][0], out) <= 1e-5, mode
        assert rel_l2(found[mode][1], grad) <= 1e-4, mode


def test_hf_v4_tiny_prints_every_row_and_breakdown_on_the_cpu(capsys):
    pytest.importorskip("transformers.models.deepseek_v4")
    cli.main(["hf-v4", "--tiny", "--T", "64", "--warmup", "1", "--iters", "2", "--breakdown"])
    out = capsys.readouterr().out
    tables = out.split("# One transformers DeepseekV4Attention layer, ")[1:]
    assert [t.split(",")[0] for t in tables] == ["CSA", "HCA"]
    for table in tables:
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in
                table.splitlines()[3:]]
        assert [r[1].split(",")[0] for r in rows] == ["eager", "patched", "compiled", "patched"]
        for row in (rows[0], rows[2]):
            assert float(row[2]) > 0 and re.fullmatch(r"\d+\.\d\dx", row[4])
        parts = dict(re.findall(r"([a-z]+) (-?\d+\.\d)", rows[3][1].split("ms:")[1]))
        assert set(parts) >= {"compressors", "indexer", "attention", "projections", "busy"}
        assert float(parts["compressors"]) > 0 and float(parts["attention"]) > 0
    # only the CSA layer has an indexer
    indexer = [float(re.search(r"indexer (\d+\.\d)", t)[1]) for t in tables]
    assert indexer[0] > 0 and indexer[1] == 0


def test_hf_v4_tiny_modes_agree():
    """The tiny V4 layers' output and input gradient, patched and compiled against eager
    (float32, the integration's tolerances); FlexAttention's forward on the patched layer's
    slots against the op's (FlexAttention has no CPU backward, nor an lse there: no sink in this
    check)."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from mla_inductor import sparse_mla
    from mla_inductor.bench import flex, hf_v4
    from mla_inductor.integrations.transformers import deepseek_v4

    for layer in hf_v4.LAYER_TYPES.values():
        attn, rotary = hf_v4.build_layer(layer, hf_v4.TINY, torch.device("cpu"), torch.float32,
                                         rope_dim=16)
        inputs = hf_v4.make_inputs(attn, rotary, 128)
        found, calls = {}, []
        for mode in ("eager", "patched", "compiled"):
            with hf_v4.layer_mode(attn, mode):
                op = deepseek_v4.sparse_mla
                if mode == "patched":
                    deepseek_v4.sparse_mla = lambda *a, **k: calls.append((a, k)) or op(*a, **k)
                layer = torch.compile(attn, fullgraph=True) if mode == "compiled" else attn
                try:
                    out, _ = layer(hidden_states=inputs.hidden_states,
                                  position_embeddings=inputs.position_embeddings,
                                  position_ids=inputs.position_ids,
                                  attention_mask=hf_v4.layer_mask(attn, inputs, mode))
                finally:
                    deepseek_v4.sparse_mla = op
            grad, = torch.autograd.grad(out, inputs.hidden_states, inputs.grad_output)
            found[mode] = out.detach(), grad
        assert len(calls) == 1
        for mode in ("patched", "compiled"):
            assert rel_l2(found[mode][0], found["eager"][0]) <= 1e-5, (layer, mode)
            assert rel_l2(found[mode][1], found["eager"][1]) <= 1e-4, (layer, mode)
        (q, kv, indices), kwargs = calls[0]
        q, kv, kwargs = q.detach(), kv.detach(), dict(kwargs, attn_sink=None)
        with torch.no_grad():
            ours = sparse_mla(q, kv, indices, **kwargs)
            theirs = flex.flex_sparse_mla(q, kv, indices, **kwargs)
        assert rel_l2(theirs, ours) <= 1e-5, layer


def test_hf_glm5_next_tiny_prints_every_row_breakdown_and_json_on_the_cpu(capsys, tmp_path):
    """The tiny GLM-5.3-Flash layer's table (the compiled mode is left to the next test), its
    breakdown (pooling, slots, indexer, attention, projections) and the indexer-alone rows, and
    the same rows written as JSON."""
    pytest.importorskip("transformers.models.glm5_next")
    import json

    path = tmp_path / "glm5_next.json"
    cli.main(["hf-glm5-next", "--tiny", "--T", "64", "--warmup", "1", "--iters", "2",
              "--modes", "eager", "sdpa", "patched", "--breakdown", "--json", str(path)])
    out = capsys.readouterr().out
    table = out.split("# One transformers Glm5NextTextAttention layer ")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[3:]
            if line.startswith("|")]
    assert [r[1].split(",")[0] for r in rows] == [
        "eager", "sdpa", "patched", "patched", "transformers' indexer alone (fwd)",
        "pooled indexer alone (fwd)"]
    for row in rows[:3] + rows[4:]:
        assert float(row[2]) > 0 and row[3] == "-"
    parts = dict(re.findall(r"([a-z]+) (-?\d+\.\d)", rows[3][1].split("ms:")[1]))
    assert set(parts) >= {"pooling", "slots", "indexer", "attention", "projections", "busy"}
    assert float(parts["indexer"]) > 0 and float(parts["attention"]) > 0
    report = json.loads(path.read_text())
    assert [r["mode"] for r in report["rows"]] == [r[1] for r in rows[:3] + rows[4:]]
    assert [r["ms"] for r in report["rows"]] == pytest.approx([float(r[2]) for r in rows[:3] +
                                                               rows[4:]], abs=0.06)
    assert report["breakdown"][0]["ms"]["attention"] > 0


@pytest.mark.slow
def test_hf_glm5_next_tiny_modes_agree():
    """The tiny GLM-5.3-Flash layer's output and input gradient, sdpa, patched and compiled
    against eager (float32, the integration's tolerances); FlexAttention's forward on the patched
    layer's slots against the op's (FlexAttention has no CPU backward)."""
    pytest.importorskip("transformers.models.glm5_next")
    from mla_inductor import sparse_mla
    from mla_inductor.bench import flex, hf_glm5_next
    from mla_inductor.integrations.transformers import glm5_next

    attn = hf_glm5_next.build_layer(hf_glm5_next.TINY, 4, torch.device("cpu"), torch.float32)
    inputs = hf_glm5_next.make_inputs(attn, 130)
    found, calls = {}, []
    for mode in ("eager", "sdpa", "patched", "compiled"):
        with hf_glm5_next.layer_mode(attn, mode):
            op = glm5_next.sparse_mla
            if mode == "patched":
                glm5_next.sparse_mla = lambda *a, **k: calls.append((a, k)) or op(*a, **k)
            layer = torch.compile(attn, fullgraph=True) if mode == "compiled" else attn
            try:
                out = layer(hidden_states=inputs.hidden_states,
                            attention_mask=inputs.attention_mask)[0]
            finally:
                glm5_next.sparse_mla = op
        grad, = torch.autograd.grad(out, inputs.hidden_states, inputs.grad_output)
        found[mode] = out.detach(), grad
    assert len(calls) == 1
    for mode in ("sdpa", "patched", "compiled"):
        assert rel_l2(found[mode][0], found["eager"][0]) <= 1e-5, mode
        assert rel_l2(found[mode][1], found["eager"][1]) <= 1e-4, mode
    (q, kv, indices), kwargs = calls[0]
    assert indices.shape == (1, 130, 16 + 3) and kwargs["topk_length"] is not None
    with torch.no_grad():
        ours = sparse_mla(q.detach(), kv.detach(), indices, **kwargs)
        theirs = flex.flex_sparse_mla(q.detach(), kv.detach(), indices, **kwargs)
    assert rel_l2(theirs, ours) <= 1e-5


def test_hf_glm5_next_anchors_count_the_layers_own_flops(monkeypatch):
    """The breakdown's anchors on the tiny layer at T 256 on the CPU, every timer returning 1 ms:
    the attention's FLOPs on the valid slots (``min(4, (t + 1) // 4)`` pools of 4 keys plus the
    ``(t + 1) % 4`` tail keys a token), the pooled indexer's on the visible (token, pool) pairs,
    and DeepSeek-V3.2's attention at the largest T / 2**k that fits (an out-of-memory above 64
    tokens here)."""
    pytest.importorskip("transformers.models.glm5_next")
    from mla_inductor.bench import hf_glm5_next, hf_v4

    def one_ms(fn, grad_to_none=None):
        fn()
        return 1.0

    tried = []

    def v32(T):
        tried.append(T)
        if T > 64:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return dict(slots_per_token=2048, fwd_ms=1.0, fwd_tflops=500.0, bwd_ms=1.0,
                    bwd_tflops=400.0)

    monkeypatch.setattr(hf_v4, "time_ms", one_ms)
    monkeypatch.setattr(hf_glm5_next, "time_ms", one_ms)
    monkeypatch.setattr(hf_glm5_next, "v32_rates", v32)
    attn = hf_glm5_next.build_layer(hf_glm5_next.TINY, 4, torch.device("cpu"), torch.float32)
    inputs = hf_glm5_next.make_inputs(attn, 256)
    with hf_glm5_next.layer_mode(attn, "patched"):
        def step():
            out = attn(hidden_states=inputs.hidden_states, attention_mask=inputs.attention_mask)[0]
            out.backward(inputs.grad_output)

        found = hf_glm5_next.anchors(step, 256)
    t = torch.arange(256)
    slots = (((t + 1) // 4).clamp(max=4) * 4 + (t + 1) % 4).sum().item()
    pairs = ((t + 1) // 4).sum().item()
    assert found["attention"]["slots_per_token"] == slots / 256
    assert found["attention"]["fwd_tflops"] == pytest.approx(2 * 4 * slots * (32 + 32) / 1e9)
    assert found["attention"]["bwd_tflops"] == pytest.approx(2 * 4 * slots * (3 * 32 + 2 * 32) / 1e9)
    assert found["indexer"]["tflops"] == pytest.approx(2 * 32 * 16 * pairs / 1e9)
    assert found["indexer_v32"]["tflops"] == pytest.approx(2 * 64 * 16 * pairs / 1e9)
    assert tried == [256, 128, 64] and found["attention_v32"]["T"] == 64
    assert len(found["lines"]) == 4 and "pooled / V3.2 rate 0.50" in found["lines"][3]


def test_flex_selection_bitmap_names_exactly_the_valid_slots():
    from mla_inductor.bench.flex import selection_bitmap

    S = 70
    indices = torch.tensor([[[0, 31, 32, 69, -1, 5], [69, 68, 40, 3, 2, 1]]], dtype=torch.int32)
    length = torch.tensor([[4, 2]], dtype=torch.int32)
    words = selection_bitmap(indices, length, S)
    assert words.shape == (1, 2, 3) and words.dtype == torch.int32
    bits = ((words[..., None].long() >> torch.arange(32)) & 1).flatten(-2)[..., :S].bool()
    want = torch.zeros(1, 2, S, dtype=torch.bool)
    want[0, 0, [0, 31, 32, 69]] = True
    want[0, 1, [68, 69]] = True
    assert torch.equal(bits, want)


@pytest.mark.cuda
@pytest.mark.parametrize("protocol", list(timing.PROTOCOLS))
def test_timer_measures_twice_the_work(protocol):
    """Each protocol's timer times each function on its own: a function doing the same matmul
    twice takes about twice as long as one doing it once (checked against a wide band, since the
    two share the GPU's clock drift but not its noise)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    once = lambda: a @ a  # noqa: E731
    twice = lambda: (a @ a, a @ a)  # noqa: E731
    times = timing.PROTOCOLS[protocol]({"once": once, "twice": twice})
    assert set(times) == {"once", "twice"}
    assert times["once"] > 0
    assert 1.6 < times["twice"] / times["once"] < 2.4


def test_paired_ratios_take_each_variant_over_the_base_timed_next_to_it():
    """A clock that drifts between pairs cancels in each pair's ratio: the base takes 1 ms and
    the variant 1.01 ms at clock c, with c doubling every pair, so medians of separate timings
    would read anything while every pair reads 1.01; a second variant alternates 1.0 and 1.1."""
    clock = [1.0]
    calls = {"flip": 0}

    def timer(fn):
        ms = fn() * clock[0]
        return ms

    def base():
        return 1.0

    def slow():
        clock[0] *= 2.0  # drift after the pair's base
        return 1.01 / 2.0

    def flip():
        calls["flip"] += 1
        return 1.0 + 0.1 * (calls["flip"] % 2)

    r = timing.paired_ratios(base, {"slow": slow, "flip": flip}, rounds=5, timer=timer)
    assert list(r) == ["slow", "flip"]
    assert r["slow"] == pytest.approx((1.01, 1.01, 1.01))
    median, q1, q3 = r["flip"]
    assert {round(median, 6), round(q1, 6), round(q3, 6)} <= {1.0, 1.1} and q1 <= median <= q3
    with pytest.raises(ValueError, match="rounds >= 1"):
        timing.paired_ratios(base, {}, rounds=0, timer=timer)


def test_dist_tiny_on_two_gloo_ranks(capsys):
    """``dist --tiny --ranks 2`` through the command: every row; tp and cp equal to the single
    process (out, dq, dkv; float32 on the reference backend, only the order of dkv's sums
    differs); tp all-reduces dkv ``[T, d_qk]`` once, cp all-gathers kv twice (forward and
    backward) and reduce-scatters dkv: sizes ``T * d_qk * 4`` bytes each."""
    cli.main(["dist", "--tiny", "--ranks", "2", "--warmup", "1", "--iters", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"# One DSA attention layer .* DTensor over 2 ranks \(gloo\), \d{4}-\d\d-\d\d, "
                    r"CPU, torch .*, H 8, d_qk 80, d_v 64, topk 16, S = T, float32;", lines[0])
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines[3:]]
    assert [(int(r[0]), r[1]) for r in table] == [(T, m) for T in (64, 128) for m in dist.MODES]
    size = {64: 64 * 80 * 4, 128: 128 * 80 * 4}
    expected = {"single": ("none", 0), "tp": ("all_reduce x1", 1),
                "cp": ("all_gather_into_tensor x2, reduce_scatter_tensor x1", 3)}
    for T, mode, ms, peak, counts, nbytes, speedup, err in table:
        T = int(T)
        assert float(ms) > 0 and peak == "-"
        assert counts == expected[mode][0]
        assert int(nbytes.replace(",", "")) == expected[mode][1] * size[T]
        if mode == "single":
            assert speedup == err == ""
        else:
            assert re.fullmatch(r"\d+\.\d\dx", speedup)
            assert float(err) <= 1e-5, (T, mode, err)


def test_dist_train_tiny_on_two_gloo_ranks(capsys):
    """``dist --tiny --train 3 --ranks 2`` through the command: single's losses are those of the
    same model trained here in one process on the same batches, tp's and cp's equal them
    (float32 on the reference backend: only the order of sums differs), and the last line gives
    the largest relative difference of each."""
    cli.main(["dist", "--tiny", "--train", "3", "--ranks", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"# A 2-layer DSA model \(dim 32, H 8, d_qk 80, d_v 64, topk 16, T 64; "
                    r"attention in float32, parameters float32\), 3 SGD steps \(lr 0\.5\) .* "
                    r"over 2 ranks \(gloo\), \d{4}-\d\d-\d\d, CPU, torch ", lines[0])
    assert lines[1] == "| step | single | tp | cp |"
    table = [[float(c) for c in line.strip("|").split("|")] for line in lines[3:6]]
    assert [row[0] for row in table] == [1, 2, 3]
    w = dist_train.Widths(dim=32, heads=8, d_qk=80, d_v=64, dtype="float32")
    batches = dist_train.make_batches(32, 64, 16, 3, torch.device("cpu"))
    here = dist_train.train(dist_train.Model(w), batches, lr=0.5).tolist()
    worst = {}
    for (_, single, tp, cp), loss in zip(table, here):
        assert single == pytest.approx(loss, rel=1e-6)  # printed to 7 digits
        for mode, value in (("tp", tp), ("cp", cp)):
            assert value == pytest.approx(single, rel=1e-5), (mode, value, single)
            worst[mode] = max(worst.get(mode, 0.0), abs(value - single) / single)
    found = re.fullmatch(r"largest \|loss - single\| / single over the steps: tp (\S+), cp (\S+)",
                         lines[6])
    assert found and all(float(found[i + 1]) <= 1e-5 for i in range(2)), lines[6]
    assert float(found[1]) == pytest.approx(worst["tp"], abs=1e-6)
    assert float(found[2]) == pytest.approx(worst["cp"], abs=1e-6)


def test_dist_refuses_torchrun_and_missing_gpus(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    with pytest.raises(SystemExit, match="spawns its own ranks"):
        cli.main(["dist", "--tiny"])
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(SystemExit, match="needs --ranks >= 1"):
        cli.main(["dist", "--tiny", "--ranks", "0"])
    with pytest.raises(SystemExit, match="needs --train >= 1"):
        cli.main(["dist", "--tiny", "--train", "0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--ranks 2 needs as many GPUs, found 0"):
            cli.main(["dist", "--tiny", "--device", "cuda"])
