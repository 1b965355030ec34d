"""``flowattn sets``: fit, resume, eval, sample, bad input, and torchrun/DDP."""

import json
import math
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
from flowattn.errors import ConfigError
from flowattn.sets import SetsRunConfig, load_flow
from flowattn.sets.config import build_flow

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


@pytest.fixture
def tiny_run(tmp_path: Path) -> Path:
    """A run folder of four training steps of a one-block flow on gaussian-sets."""
    out = tmp_path / "run"
    assert run_cli("fit", *TINY, "--steps", "4", "--out", str(out),
                   "--config", str(tiny_config(tmp_path))) == 0
    return out


def final_parameters(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)["model"]


def test_fit_writes_checkpoint_metrics_summary_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    code = run_cli("fit", *TINY, "--steps", "8", "--out", str(out),
                   "--config", str(tiny_config(tmp_path)), "--json")
    assert code == 0
    printed = capsys.readouterr().out
    # --json is summary.json (it left the test split's metrics out)
    assert json.loads(printed.strip().splitlines()[-1]) == \
        json.loads((out / "summary.json").read_text())
    assert printed.startswith("data: gaussian-sets, 200 training, 500 validation, 2,000 test "
                              "sets of 8 elements in R^2\nflow: residual flow, 1 block, "
                              "attention interaction, ")
    assert "test NLL" in printed and "true NLL" in printed and "samples.png" in printed
    for name in ["checkpoint.pt", "config.json", "metrics.jsonl", "summary.json", "samples.png"]:
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "val" for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert np.isfinite(summary["test_nll"]) and summary["true_nll"] > 0
    assert not list(out.glob(".*.tmp"))  # no temporary file left behind


def test_the_run_log_names_the_data_and_the_flow_it_fits():
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    one = Distributed(rank=0, world=1, device=torch.device("cpu"))

    def describe(**settings):
        config = SetsRunConfig.build({"num_train": 32, "val_sets": 8, **settings})
        return SetsTask(config, one, plots=False).describe()

    data, flow = describe(data="shape-sets-varsize", flow="coupling", coupling_layers=3)
    assert data.startswith("data: shape-sets-varsize, 32 training, 500 validation, 2,000 test ")
    assert "sets of up to 10 elements in R^2" in data
    assert flow.startswith("flow: set-coupling flow, 3 layers, ")
    data, flow = describe(data="dw4", flow="cnf")
    assert data.endswith("sets of 4 elements in R^2, centre of mass at 0")
    assert flow.startswith("flow: continuous flow, egnn field, ")
    _, flow = describe(data="gaussian-sets", blocks=2, coupling_layers=1, preset="none")
    assert flow.startswith("flow: residual flow, 2 blocks, attention interaction, then 1 "
                           "set-coupling layer, ")
    count = int(flow.split(", ")[-1].split()[0].replace(",", ""))
    assert count > 0
    # the splines of every block were counted as set-coupling layers after the blocks
    _, flow = describe(data="shape-sets", blocks=3, splines=True, interaction="none",
                       preset="none")
    assert flow.startswith("flow: residual flow, 3 blocks (each with an element-wise spline "
                           "coupling), no interaction, ")
    _, flow = describe(data="shape-sets", blocks=3, splines=True, coupling_layers=2,
                       preset="none")
    assert "3 blocks (each with an element-wise spline coupling), " in flow
    assert ", then 2 set-coupling layers, " in flow


def test_eval_prints_a_json_last_line_and_sample_writes_sets(tmp_path, capsys, tiny_run):
    out = tiny_run
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
    capsys.readouterr()
    # --json was ignored without --energy; one set of one element was "1 sets of 1 elements"
    assert run_cli("sample", "--checkpoint", str(out), "--num", "1", "--set-size", "1",
                   "--out", str(samples), "--json", "--no-progress") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"wrote 1 set of 1 element to {samples}"
    assert json.loads(lines[-1]) == {"out": str(samples), "num": 1, "set_size": 1, "dim": 2,
                                     "dtype": "float32", "masked": False, "min_size": 1,
                                     "max_size": 1}


def test_sample_draws_in_batches_and_reports_its_progress(tmp_path, capsys, tiny_run):
    out = tiny_run
    capsys.readouterr()
    samples = tmp_path / "samples.npz"
    assert run_cli("sample", "--checkpoint", str(out), "--num", "7", "--batch-size", "3",
                   "--out", str(samples)) == 0
    # a log (captured stderr is not a terminal): one line at the end, counting sets
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sampling")]
    assert len(lines) == 1 and "set 7/7 (100%)" in lines[0]
    with np.load(samples) as archive:
        x = archive["x"]
    # three batches (3 + 3 + 1), each drawn on from the one generator: no batch repeats another
    assert x.shape == (7, 8, 2) and np.isfinite(x).all()
    assert not np.allclose(x[:3], x[3:6]) and not np.allclose(x[0], x[6])
    assert run_cli("sample", "--checkpoint", str(out), "--num", "2", "--no-progress",
                   "--out", str(samples)) == 0
    assert "sampling" not in capsys.readouterr().err
    assert main(["sets", "sample", "--checkpoint", str(out), "--num", "2", "--batch-size", "0",
                 "--out", str(samples)]) == 2
    assert "--batch-size must be >= 1, got 0" in capsys.readouterr().err


def test_sample_refuses_an_output_it_cannot_write_before_sampling(tmp_path, capsys, tiny_run,
                                                                    monkeypatch):
    import flowattn.sets.cli as sets_cli

    (tmp_path / "folder.npz").mkdir()
    (tmp_path / "file").write_text("")
    drawn = []
    monkeypatch.setattr(sets_cli, "_load", lambda args: drawn.append(1))  # never reached
    for out, message in ((tmp_path / "folder.npz", "it is a folder"),
                         (tmp_path / "file" / "x.npz", "is a file, not a folder"),
                         (tmp_path / "absent" / "x.npz", "does not exist"),
                         (tmp_path / "x.txt", "must name a .npz file"),
                         (".npz", "must name a .npz file, such as out.npz, got '.npz'"),
                         ("", "must name a .npz file, such as out.npz, got ''")):
        assert run_cli("sample", "--checkpoint", str(tiny_run), "--num", "2", "--out",
                       str(out)) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not drawn


def test_sample_refuses_to_overwrite_the_data_file_its_run_was_fitted_to(tmp_path, capsys,
                                                                         monkeypatch):
    from flowattn.data import save_npz

    data = tmp_path / "sets.npz"
    save_npz(data, torch.randn(60, 5, 2))
    before = data.read_bytes()
    out = tmp_path / "run"
    assert run_cli("fit", "--data", str(data), "--batch-size", "16", "--no-progress", "--steps",
                   "2", "--out", str(out), "--config", str(tiny_config(tmp_path))) == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # the same file by another name
    assert run_cli("sample", "--checkpoint", str(out), "--num", "3", "--out", "sets.npz") == 2
    err = capsys.readouterr().err.strip()
    assert "is the data file this run was fitted to" in err and len(err.splitlines()) == 1
    assert data.read_bytes() == before
    assert run_cli("sample", "--checkpoint", str(out), "--num", "3", "--out", "other.npz") == 0


