"""The training core both commands share: configs, run folders, resume, checkpoints, metrics,
devices, divergence and the command line's errors — each case a user can hit."""

import contextlib
import copy
import io
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flowattn.cli import main
from flowattn.data import save_npz
from flowattn.errors import CheckpointError, ConfigError, DataError, FlowattnError, RunError
from flowattn.progress import Progress, progress_batches
from flowattn.sets.config import SetsRunConfig
from flowattn.sets.train import fit
from flowattn.training.checkpoint import read_checkpoint
from flowattn.training.config import read_config_file
from flowattn.training.device import resolve_device
from flowattn.training.metrics import MetricsLog, read_metrics
from flowattn.training.schedule import learning_rate

ROOT = Path(__file__).resolve().parents[1]
TINY = {"data": "gaussian-sets", "num_train": 64, "batch_size": 8, "blocks": 1, "hidden": 8,
        "steps": 4, "eval_every": 2, "checkpoint_every": 2, "val_sets": 16, "warmup": 1}
SETS_FLAGS = ["--num-train", "64", "--batch-size", "8", "--blocks", "1", "--hidden", "8",
              "--eval-every", "2", "--checkpoint-every", "2", "--val-sets", "16",
              "--no-progress", "--no-tensorboard"]
TEXT = "to be or not to be, that is the question. " * 50
LM_FLAGS = ["--layers", "1", "--dim", "16", "--heads", "2", "--block-size", "16",
            "--batch-size", "4", "--eval-every", "2", "--checkpoint-every", "2",
            "--no-progress", "--no-tensorboard"]


