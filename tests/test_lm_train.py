"""Tests for flowattn.lm.train: schedules, learning, checkpoints, exact resume, divergence, DDP."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flowattn.lm.train as lm_train
from flowattn.errors import CheckpointError, ConfigError, RunError
from flowattn.lm.config import LMConfig, LMRunConfig
from flowattn.lm.train import load_checkpoint, train
from flowattn.training.run import plan_run

ROOT = Path(__file__).resolve().parents[1]
TEXT = "the quick brown fox jumps over the lazy dog. " * 60


@pytest.fixture
def corpus(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def tiny(corpus: str, **kw) -> LMRunConfig:
    base = dict(data=corpus, layers=1, dim=16, heads=2, block_size=16, batch_size=4, steps=16,
                eval_every=8, checkpoint_every=8, log_every=2)
    base.update(kw)
    return LMRunConfig.build(base)


def run(config: LMRunConfig, out, **kw) -> dict:
    return train(config, out, progress=False, tensorboard=kw.pop("tensorboard", False), **kw)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- training


def test_training_lowers_validation_loss_far_below_uniform(corpus, tmp_path):
    summary = run(tiny(corpus, dim=32, steps=80, eval_every=40, lr=3e-3, warmup=10,
                       min_lr=3e-4), tmp_path / "run")
    vals = [r["loss"] for r in records(tmp_path / "run") if r["split"] == "val"]
    assert len(vals) == 2 and vals[1] < vals[0]
    assert summary["val_loss"] == vals[1] < 0.5 * math.log(28)  # 28 symbols in TEXT
    assert not summary["diverged"] and summary["step"] == 80
    assert summary["val_bpc"] == pytest.approx(summary["val_loss"] / math.log(2))


def test_checkpoint_is_written_atomically_and_rebuilds_the_trained_model(corpus, tmp_path):
    out = tmp_path / "run"
    summary = run(tiny(corpus, dropout=0.1), out)
    assert sorted(p.name for p in out.iterdir()) == [  # (.run.lock: the folder's lock)
        ".run.lock", "checkpoint.pt", "config.json", "metrics.jsonl", "run.json",
        "summary.json"]
    model, ckpt, vocab = load_checkpoint(out)
    assert ckpt["step"] == 16 and len(ckpt["rng"]) == 1 and not model.training
    assert ckpt["format"] == "flowattn" and ckpt["kind"] == "lm" and ckpt["version"] == 2
    assert vocab.decode(vocab.encode("lazy dog")) == "lazy dog"
    # the rebuilt model scores the validation split exactly as the run's last evaluation did
    corpus_ids = vocab.encode(TEXT)
    val = corpus_ids[int(0.9 * len(corpus_ids)):]
    loss = lm_train.evaluate(model, val, 16, 4, torch.device("cpu"))
    assert loss == pytest.approx(summary["val_loss"], rel=1e-6)
    assert not list(out.glob(".*.tmp"))  # no temporary file left behind


def test_an_averaged_run_validates_and_saves_the_average_of_a_certified_model(corpus, tmp_path):
    out = tmp_path / "run"
    summary = run(tiny(corpus, attention="contractive-l2", ema=0.9), out)
    model, ckpt, vocab = load_checkpoint(out)
    assert any(not torch.equal(ckpt["model"][k], ckpt["training_model"][k])
               for k in ckpt["model"])
    for name, value in model.state_dict().items():
        assert torch.equal(value, ckpt["model"][name]), name
    corpus_ids = vocab.encode(TEXT)
    val = corpus_ids[int(0.9 * len(corpus_ids)):]
    loss = lm_train.evaluate(model, val, 16, 4, torch.device("cpu"))
    assert loss == pytest.approx(summary["val_loss"], rel=1e-6)
    trained, *_ = load_checkpoint(out)
    trained.load_state_dict(ckpt["training_model"])
    assert lm_train.evaluate(trained, val, 16, 4, torch.device("cpu")) != pytest.approx(
        loss, rel=1e-6)


def test_metrics_record_training_and_validation_at_their_intervals(corpus, tmp_path):
    run(tiny(corpus), tmp_path / "run")
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs if r["split"] == "train"] == list(range(2, 17, 2))
    assert [r["step"] for r in recs if r["split"] == "val"] == [8, 16]
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in recs if r["split"] == "train")
    assert all({"step", "split", "time", "loss"} <= r.keys() for r in recs)


def test_tensorboard_events_are_written_when_tensorboard_is_installed(corpus, tmp_path):
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is not installed")
    run(tiny(corpus, steps=4, eval_every=4), tmp_path / "run", tensorboard=True)
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_interrupted_run_resumes_to_exactly_the_uninterrupted_result(
    corpus, tmp_path, monkeypatch, schedule
):
    # dropout exercises the saved random state; the interruption falls between checkpoints
    kw = dict(dropout=0.2, schedule=schedule, warmup=3, steps=16, eval_every=6,
              checkpoint_every=6)
    straight = run(tiny(corpus, **kw), tmp_path / "a")

    calls = {"n": 0}
    real_get_batch = lm_train.get_batch

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 10:  # during step 10, after the checkpoint of step 6
            raise KeyboardInterrupt
        return real_get_batch(*args, **kwargs)

    monkeypatch.setattr(lm_train, "get_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tiny(corpus, **kw), tmp_path / "b")
    assert max(r["step"] for r in records(tmp_path / "b")) == 8  # logged past the checkpoint
    monkeypatch.setattr(lm_train, "get_batch", real_get_batch)
    resumed = train(out=tmp_path / "b", resume=True, progress=False, tensorboard=False)

    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True) for d in ("a", "b"))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert resumed["val_loss"] == straight["val_loss"]
    strip = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "time")}
             for r in records(tmp_path / "a")]
    again = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "time")}
             for r in records(tmp_path / "b")]
    assert again == strip


def test_existing_checkpoint_is_not_overwritten_without_resume(corpus, tmp_path):
    run(tiny(corpus, steps=2, eval_every=2), tmp_path / "run")
    with pytest.raises(RunError, match="already holds a run"):
        run(tiny(corpus, steps=2, eval_every=2), tmp_path / "run")


def test_resume_refuses_changed_model_settings(corpus, tmp_path):
    run(tiny(corpus, steps=2, eval_every=2), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"layers \(1 in the run, 2 now\)"):
        train(out=tmp_path / "run", resume=True, flags={"steps": 4, "layers": 2})


def test_resume_may_extend_training(corpus, tmp_path):
    run(tiny(corpus, steps=4, eval_every=4, checkpoint_every=4, schedule="constant"),
        tmp_path / "run")
    summary = train(out=tmp_path / "run", resume=True, flags={"steps": 8}, progress=False)
    assert summary["step"] == 8
    assert [r["step"] for r in records(tmp_path / "run") if r["split"] == "val"] == [4, 8]


# ----------------------------------------------------------------------------- divergence


@pytest.mark.parametrize(
    "lr, reason", [(10.0, "smoothed loss"), (1e30, "non-finite")], ids=["exploding", "nan"]
)
def test_divergence_is_detected_recorded_and_keeps_the_last_good_checkpoint(
    corpus, tmp_path, lr, reason
):
    out = tmp_path / "run"
    summary = run(tiny(corpus, lr=lr, min_lr=0.0, schedule="constant", warmup=0,
                       grad_clip=None, steps=50, eval_every=1, checkpoint_every=1,
                       log_every=1), out)
    assert summary["diverged"] and reason in summary["divergence"]["reason"]
    stop = summary["divergence"]["step"]
    assert stop < 50
    saved = json.loads((out / "diverged.json").read_text())
    assert saved["step"] == stop and reason in saved["reason"]
    events = [r for r in records(out) if r.get("event") == "diverged"]
    assert len(events) == 1 and events[0]["step"] == stop and events[0]["split"] == "event"
    if lr == 1e30:  # the first update already overflows: no state was ever good enough to save
        assert not (out / "checkpoint.pt").exists()
        return
    _, ckpt, _ = load_checkpoint(out)
    assert 1 <= ckpt["step"] < stop
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_load_checkpoint_rejects_other_files(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a flowattn checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing")


def test_checkpoints_of_format_version_1_still_load(corpus, tmp_path):
    out = tmp_path / "run"
    run(tiny(corpus, steps=4, eval_every=4, checkpoint_every=4), out)
    model, record, vocab = load_checkpoint(out)
    old = tmp_path / "old"
    old.mkdir()
    task = record["task"]
    legacy = {"kind": "flowattn-lm", "version": 1, "model_config": task["model_config"],
              "vocab": task["vocab"], "data": task["corpus"], "model": record["model"],
              "step": record["step"]}
    torch.save(legacy, old / "ckpt.pt")  # the name and layout of format version 1
    again, saved, _ = load_checkpoint(old)
    assert saved["version"] == 1 and saved["step"] == 4
    x = vocab.encode("the quick brown ")[None]
    assert torch.equal(model(x)[0], again(x)[0])
    with pytest.raises(RunError, match="format version 1"):
        train(out=old, resume=True)


# ----------------------------------------------------------------------------- legacy rule

# The settings every model had before tied L2 attention got defaults of its own (version 2).
OLD_SETTINGS = dict(self_offset=0.0, position_bias=0.0, init="default", init_scale=1 / 16,
                    contractive_norm="inf", norm_gain=1.0)


def as_stored_before_version_2(network: dict, drop: tuple[str, ...]) -> None:
    """Network settings as flowattn stored them before defaults_version 2: no version, and
    (for runs older still) without the keys ``drop``."""
    for key in ("defaults_version", *drop):
        del network[key]


def store_as_before_version_2(out: Path, drop: tuple[str, ...] = ()) -> None:
    """The run in ``out`` as flowattn stored it before version 2 (and so before version 4's
    automatic ``lr`` and ``warmup``: they are stored as the numbers it trained with)."""
    path = out / "checkpoint.pt"
    record = torch.load(path, weights_only=True)
    trained = LMRunConfig.from_stored(record["config"]).training()
    numbers = {"lr": trained.lr, "warmup": trained.warmup}
    record["config"]["train"].update(numbers)
    as_stored_before_version_2(record["config"]["network"], drop)
    as_stored_before_version_2(record["task"]["model_config"], drop)
    torch.save(record, path)
    config = json.loads((out / "config.json").read_text())
    config["train"].update(numbers)
    as_stored_before_version_2(config["network"], drop)
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("drop", [(), tuple(OLD_SETTINGS)], ids=["old-values", "missing-keys"])
@pytest.mark.parametrize("attention", ["l2-tied", "contractive-l2"])
def test_runs_stored_before_the_tied_l2_defaults_load_score_and_resume_as_they_trained(
    corpus, tmp_path, attention, drop
):
    kw = dict(attention=attention, schedule="constant", warmup=0, eval_every=4,
              checkpoint_every=4, **OLD_SETTINGS)
    straight = run(tiny(corpus, steps=8, **kw), tmp_path / "straight")
    out = tmp_path / "old"
    first = run(tiny(corpus, steps=4, **kw), out)
    before, _, vocab = load_checkpoint(out)
    store_as_before_version_2(out, drop)

    model, record, _ = load_checkpoint(out)
    assert {k: getattr(model.config, k) for k in OLD_SETTINGS} == OLD_SETTINGS
    assert model.config.defaults_version == 1
    x = vocab.encode("the quick brown ")[None]
    assert torch.equal(model(x)[0], before(x)[0])
    ids = vocab.encode(TEXT)
    loss = lm_train.evaluate(model, ids[int(0.9 * len(ids)):], 16, 4, torch.device("cpu"))
    assert loss == pytest.approx(first["val_loss"], rel=1e-6)

    resumed = train(out=out, resume=True, flags={"steps": 8}, progress=False,
                    tensorboard=False)
    assert resumed["step"] == 8 and resumed["val_loss"] == straight["val_loss"]
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)
            for d in ("straight", "old"))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(t, b["model"][name]) for name, t in a["model"].items())


def test_a_run_stopped_before_its_first_checkpoint_restarts_with_its_old_defaults(
    corpus, tmp_path
):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"format": "flowattn-run", "kind": "lm",
                                              "data": {}}))
    config = tiny(corpus, attention="l2-tied").to_dict()
    as_stored_before_version_2(config["network"], tuple(OLD_SETTINGS))
    (out / "config.json").write_text(json.dumps(config))
    plan = plan_run(out, "lm", LMRunConfig, resume=True)
    assert plan.checkpoint is None and plan.config.network.defaults_version == 1
    model = LMConfig(vocab_size=5, **plan.config.network.to_dict())
    assert {k: getattr(model, k) for k in OLD_SETTINGS} == OLD_SETTINGS


def test_resume_refuses_settings_that_no_longer_build_the_checkpoints_model(corpus, tmp_path):
    out = tmp_path / "run"
    run(tiny(corpus, attention="contractive-l2", steps=2, eval_every=2, checkpoint_every=2),
        out)
    path = out / "checkpoint.pt"
    record = torch.load(path, weights_only=True)
    assert record["config"]["network"]["contractive_norm"] == "auto"
    assert record["task"]["model_config"]["contractive_norm"] == "2,inf"
    record["config"]["network"]["contractive_norm"] = "2"  # what another "auto" could mean
    torch.save(record, path)
    settings = json.loads((out / "config.json").read_text())  # the folder's settings agree
    settings["network"]["contractive_norm"] = "2"
    (out / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=r"contractive_norm \('2,inf' in the checkpoint, "
                                              r"'2' now\)"):
        train(out=out, resume=True, flags={"steps": 4}, progress=False, tensorboard=False)


# ----------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_trains_with_two_gloo_processes(corpus, tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        "-m", "flowattn", "lm", "train", "--data", corpus, "--layers", "1", "--dim", "16",
        "--heads", "2", "--block-size", "16", "--batch-size", "4", "--steps", "6",
        "--eval-every", "3", "--checkpoint-every", "3", "--out", str(out), "--no-progress",
        "--no-tensorboard",
        "--threads", "1", "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[:3000] + " ... " + done.stderr[-2000:]
    summaries = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1  # only the first process reports
    assert summaries[0]["world_size"] == 2 and summaries[0]["step"] == 6
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    # every process draws the same batch indices and keeps its share; dropout streams differ
    assert torch.equal(ckpt["rng"][0]["batches"], ckpt["rng"][1]["batches"])
    assert not torch.equal(ckpt["rng"][0]["torch"], ckpt["rng"][1]["torch"])


@pytest.mark.parametrize(("network", "peak"), [(dict(attention="dp"), 1e-3),
                                               (dict(attention="l2-tied"), 2e-3),
                                               (dict(attention="l2"), 1e-3),
                                               (dict(attention="contractive-l2"), 2e-3),
                                               (dict(invertible=True), 6e-3),
                                               (dict(invertible=True, defaults_version=3), 1e-3),
                                               (dict(invertible=True, lr=5e-4), 5e-4)])
def test_the_loop_trains_at_the_models_own_learning_rate(corpus, tmp_path, network, peak):
    out = tmp_path / "run"
    run(tiny(corpus, steps=4, log_every=1, warmup=0, schedule="constant", **network), out)
    assert {r["lr"] for r in records(out) if r["split"] == "train"} == {peak}
    # the run keeps "auto" and its defaults version, and resumes at the same rate
    stored = json.loads((out / "config.json").read_text())
    assert stored["train"]["lr"] == network.get("lr", "auto")
    assert LMRunConfig.from_stored(stored).training().lr == peak


@pytest.mark.parametrize(("network", "warmup"), [(dict(attention="dp"), 100),
                                                 (dict(attention="l2-tied"), 400),
                                                 (dict(attention="contractive-l2"), 400),
                                                 (dict(invertible=True), 400),
                                                 (dict(invertible=True, defaults_version=3), 100),
                                                 (dict(invertible=True, warmup=7), 7)])
def test_the_loop_warms_up_for_the_models_own_number_of_steps(corpus, tmp_path, network, warmup):
    from flowattn.training.schedule import learning_rate

    out = tmp_path / "run"
    config = tiny(corpus, steps=4, log_every=1, schedule="constant", **network)
    assert config.training().warmup == warmup
    run(config, out)
    peak = config.training().lr
    logged = [(r["step"], r["lr"]) for r in records(out) if r["split"] == "train"]
    assert [lr for _, lr in logged] == pytest.approx(
        [learning_rate(step - 1, lr=peak, steps=4, schedule="constant", warmup=warmup)
         for step, _ in logged], rel=1e-12)


def test_the_shared_checks_see_the_resolved_learning_rate_and_warm_up(corpus):
    with pytest.raises(ConfigError, match=r"min_lr \(0.0001\) must not exceed lr \(1e-05\)"):
        tiny(corpus, lr=1e-5)
    # a floor above contractive attention's automatic 2e-3 is refused; the invertible
    # model's automatic 6e-3 admits it
    with pytest.raises(ConfigError, match=r"min_lr \(0.003\) must not exceed lr \(0.002\)"):
        tiny(corpus, attention="contractive-l2", min_lr=3e-3)
    assert tiny(corpus, invertible=True, min_lr=3e-3).training().min_lr == 3e-3
    with pytest.raises(ConfigError, match="the noam schedule needs warmup >= 1"):
        tiny(corpus, schedule="noam", warmup=0)
    assert tiny(corpus, schedule="noam").training().warmup == 100


def test_resume_may_change_how_the_certificate_takes_its_spectral_norms(corpus, tmp_path):
    # a run trained with the squarings (as on a GPU) resumes with the eigensolver (as on the
    # CPU): the same model to about 1e-6, so the change is allowed; a structural change is not
    out = tmp_path / "run"
    run(tiny(corpus, attention="contractive-l2", spectral_norms="squarings", steps=2,
             eval_every=2, checkpoint_every=2), out)
    model, _, _ = load_checkpoint(out)
    assert {m.spectral_norms for m in model.modules() if hasattr(m, "spectral_norms")} == {
        "squarings"}
    with pytest.raises(ConfigError, match=r"layers \(1 in the run, 2 now\)"):
        train(out=out, resume=True, flags={"steps": 4, "layers": 2, "spectral_norms": "eigh"})
    summary = train(out=out, resume=True, flags={"steps": 4, "spectral_norms": "eigh"},
                    progress=False, tensorboard=False)
    assert summary["step"] == 4
    model, record, _ = load_checkpoint(out)
    assert record["task"]["model_config"]["spectral_norms"] == "eigh"
    assert {m.spectral_norms for m in model.modules() if hasattr(m, "spectral_norms")} == {
        "eigh"}


def test_a_run_on_a_gpu_is_told_of_the_squarings_where_its_certificates_use_the_eigensolver():
    # only contractive attention's certificate is evaluated in training: tied L2 attention
    # (no certificate in its forward) and dot product get no hint, nor does any run on the CPU
    from flowattn.lm.model import build_model
    from flowattn.lm.train import spectral_norms_hint

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    models = {kind: build_model(LMConfig(vocab_size=5, layers=1, dim=8, **kw))
              for kind, kw in {"contractive": dict(attention="contractive-l2"),
                               "squarings": dict(attention="contractive-l2",
                                                 spectral_norms="squarings"),
                               "invertible": dict(invertible=True),
                               "tied": dict(attention="l2-tied"),
                               "dp": dict(attention="dp")}.items()}
    hinted = {kind for kind, model in models.items() if spectral_norms_hint(model, cuda)}
    assert hinted == {"contractive", "invertible"}
    assert all(spectral_norms_hint(model, cpu) is None for model in models.values())
    assert "--spectral-norms squarings" in spectral_norms_hint(models["contractive"], cuda)