def test_atomic_write_names_the_file_it_cannot_write_and_leaves_nothing(tmp_path):
    from flowattn.errors import InputError
    from flowattn.files import atomic_write_text

    with pytest.raises(InputError, match="cannot write .*absent/x.json: No such file"):
        atomic_write_text("{}", tmp_path / "absent" / "x.json")
    (tmp_path / "x.json").mkdir()  # a folder where the file should go: the rename fails
    with pytest.raises(InputError, match="cannot write .*x.json: Is a directory"):
        atomic_write_text("{}", tmp_path / "x.json")
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_an_atomic_write_waits_until_the_file_is_in_place(tmp_path, signum):
    # Ctrl-C inside torch.save became torch's "unexpected pos" error, a traceback
    from flowattn.files import atomic_write

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    def write(handle):
        handle.write(b"a")
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # an undeferred handler runs here
        handle.write(b"b")

    previous = signal.signal(signum, stop)
    try:
        with pytest.raises(Stop):  # delivered, after the write
            atomic_write(tmp_path / "f", write)
    finally:
        signal.signal(signum, previous)
    assert (tmp_path / "f").read_bytes() == b"ab" and not list(tmp_path.glob(".*.tmp"))


def test_an_output_folder_that_cannot_be_made_is_refused_before_the_data_load(tmp_path,
                                                                            capsys):
    # the data were loaded and the model built ("data: ...", "flow: ...") first
    (tmp_path / "plain").write_text("x")
    assert run_cli("fit", "--steps", "2", "--out", str(tmp_path / "plain" / "run")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (f"flowattn sets fit: error: cannot write to output folder "
                                    f"{tmp_path / 'plain' / 'run'}: Not a directory")


def test_a_folder_that_takes_no_new_file_is_named_with_the_reason(tmp_path, monkeypatch):
    import tempfile

    from flowattn.errors import InputError, RunError
    from flowattn.files import check_output_file, unwritable
    from flowattn.training.run import prepare_out_dir

    assert unwritable(tmp_path) is None
    assert not list(tmp_path.iterdir())  # the test file is removed again
    (tmp_path / "plain").write_text("x")
    assert unwritable(tmp_path / "plain") == "Not a directory"
    assert unwritable(tmp_path / "absent") == "No such file or directory"

    def refuse(*args, **kwargs):  # a read-only folder (root may write anywhere)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    assert unwritable(tmp_path) == "Permission denied"
    with pytest.raises(RunError, match="cannot write to output folder .*new: Permission denied"):
        prepare_out_dir(tmp_path / "new")
    with pytest.raises(InputError, match="cannot write .*x.npz: Permission denied"):
        check_output_file(tmp_path / "x.npz", ".npz")


def test_eval_scores_the_same_nll_as_the_run_and_does_not_depend_on_batching(capsys, tiny_run):
    out = tiny_run
    summary = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    # the fitted data's test split, scored by the eval command in two batch sizes
    results = []
    for batch in ("256", "7"):
        assert run_cli("eval", "--checkpoint", str(out), "--data", "gaussian-sets",
                       "--batch-size", batch, "--json") == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0]["nll"] == pytest.approx(summary["test_nll"], rel=1e-6)
    assert results[1]["nll"] == pytest.approx(results[0]["nll"], rel=1e-6)


def test_eval_takes_a_built_in_name_before_a_folder_of_that_name(tmp_path, capsys, tiny_run,
                                                                  monkeypatch):
    # `cd runs && flowattn sets eval --checkpoint gaussian-sets --data gaussian-sets` read the
    # run folder as the data ("Is a directory"); fit takes the built-in set there, and so does
    # eval now
    summary = json.loads((tiny_run / "summary.json").read_text())
    (tmp_path / "gaussian-sets").mkdir()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert run_cli("eval", "--checkpoint", str(tiny_run), "--data", "gaussian-sets",
                   "--json") == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["nll"] == pytest.approx(summary["test_nll"], rel=1e-6)


def test_eval_scores_the_mirror_average_of_a_fitted_flow(capsys, tiny_run):
    from flowattn.data import load_dataset

    results = {}
    for symmetry in ("auto", "none", "reflections"):
        assert run_cli("eval", "--checkpoint", str(tiny_run), "--data", "gaussian-sets",
                       "--symmetry", symmetry, "--json") == 0
        results[symmetry] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["auto"] == results["none"]  # the run's own: no symmetry
    flow, _ = load_flow(tiny_run)
    x = load_dataset("gaussian-sets")["test"].x
    signs = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
    with torch.no_grad():
        log_q = torch.stack([flow.log_prob(x * s) for s in signs]).double()
    expected = -(torch.logsumexp(log_q, 0) - math.log(4)).mean().item()
    assert results["reflections"]["nll"] == pytest.approx(expected, rel=1e-5)
    assert abs(results["reflections"]["nll"] - results["none"]["nll"]) > 1e-3


def test_eval_scores_the_test_split_of_the_runs_own_seed(tmp_path, capsys):
    out = tmp_path / "seed1"
    assert run_cli("fit", *TINY, "--steps", "2", "--seed", "1", "--out", str(out),
                   "--config", str(tiny_config(tmp_path))) == 0
    summary = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    assert run_cli("eval", "--checkpoint", str(out), "--data", "gaussian-sets", "--json") == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["nll"] == pytest.approx(summary["test_nll"], rel=1e-6)


def test_eval_reports_the_sets_scored_and_takes_a_thread_count(tmp_path, capsys, tiny_run):
    out = tiny_run
    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        assert run_cli("eval", "--checkpoint", str(out), "--data", "gaussian-sets",
                       "--batch-size", "64", "--threads", "1") == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    # a log (captured stderr is not a terminal): one line at the end, counting sets
    lines = [line for line in captured.err.splitlines() if line.startswith("evaluating")]
    assert len(lines) == 1 and "set 2000/2000 (100%)" in lines[0] and "s/set," in lines[0]
    assert "NLL:" in captured.out
    assert run_cli("eval", "--checkpoint", str(out), "--data", "gaussian-sets",
                   "--no-progress") == 0
    assert "evaluating" not in capsys.readouterr().err
    for command in (["eval", "--data", "gaussian-sets"], ["sample", "--num", "2", "--out",
                                                          str(tmp_path / "s.npz")]):
        assert main(["sets", *command, "--checkpoint", str(out), "--threads", "0"]) != 0
        assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def _fit_command(out: Path, config: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flowattn", "sets", "fit", *TINY, "--steps", str(steps),
            "--out", str(out), "--config", str(config), *extra]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--augment", "rotations"),
                                   ("--flow", "cnf", "--objective", "matching", "--no-location",
                                    "--field-hidden", "8")],
                         ids=["plain", "augmented", "matching"])