def fit_tiny(out: Path, **changes) -> dict:
    config = SetsRunConfig.build({**TINY, **changes})
    return fit(config, out, progress=False, tensorboard=False, plots=False)


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse: --help and usage errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(capsys, *argv, code: int = 2) -> str:
    status, _, err = cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert status == code, (status, err)
    assert len(lines) == 1, lines
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def records(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


# ----------------------------------------------------------------------------- typed configs


@pytest.mark.parametrize(
    "values, message",
    [
        ({"grad_clip": -1}, r"train: grad_clip: Input should be greater than 0 \(got -1\)"),
        ({"warmup": -5}, r"train: warmup: .* greater than or equal to 0 \(got -5\)"),
        ({"location": "false"}, r"flow: location: Input should be a valid boolean"),
        ({"mlp": "no"}, r"flow: mlp: Input should be a valid boolean \(got 'no'\)"),
        ({"steps": "five"}, r"train: steps: Input should be a valid integer \(got 'five'\)"),
        ({"blocks": 2.5}, r"flow: blocks: Input should be a valid integer \(got 2.5\)"),
        ({"data": 5}, r"data: data: Input should be a valid string \(got 5\)"),
        ({"num_train": -3}, r"data: num_train: .* greater than or equal to 1 \(got -3\)"),
        ({"lr": float("nan")}, r"train: lr: "),
        ({"min_lr": 1.0}, r"train: min_lr \(1.0\) must not exceed lr"),
        ({"device": "gpu"}, r"train: device: is not one of cpu, cuda, cuda:N, auto \(got .gpu.\)"),
        ({"ema": 1.0}, r"train: ema: Input should be less than 1 \(got 1.0\)"),
        ({"ema": 0}, r"train: ema: Input should be greater than 0 \(got 0\)"),
        ({"nope": 1}, r"unknown setting 'nope'"),
        ({"train": {"stepz": 1}}, r"train: stepz: unknown setting"),
        ({"train": {"steps": 3}, "steps": 4}, r"steps is given twice \(steps and train.steps\)"),
        ({"seed": 2**64}, r"train: seed: Input should be less than or equal to"),
        ({"data": "x.npz", "num_train": 10}, r"num_train=10 sizes a built-in data set's"),
    ],
)
def test_config_refuses_each_bad_value_naming_key_and_value(values, message):
    with pytest.raises(ConfigError, match=message):
        SetsRunConfig.build(values)


def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe")
    line = one_line(capsys, "sets", "fit", "--config", tmp_path / "bin.yaml", "--out",
                    tmp_path / "run")
    assert "bin.yaml is not UTF-8 text" in line


def test_config_files_are_json_or_yaml_flat_or_nested(tmp_path):
    (tmp_path / "a.yaml").write_text("train:\n  steps: 7\nflow:\n  blocks: 3\nlr: 0.01\n")
    (tmp_path / "b.json").write_text(json.dumps({"steps": 7, "flow": {"blocks": 3},
                                                 "lr": 0.01}))
    a, b = (SetsRunConfig.build(read_config_file(tmp_path / f)) for f in ("a.yaml", "b.json"))
    assert a == b and a.train.steps == 7 and a.flow.blocks == 3 and a.train.lr == 0.01
    (tmp_path / "bad.yaml").write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        read_config_file(tmp_path / "bad.yaml")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        read_config_file(tmp_path / "list.json")
    # another format by its suffix was only "not valid JSON"
    (tmp_path / "run.toml").write_text("steps = 3\n")
    with pytest.raises(ConfigError, match=r"run.toml is not valid JSON: .* \(a config file is "
                       r"JSON, or YAML named .yaml or .yml; .toml is read as JSON\)$"):
        read_config_file(tmp_path / "run.toml")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML: [^(]*$"):
        read_config_file(tmp_path / "bad.yaml")
    # the place of a YAML error, which its message puts on later lines, is named
    (tmp_path / "indent.yaml").write_text("steps: 10\n  blocks: 3\n")
    with pytest.raises(ConfigError, match=r"indent.yaml is not valid YAML: mapping values are "
                       r"not allowed here at line 2, column 9$"):
        read_config_file(tmp_path / "indent.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML: while parsing a flow "
                       r"node: expected the node content, .* at line 2, column 1$"):
        read_config_file(tmp_path / "bad.yaml")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_an_empty_yaml_config_is_refused_like_an_empty_json_one(tmp_path, text):
    # it was taken as the defaults, while an empty JSON file is a syntax error
    (tmp_path / "empty.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"empty.yaml holds no settings .* write \{\} for the "
                       r"defaults"):
        read_config_file(tmp_path / "empty.yaml")
    (tmp_path / "empty.json").write_text(text)
    with pytest.raises(ConfigError, match="empty.json is not valid JSON"):
        read_config_file(tmp_path / "empty.json")
    (tmp_path / "braces.yaml").write_text("{}\n")
    assert read_config_file(tmp_path / "braces.yaml") == {}


@pytest.mark.parametrize("name, text", [
    ("flat.yaml", "steps: 5\nlr: 0.01\nsteps: 6\n"),
    ("nested.yaml", "train:\n  steps: 5\n  steps: 6\n"),
    ("flat.json", '{"steps": 5, "steps": 6}'),
    ("nested.json", '{"train": {"steps": 5, "steps": 6}}')])
def test_a_setting_written_twice_in_a_config_file_is_refused(tmp_path, name, text):
    # both parsers keep the last value silently: the user meant one of them
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=f"config .*{name}: 'steps' given twice; keep one"):
        read_config_file(tmp_path / name)


def test_a_yaml_merge_may_still_be_overridden(tmp_path):
    (tmp_path / "merge.yaml").write_text("base: &b\n  steps: 5\ntrain:\n  <<: *b\n  steps: 7\n")
    assert read_config_file(tmp_path / "merge.yaml")["train"] == {"steps": 7}


def test_bad_values_on_the_command_line_are_one_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    line = one_line(capsys, "sets", "fit", "--steps", "five", "--out", out)
    assert "--steps expects an integer, got 'five'" in line
    line = one_line(capsys, "sets", "fit", "--num-train", "-3", "--out", out)
    assert "num_train" in line and "-3" in line
    line = one_line(capsys, "lm", "train", "--threads", "0", "--out", out)
    assert "threads" in line and "(got 0)" in line
    (tmp_path / "c.json").write_text(json.dumps({"grad_clip": -1}))
    line = one_line(capsys, "sets", "fit", "--config", tmp_path / "c.json", "--out", out)
    assert "grad_clip" in line and "(got -1)" in line
    assert not out.exists()


def test_help_shows_every_setting_with_its_default_and_print_config_every_key(capsys):
    code, text, _ = cli(capsys, "sets", "fit", "--help")
    assert code == 0
    for name in SetsRunConfig.leaves():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
    for flag in ("--flow", "--steps", "--batch-size", "--seed"):
        line = next(line for line in text.splitlines() if line.strip().startswith(flag))
        block = text[text.index(line):text.index(line) + 300]
        assert "(default:" in block, flag
    code, text, _ = cli(capsys, "sets", "fit", "--print-config", "--steps", "9")
    import yaml

    printed = yaml.safe_load(text)
    assert code == 0 and printed["train"]["steps"] == 9
    assert {k for section in printed.values() for k in section} == set(SetsRunConfig.leaves())
    code, text, _ = cli(capsys, "lm", "train", "--print-config", "json", "--layers", "2")
    assert code == 0 and json.loads(text)["network"]["layers"] == 2


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize("name", ["gpu", "CUDA", "mps", "cuda:x", ""])
def test_unknown_devices_are_refused(name):
    with pytest.raises(ConfigError, match="is not one of cpu, cuda, cuda:N, auto"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda_is_one_line_in_every_command(tmp_path, capsys, corpus):
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device(name)
    run = tmp_path / "run"
    fit_tiny(run)
    for argv in (["sets", "eval", "--checkpoint", run, "--data", "gaussian-sets"],
                 ["sets", "sample", "--checkpoint", run, "--num", "2", "--out",
                  tmp_path / "s.npz"],
                 ["lm", "train", "--data", corpus, "--out", tmp_path / "x"],
                 ["sets", "fit", "--out", tmp_path / "y"]):
        line = one_line(capsys, *argv, "--device", "cuda")
        assert "CUDA is not available" in line and "checkpoint" not in line.split(":")[-1]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_warmup_is_linear_and_cosine_reaches_min_lr_at_the_last_step(schedule):
    kw = dict(lr=1.0, steps=50, schedule=schedule, warmup=5, min_lr=0.1)
    rates = [learning_rate(t, **kw) for t in range(50)]
    assert rates[:5] == pytest.approx([(t + 1) / 6 for t in range(5)])
    assert rates[5] == 1.0
    assert rates[-1] == pytest.approx(0.1 if schedule == "cosine" else 1.0)
    assert min(rates[5:]) == pytest.approx(rates[-1])


def test_noam_schedule_peaks_at_lr_after_warmup_and_decays_as_inverse_square_root():
    kw = dict(lr=2e-3, steps=10_000, schedule="noam", warmup=400, min_lr=0.0)
    assert learning_rate(399, **kw) == pytest.approx(2e-3)
    assert learning_rate(199, **kw) == pytest.approx(1e-3)
    assert learning_rate(1599, **kw) == pytest.approx(1e-3)  # t = 4w: lr / 2
    assert max(learning_rate(t, **kw) for t in range(2000)) == pytest.approx(2e-3)
    assert learning_rate(9999, **{**kw, "min_lr": 5e-4}) == pytest.approx(5e-4)


def test_cosine_midpoint_and_constant_without_warmup():
    kw = dict(lr=1e-3, steps=2000, warmup=100, min_lr=1e-4)
    assert learning_rate(1049, **kw) == pytest.approx(5.5e-4, rel=1e-3)
    after = [learning_rate(t, **kw) for t in range(100, 2000)]
    assert all(a >= b for a, b in zip(after[:-1], after[1:], strict=True))
    assert {learning_rate(t, lr=3e-4, steps=5000, schedule="constant") for t in
            range(0, 5000, 97)} == {3e-4}
    with pytest.raises(ConfigError, match="noam schedule needs warmup >= 1"):
        SetsRunConfig.build({"schedule": "noam", "warmup": 0})


def test_the_run_follows_the_schedule_it_documents(tmp_path):
    fit_tiny(tmp_path / "run", steps=6, log_every=1, warmup=2, lr=0.01, min_lr=0.001)
    logged = [r["lr"] for r in records(tmp_path / "run") if r["split"] == "train"]
    expected = [learning_rate(t, lr=0.01, steps=6, warmup=2, min_lr=0.001) for t in range(6)]
    assert logged == pytest.approx(expected) and logged[-1] == pytest.approx(0.001)


def test_a_finished_run_extended_by_steps_follows_the_stretched_schedule(tmp_path):
    """docs/runs.md: a cosine run resumed with a larger --steps restarts warm, at the longer
    cosine's rate for the step reached, and decays again to min_lr at its new last step."""
    out = tmp_path / "run"
    fit_tiny(out, steps=6, log_every=1, warmup=2, lr=0.01, min_lr=0.001, checkpoint_every=6)
    fit(out=out, resume=True, flags={"steps": 12}, progress=False, plots=False)
    logged = [r["lr"] for r in records(out) if r["split"] == "train"]
    first = [learning_rate(t, lr=0.01, steps=6, warmup=2, min_lr=0.001) for t in range(6)]
    then = [learning_rate(t, lr=0.01, steps=12, warmup=2, min_lr=0.001) for t in range(6, 12)]
    assert logged == pytest.approx(first + then)
    assert logged[5] == pytest.approx(0.001) and logged[6] > 0.004
    assert logged[-1] == pytest.approx(0.001)


# ----------------------------------------------------------------------------- progress


def test_progress_in_a_log_file_is_plain_lines_not_a_redrawn_bar(tmp_path, capsys):
    # captured standard error is not a terminal, as with nohup or a batch scheduler
    fit(SetsRunConfig.build({**TINY, "steps": 40, "eval_every": 40, "checkpoint_every": 40}),
        tmp_path / "run", progress=True, tensorboard=False, plots=False)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("sets train:")]
    assert len(lines) == 1 and lines[0].startswith("sets train: step 40/40 (100%), loss ")
    assert "s/step, 0:00:00 left" in lines[0]


def test_progress_on_a_terminal_is_a_bar_and_lines_every_interval_otherwise():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    class Notebook(io.StringIO):  # a Jupyter kernel's output stream
        pass

    Notebook.__module__ = "ipykernel.iostream"
    screen, notebook, log = Terminal(), Notebook(), io.StringIO()
    for stream, interval in ((screen, 60.0), (notebook, 60.0), (log, 0.0)):
        bar = Progress(5, 1, "demo", file=stream, interval=interval)
        for _ in range(4):
            bar.set_postfix(loss="0.5")
            bar.update()
        bar.close()
    for bar in (screen, notebook):
        assert "\r" in bar.getvalue() and "5/5" in bar.getvalue()
    lines = log.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [f"demo: step {k}/5 ({20 * k}%)"
                                                      for k in (2, 3, 4, 5)]


def test_progress_batches_cover_the_items_once_and_count_each_batch_when_it_is_done(capsys):
    batches = progress_batches(7, 3, "demo", unit="set")
    done = []
    for batch in batches:
        assert "demo:" not in capsys.readouterr().err or done  # counted after, not before
        done.append(batch)
    assert [list(b) for b in done] == [[0, 1, 2], [3, 4, 5], [6]]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("demo:")]
    assert len(lines) == 1 and lines[0].startswith("demo: set 7/7 (100%)")
    assert list(progress_batches(0, 3, "empty", enabled=False)) == []


# ----------------------------------------------------------------------------- evaluation


