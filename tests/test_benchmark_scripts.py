"""The measuring helpers of scripts in benchmarks/ that are not exercised by their own runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from flowattn.attention import ContractiveL2MHA
from flowattn.attention.contractive import ContractiveAttention
from flowattn.flows import LogDetOptions, set_flow
from flowattn.sets import SetsRunConfig

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name: str):
    if str(BENCHMARKS) not in sys.path:  # the scripts import their neighbours (entry, machine)
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_spent_budget_captures_every_attention_branch_input():
    # Residual blocks reach their branch through ``linearise`` (closed-form products), not
    # ``forward``: the capture must see both, and leave the modules as they were.
    spent_budget = _script("spent_budget")
    torch.manual_seed(0)
    flow = set_flow(dim=2, blocks=3, heads=1, logdet=LogDetOptions("exact")).double()
    x = torch.randn(4, 5, 2, dtype=torch.float64)
    flow.log_prob(x)  # data-dependent initialisation first, as a trained flow has had
    branches = [m for m in flow.modules() if isinstance(m, ContractiveAttention)]
    seen = spent_budget.captured_inputs(flow, x, None)
    assert len(seen) == len(branches) == 3
    first_name, (module, inputs, mask) = next(iter(seen.items()))
    assert module is branches[0] and mask is None and inputs.shape == x.shape
    assert all("forward" not in vars(m) and "linearise" not in vars(m) for m in branches)
    # what was captured is what the first branch was given: rerun the flow up to it
    layers = list(flow.transform._transforms)
    h, _ = flow.standardisation(x)
    for layer in layers:
        if module in layer.modules():
            break
        h, _ = layer(h)
    assert torch.allclose(inputs, h)


def test_spent_budget_captures_branches_without_closed_form_products():
    # lifted attention has no ``linearise``: its blocks call it directly, and the capture
    # watches only the entry points a branch has
    spent_budget = _script("spent_budget")
    torch.manual_seed(0)
    flow = set_flow(dim=2, blocks=2, heads=2, attention_width=4,
                    logdet=LogDetOptions("exact")).double()
    x = torch.randn(3, 5, 2, dtype=torch.float64)
    flow.log_prob(x)
    branches = [m for m in flow.modules() if isinstance(m, ContractiveAttention)]
    seen = spent_budget.captured_inputs(flow, x, None)
    assert len(seen) == len(branches) == 2
    assert all(not hasattr(m, "linearise") and "forward" not in vars(m) for m in branches)


def test_enf_budget_is_the_epochs_of_enf_sweep_in_steps():
    # main_dw4_lj13.py: DW4 10^3 trains 300 epochs of batch 100, validating every 5 epochs;
    # 10^5, 6 epochs validated every epoch; LJ13 10, 500 epochs of batch 10 every 10 epochs
    enf = _script("enf")
    assert enf.budget("dw4", 1000) == {"steps": 3000, "batch_size": 100, "eval_every": 50}
    assert enf.budget("dw4", 100000) == {"steps": 6000, "batch_size": 100, "eval_every": 1000}
    assert enf.budget("lj13", 10000) == {"steps": 5000, "batch_size": 100, "eval_every": 100}
    assert enf.budget("lj13", 10) == {"steps": 500, "batch_size": 10, "eval_every": 10}
    with pytest.raises(SystemExit, match="no dw4 run with 5000 .* 100000"):
        enf.budget("dw4", 5000)


def test_enf_reports_solver_evaluations_of_training_or_of_the_last_validation(tmp_path):
    enf = _script("enf")
    likelihood, matching = tmp_path / "likelihood", tmp_path / "matching"
    for out, records in (
        (likelihood, [{"step": s, "split": "train", "loss": 1.0, "nfe_forward": s}
                      for s in range(10, 110, 10)] + [{"step": 100, "split": "val", "loss": 1.0,
                                                       "nfe": 7}]),
        (matching, [{"step": 10, "split": "train", "loss": 1.0},
                    {"step": 10, "split": "val", "loss": 1.0, "nfe": 40},
                    {"step": 20, "split": "val", "loss": 1.0, "nfe": 98}]),
    ):
        out.mkdir()
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert enf.nfe(likelihood) == "100"  # the last tenth of training's solves
    assert enf.nfe(matching) == "98 (validation)"  # trained without solves


def test_enf_summary_file_keeps_the_models_of_earlier_invocations(tmp_path):
    enf = _script("enf")
    path = tmp_path / "dw4-1000.json"
    enf.record(path, {"resflow": {"test_nll": 7.9}, "cnf": {"test_nll": 7.7}})
    enf.record(path, {"matching (euclidean)": {"test_nll": 7.6}, "cnf": {"test_nll": 7.65}})
    assert json.loads(path.read_text()) == {
        "resflow": {"test_nll": 7.9}, "cnf": {"test_nll": 7.65},
        "matching (euclidean)": {"test_nll": 7.6}}


@pytest.fixture
def enf_flags(tmp_path, monkeypatch):
    """benchmarks/enf.py's main on a command line: the flags each model would be fitted with
    (nothing is trained)."""
    enf = _script("enf")

    def flags(*argv: str) -> dict:
        seen = {}

        def run(name, flags, out):
            seen[name] = flags
            return {"test_nll": 7.0, "test_sets": 10, "train_seconds": 60.0, "params": 1}

        monkeypatch.setattr(enf, "run", run)
        monkeypatch.setattr(enf, "best_validation", lambda out: (7.1, 20))
        monkeypatch.setattr(enf, "nfe", lambda out: "—")
        monkeypatch.setattr(sys, "argv", ["enf.py", "--num-train", "100", "--quick",
                                          "--out", str(tmp_path), *argv])
        enf.main()
        return seen

    return flags


def test_enf_trains_every_model_on_the_device_it_is_given(enf_flags):
    seen = enf_flags("--data", "dw4", "--device", "cuda:1")
    assert set(seen) == {"resflow", "cnf", "matching"}
    assert all(flags["device"] == "cuda:1" for flags in seen.values())


@pytest.mark.parametrize("data, choice, divergence", [
    ("dw4", "enf", "exact"), ("lj13", "enf", "hutchinson"), ("lj13", "exact", "exact")])
def test_enf_scores_continuous_flows_with_enf_trace(enf_flags, data, choice, divergence):
    # E-NF's main_dw4_lj13.py validates and tests LJ13 with Hutchinson's trace, DW4 exactly
    seen = enf_flags("--data", data, "--eval-divergence", choice)
    assert seen["cnf"]["eval_divergence"] == seen["matching"]["eval_divergence"] == divergence
    assert "eval_divergence" not in seen["resflow"]  # a residual flow has no trace to choose
    SetsRunConfig.build(seen["cnf"])  # a valid run configuration


@pytest.fixture
def lm(monkeypatch):
    """benchmarks/lm.py as a module (it imports its neighbour machine.py)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return _script("lm")


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A small text for the language-model benchmarks."""
    path = tmp_path / "corpus.txt"
    path.write_text("First Citizen: before we proceed any further, hear me speak.\n" * 40)
    return path


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")),
])
def test_lm_throughput_trains_every_model_on_the_device_it_is_given(lm, corpus, monkeypatch,
                                                                     device):
    # the rates of `lm.py throughput --device cuda` are those of the GPU only if the models,
    # their optimisers and the batches are all there
    seen: dict[str, set] = {"parameters": set(), "inputs": set()}
    build = lm._optimizer

    def recording(model, base):
        seen["parameters"].update(p.device.type for p in model.parameters())
        model.register_forward_pre_hook(lambda m, args: seen["inputs"].add(args[0].device.type))
        return build(model, base)

    monkeypatch.setattr(lm, "_optimizer", recording)
    base = {**lm.NANOGPT, "data": str(corpus), "device": device, "seed": 0, "layers": 1,
            "dim": 16, "heads": 2}
    rows = lm.interleaved_throughput(base, ["dp", "contractive-l2"], rounds=1, steps=1)
    assert [r["name"] for r in rows] == ["dp", "contractive-l2"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert seen == {"parameters": {device}, "inputs": {device}}


def test_lm_throughput_times_each_compiled_model_alone_and_compiles_nothing_in_its_rounds(
        lm, corpus, monkeypatch):
    # compiled models of one class share dynamo's caches: beside each other they run as many
    # small graphs, and a pass after the warm-up may still recompile. So each compiled model
    # is compiled after a reset of the caches, and its timed rounds compile nothing.
    from torch._dynamo.utils import counters

    compile_, reset, settle = torch.compile, torch._dynamo.reset, lm._settle
    compiled_since_reset: list = []
    compiles: list = []
    checked: list = []
    settled: list[int] = []  # the number of graphs when a compiled row's rounds begin

    def rounds_compiled_nothing() -> None:
        if settled:
            assert counters["stats"]["unique_graphs"] == settled.pop()
            checked.append(True)

    def compiling(model):
        assert not compiled_since_reset, "two models compiled into the same caches"
        compiled_since_reset.append(model)
        compiles.append(model)
        return compile_(model, backend="eager")

    def resetting():
        rounds_compiled_nothing()
        compiled_since_reset.clear()
        reset()

    def settling(row, step):
        settle(row, step)
        settled.append(counters["stats"]["unique_graphs"])

    monkeypatch.setattr(torch, "compile", compiling)
    monkeypatch.setattr(torch._dynamo, "reset", resetting)
    monkeypatch.setattr(lm, "_settle", settling)
    base = {**lm.NANOGPT, "data": str(corpus), "device": "cpu", "seed": 0, "layers": 1,
            "dim": 16, "heads": 2}
    rows = lm.interleaved_throughput(base, ["dp", "contractive-l2"], rounds=2, steps=1,
                                     compile=True)
    rounds_compiled_nothing()
    reset()
    assert [(r["name"], r["mode"]) for r in rows] == [
        ("dp", "eager"), ("contractive-l2", "eager"), ("dp", "compiled"),
        ("contractive-l2", "compiled")]
    # the eager rows are timed in the rounds of each compiled one
    assert [len(r["seconds"]) for r in rows] == [4, 4, 2, 2]
    assert len(compiles) == 2 and len(checked) == 2  # the rounds of both compiled rows


def test_lm_throughput_constant_certificates_evaluate_each_certificate_once(lm, corpus,
                                                                          monkeypatch):
    # the "constant certificates" rows time the model as if its certificate were free: each
    # layer's certificate is evaluated at the row's first call and never again, while the
    # eager row of the same model evaluates it at every step
    calls = []
    certificate = ContractiveL2MHA._certificate

    def counted(self, counts, causal):
        calls.append(self)
        return certificate(self, counts, causal)

    monkeypatch.setattr(ContractiveL2MHA, "_certificate", counted)
    base = {**lm.NANOGPT, "data": str(corpus), "device": "cpu", "seed": 0, "layers": 2,
            "dim": 16, "heads": 2}
    rows = lm.interleaved_throughput(base, ["contractive-l2"], rounds=2, steps=3,
                                     constant_certificates=True)
    assert [(r["name"], r["mode"]) for r in rows] == [
        ("contractive-l2", "eager"), ("contractive-l2", "constant certificates")]
    # eager: (1 warm-up + 2 rounds) x 3 steps, each one evaluation batched over the two layers;
    # constant: one evaluation of each layer's own, in all
    assert len(calls) == 9 + 2


def test_lm_depth_study_trains_at_a_constant_rate_after_the_warm_up_it_is_given(
        lm, corpus, tmp_path, monkeypatch):
    # --depth-warmup reaches every run of the study (and its record); without it the runs keep
    # Kim et al.'s protocol, a constant rate from the first step
    seen = []

    def recorded(name, cfg, out, reuse):
        seen.append(lm.LMRunConfig.build(cfg).train)
        return {"best_val_loss": 3.0, "val_loss": 3.0, "diverged": False, "divergence": None,
                "tokens_per_s": 1.0}

    monkeypatch.setattr(lm, "run_one", recorded)
    base = {**lm.NANOGPT, "data": str(corpus), "device": "cpu", "seed": 0, "steps": 5}
    for warmup in (0, 3):
        args = lm.argparse.Namespace(depth_variants=["dp"], depths=[1, 2], depth_lr=5e-4,
                                     depth_warmup=warmup, depth_norm_position="post",
                                     out=tmp_path, reuse=False)
        record = lm.depth(args, base)
        assert record["warmup"] == warmup and record["lr"] == 5e-4
        assert (tmp_path / "depth.png").exists()
    assert [(t.schedule, t.warmup, t.lr) for t in seen] == (
        [("constant", 0, 5e-4)] * 2 + [("constant", 3, 5e-4)] * 2)


def test_set_step_benchmark_times_each_speed_up_against_the_code_before_it(monkeypatch,
                                                                           certificate_calls):
    # benchmarks/set_step.py: each baseline must undo its change (different code is timed),
    # give today's values, and restore; the flow step must start from one state every call
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    set_step = _script("set_step")
    from flowattn.attention import l2

    stacked = (l2._each_times, l2._times_each)
    with set_step.per_matrix():
        assert all(f is not g for f, g in zip((l2._each_times, l2._times_each), stacked,
                                              strict=True))
    assert (l2._each_times, l2._times_each) == stacked  # restored
    run = set_step.product(3, 5, 4, 2, 6, "cpu")
    medians, same = set_step.timed(run, set_step.PRODUCT_MODES, 1, 1, "cpu")
    assert same and set(medians) == {"today", "per-matrix products"}
    step = set_step.flow_step(2, "cpu")
    calls = certificate_calls(step.flow)
    first = step()
    assert calls[0] == 1  # today: one batched evaluation for the two blocks
    with set_step.own_certificates():
        before = step()
    assert calls[0] == 1 + 2  # before: each block its own
    assert torch.allclose(first, before, rtol=1e-4, atol=1e-6)
    medians, same = set_step.timed(step, set_step.FLOW_MODES, 1, 1, "cpu")
    assert same and len(medians) == 4
    assert torch.equal(step(), first)  # each call from the same state


def test_egnn_benchmark_times_each_speed_up_against_the_code_before_it(monkeypatch):
    # benchmarks/egnn.py: each baseline undoes its change, gives today's values and restores
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    egnn = _script("egnn")
    from flowattn import passes
    from flowattn.flows.continuous import egnn as module

    monkeypatch.setattr(passes, "PAIR_BYTES", 5 * 5 * 32 * 4)  # passes of one set of N = 5
    split = module._EquivariantLayer._first_message_layer
    run = egnn.case(3, 5, "cpu")
    field_calls = []
    original = module.EGNNField._field
    monkeypatch.setattr(module.EGNNField, "_field",
                        lambda self, *a: field_calls.append(a[1].shape[0]) or original(self, *a))
    with egnn.MODES["both as before"]():
        assert module._EquivariantLayer._first_message_layer is not split
        run()
    assert field_calls == [3]  # one pass
    assert module._EquivariantLayer._first_message_layer is split  # restored
    assert passes.PAIR_BYTES == 5 * 5 * 32 * 4
    field_calls.clear()
    run()
    assert field_calls == [1, 1, 1]
    medians, same = egnn.timed(run, 1, 1, "cpu")
    assert same and set(medians) == set(egnn.MODES)


def test_interleaved_timing_reports_a_mode_whose_values_differ_from_todays(monkeypatch):
    # benchmarks/interleaved.py: each mode's warm-up result is compared with today's
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    interleaved = _script("interleaved")
    import contextlib

    state = {"mode": None}

    def context(name):
        @contextlib.contextmanager
        def enter():
            state["mode"] = name
            yield
        return enter

    modes = {"today": context("today"), "before": context("before")}
    results = {"today": torch.zeros(2), "before": torch.zeros(2)}
    medians, same = interleaved.timed(lambda: results[state["mode"]], modes, 2, 1, "cpu",
                                      torch.equal)
    assert same and set(medians) == {"today", "before"} and all(v >= 0 for v in medians.values())
    results["before"] = torch.ones(2)
    assert not interleaved.timed(lambda: results[state["mode"]], modes, 1, 1, "cpu",
                                 torch.equal)[1]


def test_sets_symmetry_treats_the_flowattn_flow_and_the_baseline_alike(monkeypatch):
    sets = _script("sets")
    seen = {}

    def fit(config, out, **kwargs):
        seen["flow"] = config.flow.symmetry
        return {"test_nll_per_dim": 0.7, "test_nll": 11.2, "true_nll_per_dim": 0.6,
                "true_nll": 9.6, "train_seconds": 12.0}

    def run_baseline(data, seconds, num_train, seed, orders, reflections=False):
        seen["baseline"] = (seconds, reflections)
        return {"test_nll": 11.0, "train_seconds": seconds, "steps": 5, "best_step": 5,
                "sample_ms": 1.0, "true_nll": 9.6, "dims": 16}

    monkeypatch.setattr(sets, "fit", fit)
    monkeypatch.setattr(sets, "run_baseline", run_baseline)
    monkeypatch.setattr(sets, "sampling_ms_per_set", lambda run, data: 1.0)
    monkeypatch.setattr(sets, "best_iid_nll", lambda data, seed: 16.0)
    for symmetry, mirrored in (("none", False), ("reflections", True)):
        monkeypatch.setattr(sys, "argv", ["sets.py", "--data", "shape-sets", "--variants",
                                          "large", "nflows-maf", "--symmetry", symmetry])
        sets.main()
        assert seen == {"flow": symmetry, "baseline": (12.0, mirrored)}


def test_bound_tightness_structured_starts_are_the_cores_worst_arrangement(monkeypatch):
    # benchmarks/bound_tightness.py: element 0 between two clusters along a head's top query
    # direction at core distance 1.6-2.0; and the 2-norm values they lead to never exceed the
    # certificate (each is a lower bound)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bound_tightness = _script("bound_tightness")
    from flowattn.attention import L2MHA

    torch.manual_seed(0)
    module = L2MHA(8, 2).double()  # d = 4: the core's scale d^(1/4) is not near 1
    for p in module.parameters():
        p.requires_grad_(False)
    n, restarts = 9, 3  # heads 0 and 1, then both heads together
    generator = torch.Generator().manual_seed(0)
    x, scale = bound_tightness.structured_inputs(module, n, restarts, generator)
    assert x.shape == (restarts, n, 8) and scale.shape == (restarts, 1, 1)
    assert torch.equal(scale, x.flatten(1).abs().amax(1).view(-1, 1, 1))
    wq = module.head_weights(module.w_q)
    for r in range(restarts):
        # the core coordinates of the head whose direction this set was built along
        w = wq[r] if r < 2 else wq.permute(1, 0, 2).reshape(8, 8)
        z = (x[r] - x[r, :1]) @ w / module.head_dim**0.25
        along = z @ torch.linalg.svd(w).Vh[0]
        sides = along[1:].sign()
        assert (sides < 0).any() and (sides > 0).any()  # two clusters, one on each side
        assert int((sides < 0).sum()) in range((n - 1) // 2 - 2, (n - 1) // 2 + 3)
        if r < 2:  # each cluster at core distance 1.6-2.0 from element 0, up to the noise
            for side in (-1, 1):
                mean = along[1:][sides == side].abs().mean()
                assert 1.5 < mean < 2.1, (r, side, mean)
    tight = float(module.lipschitz_bound(n, 2, method="tight"))
    lower = bound_tightness.lower_bound(module, n, "2", restarts, 5, 0,
                                        start=bound_tightness.structured_inputs)
    assert 0 < lower <= tight


def test_lm_variants_study_lists_every_model_and_needs_no_corpus(lm, capsys, tmp_path):
    # the names are a hundred long: the help names them NAME and this study lists them, each
    # with what it sets, without the corpus that every other study reads
    assert lm.main(["variants", "--data", str(tmp_path / "absent.txt")]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == list(lm.VARIANTS)
    assert "| invertible | invertible=True, heads=auto |" in rows


def test_certificate_audit_runs_every_family_and_reports_a_certificate_below_a_norm(
        monkeypatch, capsys, tmp_path):
    # benchmarks/certificate_audit.py: random weight scales and settings for every certified
    # map; exit 0 when every certificate holds, 1 (naming the trial) when one is exceeded
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    audit = _script("certificate_audit")
    out = tmp_path / "audit.json"
    small = ["--trials", "2", "--restarts", "1", "--steps", "5"]
    assert audit.main([*small, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["family"] for r in rows] == list(audit.FAMILIES)
    assert all(0 < r["largest"] <= 1 + 1e-9 and r["violations"] == 0 for r in rows)
    from flowattn.branches import LipschitzMLP

    monkeypatch.setattr(LipschitzMLP, "lipschitz_bound", lambda self, n=None: torch.tensor(1e-6))
    capsys.readouterr()
    assert audit.main([*small, "--families", "mlp"]) == 1
    assert "VIOLATION mlp: " in capsys.readouterr().out


def test_a_benchmark_script_reports_a_refusal_of_several_lines_on_one_line(capsys,
                                                                            monkeypatch):
    entry = _script("entry")
    from flowattn.errors import ConfigError

    monkeypatch.setattr(sys, "argv", ["demo.py"])

    def refuse():
        raise ConfigError("first\nsecond")

    with pytest.raises(SystemExit) as exit_:
        entry.run_main(refuse)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "demo.py: error: first second\n"


@pytest.mark.parametrize("argv, message", [
    (["bound_tightness.py", "--sizes", "0"],
     "bound_tightness.py: error: sequence length must be an integer >= 1, got 0"),
    (["sets.py", "--data", "bogus"], "sets.py: error: unknown data set 'bogus'"),
    (["attention.py", "--threads", "-1"],
     "attention.py: error: argument --threads: expected an integer >= 1, got -1"),
])
def test_a_benchmark_script_refuses_bad_input_in_one_line(argv, message):
    # flowattn's refusals were tracebacks, a thread count of -1 torch's RuntimeError
    import subprocess

    done = subprocess.run([sys.executable, str(BENCHMARKS / argv[0]), *argv[1:]],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(message) and "Traceback" not in done.stderr, done.stderr[-2000:]