def test_a_killed_run_resumed_matches_an_uninterrupted_run(tmp_path, extra):
    # augmented: the rotations come from the batch generator, whose state the checkpoint keeps;
    # matching: so do the base draws and times
    config = tiny_config(tmp_path, checkpoint_every=3, eval_every=100)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    straight = tmp_path / "straight"
    subprocess.run(_fit_command(straight, config, 12, *extra), check=True, env=env,
                   capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_fit_command(killed, config, 12, *extra), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step = torch.load(killed / "checkpoint.pt", weights_only=True)["step"]
    assert 3 <= step < 12, "the run was not interrupted mid-training"
    resumed = subprocess.run([sys.executable, "-m", "flowattn", "sets", "fit", "--out",
                              str(killed), "--resume", "--no-progress"], env=env,
                             capture_output=True, text=True)  # --resume alone suffices
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
        (["--config", "CONFIG"], "unknown setting 'nope'"),
        (["--threads", "0"], "threads: Input should be greater than or equal to 1"),
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
    assert not out.exists()  # refused before anything is written


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


def test_config_rejects_invalid_settings_naming_key_and_value():
    with pytest.raises(ConfigError, match=r"flow: coeff: Input should be less than 1 \(got 1.5\)"):
        SetsRunConfig.build({"coeff": 1.5})
    with pytest.raises(ConfigError, match=r"flow: flow: Input should be 'resflow', 'cnf' or "
                       r"'coupling' \(got 'glow'\)"):
        SetsRunConfig.build({"flow": "glow"})
    with pytest.raises(ConfigError, match=r"flow: activation: Input should be 'lipswish' or "
                       r"'clipswish' \(got 'relu'\)"):
        SetsRunConfig.build({"activation": "relu"})
    with pytest.raises(ConfigError, match="activation is a setting of the Lipschitz MLPs of "
                       "residual flows"):
        SetsRunConfig.build({"flow": "coupling", "activation": "clipswish"})
    from flowattn.branches.mlp import CLipSwish

    built = build_flow(SetsRunConfig.build({"activation": "clipswish"}).flow, 2, 4, False)
    assert sum(isinstance(m, CLipSwish) for m in built.modules()) == 4  # one per block


@pytest.mark.slow
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


def test_a_batch_smaller_than_the_number_of_processes_is_refused():
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    config = SetsRunConfig.build({"data": "gaussian-sets", "num_train": 32, "batch_size": 2})
    with pytest.raises(ConfigError, match="batch_size=2 is smaller than the number of "
                       "processes \\(3\\)"):
        SetsTask(config, Distributed(rank=0, world=3, device=torch.device("cpu")), plots=False)


@pytest.mark.slow
def test_torchrun_training_by_energy_matches_the_single_process_run(tmp_path):
    # each process maps its share of the step's base draws: the mean of the two shares'
    # reverse KLs is the single process's (a fresh home: DW4 is sampled here, by the first run)
    config = tiny_config(tmp_path, eval_every=100, radial_basis=8, energy_weight=0.5,
                         energy_samples=16, compile=False)  # (DW4 compiles by default)
    env = dict(os.environ, OMP_NUM_THREADS="1", HOME=str(tmp_path / "home"))
    dw4 = ["--data", "dw4", "--num-train", "200", "--batch-size", "16", "--no-progress"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    fit = ["sets", "fit", *dw4, "--steps", "4", "--config", str(config), "--out"]
    subprocess.run([sys.executable, "-m", "flowattn", *fit, str(single)], check=True, env=env,
                   capture_output=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "flowattn", *fit, str(ddp)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = final_parameters(single), final_parameters(ddp)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    records = [json.loads(line) for line in (ddp / "metrics.jsonl").read_text().splitlines()]
    assert any("reverse_kl" in r for r in records if r["split"] == "train")


@pytest.mark.slow
def test_cnf_fit_logs_solver_evaluations(tmp_path):
    out = tmp_path / "run"
    config = tiny_config(tmp_path, field_hidden=8)
    assert run_cli("fit", *TINY, "--flow", "cnf", "--steps", "2", "--out", str(out),
                   "--config", str(config)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert train and all(r["nfe_forward"] > 0 and r["nfe_backward"] > 0 for r in train)


def test_cnf_eval_divergence_chooses_the_trace_of_reported_nlls():
    # E-NF scores LJ13 with Hutchinson's trace: one probe per set, unbiased, its noise in the
    # sampling error; by default sets this small (N D <= 64) are scored with the exact trace
    from flowattn.data import SetData
    from flowattn.flows.continuous.cnf import CNF
    from flowattn.sets.config import SetsFlow
    from flowattn.sets.train import evaluate

    def solver(flow):
        return next(m for m in flow.modules() if isinstance(m, CNF))

    settings = {"flow": "cnf", "field_hidden": 8, "field_layers": 1, "divergence": "hutchinson"}
    torch.manual_seed(0)
    exact = build_flow(SetsFlow(**settings), 2, 3, True).double()
    torch.manual_seed(0)
    probed = build_flow(SetsFlow(**settings, eval_divergence="hutchinson"), 2, 3, True).double()
    assert solver(exact).eval_divergence == "exact"
    assert solver(probed).eval_divergence == "hutchinson"
    for p in exact.parameters():  # a field that bends: the trace varies with the probe
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(1))
    probed.load_state_dict(exact.state_dict())
    x = torch.randn(300, 3, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    data = SetData(x - x.mean(1, keepdim=True), zero_com=True)
    truth, estimate = evaluate(exact, data), evaluate(probed, data)
    assert truth["logdet"] == "exact" and estimate["logdet"] == "estimated"
    with torch.no_grad():
        exact_nll = -exact.eval().log_prob(data.x)
        probed_nll = -probed.eval().log_prob(data.x)
    difference = probed_nll - exact_nll
    assert difference.std() > 1e-3  # the probes' noise is there ...
    # ... and averages out: unbiased within four standard errors of the mean difference
    error = float(difference.std()) / math.sqrt(len(difference))
    assert abs(estimate["nll"] - truth["nll"]) < 4 * error
    with pytest.raises(ConfigError, match="eval_divergence is a setting of continuous flows"):
        SetsRunConfig.build({"flow": "resflow", "eval_divergence": "hutchinson"})


@pytest.mark.parametrize("kind", ["cnf", "resflow"])
def test_evaluation_probes_are_independent_across_batches_and_blocks(kind):
    # one set scored 6 times in batches of one: re-seeding every call would give 6 equal
    # estimates (a sampling error of 0 that hides the probe noise); one stream per pass gives
    # independent ones, and the pass as a whole stays repeatable
    from flowattn.data import SetData
    from flowattn.flows import LogDetOptions, set_flow
    from flowattn.flows.geometry import probe_stream
    from flowattn.sets.config import SetsFlow
    from flowattn.sets.train import evaluate

    torch.manual_seed(0)
    if kind == "cnf":
        flow = build_flow(SetsFlow(flow="cnf", field_hidden=8, field_layers=1,
                                   eval_divergence="hutchinson"), 2, 3, True).double()
        for p in flow.parameters():
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(1))
    else:  # N D = 6 > eval_exact_max_dim: each block's series estimate with probes
        flow = set_flow(2, blocks=2, hidden=8, heads=1, zero_com=True, location=False,
                        logdet=LogDetOptions(eval_exact_max_dim=2, eval_n_samples=1,
                                             eval_max_samples=1, eval_n_terms=10)).double()
    x = torch.randn(1, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    data = SetData((x - x.mean(1, keepdim=True)).expand(6, 3, 2).clone(), zero_com=True)
    first = evaluate(flow, data, batch_size=1)
    assert first["logdet"] == "estimated" and first["nll_sampling_se"] > 1e-4
    assert evaluate(flow, data, batch_size=1) == first
    with torch.no_grad():
        single = -flow.eval().log_prob(data.x[:1])  # re-seeded: one call, one probe pattern
        assert torch.equal(single, -flow.log_prob(data.x[:1]))
        with probe_stream():
            streamed = torch.cat([-flow.log_prob(data.x[:1]) for _ in range(2)])
    assert not torch.equal(streamed[0], streamed[1])
    # a single solver's first streamed call is its re-seeded one; two residual blocks of the
    # same seed draw on from one stream, so the second block's probes differ (and the
    # variances that evaluation adds over blocks are those of independent estimates)
    assert torch.equal(streamed[0], single[0]) == (kind == "cnf")


def test_eval_divergence_flag_scores_a_continuous_flow_with_probes(tmp_path, capsys, tiny_run):
    out = tmp_path / "cnf"
    assert run_cli("fit", *TINY, "--flow", "cnf", "--steps", "2", "--out", str(out),
                   "--config", str(tiny_config(tmp_path, field_hidden=8))) == 0
    data = tmp_path / "test.npz"
    save_npz(data, torch.randn(10, 8, 2))
    results = {}
    for divergence in ("auto", "hutchinson", "exact"):
        capsys.readouterr()
        assert run_cli("eval", "--checkpoint", str(out), "--data", str(data), "--json",
                       "--divergence", divergence) == 0
        printed = capsys.readouterr().out.strip().splitlines()
        results[divergence] = json.loads(printed[-1])
        assert ("estimated log-det" in printed[0]) == (divergence == "hutchinson")
    assert results["hutchinson"]["logdet"] == "estimated"
    assert results["auto"] == results["exact"]
    assert results["hutchinson"]["nll"] != results["exact"]["nll"]
    # a residual flow has no trace to choose: a clear error, not a silent exact score
    capsys.readouterr()
    assert main(["sets", "eval", "--checkpoint", str(tiny_run), "--data", str(data),
                 "--divergence", "hutchinson"]) == 2
    assert "--divergence chooses a continuous flow's trace" in capsys.readouterr().err


def test_interaction_and_blocks_flags_reach_the_flow(tmp_path):
    out = tmp_path / "run"
    config = tiny_config(tmp_path)
    assert run_cli("fit", *TINY, "--interaction", "radial", "--blocks", "1", "--steps", "2",
                   "--out", str(out), "--config", str(config)) == 0
    saved = json.loads((out / "config.json").read_text())["flow"]
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
        flow = build_flow(config.flow, 2, 4, zero_com)
        return sum(isinstance(m, NeighbourhoodInteraction) for m in flow.modules())

    config = SetsRunConfig.build({"blocks": 2})
    assert config.flow.manybody is None
    assert count(config, zero_com=True) == 2  # particles: radial blocks, many-body on
    assert count(config, zero_com=False) == 0  # attention
    assert count(config.updated({"flow": {"flow": "cnf"}}), zero_com=True) == 0
    assert count(config.updated({"manybody": False}), zero_com=True) == 0


def _as_format_1(record: dict, drop: tuple[str, ...] = ()) -> dict:
    """A checkpoint in the layout of format version 1: flat settings, data spec on top."""
    settings = {k: v for section in record["config"].values() for k, v in section.items()
                if k not in drop}
    if settings.get("grad_clip") is None:
        settings["grad_clip"] = 0.0
    return {"version": 1, "config": settings, "data": record["task"]["data"],
            "model": record["model"], "optimizer": record["optimizer"], "step": record["step"],
            "rng": record["rng"][0]}


def test_checkpoints_of_format_1_and_before_a_setting_existed_still_load(tmp_path, capsys):
    out = tmp_path / "run"
    config = tiny_config(tmp_path, interaction="radial", manybody=False)
    assert run_cli("fit", *TINY, "--steps", "2", "--out", str(out), "--config", str(config)) == 0
    record = torch.load(out / "checkpoint.pt", weights_only=True)
    fresh, _ = load_flow(out)
    old = tmp_path / "old"
    old.mkdir()
    # as written by an older version, before these settings existed
    legacy = _as_format_1(record, drop=("manybody", "radial_max_slope", "radial_inverse",
                                        "field"))
    torch.save(legacy, old / "checkpoint.pt")
    flow, saved = load_flow(old)
    assert saved["version"] == 1 and saved["config"].flow.manybody is False
    x = torch.randn(3, 4, 2)
    torch.testing.assert_close(flow.log_prob(x), fresh.log_prob(x), rtol=0, atol=0)
    capsys.readouterr()
    assert run_cli("fit", "--out", str(old), "--resume") == 2  # its model loads; the run not
    assert "format version 1" in capsys.readouterr().err


def test_auto_interaction_is_radial_for_particles_and_attention_otherwise():
    from flowattn.sets.config import SetsFlow, resolved_interaction

    flow = SetsFlow()
    assert flow.interaction == "auto"
    assert resolved_interaction(flow, zero_com=True) == "radial"
    assert resolved_interaction(flow, zero_com=False) == "attention"
    assert resolved_interaction(SetsFlow(interaction="linear"), zero_com=True) == "linear"


def test_cnf_field_is_the_graph_network_for_particles_and_attention_otherwise():
    from flowattn.flows import CNF, AttentionField, EGNNField
    from flowattn.sets.config import SetsFlow

    def field(flow, zero_com):
        built = build_flow(flow, 2, 4, zero_com)
        return next(m for m in built.modules() if isinstance(m, CNF)).field

    assert isinstance(field(SetsFlow(flow="cnf"), zero_com=True), EGNNField)
    assert isinstance(field(SetsFlow(flow="cnf"), zero_com=False), AttentionField)
    chosen = field(SetsFlow(flow="cnf", field="attention"), zero_com=True)
    assert isinstance(chosen, AttentionField) and chosen.layers == 2 and chosen.hidden == 16
    egnn = field(SetsFlow(flow="cnf", field="egnn", field_layers=2, field_hidden=8), True)
    assert len(egnn.layers) == 2 and egnn.embed_time.out_features == 8
    with pytest.raises(ConfigError, match=r"field: Input should be 'auto', 'attention' or "
                       r"'egnn' \(got 'transformer'\)"):
        SetsFlow(field="transformer")
    with pytest.raises(ConfigError, match="setting of continuous flows"):
        SetsFlow(field="egnn")  # a residual flow


def test_continuous_flows_saved_before_the_field_setting_keep_the_attention_field():
    from flowattn.flows import AttentionField
    from flowattn.sets.config import legacy_settings

    settings = SetsRunConfig.build({"flow": {"flow": "cnf", "field_layers": 2,
                                             "field_hidden": 16}}).flat()
    del settings["field"]  # as written by an older version
    settings["grad_clip"] = 10.0
    config = SetsRunConfig.build(legacy_settings(settings))
    flow = build_flow(config.flow, 2, 4, zero_com=True)
    assert isinstance(flow.transform.field, AttentionField)


def test_evaluation_and_sampling_keep_no_graph():
    # a continuous flow's solve would otherwise hold every solver step of a batch in memory
    from flowattn.data import SetData
    from flowattn.sets.config import SetsFlow, build_flow
    from flowattn.sets.plots import draw_samples
    from flowattn.sets.train import evaluate

    flow = build_flow(SetsFlow(flow="cnf", field_hidden=4, field_layers=1), 2, 3, True)
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


def test_sets_of_points_on_a_line_are_plotted_one_set_per_row(tmp_path):
    from flowattn.data import repulsive_sets
    from flowattn.sets.plots import plot_sets

    data = repulsive_sets(20, generator=torch.Generator().manual_seed(0))  # points in R^1
    path = plot_sets(data, data.x[:10], torch.ones(10, 6, dtype=torch.bool), tmp_path / "s.png")
    assert path.stat().st_size > 1000


def test_within_set_distances_take_each_pair_of_present_elements_once():
    from flowattn.sets.plots import within_set_distances

    x = torch.randn(3, 5, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 0, 1, 1]], dtype=torch.bool)
    expected = [torch.pdist(x[b, mask[b]]) for b in range(3)]
    torch.testing.assert_close(within_set_distances(x, mask), torch.cat(expected))


# -- data at any offset and scale, tiny batches, and the error of the reported NLL ------------


def _fit_summary(tmp_path, name, x, *flags, steps="5"):
    data = tmp_path / f"{name}.npz"
    save_npz(data, x)
    out = tmp_path / name
    code = run_cli("fit", "--data", str(data), "--steps", steps, "--out", str(out),
                   "--no-progress", "--config", str(tiny_config(tmp_path)), *flags)
    assert code == 0
    return json.loads((out / "summary.json").read_text())


def test_fit_on_two_sets_with_batch_size_one_and_a_constant_coordinate(tmp_path, capsys):
    x = torch.randn(2, 6, 2, generator=torch.Generator().manual_seed(0))
    summary = _fit_summary(tmp_path, "two_sets", x, "--batch-size", "1")
    assert np.isfinite(summary["test_nll"])
    constant = torch.randn(40, 6, 2, generator=torch.Generator().manual_seed(1))
    constant[..., 1] = 3.0  # one coordinate never varies
    summary = _fit_summary(tmp_path, "constant", constant, "--batch-size", "8")
    assert np.isfinite(summary["test_nll"])
    assert "non-finite" not in capsys.readouterr().err


def test_data_in_other_units_fit_to_the_same_model_up_to_n_d_log_scale(tmp_path):
    # The standardisation makes the fit of 10 x + 1e6 that of x (up to float32 rounding of the
    # data, 1/16 at 1e6): its NLL per dimension is higher by log 10, no more.
    x = torch.randn(120, 6, 2, generator=torch.Generator().manual_seed(2))
    base = _fit_summary(tmp_path, "base", x, "--batch-size", "16", steps="8")
    moved = _fit_summary(tmp_path, "moved", 10 * x + 1e6, "--batch-size", "16", steps="8")
    gap = moved["test_nll_per_dim"] - base["test_nll_per_dim"]
    assert abs(gap - np.log(10.0)) < 0.02, gap
    assert base["test_nll_per_dim"] < 2.0  # a sane NLL for unit Gaussians (1.42 exact)


def test_summary_and_eval_report_how_the_log_det_was_computed(tmp_path, capsys):
    out = tmp_path / "run"
    run_cli("fit", *TINY, "--steps", "2", "--out", str(out),
            "--config", str(tiny_config(tmp_path)))
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_logdet"] == "exact" and summary["test_nll_per_dim_se"] == 0.0
    assert "exact log-det" in printed
    sampling = summary["test_nll_per_dim_sampling_se"]
    assert 0 < sampling < 0.1 and f"sampling error {sampling:.4f} nats/dim" in printed
    assert run_cli("eval", "--checkpoint", str(out), "--data", "gaussian-sets", "--json") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "exact log-det" in lines[0]
    result = json.loads(lines[-1])
    assert result["nll_se"] == 0.0
    assert f"sampling error {result['nll_per_dim_sampling_se']:.4f} nats/dim" in lines[0]


def test_evaluate_reports_the_standard_error_of_an_estimated_log_det():
    from flowattn.data import SetData
    from flowattn.flows import LogDetOptions, set_flow
    from flowattn.sets import evaluate

    torch.manual_seed(0)
    x = torch.randn(6, 12, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    data = SetData(x)
    results = {}
    for name, options in (("exact", LogDetOptions()),
                          ("estimated", LogDetOptions(eval_exact_max_dim=8))):
        torch.manual_seed(0)
        flow = set_flow(2, blocks=1, heads=1, logdet=options).double()
        flow.train().log_prob(x)  # the same ActNorm initialisation in both
        results[name] = evaluate(flow, data)
    exact, estimated = results["exact"], results["estimated"]
    assert exact["logdet"] == "exact" and exact["nll_per_dim_se"] == 0.0
    assert estimated["logdet"] == "estimated" and 0 < estimated["nll_per_dim_se"] < 0.01
    assert abs(estimated["nll"] - exact["nll"]) < 4 * estimated["nll_se"]


def test_evaluate_reports_the_sampling_error_of_its_means_over_sets():
    from flowattn.data import SetData
    from flowattn.flows import set_flow
    from flowattn.sets import evaluate

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(11, 6, 2, dtype=torch.float64, generator=gen)
    sizes = torch.tensor([6, 2, 5, 3, 6, 4, 2, 6, 3, 5, 4])
    mask = torch.arange(6) < sizes[:, None]
    torch.manual_seed(0)
    flow = set_flow(2, blocks=1, heads=1).double()
    flow.train().log_prob(x, mask)
    flow.eval()
    with torch.no_grad():
        y = -flow.log_prob(x, mask).numpy()  # per-set NLLs, scored one batch
    d = 2.0 * sizes.numpy()
    result = evaluate(flow, SetData(x, mask), batch_size=4)  # three batches
    n = len(y)
    assert np.isclose(result["nll"], y.mean())
    assert np.isclose(result["nll_per_dim"], y.sum() / d.sum())
    assert np.isclose(result["nll_sampling_se"], y.std(ddof=1) / np.sqrt(n), rtol=1e-9)
    ratio = y.sum() / d.sum()  # first-order error of a ratio of means, from its residuals
    expected = np.sqrt(((y - ratio * d) ** 2).sum() / (n * (n - 1))) / d.mean()
    assert np.isclose(result["nll_per_dim_sampling_se"], expected, rtol=1e-9)
    # the ratio's error is not the per-set error over the mean size when sizes vary
    assert not np.isclose(expected, y.std(ddof=1) / np.sqrt(n) / d.mean(), rtol=0.05)
    single = evaluate(flow, SetData(x[:1]))
    assert single["nll_sampling_se"] is None and single["nll_per_dim_sampling_se"] is None


def test_evaluating_zero_com_sets_of_one_element_is_a_clear_error(tmp_path):
    from flowattn.data import SetData
    from flowattn.errors import DataError
    from flowattn.flows import set_flow
    from flowattn.sets import evaluate

    flow = set_flow(2, blocks=1, heads=1, zero_com=True, norm="2", interaction="linear")
    mask = torch.tensor([[True, True, True], [True, False, False]])
    data = SetData(torch.randn(2, 3, 2), mask, name="particles", zero_com=True)
    with pytest.raises(DataError, match="particles: set 1 has 1 element"):
        evaluate(flow, data)
    with pytest.raises(DataError, match="set 0 has 1 element"):
        evaluate(flow, SetData(torch.randn(4, 1, 2), zero_com=True))


def test_attention_width_builds_lifted_attention_or_fails_clearly(tmp_path, capsys):
    from flowattn.branches import ContractiveLiftedL2MHA

    out = tmp_path / "run"
    assert run_cli("fit", *TINY, "--attention-width", "8", "--heads", "4", "--steps", "2",
                   "--out", str(out), "--config", str(tiny_config(tmp_path))) == 0
    flow, _ = load_flow(out)  # the saved setting rebuilds the same flow
    branches = [m for m in flow.modules() if isinstance(m, ContractiveLiftedL2MHA)]
    assert branches and branches[0].width == 8 and branches[0].heads == 4
    assert "test NLL" in capsys.readouterr().out
    for extra in (["--interaction", "linear"], ["--inducing-points", "4"]):
        assert run_cli("fit", *TINY, "--attention-width", "8", *extra, "--steps", "2",
                       "--out", str(tmp_path / "x")) != 0
        assert "attention_width" in capsys.readouterr().err
    assert run_cli("fit", *TINY, "--attention-width", "6", "--heads", "4", "--steps", "2",
                   "--out", str(tmp_path / "z")) != 0
    assert "must divide attention_width" in capsys.readouterr().err
    # particles resolve to radial interactions: refused when the flow is built
    assert run_cli("fit", "--data", "dw4", "--num-train", "64", "--no-progress",
                   "--attention-width", "8", "--steps", "1", "--out", str(tmp_path / "y")) != 0
    assert "attention_width" in capsys.readouterr().err


def test_inducing_points_build_induced_attention_or_fail_clearly(tmp_path, capsys):
    from flowattn.attention import ContractiveInducedL2MHA, ContractiveL2MHA

    out = tmp_path / "run"
    assert run_cli("fit", *TINY, "--inducing-points", "4", "--steps", "2", "--out", str(out),
                   "--config", str(tiny_config(tmp_path))) == 0
    flow, _ = load_flow(out)  # the saved setting rebuilds the same flow
    branches = [m for m in flow.modules() if isinstance(m, ContractiveInducedL2MHA)]
    assert branches and branches[0].attention.inducing == 4
    assert not any(isinstance(m, ContractiveL2MHA) for m in flow.modules())
    assert "test NLL" in capsys.readouterr().out
    for extra in (["--interaction", "linear"], ["--flow", "coupling"]):
        assert run_cli("fit", *TINY, "--inducing-points", "4", *extra, "--steps", "2",
                       "--out", str(tmp_path / "x")) != 0
        assert "inducing_points" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not (tmp_path / "x" / "checkpoint.pt").exists()
    # particles resolve to radial interactions: refused when the flow is built
    assert run_cli("fit", "--data", "dw4", "--num-train", "64", "--no-progress",
                   "--inducing-points", "4", "--steps", "1", "--out", str(tmp_path / "y")) != 0
    assert "inducing_points" in capsys.readouterr().err


def test_rnode_weights_add_the_penalties_per_dimension_to_the_objective_only():
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    settings = {"data": "gaussian-sets", "num_train": 32, "val_sets": 8, "flow": "cnf",
                "field_hidden": 8, "location": False, "divergence": "exact"}
    plain = SetsRunConfig.build(settings)
    weighted = SetsRunConfig.build({**settings, "kinetic_weight": 0.5, "jacobian_weight": 0.25})
    one = Distributed(rank=0, world=1, device=torch.device("cpu"))
    x, mask = torch.randn(4, 8, 2), None
    dims = 16.0  # 8 points in R^2

    torch.manual_seed(0)
    task = SetsTask(weighted, one, plots=False)
    objective, nll, count = task.loss(task.forward_module, (x, mask))
    cnf = next(m for m in task.flow.modules() if hasattr(m, "kinetic_energy"))
    kinetic, frobenius = cnf.kinetic_energy.mean(), cnf.jacobian_frobenius.mean()
    assert kinetic > 0 and frobenius > 0 and count == 4
    torch.testing.assert_close(objective, nll + (0.5 * kinetic + 0.25 * frobenius) / dims)
    objective.backward()  # the penalties are differentiable through the solve
    assert all(p.grad is not None for p in task.flow.parameters() if p.requires_grad)

    torch.manual_seed(0)
    task = SetsTask(plain, one, plots=False)
    objective, same_nll, _ = task.loss(task.forward_module, (x, mask))
    assert objective is same_nll  # no weights: nothing integrated, nothing added
    cnf = next(m for m in task.flow.modules() if hasattr(m, "kinetic_energy"))
    assert cnf.kinetic_energy is None
    torch.testing.assert_close(same_nll, nll, rtol=1e-5, atol=1e-6)  # the same model and NLL


def test_adjoint_training_gives_the_solvers_gradients_by_a_backward_solve():
    # E-NF backpropagates through the adjoint ODE: memory independent of the solver's steps
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    settings = {"data": "gaussian-sets", "num_train": 32, "val_sets": 8, "flow": "cnf",
                "field_hidden": 8, "divergence": "hutchinson", "ode_tol": 1e-7,
                "kinetic_weight": 0.1}
    one = Distributed(rank=0, world=1, device=torch.device("cpu"))
    x = torch.randn(4, 8, 2, generator=torch.Generator().manual_seed(5))
    gradients, backward = {}, {}
    for adjoint in (False, True):
        torch.manual_seed(0)  # the same weights and the same Hutchinson probe
        task = SetsTask(SetsRunConfig.build({**settings, "adjoint": adjoint}), one, plots=False)
        cnf = next(m for m in task.flow.modules() if hasattr(m, "kinetic_energy"))
        assert cnf.adjoint is adjoint
        objective, _, _ = task.loss(task.forward_module, (x, None))
        objective.backward()
        gradients[adjoint] = torch.cat([p.grad.flatten() for p in task.flow.parameters()
                                        if p.grad is not None])
        backward[adjoint] = cnf.nfe_backward
    # the location flow before the solve gets its gradients through the adjoint's input
    assert len(gradients[True]) == len(gradients[False])
    error = (gradients[True] - gradients[False]).norm() / gradients[False].norm()
    assert error < 1e-4  # float32 solves at tolerance 1e-7
    assert backward[True] != backward[False]  # a solve of its own, not the forward's graph
    for bad in ({"adjoint": True}, {"flow": "cnf", "objective": "matching", "adjoint": True}):
        with pytest.raises(ConfigError, match="adjoint backpropagates through a continuous"):
            SetsRunConfig.build(bad)


def test_rnode_weights_are_refused_outside_continuous_flows():
    with pytest.raises(ConfigError, match="kinetic_weight is a setting of continuous flows"):
        SetsRunConfig.build({"kinetic_weight": 0.1})
    with pytest.raises(ConfigError, match="jacobian_weight"):
        SetsRunConfig.build({"flow": "coupling", "jacobian_weight": 0.1})


def test_flow_matching_trains_on_the_batchs_own_draws_and_reports_the_odes_nll():
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    config = SetsRunConfig.build({"data": "gaussian-sets", "num_train": 32, "val_sets": 8,
                                  "flow": "cnf", "objective": "matching", "field_hidden": 8,
                                  "location": False, "batch_size": 6})
    one = Distributed(rank=0, world=1, device=torch.device("cpu"))
    torch.manual_seed(0)
    task = SetsTask(config, one, plots=False)
    batch = task.batch(torch.Generator().manual_seed(3), one)
    x, mask, noise, times = batch
    assert noise.shape == x.shape and times.shape == (6,) and mask is None
    assert 0 <= float(times.min()) and float(times.max()) <= config.flow.t1
    objective, reported, count = task.loss(task.forward_module, batch)
    expected = task.flow.matching_loss(x, mask, noise=noise, times=times).mean() / 16
    torch.testing.assert_close(objective, expected)
    assert reported is objective and count == 6
    objective.backward()
    assert all(p.grad is not None for p in task.flow.parameters() if p.requires_grad)
    again = task.batch(torch.Generator().manual_seed(3), one)  # the draws follow the generator
    for first, second in zip(batch[2:], again[2:], strict=True):
        torch.testing.assert_close(first, second, rtol=0, atol=0)
    result = task.evaluate(one)  # validation: the ODE's exact NLL, and its solver's evaluations
    assert math.isfinite(result["loss"]) and result["nfe"] > 0
    assert "nfe_forward" not in task.train_stats()  # no solve in a matching step


def test_aligned_flow_matching_moves_the_batchs_draws_towards_their_particles(tmp_path, capsys):
    from flowattn.flows.continuous.alignment import align
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    config = SetsRunConfig.build({"data": "dw4", "num_train": 32, "val_sets": 8, "flow": "cnf",
                                  "objective": "matching", "alignment": "euclidean",
                                  "field_hidden": 8, "batch_size": 6})
    one = Distributed(rank=0, world=1, device=torch.device("cpu"))
    torch.manual_seed(0)
    task = SetsTask(config, one, plots=False)
    scale = task.flow.standardisation.log_scale  # one scale for both directions
    assert torch.equal(scale, scale[:1].expand_as(scale))
    x, mask, noise, times = batch = task.batch(torch.Generator().manual_seed(3), one)
    objective, _, _ = task.loss(task.forward_module, batch)
    u = x * scale.exp()  # the standardised sets, x / s
    u = u - u.mean(dim=1, keepdim=True)
    draws = noise - noise.mean(dim=1, keepdim=True)
    expected = task.flow.transform.matching_loss(u, noise=align(draws, u, rotations=True),
                                                 times=times).mean() / 6
    torch.testing.assert_close(objective, expected)
    # the task standardised isotropically once; its steps do not read the scales back (a host
    # sync per step): only a direct call checks them
    with torch.no_grad():
        scale[0] += 0.1
    task.loss(task.forward_module, batch)
    with pytest.raises(ValueError, match="standardise with isotropic=True"):
        task.flow.matching_loss(x, mask, noise=noise, times=times, alignment="euclidean")
    with pytest.raises(ConfigError, match="alignment='permutation' is a setting of flow"):
        SetsRunConfig.build({"flow": "cnf", "alignment": "permutation"})
    out = tmp_path / "run"  # rotations of sets whose law is not invariant under them: refused
    assert run_cli("fit", *TINY, "--flow", "cnf", "--objective", "matching", "--no-location",
                   "--alignment", "euclidean", "--steps", "1", "--out", str(out)) != 0
    assert "alignment=euclidean turns base draws" in capsys.readouterr().err
    assert not (out / "checkpoint.pt").exists()


def test_the_initialising_pass_keeps_no_graph(monkeypatch):
    # a continuous flow's solve with its graph (LJ13, exact trace, batch 100) held 20 GB
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    config = SetsRunConfig.build({"data": "gaussian-sets", "num_train": 32, "val_sets": 8,
                                  "flow": "cnf", "field_hidden": 8, "batch_size": 6})
    one = Distributed(rank=0, world=1, device=torch.device("cpu"))
    task = SetsTask(config, one, plots=False)
    seen = []
    log_prob = task.flow.component_log_prob  # the flow's own density (before any symmetry)
    monkeypatch.setattr(task.flow, "component_log_prob",
                        lambda x, m: seen.append((torch.is_grad_enabled(), len(x)))
                        or log_prob(x, m))
    task.initialise()
    assert seen == [(False, 6)]  # the batch, without a graph
    task.check_memory()
    # the memory check: one set and two, with their graphs
    assert seen == [(False, 6), (True, 1), (True, 2)]


def test_flow_matching_is_refused_where_it_cannot_train_the_flow(tmp_path, capsys):
    with pytest.raises(ConfigError, match="objective=matching trains continuous flows"):
        SetsRunConfig.build({"objective": "matching"})
    with pytest.raises(ConfigError, match="solves nothing"):
        SetsRunConfig.build({"flow": "cnf", "objective": "matching", "kinetic_weight": 0.1})
    # a centroid flow before the CNF (non-particle data with location) and compile: one line
    refusals = [((), "give location false"),
                (("--no-location", "--compile"), "compile is a setting of")]
    for extra, message in refusals:
        out = tmp_path / f"run{len(extra)}"
        assert run_cli("fit", *TINY, "--flow", "cnf", "--objective", "matching", *extra,
                       "--steps", "1", "--out", str(out)) != 0
        assert message in capsys.readouterr().err
        assert not (out / "checkpoint.pt").exists()


def test_splines_put_a_spline_coupling_in_every_block_or_fail_clearly(tmp_path, capsys):
    from flowattn.flows.coupling import SetCoupling

    out = tmp_path / "run"
    assert run_cli("fit", *TINY, "--splines", "--blocks", "2", "--steps", "2", "--out",
                   str(out), "--config", str(tiny_config(tmp_path))) == 0
    flow, _ = load_flow(out)  # the saved setting rebuilds the same flow
    assert sum(isinstance(m, SetCoupling) for m in flow.modules()) == 2
    assert "test NLL" in capsys.readouterr().out
    assert run_cli("fit", *TINY, "--splines", "--flow", "coupling", "--steps", "2",
                   "--out", str(tmp_path / "x")) != 0
    assert "splines is a setting of residual flows" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not (tmp_path / "x" / "checkpoint.pt").exists()
    # particles (zero centre of mass) and points on a line are refused when the flow is built
    for data in ("dw4", "repulsive-sets"):
        assert run_cli("fit", "--data", data, "--num-train", "64", "--no-progress",
                       "--splines", "--steps", "1", "--out", str(tmp_path / data)) != 0
        err = capsys.readouterr().err
        assert "splines" in err and "D >= 2" in err and len(err.strip().splitlines()) == 1


def test_sample_draws_set_sizes_as_often_as_in_training_and_writes_their_mask(tmp_path,
                                                                               capsys):
    sizes = torch.tensor([3] * 150 + [5] * 50)  # three quarters of the sets hold 3 elements
    mask = torch.arange(5) < sizes.unsqueeze(1)
    x = torch.randn(200, 5, 2, generator=torch.Generator().manual_seed(0)) * mask.unsqueeze(-1)
    data = tmp_path / "sets.npz"
    save_npz(data, x, mask)
    out = tmp_path / "run"
    assert run_cli("fit", "--data", str(data), "--steps", "2", "--batch-size", "16",
                   "--no-progress", "--out", str(out), "--config",
                   str(tiny_config(tmp_path))) == 0
    drawn = tmp_path / "drawn.npz"
    assert run_cli("sample", "--checkpoint", str(out), "--num", "400", "--out", str(drawn),
                   "--no-progress") == 0
    assert "3-5 elements (sizes drawn as often as in training" in capsys.readouterr().out
    with np.load(drawn) as saved:
        got, got_mask = saved["x"], saved["mask"]
    assert got.shape == (400, 5, 2) and got_mask.shape == (400, 5)
    counts = got_mask.sum(1)
    assert set(counts.tolist()) == {3, 5}
    assert 0.68 < (counts == 3).mean() < 0.82  # 0.75, four standard errors either side
    assert (got_mask == (np.arange(5) < counts[:, None])).all()  # the first n present
    assert (got[~got_mask] == 0).all() and np.isfinite(got).all()
    fixed = tmp_path / "fixed.npz"
    assert run_cli("sample", "--checkpoint", str(out), "--num", "4", "--set-size", "4",
                   "--out", str(fixed), "--no-progress") == 0
    with np.load(fixed) as saved:
        assert saved["x"].shape == (4, 4, 2) and "mask" not in saved
    # a checkpoint written before sizes were recorded: the largest size, and a word on it
    record = torch.load(out / "checkpoint.pt", weights_only=True)
    del record["task"]["data"]["size_counts"]
    torch.save(record, out / "checkpoint.pt")
    old = tmp_path / "old.npz"
    assert run_cli("sample", "--checkpoint", str(out), "--num", "4", "--out", str(old),
                   "--no-progress") == 0
    assert "records no size distribution" in capsys.readouterr().out
    with np.load(old) as saved:
        assert saved["x"].shape == (4, 5, 2) and "mask" not in saved


def test_eval_of_sets_on_which_the_flow_overflows_names_their_scale(tiny_run, tmp_path, capsys):
    # "non-finite log-likelihood while evaluating huge": the file's stem and no reason
    path = tmp_path / "huge.npz"
    save_npz(path, torch.randn(4, 8, 2) * 1e30)  # finite in float32
    assert run_cli("eval", "--checkpoint", str(tiny_run), "--data", str(path),
                   "--no-progress") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite log-likelihood while evaluating huge (its " \
        "coordinates reach |x| = " in err[0], err
    assert err[0].endswith("sets far outside the range of the training data need the training "
                           "data's scale (rescale them as those were)")


def test_floor_names_its_own_flags_and_takes_threads(capsys):
    # "--chains 0" was "AnnealingOptions.chains must be an integer >= 2", and --threads was
    # an unrecognised argument
    for argv, message in ((["--chains", "0"], "--chains must be >= 2, got 0"),
                          (["--stages", "0"], "--stages must be >= 1, got 0"),
                          (["--threads", "0"], "--threads must be >= 1, got 0")):
        assert run_cli("floor", "--data", "dw4", *argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"flowattn sets floor: error: {message}"], err


def test_eval_says_which_density_it_scores_and_when_the_sets_are_the_training_file(
        tmp_path, capsys):
    # the mirror average and the flow's own density gave the same line; the run's own data
    # file, training sets included, was scored without a word
    data = tmp_path / "sets.npz"
    save_npz(data, torch.randn(40, 4, 2))
    out = tmp_path / "run"
    assert run_cli("fit", "--data", str(data), "--steps", "2", "--blocks", "1", "--hidden", "8",
                   "--batch-size", "8", "--no-progress", "--no-tensorboard", "--out",
                   str(out)) == 0
    capsys.readouterr()
    other = tmp_path / "other.npz"
    save_npz(other, torch.randn(5, 4, 2))
    for path, symmetry in ((data, "none"), (other, "reflections")):
        assert run_cli("eval", "--checkpoint", str(out), "--data", str(path), "--symmetry",
                       symmetry, "--no-progress", "--json") == 0
        lines = capsys.readouterr().out.strip().splitlines()
        mirrored = "the mirror average over the 4 reflections through the axes; " in lines[0]
        assert mirrored == (symmetry == "reflections"), lines[0]
        noted = lines[1] == (f"note: {path} is the file the run was fitted to: these sets "
                             "include its training sets (the NLL fit reports is of the "
                             "held-out tenth alone)")
        assert noted == (path == data), lines
        assert json.loads(lines[-1])["density"] == ("mirror average" if mirrored
                                                    else "the flow's own")


def test_radial_settings_are_read_where_auto_resolves_to_radial():
    from flowattn.sets.config import SetsRunConfig, check_applicable

    for data in ("dw4", "lj13"):  # particle systems: auto is radial
        config = SetsRunConfig.build({"data": data, "radial_basis": 8})
        check_applicable({"radial_basis": 8, "radial_range": 3.0}, config)


@pytest.mark.parametrize("flags, message", [
    (["--flow", "coupling", "--blocks", "7"], "blocks is a setting of residual flows"),
    (["--flow", "coupling", "--coeff", "0.5"], "coeff is a setting of residual flows"),
    (["--preset", "small", "--hidden", "7"], "(flow=coupling): a coupling flow's depth and"),
    (["--flow", "cnf", "--train-logdet", "exact"], "train_logdet is a setting of residual"),
    (["--t1", "2"], "t1 is a setting of continuous flows (flow=cnf)"),
    (["--divergence", "hutchinson"], "divergence is a setting of continuous flows"),
    (["--interaction", "attention", "--radial-basis", "8"], "radial_basis is a setting of "
                                                            "radial interactions"),
    # auto resolves to attention for every data set but the particle systems
    (["--radial-basis", "8"], "radial_basis is a setting of radial interactions (flow=resflow, "
                              "interaction=radial; here flow=resflow, interaction=attention "
                              "(auto, for data=gaussian-sets))"),
    (["--energy-max", "5"], "energy_max is a setting of training by energy"),
    (["--interaction", "none", "--location"], "location is not built with interaction=none"),
])
def test_fit_refuses_typed_settings_its_flow_would_not_read(tmp_path, capsys, flags, message):
    # each of these was ignored in silence: the run trained the flow it would have without it
    out = tmp_path / "run"
    assert run_cli("fit", *TINY, "--steps", "2", "--out", str(out), *flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()  # refused before the run folder is made


def test_a_checkpoint_that_does_not_rebuild_its_flow_says_which_entry_and_why(tmp_path, capsys,
                                                                             tiny_run):
    # a weight of the wrong shape: torch's whole message (the key and both shapes) on one
    # line, not only its first line; a record without its model: the entry by name
    record = torch.load(tiny_run / "checkpoint.pt", weights_only=True)
    name = next(k for k, v in record["model"].items() if v.dim() == 2)
    record["model"][name] = torch.zeros(3, 3)
    torch.save(record, tmp_path / "shape.pt")
    del record["model"]
    torch.save(record, tmp_path / "nomodel.pt")
    capsys.readouterr()
    for path, message in (("shape.pt", f"size mismatch for {name}: copying a param with shape "
                                       "torch.Size([3, 3]) from checkpoint"),
                          ("nomodel.pt", "its record has no entry 'model'")):
        assert run_cli("sample", "--checkpoint", str(tmp_path / path), "--num", "2", "--out",
                       str(tmp_path / "s.npz")) == 2
        err = capsys.readouterr().err.strip()
        assert "does not hold a set flow this flowattn can rebuild: " in err, err
        assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("step", [-5, 2.5, True, None])
def test_a_checkpoint_whose_step_is_not_a_count_is_refused_naming_it(tmp_path, capsys, tiny_run,
                                                                     step):
    # a hand-edited step = -5 was taken as it was (a resumed run would count from -5)
    record = torch.load(tiny_run / "checkpoint.pt", weights_only=True)
    record["step"] = step
    torch.save(record, tmp_path / "step.pt")
    capsys.readouterr()
    assert run_cli("sample", "--checkpoint", str(tmp_path / "step.pt"), "--num", "2", "--out",
                   str(tmp_path / "s.npz")) == 2
    err = capsys.readouterr().err.strip()
    assert not (tmp_path / "s.npz").exists()
    assert f"step.pt: its step is {step!r}, not a number of steps taken" in err, err
    assert len(err.splitlines()) == 1


def test_sample_refuses_a_draw_that_would_not_fit_in_memory_before_drawing(tmp_path, capsys,
                                                                          tiny_run,
                                                                          monkeypatch):
    # --num 10^12 drew batch after batch until the machine ran out of memory
    import flowattn.training.memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 10_000)
    out = tmp_path / "s.npz"
    capsys.readouterr()
    assert run_cli("sample", "--checkpoint", str(tiny_run), "--num", "100", "--out",
                   str(out)) == 2  # 2 x 100 x 8 x 2 x 4 = 12,800 bytes
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowattn sets sample: error: 100 sets of 8 elements in R^2 take "
                          "12.5 KiB as they are drawn and written, and 9.8 KiB is available")
    assert "--num, --set-size" in err and not out.exists()
    assert run_cli("sample", "--checkpoint", str(tiny_run), "--num", "50", "--out",
                   str(out)) == 0  # 6,400 bytes