def test_set_evaluation_computes_each_attention_bound_once_with_the_same_result(
    monkeypatch, certificate_calls
):
    # validation and test scores call the flow on many batches with fixed weights: inside
    # frozen_certificates each attention bound is computed once per set size, not per batch
    from flowattn.attention import contractive
    from flowattn.data import load_dataset
    from flowattn.flows import set_flow
    from flowattn.sets import train

    torch.manual_seed(0)
    flow = set_flow(dim=2, blocks=2, heads=1)
    data = load_dataset("gaussian-sets", sizes={"train": 8, "val": 40, "test": 8})["val"]
    blocks = sum(isinstance(m, contractive.ContractiveAttention) for m in flow.modules())
    calls = certificate_calls(flow)
    frozen = train.evaluate(flow, data, batch_size=8)  # five batches of one set size
    assert blocks == 2 and calls[0] == 1  # once, batched over the blocks (shared_certificates)
    monkeypatch.setattr(train, "frozen_certificates", contextlib.nullcontext)
    fresh = train.evaluate(flow, data, batch_size=8)
    assert calls[0] == 1 + 5  # afresh: every batch
    assert frozen == fresh


def test_lm_evaluation_computes_each_attention_bound_once_with_the_same_result(
    monkeypatch, certificate_calls
):
    from flowattn.lm import train
    from flowattn.lm.config import LMConfig
    from flowattn.lm.model import build_model

    torch.manual_seed(0)
    model = build_model(LMConfig(vocab_size=7, block_size=8, layers=2, dim=8, heads=2,
                                 attention="contractive-l2"))
    data = torch.randint(0, 7, (8 * 64 * 3 + 1,))  # three batches of 64 windows
    calls = certificate_calls(model)
    frozen = train.evaluate(model, data, 8, 4, torch.device("cpu"))
    assert calls[0] == 1  # once, batched over the two layers (shared_certificates)
    monkeypatch.setattr(train, "frozen_certificates", contextlib.nullcontext)
    assert train.evaluate(model, data, 8, 4, torch.device("cpu")) == frozen
    assert calls[0] == 1 + 3  # then once per batch


# ----------------------------------------------------------------------------- resume


def _fused_on_the_cpu() -> bool:
    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _fused_on_the_cpu(), reason="this torch has no fused AdamW for the CPU")
def test_adamw_is_fused_and_computes_the_per_tensor_adamw_with_its_groups():
    from flowattn.training.loop import adamw, parameter_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model = model.double()
    twin, start = copy.deepcopy(model), [p.detach().clone() for p in model.parameters()]
    fused = adamw(model, 1e-2, (0.8, 0.95), weight_decay=0.3)
    plain = torch.optim.AdamW(parameter_groups(twin, 0.3), lr=1e-2, betas=(0.8, 0.95))
    assert all(group["fused"] for group in fused.param_groups)
    assert [g["weight_decay"] for g in fused.param_groups] == [0.3, 0.0]  # matrices decay
    x = torch.randn(16, 5, dtype=torch.float64)
    for _ in range(5):
        for net, opt in ((model, fused), (twin, plain)):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    moved = zip(model.parameters(), start, strict=True)
    assert all((a - b).abs().max() > 1e-3 for a, b in moved)


def test_adamw_falls_back_to_the_per_tensor_loop_where_torch_has_no_fused_kernel(monkeypatch):
    from flowattn.training import loop

    class NoFused(torch.optim.AdamW):
        def __init__(self, params, *args, fused=None, **kwargs):
            if fused:  # as torch 2.1-2.3 refuse on the CPU: after filling in the groups
                torch.optim.Optimizer.__init__(self, params, {"fused": True})
                raise RuntimeError("`fused=True` requires all the params to be floating point "
                                   "Tensors of supported devices")
            super().__init__(params, *args, **kwargs)

    monkeypatch.setattr(loop.torch.optim, "AdamW", NoFused)
    opt = loop.adamw(torch.nn.Linear(3, 2), 1e-3)
    assert isinstance(opt, NoFused) and not any(g["fused"] for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) == 2  # weight and bias, once


@pytest.mark.skipif(not _fused_on_the_cpu(), reason="this torch has no fused AdamW for the CPU")
def test_training_runs_take_the_fused_optimiser_and_resume_with_its_state(tmp_path):
    out = tmp_path / "run"
    fit_tiny(out, steps=2)
    stored = read_checkpoint(out / "checkpoint.pt", "sets")["optimizer"]
    assert all(group["fused"] for group in stored["param_groups"])
    fit(out=out, resume=True, flags={"steps": 4}, progress=False, plots=False)
    stored = read_checkpoint(out / "checkpoint.pt", "sets")["optimizer"]
    assert all(group["fused"] for group in stored["param_groups"])


def test_a_run_checkpointed_by_the_per_tensor_adamw_resumes_with_it_bit_for_bit(
        tmp_path, monkeypatch):
    # runs written before the fused optimiser: their stored param groups say fused None, and
    # loading them keeps the per-tensor loop, so the resumed run repeats an uninterrupted one
    from flowattn.training import loop

    fused = loop.adamw
    with monkeypatch.context() as patch:
        def per_tensor(model, lr, betas=(0.9, 0.999), weight_decay=0.0):
            return torch.optim.AdamW(loop.parameter_groups(model, weight_decay), lr=lr,
                                     betas=betas)

        patch.setattr(loop, "adamw", per_tensor)
        fit_tiny(tmp_path / "whole", steps=4)
        fit_tiny(tmp_path / "split", steps=2)
    assert loop.adamw is fused
    fit(out=tmp_path / "split", resume=True, flags={"steps": 4}, progress=False, plots=False)
    whole = read_checkpoint(tmp_path / "whole" / "checkpoint.pt", "sets")
    split = read_checkpoint(tmp_path / "split" / "checkpoint.pt", "sets")
    assert not any(group["fused"] for group in split["optimizer"]["param_groups"])
    for name, value in whole["model"].items():
        assert torch.equal(value, split["model"][name]), name


def test_resume_alone_continues_with_the_stored_settings(tmp_path):
    out = tmp_path / "run"
    fit_tiny(out, steps=2)
    summary = fit(out=out, resume=True, flags={"steps": 4}, progress=False, plots=False)
    assert summary["step"] == 4
    assert json.loads((out / "config.json").read_text())["flow"]["hidden"] == 8
    steps = [r["step"] for r in records(out) if r["split"] == "train"]
    assert steps == sorted(set(steps))


def test_keep_best_ends_with_the_state_of_the_lowest_validation_loss(tmp_path, monkeypatch):
    from flowattn.data import load_dataset
    from flowattn.sets.train import SetsTask, evaluate, load_flow

    losses = iter([3.0, 1.0, 2.0, 5.0, 0.5])  # validations at steps 2, 4, 6 (, 8, 10)
    scored = SetsTask.evaluate
    monkeypatch.setattr(SetsTask, "evaluate",
                        lambda self, dist: {**scored(self, dist), "loss": next(losses)})
    out = tmp_path / "run"
    summary = fit_tiny(out, steps=6, keep_best=True)
    assert summary["best_step"] == 4 and summary["best_val_loss"] == 1.0
    best = read_checkpoint(out / "best.pt", "sets")
    last = read_checkpoint(out / "checkpoint.pt", "sets")
    assert (best["step"], last["step"]) == (4, 6)
    flow, record = load_flow(out)  # a run folder: its best state
    assert record["step"] == 4
    for name, value in flow.state_dict().items():
        torch.testing.assert_close(value, best["model"][name])
    assert any(not torch.equal(best["model"][k], last["model"][k]) for k in best["model"])
    assert load_flow(out / "checkpoint.pt")[1]["step"] == 6  # a file: that file
    # the reported test NLL is the best state's
    test = load_dataset("gaussian-sets", {"train": 64}, seed=0)["test"]
    assert evaluate(flow, test)["nll"] == pytest.approx(summary["test_nll"], rel=1e-6)
    # resumed, the run keeps its best and replaces it only by a lower validation loss
    summary = fit(out=out, resume=True, flags={"steps": 10}, progress=False, plots=False)
    assert summary["best_step"] == 10 and read_checkpoint(out / "best.pt", "sets")["step"] == 10


