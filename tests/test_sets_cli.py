"""``flowattn sets``: fit, resume, eval, sample, bad input, and torchrun/DDP."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flowattn.cli import main
from flowattn.data import save_npz
from flowattn.sets import SetsConfig, load_flow

TINY = ["--data", "gaussian-sets", "--num-train", "200", "--batch-size", "16", "--no-progress"]


def tiny_config(tmp_path: Path, **changes) -> Path:
    settings = {"blocks": 1, "hidden": 16, "eval_every": 4, "checkpoint_every": 4,
                "val_sets": 32, "warmup": 2}
    settings.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(settings))
    return path


def run_cli(*args: str) -> int:
    return main(["sets", *args])


def final_parameters(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=False)["model"]


def test_fit_writes_checkpoint_metrics_summary_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    code = run_cli("fit", *TINY, "--steps", "8", "--out", str(out),
                   "--config", str(tiny_config(tmp_path)))
    assert code == 0
    printed = capsys.readouterr().out
    assert "test NLL" in printed and "true NLL" in printed and "samples.png" in printed
    for name in ["checkpoint.pt", "config.json", "metrics.jsonl", "summary.json", "samples.png"]:
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "val" for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert np.isfinite(summary["test_nll"]) and summary["true_nll"] > 0
    assert not list(out.glob(".*.tmp"))  # no temporary file left behind


def test_eval_prints_a_json_last_line_and_sample_writes_sets(tmp_path, capsys):
    out = tmp_path / "run"
    run_cli("fit", *TINY, "--steps", "4", "--out", str(out),
            "--config", str(tiny_config(tmp_path)))
    capsys.readouterr()
    data = tmp_path / "test.npz"
    save_npz(data, torch.randn(10, 8, 2))
    assert run_cli("eval", "--checkpoint", str(out), "--data", str(data), "--json") == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["num_sets"] == 10 and np.isfinite(result["nll"])
    assert result["nll_per_dim"] == pytest.approx(result["nll"] / 16)
    samples = tmp_path / "samples.npz"
    assert run_cli("sample", "--checkpoint", str(out), "--num", "7", "--set-size", "5",
                   "--out", str(samples)) == 0
    with np.load(samples) as archive:
        assert archive["x"].shape == (7, 5, 2) and np.isfinite(archive["x"]).all()


def test_eval_is_deterministic(tmp_path):
    out = tmp_path / "run"
    run_cli("fit", *TINY, "--steps", "4", "--out", str(out),
            "--config", str(tiny_config(tmp_path)))
    flow, _ = load_flow(out)
    x = torch.randn(6, 8, 2)
    torch.testing.assert_close(flow.log_prob(x), flow.log_prob(x), rtol=0, atol=0)


def _fit_command(out: Path, config: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "flowattn", "sets", "fit", *TINY, "--steps", str(steps),
            "--out", str(out), "--config", str(config)]


def test_a_killed_run_resumed_matches_an_uninterrupted_run(tmp_path):
    config = tiny_config(tmp_path, checkpoint_every=3, eval_every=100)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    straight = tmp_path / "straight"
    subprocess.run(_fit_command(straight, config, 12), check=True, env=env,
                   capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_fit_command(killed, config, 12), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step = torch.load(killed / "checkpoint.pt", weights_only=False)["step"]
    assert 3 <= step < 12, "the run was not interrupted mid-training"
    resumed = subprocess.run(_fit_command(killed, config, 12) + ["--resume"], env=env,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    a, b = final_parameters(straight), final_parameters(killed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    records = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["split"] == "train"]
    assert steps == sorted(set(steps)), "metrics of the interrupted part were duplicated"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--data", "no-such-set"], "unknown data set"),
        (["--data", "MISSING.npz"], "no such file"),
        (["--config", "CONFIG"], "unknown setting"),
        (["--threads", "0"], "--threads must be positive"),
    ],
)
def test_fit_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    (tmp_path / "bad.json").write_text(json.dumps({"nope": 1}))
    args = [a.replace("MISSING", str(tmp_path / "missing")).replace("CONFIG",
            str(tmp_path / "bad.json")) for a in args]
    out = tmp_path / "run"
    code = run_cli("fit", "--steps", "2", "--out", str(out), "--no-progress", *args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1
    assert not (out / "checkpoint.pt").exists()


def test_malformed_npz_and_unwritable_out_are_rejected(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.full((4, 3, 2), np.nan))
    assert run_cli("fit", "--data", str(bad), "--out", str(tmp_path / "r"), "--steps", "1",
                   "--no-progress") == 2
    assert "NaN" in capsys.readouterr().err
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert run_cli("fit", *TINY, "--steps", "1", "--out", str(blocked / "sub")) == 2
    assert "cannot write" in capsys.readouterr().err


def test_fit_refuses_to_overwrite_a_run_without_resume(tmp_path, capsys):
    out = tmp_path / "run"
    config = str(tiny_config(tmp_path))
    assert run_cli("fit", *TINY, "--steps", "2", "--out", str(out), "--config", config) == 0
    capsys.readouterr()
    assert run_cli("fit", *TINY, "--steps", "2", "--out", str(out), "--config", config) == 2
    assert "--resume" in capsys.readouterr().err


def test_config_rejects_invalid_settings():
    with pytest.raises(Exception, match="coeff"):
        SetsConfig(coeff=1.5)
    with pytest.raises(Exception, match="flow"):
        SetsConfig(flow="glow")


def test_torchrun_two_gloo_processes_match_the_single_process_run(tmp_path):
    config = tiny_config(tmp_path, eval_every=100)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single = tmp_path / "single"
    subprocess.run(_fit_command(single, config, 4), check=True, env=env, capture_output=True)
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "flowattn"] + _fit_command(ddp, config, 4)[3:]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = final_parameters(single), final_parameters(ddp)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_cnf_fit_logs_solver_evaluations(tmp_path):
    out = tmp_path / "run"
    config = tiny_config(tmp_path, field_hidden=8)
    assert run_cli("fit", *TINY, "--flow", "cnf", "--steps", "2", "--out", str(out),
                   "--config", str(config)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert train and all(r["nfe_forward"] > 0 and r["nfe_backward"] > 0 for r in train)


def test_interaction_and_blocks_flags_reach_the_flow(tmp_path):
    out = tmp_path / "run"
    config = tiny_config(tmp_path)
    assert run_cli("fit", *TINY, "--interaction", "radial", "--blocks", "1", "--steps", "2",
                   "--out", str(out), "--config", str(config)) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["interaction"] == "radial" and saved["blocks"] == 1 and saved["location"]
    from flowattn.branches import RadialInteraction
    from flowattn.flows import SetLocation
    from flowattn.sets import load_flow

    flow, _ = load_flow(out)
    kinds = {type(m) for m in flow.modules()}
    assert RadialInteraction in kinds and SetLocation in kinds
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", *TINY, "--interaction", "sideways", "--out", str(tmp_path / "x"))
    assert exit_info.value.code == 2


def test_manybody_setting_adds_neighbourhood_blocks_or_fails_clearly(tmp_path, capsys):
    from flowattn.branches import NeighbourhoodInteraction

    out = tmp_path / "run"
    config = tiny_config(tmp_path, manybody=True, interaction="radial")
    assert run_cli("fit", *TINY, "--steps", "2", "--out", str(out), "--config", str(config)) == 0
    flow, _ = load_flow(out)
    assert any(isinstance(m, NeighbourhoodInteraction) for m in flow.modules())
    capsys.readouterr()
    attention = tiny_config(tmp_path, manybody=True, interaction="attention")
    assert run_cli("fit", *TINY, "--steps", "2", "--out", str(tmp_path / "x"),
                   "--config", str(attention)) != 0
    assert "manybody" in capsys.readouterr().err
    assert not (tmp_path / "x" / "checkpoint.pt").exists()


def test_many_body_residuals_are_on_by_default_only_with_radial_blocks():
    from flowattn.branches import NeighbourhoodInteraction
    from flowattn.sets.config import build_flow

    def count(config, zero_com):
        flow = build_flow(config, 2, 4, zero_com)
        return sum(isinstance(m, NeighbourhoodInteraction) for m in flow.modules())

    config = SetsConfig(blocks=2)
    assert config.manybody is None
    assert count(config, zero_com=True) == 2  # particles: radial blocks, many-body on
    assert count(config, zero_com=False) == 0  # attention
    assert count(config.updated(flow="cnf"), zero_com=True) == 0
    assert count(config.updated(manybody=False), zero_com=True) == 0


def test_checkpoints_written_before_a_setting_existed_still_load(tmp_path):
    out = tmp_path / "run"
    config = tiny_config(tmp_path, interaction="radial", manybody=False)
    assert run_cli("fit", *TINY, "--steps", "2", "--out", str(out), "--config", str(config)) == 0
    record = torch.load(out / "checkpoint.pt", weights_only=False)
    for key in ("manybody", "radial_max_slope", "radial_inverse", "field"):
        del record["config"][key]  # as written by an older version
    torch.save(record, out / "checkpoint.pt")
    flow, _ = load_flow(out)
    assert torch.isfinite(flow.log_prob(torch.randn(3, 4, 2))).all()


def test_auto_interaction_is_radial_for_particles_and_attention_otherwise():
    from flowattn.sets import SetsConfig
    from flowattn.sets.config import resolved_interaction

    config = SetsConfig()
    assert config.interaction == "auto"
    assert resolved_interaction(config, zero_com=True) == "radial"
    assert resolved_interaction(config, zero_com=False) == "attention"
    assert resolved_interaction(config.updated(interaction="linear"), zero_com=True) == "linear"


def test_cnf_field_is_the_graph_network_for_particles_and_attention_otherwise():
    from flowattn.flows import CNF, AttentionField, EGNNField
    from flowattn.sets.config import build_flow

    def field(config, zero_com):
        flow = build_flow(config, 2, 4, zero_com)
        return next(m for m in flow.modules() if isinstance(m, CNF)).field

    config = SetsConfig(flow="cnf")
    assert isinstance(field(config, zero_com=True), EGNNField)
    assert isinstance(field(config, zero_com=False), AttentionField)
    chosen = field(config.updated(field="attention"), zero_com=True)
    assert isinstance(chosen, AttentionField) and chosen.layers == 2 and chosen.hidden == 16
    egnn = field(config.updated(field="egnn", field_layers=2, field_hidden=8), zero_com=True)
    assert len(egnn.layers) == 2 and egnn.embed_time.out_features == 8
    with pytest.raises(Exception, match="field must be one of"):
        SetsConfig(field="transformer")
    with pytest.raises(Exception, match="setting of continuous flows"):
        build_flow(SetsConfig(field="egnn"), 2, 4, zero_com=True)  # a residual flow


def test_continuous_flows_saved_before_the_field_setting_keep_the_attention_field():
    from flowattn.flows import AttentionField
    from flowattn.sets.config import build_flow
    from flowattn.sets.train import _with_legacy_defaults

    settings = SetsConfig(flow="cnf", field_layers=2, field_hidden=16).to_dict()
    del settings["field"]  # as written by an older version
    config = SetsConfig(**_with_legacy_defaults(settings))
    assert isinstance(build_flow(config, 2, 4, zero_com=True).transform.field, AttentionField)


def test_resume_names_changed_settings_and_accepts_checkpoints_older_than_a_setting(
        tmp_path, capsys):
    out = tmp_path / "run"
    config = tiny_config(tmp_path)
    assert run_cli("fit", *TINY, "--steps", "4", "--out", str(out), "--config", str(config)) == 0
    assert run_cli("fit", *TINY, "--steps", "6", "--out", str(out), "--config", str(config),
                   "--resume", "--blocks", "2") == 2
    assert "['blocks', 'steps'] differ" in capsys.readouterr().err
    record = torch.load(out / "checkpoint.pt", weights_only=False)
    del record["config"]["field"]  # as written before the setting existed, when the field's
    record["config"].update(field_layers=2, field_hidden=16)  # size had fixed defaults
    torch.save(record, out / "checkpoint.pt")
    assert run_cli("fit", *TINY, "--steps", "4", "--out", str(out), "--config", str(config),
                   "--resume") == 0


def test_evaluation_and_sampling_keep_no_graph():
    # a continuous flow's solve would otherwise hold every solver step of a batch in memory
    from flowattn.data import SetData
    from flowattn.sets.config import build_flow
    from flowattn.sets.plots import draw_samples
    from flowattn.sets.train import evaluate

    flow = build_flow(SetsConfig(flow="cnf", field_hidden=4, field_layers=1), 2, 3, True)
    seen = []
    log_prob, inverse = flow.log_prob, flow.transform.inverse
    flow.log_prob = lambda *a, **k: seen.append(torch.is_grad_enabled()) or log_prob(*a, **k)
    flow.transform.inverse = lambda *a, **k: seen.append(torch.is_grad_enabled()) or inverse(
        *a, **k)
    x = torch.randn(4, 3, 2)
    data = SetData(x - x.mean(1, keepdim=True), zero_com=True)
    evaluate(flow, data)
    draw_samples(flow, data, 2, seed=0)
    assert seen == [False, False]