# ----------------------------------------------------------------------------- parameter average


def test_the_parameter_average_follows_its_recursion_in_float64():
    from flowattn.training.average import ParameterAverage

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).double()
    average = ParameterAverage(model, decay=0.95)
    expected = [p.detach().clone() for p in model.parameters()]
    for step in range(1, 80):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        average.update(step)
        beta = min(0.95, (1 + step) / (10 + step))  # the ramp, then the decay (from step 9)
        expected = [beta * e + (1 - beta) * p.detach()
                    for e, p in zip(expected, model.parameters(), strict=True)]
        for name, e in zip(average.names, expected, strict=True):
            torch.testing.assert_close(average.state()[name], e, rtol=1e-12, atol=1e-12)
    # swapped in and back: exactly the trained values again, the average untouched
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with average.swapped():
        for name, value in average.state().items():
            assert torch.equal(model.state_dict()[name], value)
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name])
    with pytest.raises(ValueError, match="decay must lie in"):
        ParameterAverage(model, decay=1.0)


def _captured_average(monkeypatch):
    """Patch the loop's average to remember its instance, and the set task's validation to
    record the parameters it scores."""
    from flowattn.sets.train import SetsTask
    from flowattn.training import average as average_module

    seen = {"instances": [], "scored": []}
    original_init = average_module.ParameterAverage.__init__

    def init(self, model, decay):
        original_init(self, model, decay)
        seen["instances"].append(self)

    scored = SetsTask.evaluate

    def evaluate(self, dist):
        seen["scored"].append({k: v.clone() for k, v in self.model.state_dict().items()})
        return scored(self, dist)

    monkeypatch.setattr(average_module.ParameterAverage, "__init__", init)
    monkeypatch.setattr(SetsTask, "evaluate", evaluate)
    return seen


def test_an_averaged_run_trains_as_without_and_reports_scores_and_saves_the_average(
        tmp_path, monkeypatch):
    from flowattn.data import load_dataset
    from flowattn.sets.train import evaluate, load_flow

    plain = fit_tiny(tmp_path / "plain")
    seen = _captured_average(monkeypatch)
    trajectory = []  # the parameters before the first optimiser step and after each

    def record_parameters(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        trajectory.append([p.detach().clone() for p in params])

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    first = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: None if trajectory else
        record_parameters(optimizer, args, kwargs))
    after = register_optimizer_step_post_hook(record_parameters)
    try:
        summary = fit_tiny(tmp_path / "ema", ema=0.9)
    finally:
        first.remove()
        after.remove()
    record = read_checkpoint(tmp_path / "ema" / "checkpoint.pt", "sets")
    without = read_checkpoint(tmp_path / "plain" / "checkpoint.pt", "sets")
    # the average never touches training: the trained parameters are bit for bit those of a
    # run without it (every validation swapped the average in and the trained values back)
    for name, value in without["model"].items():
        assert torch.equal(record["training_model"][name], value), name
    assert "training_model" not in without
    # the checkpoint's model is the average, buffers included from the trained model
    (average,) = seen["instances"]
    state = average.state()
    assert set(record["model"]) == set(without["model"])
    for name, value in record["model"].items():
        expected = state.get(name, record["training_model"][name])
        assert torch.equal(value, expected), name
    assert any(not torch.equal(record["model"][k], record["training_model"][k]) for k in state)
    # ... and it is the recursion over the trained parameters of every step
    assert len(trajectory) == 1 + 4
    expected = trajectory[0]
    for step, params in enumerate(trajectory[1:], start=1):
        beta = min(0.9, (1 + step) / (10 + step))
        expected = [beta * e + (1 - beta) * p for e, p in zip(expected, params, strict=True)]
    from flowattn.training.loop import parameter_groups

    flow, _ = load_flow(tmp_path / "ema")  # the optimiser's order: its parameter groups
    names = {id(p): n for n, p in flow.named_parameters()}
    order = [names[id(p)] for group in parameter_groups(flow, 0.0) for p in group["params"]]
    assert sorted(order) == sorted(state)
    for name, value in zip(order, expected, strict=True):
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
    # validations scored the average of their step: the last one the final average
    assert len(seen["scored"]) == 2
    for name, value in state.items():
        assert torch.equal(seen["scored"][-1][name], value), name
    # the run folder's model and the final report are the average's
    flow, _ = load_flow(tmp_path / "ema")
    test = load_dataset("gaussian-sets", {"train": 64}, seed=0)["test"]
    assert evaluate(flow, test)["nll"] == pytest.approx(summary["test_nll"], rel=1e-6)
    assert summary["test_nll"] != pytest.approx(plain["test_nll"], rel=1e-9)


def test_an_averaged_run_resumed_matches_an_uninterrupted_one_bit_for_bit(tmp_path):
    fit_tiny(tmp_path / "whole", ema=0.9)
    fit_tiny(tmp_path / "split", ema=0.9, steps=2)
    fit(out=tmp_path / "split", resume=True, flags={"steps": 4}, progress=False, plots=False)
    whole = read_checkpoint(tmp_path / "whole" / "checkpoint.pt", "sets")
    split = read_checkpoint(tmp_path / "split" / "checkpoint.pt", "sets")
    for key in ("model", "training_model"):
        for name, value in whole[key].items():
            assert torch.equal(value, split[key][name]), (key, name)
    with pytest.raises(ConfigError, match=r"ema \(0.9 in the run, 0.99 now\)"):
        fit(out=tmp_path / "split", resume=True, flags={"ema": 0.99})


def test_keep_best_lm_run_reports_the_loss_of_the_state_it_keeps(tmp_path, capsys, corpus,
                                                                 monkeypatch):
    # the final line named the last validation while the run's result was the best one's
    from flowattn.lm.train import LMTask

    losses = iter([3.0, 1.0, 2.0] * 2)  # validations at steps 2, 4, 6 of each run
    monkeypatch.setattr(LMTask, "evaluate", lambda self, dist: {"loss": next(losses)})
    run = tmp_path / "lm"
    code, text, _ = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "6",
                        "--keep-best", "--out", run, "--json")
    summary = json.loads(text.strip().splitlines()[-1])
    assert code == 0 and (summary["result_step"], summary["result_val_loss"]) == (4, 1.0)
    assert summary["val_loss"] == 2.0  # the last validation, as before
    code, text, _ = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "6",
                        "--keep-best", "--out", tmp_path / "again")
    assert code == 0
    assert "val loss 1.0000 nats/char (1.4427 bpc) (step 4's parameters, kept as the best)" \
        in text.splitlines()[-1]


def test_keep_best_with_an_average_keeps_the_average_of_the_best_step(tmp_path, monkeypatch):
    from flowattn.sets.train import SetsTask, load_flow

    seen = _captured_average(monkeypatch)
    losses = iter([1.0, 2.0])  # validations at steps 2 and 4: step 2 is the best
    scored = SetsTask.evaluate
    monkeypatch.setattr(SetsTask, "evaluate",
                        lambda self, dist: {**scored(self, dist), "loss": next(losses)})
    fit_tiny(tmp_path / "run", ema=0.9, keep_best=True)
    best = read_checkpoint(tmp_path / "run" / "best.pt", "sets")
    assert best["step"] == 2 and "training_model" not in best
    for name in seen["instances"][0].state():  # the average at step 2
        assert torch.equal(best["model"][name], seen["scored"][0][name]), name
    flow, record = load_flow(tmp_path / "run")
    assert record["step"] == 2
    for name, value in flow.state_dict().items():
        assert torch.equal(value, best["model"][name]), name


def test_without_keep_best_a_run_ends_with_its_last_state(tmp_path):
    from flowattn.sets.train import load_flow

    out = tmp_path / "run"
    summary = fit_tiny(out)
    assert not (out / "best.pt").exists() and summary["best_step"] in (2, 4)
    assert load_flow(out)[1]["step"] == 4


def test_resume_refuses_changed_run_settings_by_name_and_accepts_safe_ones(tmp_path):
    out = tmp_path / "run"
    fit_tiny(out, steps=2)
    with pytest.raises(ConfigError, match=r"hidden \(8 in the run, 16 now\); lr"):
        fit(out=out, resume=True, flags={"hidden": 16, "lr": 0.1})
    with pytest.raises(ConfigError, match="below the step the run has reached"):
        fit(out=out, resume=True, flags={"steps": 1})
    # a preset refused beside the stored flow was "preset='small' is a coupling flow, but
    # flow='resflow' was given: drop one of them", a flag the user had not given
    with pytest.raises(ConfigError, match=r"cannot change the run's settings when resuming: "
                       r"preset \('none' in the run, 'small' now\)"):
        fit(out=out, resume=True, flags={"preset": "small"})
    summary = fit(out=out, resume=True, progress=False, plots=False,
                  flags={"steps": 3, "eval_every": 3, "threads": 1, "device": "cpu"})
    assert summary["step"] == 3


def test_resume_without_a_run_is_one_line_for_both_commands(tmp_path, capsys):
    for group, command in (("sets", "fit"), ("lm", "train")):
        line = one_line(capsys, group, command, "--out", tmp_path / group, "--resume")
        assert "no run to resume" in line
        assert not (tmp_path / group).exists()


def test_a_run_stopped_before_its_first_checkpoint_starts_over_clean(tmp_path):
    out = tmp_path / "run"
    fit_tiny(out)
    (out / "checkpoint.pt").unlink()  # as if killed before its first checkpoint
    (out / "summary.json").unlink()
    with (out / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({"step": 99, "split": "train", "loss": 1.0}) + "\n")
    fit_tiny(out)  # started again: no stale record survives
    assert max(r["step"] for r in records(out)) == 4
    (out / "checkpoint.pt").unlink()
    (out / "summary.json").unlink()
    summary = fit(out=out, resume=True, progress=False, plots=False)  # its stored settings
    assert summary["step"] == 4 and max(r["step"] for r in records(out)) == 4


def test_a_finished_run_resumed_does_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, _ = cli(capsys, "sets", "fit", *SETS_FLAGS, "--steps", "2", "--out", out)
    assert code == 0
    before = (out / "metrics.jsonl").read_text()
    code, text, _ = cli(capsys, "sets", "fit", "--out", out, "--resume")
    assert code == 0 and "already finished at step 2" in text
    assert (out / "metrics.jsonl").read_text() == before  # no second test record
    assert sum(r["split"] == "test" for r in records(out)) == 1


def test_a_torn_last_metrics_line_is_dropped_and_a_torn_middle_one_named(tmp_path):
    out = tmp_path / "run"
    fit_tiny(out, steps=2)
    (out / "summary.json").unlink()
    with (out / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "split": "tr')  # interrupted mid-write
    summary = fit(out=out, resume=True, flags={"steps": 4}, progress=False, plots=False)
    assert summary["step"] == 4 and all("split" in r for r in records(out))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(RunError, match=r"metrics.jsonl, line 2, is not a metrics record"):
        read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("same_dim", [True, False], ids=["same-D", "other-D"])
def test_resume_refuses_a_data_file_that_changed(tmp_path, same_dim):
    data = tmp_path / "sets.npz"
    save_npz(data, torch.randn(40, 5, 2, generator=torch.Generator().manual_seed(1)))
    out = tmp_path / "run"
    fit_tiny(out, data=str(data), steps=2, num_train=None)
    changed = torch.randn(40, 5, 2 if same_dim else 3, generator=torch.Generator().manual_seed(2))
    save_npz(data, changed)
    with pytest.raises(DataError, match="changed since the run in .* began"):
        fit(out=out, resume=True, flags={"steps": 4})


def test_a_run_folder_of_another_command_is_refused(tmp_path, capsys, corpus):
    sets_run, lm_run = tmp_path / "sets", tmp_path / "lm"
    fit_tiny(sets_run)
    code, _, _ = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "2",
                     "--out", lm_run)
    assert code == 0
    before = (sets_run / "metrics.jsonl").read_text(), (lm_run / "metrics.jsonl").read_text()
    assert "holds a flowattn sets run" in one_line(capsys, "lm", "train", "--data", corpus,
                                                   "--out", sets_run)
    assert "holds a flowattn lm run" in one_line(capsys, "sets", "fit", "--out", lm_run)
    for path in (sets_run, lm_run):
        assert "--resume" in one_line(capsys, "sets" if path == sets_run else "lm",
                                      "fit" if path == sets_run else "train", "--out", path)
    after = (sets_run / "metrics.jsonl").read_text(), (lm_run / "metrics.jsonl").read_text()
    assert after == before
    foreign = tmp_path / "other"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("{}\n")
    assert "files of another run" in one_line(capsys, "sets", "fit", "--out", foreign)


def test_a_folder_of_a_users_own_files_is_refused_but_the_runs_own_inputs_may_be_there(
        tmp_path, capsys):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    (folder / ".hidden").write_text("")
    message = one_line(capsys, "sets", "fit", *SETS_FLAGS, "--steps", "2", "--out", folder)
    assert "1 file(s) or folder(s) of its own (e.g. 'notes.txt')" in message
    assert sorted(p.name for p in folder.iterdir()) == [".hidden", "notes.txt"]  # untouched
    # the config file and the data file the run reads may sit in its folder, as may hidden files
    run = tmp_path / "experiment"
    run.mkdir()
    save_npz(run / "sets.npz", torch.randn(40, 5, 2, generator=torch.Generator().manual_seed(1)))
    (run / "run.yaml").write_text("steps: 2\nblocks: 1\nhidden: 8\nbatch_size: 8\n")
    (run / ".hidden").write_text("")
    code, _, err = cli(capsys, "sets", "fit", "--config", run / "run.yaml", "--data",
                       run / "sets.npz", "--no-progress", "--no-tensorboard", "--out", run)
    assert code == 0, err
    assert (run / "checkpoint.pt").exists()


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("kind", ["empty", "truncated", "garbage", "foreign", "other-command"])
def test_unusable_checkpoints_are_one_line_naming_the_file(tmp_path, capsys, kind):
    run = tmp_path / "run"
    fit_tiny(run, steps=2)
    path = run / "checkpoint.pt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "garbage":
        path.write_bytes(os.urandom(4096))
    elif kind == "foreign":
        torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
    else:
        record = torch.load(path, weights_only=True)
        torch.save({**record, "kind": "lm"}, path)
    with pytest.raises(CheckpointError, match=str(path)):
        read_checkpoint(run, "sets")
    if kind == "garbage" and path.read_bytes()[:1] not in (b"P", b"\x80"):
        with pytest.raises(CheckpointError, match="is not a torch file .*zip archive"):
            read_checkpoint(run, "sets")
    for argv in (["sets", "eval", "--checkpoint", run, "--data", "gaussian-sets"],
                 ["sets", "sample", "--checkpoint", run, "--num", "2", "--out",
                  tmp_path / "s.npz"],
                 ["lm", "eval", "--checkpoint", run],
                 ["sets", "fit", "--out", run, "--resume"]):
        line = one_line(capsys, *argv)
        assert str(path) in line, line
        if kind in ("empty", "truncated"):  # and the way out
            assert line.endswith("restore it from a copy, or train the run again in a new "
                                 "--out folder"), line


def test_a_checkpoint_whose_bytes_changed_is_refused_by_its_checksums(tmp_path, capsys):
    # zeroed bytes inside a tensor's record leave finite weights: torch.load read them, and
    # the run evaluated silently with damaged weights
    import struct
    import zipfile

    run = tmp_path / "run"
    fit_tiny(run, steps=2)
    path = run / "checkpoint.pt"
    read_checkpoint(run, "sets")  # intact: every record passes
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        record = next(i for i in archive.infolist() if "/data/" in i.filename
                      and i.file_size >= 16)
    name_length, extra_length = struct.unpack(
        "<HH", data[record.header_offset + 26 : record.header_offset + 30])
    start = record.header_offset + 30 + name_length + extra_length
    data[start : start + 16] = bytes(16)
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=f"record {record.filename} fails the checksum"):
        read_checkpoint(run, "sets")
    line = one_line(capsys, "sets", "eval", "--checkpoint", run, "--data", "gaussian-sets")
    assert "is corrupted" in line and line.endswith("--out folder"), line


def test_a_checkpoint_holding_python_objects_is_refused_in_one_sentence(tmp_path, capsys):
    import fractions

    path = tmp_path / "objects.pt"
    torch.save({"x": fractions.Fraction(1, 2)}, path)  # loads only with weights_only=False
    line = one_line(capsys, "lm", "eval", "--checkpoint", path)
    assert line.endswith("it holds Python objects other than tensors and plain data, which "
                         "are not loaded (weights_only)"), line


def test_a_data_file_given_as_the_checkpoint_is_named_as_data(tmp_path, capsys):
    # an .npz is a zip file as a checkpoint is: it was reported as a damaged checkpoint, with
    # the advice to train the run again
    path = tmp_path / "sets.npz"
    save_npz(path, torch.randn(4, 3, 2))
    line = one_line(capsys, "sets", "eval", "--checkpoint", path, "--data", "gaussian-sets")
    assert line.endswith(f"{path} is a numpy .npz archive (data), not a checkpoint: give the "
                         "run folder or its checkpoint.pt as the checkpoint, and this file as "
                         "the data"), line


def test_checkpoints_are_read_with_weights_only_and_refuse_newer_formats(tmp_path):
    run = tmp_path / "run"
    fit_tiny(run, steps=2)
    record = torch.load(run / "checkpoint.pt", weights_only=True)  # no pickled objects
    assert record["format"] == "flowattn" and record["version"] == 2
    torch.save({**record, "version": 3}, run / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="format version 3; this flowattn reads"):
        read_checkpoint(run, "sets")


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        fit_tiny(tmp_path / "run", steps=2)
        save_npz(tmp_path / "sets.npz", torch.zeros(2, 3, 2))
    finally:
        os.umask(old)
    for name in ("checkpoint.pt", "config.json", "run.json", "summary.json", "metrics.jsonl"):
        mode = stat.S_IMODE((tmp_path / "run" / name).stat().st_mode)
        assert mode == 0o644, (name, oct(mode))
    assert stat.S_IMODE((tmp_path / "sets.npz").stat().st_mode) == 0o644


# ----------------------------------------------------------------------------- metrics


def test_tensorboard_restarts_with_a_fresh_run_and_purges_past_the_resumed_step(tmp_path,
                                                                               monkeypatch):
    import torch.utils.tensorboard as tb

    created = []

    class Recording(tb.SummaryWriter):
        def __init__(self, *args, **kwargs):
            created.append(kwargs.get("purge_step"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tb, "SummaryWriter", Recording)
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "stale").write_text("")
    log = MetricsLog(out, start=0)
    log.log(1, "train", loss=1.0)
    log.close()
    assert not (out / "tensorboard" / "stale").exists() and created == [None]
    resumed = MetricsLog(out, start=1)
    resumed.log(2, "train", loss=0.5)
    resumed.close()
    assert created == [None, 1]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_a_resumed_run_keeps_its_own_tensorboard_choice(tmp_path):
    # a run started with --no-tensorboard gained a tensorboard/ folder when resumed without it
    without, with_ = tmp_path / "without", tmp_path / "with"
    fit_tiny(without, steps=2)  # tensorboard=False
    fit(out=without, resume=True, flags={"steps": 3}, progress=False, plots=False)
    assert not (without / "tensorboard").exists()
    fit(config=SetsRunConfig.build({**TINY, "steps": 2}), out=with_, progress=False,
        plots=False)
    events = len(list((with_ / "tensorboard").iterdir()))
    fit(out=with_, resume=True, flags={"steps": 3}, progress=False, plots=False)
    assert len(list((with_ / "tensorboard").iterdir())) > events  # it goes on writing
    fit(out=without, resume=True, flags={"steps": 4}, progress=False, plots=False,
        tensorboard=True)  # asked for: the events start here
    assert (without / "tensorboard").is_dir()


def test_refused_runs_leave_no_files(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.full((4, 3, 2), np.nan))
    out = tmp_path / "run"
    assert "NaN" in one_line(capsys, "sets", "fit", "--data", bad, "--out", out, "--steps", "1")
    assert "divide" in one_line(capsys, "sets", "fit", "--heads", "3", "--out", out,
                                "--num-train", "8")
    assert not out.exists()


# ----------------------------------------------------------------------------- divergence


def test_divergence_behaves_the_same_in_both_commands(tmp_path, capsys, corpus):
    sets_run = tmp_path / "sets"
    code, text, _ = cli(capsys, "sets", "fit", *SETS_FLAGS, "--lr", "1e30", "--grad-clip",
                        "none", "--warmup", "0", "--steps", "8", "--out", sets_run, "--json")
    assert code == 3 and re.search(r"training diverged at step \d+: non-finite", text)
    assert json.loads(text.strip().splitlines()[-1])["diverged"]
    lm_run = tmp_path / "lm"
    code, text, _ = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--lr", "1e30",
                        "--grad-clip", "none", "--warmup", "0", "--steps", "8", "--out",
                        lm_run, "--json")
    assert code == 3 and re.search(r"training diverged at step \d+: non-finite", text)
    for run in (sets_run, lm_run):
        saved = json.loads((run / "diverged.json").read_text())
        assert "non-finite" in saved["reason"]
        assert [r["event"] for r in records(run) if r["split"] == "event"] == ["diverged"]
        # diverged at its first step, before any checkpoint: it says so, not that a
        # checkpoint holds a state
        assert not (run / "checkpoint.pt").exists()
        assert saved["message"].endswith(f"so {run} holds no trained state")
    # reported once, by the loop (the --json payload carries the same message)
    assert sum(line.startswith("training diverged") for line in text.splitlines()) == 1
    assert "holds no trained state" in text and "the last state saved" not in text


def test_a_divergence_after_a_checkpoint_names_the_step_the_checkpoint_holds(tmp_path, capsys,
                                                                           corpus, monkeypatch):
    # the state saved last is named by its step, not called good: a step can break the
    # weights before any loss shows it. Here the loss of step 4 is NaN, the checkpoint is
    # step 2's and the loop had finished step 3.
    from flowattn.lm.train import LMTask

    calls, loss = iter(range(1, 100)), LMTask.loss

    def failing(self, module, batch):
        objective, reported, items = loss(self, module, batch)
        if next(calls) == 4:
            objective, reported = objective * math.nan, reported * math.nan
        return objective, reported, items

    monkeypatch.setattr(LMTask, "loss", failing)
    run = tmp_path / "lm"
    code, text, _ = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "8",
                        "--out", run)
    assert code == 3
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 2
    assert json.loads((run / "diverged.json").read_text())["step"] == 4
    assert "holds step 2, the last state saved before the divergence" in text


# ----------------------------------------------------------------------------- reports, errors


def test_a_run_shorter_than_its_warm_up_says_so(tmp_path, capsys, corpus):
    # l2-tied's automatic warm-up is 400 steps: a 6-step run never left it, silently
    code, text, _ = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "6",
                        "--warmup", "6", "--lr", "1e-3", "--out", tmp_path / "a")
    assert code == 0
    assert ("note: the warm-up (6 steps) is as long as the run (6 steps), so the learning "
            "rate never reaches lr 0.001 (it ends at 0.000857)") in text
    code, text, _ = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "6",
                        "--warmup", "5", "--out", tmp_path / "b")
    assert code == 0 and "warm-up" not in text


def test_a_terminated_run_says_how_to_resume_it_and_exits_with_143(tmp_path, corpus):
    # SIGTERM (a batch scheduler's stop) is Ctrl-C's: one line naming the way back, no
    # traceback; the run resumes from its last checkpoint
    run = tmp_path / "lm"
    command = [sys.executable, "-m", "flowattn", "lm", "train", "--data", str(corpus),
               *LM_FLAGS, "--steps", "100000", "--checkpoint-every", "1", "--threads", "1",
               "--out", str(run)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    try:
        for _ in range(600):  # until its first checkpoint (60 s at most)
            if (run / "checkpoint.pt").is_file() or process.poll() is not None:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, err
    lines = err.strip().splitlines()
    assert lines[0] == ("lm train: SIGTERM received: stopping after this step, once a "
                        "checkpoint holds it (a second SIGTERM stops at once)")
    step = torch.load(run / "checkpoint.pt", weights_only=True)["step"]
    assert lines[1:] == [
        f"flowattn lm train: terminated; the run continues from its checkpoint of step {step} "
        f"with `flowattn lm train --out {run} --resume`"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_torch_is_imported_stops_the_command_cleanly(tmp_path, signum):
    # Ctrl-C in the first second or two left torch half imported: a chained traceback about
    # torch.cuda, "cannot load module more than once", or an abort (status 134)
    script = f"""
import importlib.abc, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as interactive (not inherited)
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch._C":  # in the middle of torch's own import
            os.kill(os.getpid(), {int(signum)})
        return None
sys.meta_path.insert(0, Interrupt())
from flowattn.cli import main
sys.exit(main(["sets", "fit", "--steps", "2", "--out", {str(tmp_path / "run")!r}]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    word = "interrupted" if signum == signal.SIGINT else "terminated"
    assert result.returncode == (130 if signum == signal.SIGINT else 143), result.stderr
    assert result.stderr.strip().splitlines() == [f"flowattn sets fit: {word}"]


def _request_stop_during_step(monkeypatch, signals: list[int], at: int = 2) -> None:
    """Send ``signals`` to this process while the loop takes the learning rate of step index
    ``at``, i.e. inside that step."""
    from flowattn.training import loop

    rate = loop.learning_rate

    def requesting(step, **kwargs):
        if step == at:
            for signum in signals:
                os.kill(os.getpid(), signum)
        return rate(step, **kwargs)

    monkeypatch.setattr(loop, "learning_rate", requesting)


@pytest.fixture
def interruptible():
    """Ctrl-C raising KeyboardInterrupt, as in an interactive Python: a test run started in
    the background of a script inherits SIGINT ignored, and the loop leaves ignored signals
    alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def terminating():
    """SIGTERM handled as the command line handles it (a KeyboardInterrupt), not by default."""
    from flowattn.cli import _terminate

    previous = signal.signal(signal.SIGTERM, _terminate)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_request_ends_the_run_after_its_step_saved_and_resume_repeats_nothing(
        tmp_path, monkeypatch, interruptible, terminating, signum):
    # Ctrl-C lost every step since the last checkpoint; now the step in progress completes,
    # a checkpoint holds it, and the resumed run is the uninterrupted one bit for bit
    from flowattn.cli import Terminated

    split = tmp_path / "split"
    with monkeypatch.context() as patch:
        _request_stop_during_step(patch, [signum], at=2)
        with pytest.raises(Terminated if signum == signal.SIGTERM else KeyboardInterrupt):
            fit_tiny(split, steps=6, checkpoint_every=4)
    assert read_checkpoint(split, "sets")["step"] == 3  # the step it was in, not 0 or 2
    assert not (split / "summary.json").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    fit(out=split, resume=True, progress=False, plots=False, tensorboard=False)
    fit_tiny(tmp_path / "whole", steps=6, checkpoint_every=4)
    whole = read_checkpoint(tmp_path / "whole", "sets")
    resumed = read_checkpoint(split, "sets")
    assert resumed["step"] == whole["step"] == 6
    for name, value in whole["model"].items():
        assert torch.equal(value, resumed["model"][name]), name


def test_a_second_stop_request_stops_at_once(tmp_path, monkeypatch, interruptible):
    _request_stop_during_step(monkeypatch, [signal.SIGINT, signal.SIGINT], at=3)
    with pytest.raises(KeyboardInterrupt):
        fit_tiny(tmp_path / "run", steps=6, checkpoint_every=2)
    assert read_checkpoint(tmp_path / "run", "sets")["step"] == 2  # the last regular one
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupted_command_names_the_step_its_checkpoint_holds(tmp_path, capsys,
                                                                     monkeypatch, corpus,
                                                                     interruptible):
    _request_stop_during_step(monkeypatch, [signal.SIGINT], at=4)
    run = tmp_path / "lm"
    code, out, err = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "9",
                         "--checkpoint-every", "3", "--out", run)
    assert code == 130
    assert f"stopped after step 5; the checkpoint in {run} holds it" in out
    # each validation metric with its unit (bpc is its own)
    assert re.search(r"^step 4: validation loss \d+\.\d{4} nats/char, bpc \d+\.\d{4}$", out,
                     re.MULTILINE), out
    assert err.splitlines()[-2:] == [
        "lm train: interrupt (Ctrl-C) received: stopping after this step, once a checkpoint "
        "holds it (Ctrl-C again stops at once)",
        f"flowattn lm train: interrupted; the run continues from its checkpoint of step 5 with "
        f"`flowattn lm train --out {run} --resume`"]


def test_the_last_progress_line_of_a_stopped_run_shows_its_latest_steps(tmp_path, capsys,
                                                                       monkeypatch, corpus,
                                                                       interruptible):
    # it showed the loss and rate of the last report (log_every), steps before the stop
    _request_stop_during_step(monkeypatch, [signal.SIGINT], at=4)
    flags = [f for f in LM_FLAGS if f != "--no-progress"]
    code, _, err = cli(capsys, "lm", "train", "--data", corpus, *flags, "--steps", "9",
                       "--log-every", "100", "--lr", "0.002", "--warmup", "0",
                       "--schedule", "constant", "--out", tmp_path / "lm")
    assert code == 130
    (line,) = [line for line in err.splitlines() if line.startswith("lm train: step ")]
    assert re.match(r"lm train: step 5/9 \(55%\), loss \d+\.\d{4}, lr 2\.00e-03, ", line), line


def test_a_run_folder_in_use_by_another_process_is_refused(tmp_path, capsys, corpus):
    # two processes training into one folder interleaved their metrics and checkpoints
    run = tmp_path / "lm"
    command = [sys.executable, "-m", "flowattn", "lm", "train", "--data", str(corpus),
               *LM_FLAGS, "--steps", "100000", "--checkpoint-every", "1", "--threads", "1",
               "--out", str(run)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # until its first checkpoint (60 s at most)
            if (run / "checkpoint.pt").is_file() or process.poll() is not None:
                break
            time.sleep(0.1)
        line = one_line(capsys, "lm", "train", "--out", run, "--resume")
    finally:
        process.kill()
        process.wait()
    assert line.endswith(f"the run in {run} is in use by another process (pid {process.pid}): "
                         "wait for it to end, or stop it first")
    reached = torch.load(run / "checkpoint.pt", weights_only=False)["step"]
    code, _, err = cli(capsys, "lm", "train", "--out", run, "--resume", "--steps",
                       str(reached + 1))
    assert code == 0, err  # the lock went with its process


def test_a_closed_standard_output_stops_a_run_with_one_line(tmp_path, capsys, corpus,
                                                           monkeypatch):
    # `flowattn lm train ... | head -1`: the reader goes, the next print raises BrokenPipeError
    from flowattn.lm.train import LMTask

    def closed(self, dist):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(LMTask, "evaluate", closed)
    run = tmp_path / "lm"
    code, _, err = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "8",
                       "--checkpoint-every", "1", "--out", run)
    assert code == 141 and "Traceback" not in err
    assert err.startswith("flowattn lm train: stopped: its standard output was closed")
    assert f"--out {run} --resume" in err  # checkpoint of step 1, evaluation at step 2




def test_a_failing_file_system_or_memory_is_one_line_and_other_errors_keep_their_traceback(
        tmp_path, capsys, corpus, monkeypatch):
    # the run folder removed under a running command (its metrics file gone), a model too
    # large to allocate: one line each, exit 74 and 2; any other RuntimeError is a defect and
    # keeps its traceback
    from flowattn.lm.train import LMTask

    def removed(self, dist):
        raise FileNotFoundError(2, "No such file or directory", str(tmp_path / "m.jsonl"))

    monkeypatch.setattr(LMTask, "evaluate", removed)
    code, _, err = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "4",
                       "--out", tmp_path / "lm")
    assert code == 74 and "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("flowattn lm train: error: the file system refused: No such file or "
                          f"directory ({tmp_path / 'm.jsonl'})")

    def too_large(self, dist):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 3221225472 bytes.")

    monkeypatch.setattr(LMTask, "evaluate", too_large)
    code, _, err = cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "4",
                       "--out", tmp_path / "lm2")
    assert code == 2 and "Traceback" not in err
    assert "error: out of memory: one tensor of 3.0 GiB could not be allocated" in err
    from flowattn.cli import _machine_failure  # a GPU's own error type, its first line

    gpu = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")
    assert _machine_failure(gpu).startswith("out of memory: CUDA out of memory. Tried to "
                                            "allocate 2.00 GiB. (the settings ask for more")

    def defect(self, dist):
        raise RuntimeError("shape mismatch somewhere")

    monkeypatch.setattr(LMTask, "evaluate", defect)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli(capsys, "lm", "train", "--data", corpus, *LM_FLAGS, "--steps", "4",
            "--out", tmp_path / "lm3")


def test_a_run_on_a_relative_data_file_resumes_from_anywhere(tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    save_npz(work / "sets.npz", torch.randn(40, 5, 2))
    monkeypatch.chdir(work)
    flags = [*SETS_FLAGS[2:], "--out", "run"]
    code, _, err = cli(capsys, "sets", "fit", "--data", "sets.npz", *flags, "--steps", "2")
    assert code == 0, err
    stored = json.loads((work / "run" / "config.json").read_text())["data"]["data"]
    assert stored == str((work / "sets.npz").resolve())  # stored by absolute path
    # a run stored before that, with the path as typed: found through its data fingerprint
    record = torch.load(work / "run" / "checkpoint.pt", weights_only=True)
    record["config"]["data"]["data"] = "sets.npz"
    torch.save(record, work / "run" / "checkpoint.pt")
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "sets", "fit", "--out", "work/run", "--resume", "--steps", "4")
    assert code == 0, err
    # --print-config with --resume shows the run's own settings with the flags that may change
    code, text, _ = cli(capsys, "sets", "fit", "--out", "work/run", "--resume", "--steps", "6",
                        "--print-config", "json")
    printed = json.loads(text)
    assert code == 0 and printed["data"]["data"] == stored
    assert printed["train"]["steps"] == 6 and printed["flow"]["hidden"] == 8
    # the same file named from here is no change; another file is
    code, _, err = cli(capsys, "sets", "fit", "--out", "work/run", "--resume", "--steps", "6",
                       "--data", "work/sets.npz")
    assert code == 0, err
    save_npz(tmp_path / "other.npz", torch.randn(40, 5, 2))
    line = one_line(capsys, "sets", "fit", "--out", "work/run", "--resume", "--steps", "8",
                    "--data", "other.npz")
    assert "cannot change the run's settings when resuming: data" in line


def test_a_checkpoint_copied_in_from_another_run_is_refused(tmp_path, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    for out, blocks in ((one, "1"), (two, "2")):
        code, _, err = cli(capsys, "sets", "fit", *SETS_FLAGS, "--blocks", blocks, "--steps",
                           "2", "--out", out)
        assert code == 0, err
    (two / "checkpoint.pt").write_bytes((one / "checkpoint.pt").read_bytes())
    line = one_line(capsys, "sets", "fit", "--out", two, "--resume", "--steps", "4")
    assert "describe different runs (they differ in blocks)" in line
    code, _, err = cli(capsys, "sets", "fit", "--out", one, "--resume", "--steps", "4")
    assert code == 0, err  # its own checkpoint resumes


def test_file_data_refuse_a_training_split_size(tmp_path, capsys):
    data = tmp_path / "sets.npz"
    save_npz(data, torch.randn(40, 5, 2))
    line = one_line(capsys, "sets", "fit", "--data", data, "--num-train", "10", "--out",
                    tmp_path / "run")
    assert "num_train=10 sizes a built-in data set's training split" in line
    assert not (tmp_path / "run").exists()


def test_fit_on_a_file_names_the_split_it_reports(tmp_path, capsys):
    data = tmp_path / "sets.npz"
    save_npz(data, torch.randn(40, 5, 2))
    code, text, _ = cli(capsys, "sets", "fit", "--data", data, *SETS_FLAGS[2:], "--steps", "2",
                        "--out", tmp_path / "run")
    assert code == 0 and "val NLL (the data have no test split)" in text
    assert "test NLL" not in text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_split"] == "val"


def test_sample_refuses_a_zero_set_size(tmp_path, capsys):
    run = tmp_path / "run"
    fit_tiny(run, steps=2)
    line = one_line(capsys, "sets", "sample", "--checkpoint", run, "--num", "2",
                    "--set-size", "0", "--out", tmp_path / "s.npz")
    assert "--set-size must be positive, got 0" in line


def test_every_library_error_is_a_flowattn_error_and_debug_shows_the_traceback(tmp_path,
                                                                              capsys):
    import flowattn.errors as errors

    kinds = [getattr(errors, name) for name in errors.__all__]
    assert all(issubclass(kind, FlowattnError) for kind in kinds)
    code, _, err = cli(capsys, "sets", "fit", "--out", tmp_path / "x", "--resume", "--debug")
    assert code == 2 and "Traceback" in err and "no run to resume" in err
    code, _, err = cli(capsys, "--debug", "sets", "fit", "--out", tmp_path / "x", "--resume")
    assert code == 2 and "Traceback" in err


def test_a_refusal_of_several_lines_is_reported_on_one_line(tmp_path, capsys, monkeypatch):
    import flowattn.sets.cli as sets_cli

    err = ConfigError("bad setting\n  in the file\nat line 2")
    assert err.line() == "bad setting   in the file at line 2"

    def refuse(args):
        raise err

    monkeypatch.setattr(sets_cli, "_sample", refuse)
    line = one_line(capsys, "sets", "sample", "--checkpoint", tmp_path, "--num", "1",
                    "--out", tmp_path / "s.npz")
    assert line == "flowattn sets sample: error: bad setting   in the file at line 2"


def test_the_command_line_starts_without_importing_torch():
    script = ("import sys; from flowattn.cli import build_parser; build_parser(); "
              "print(sorted(m for m in ('torch', 'numpy', 'flowattn.flows') "
              "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
