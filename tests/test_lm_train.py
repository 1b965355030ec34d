"""Tests for flowattn.lm.train: schedules, learning, checkpoints, exact resume, divergence, DDP."""

import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import flowattn.lm.train as lm_train
from flowattn.lm.train import TrainConfig, learning_rate, load_checkpoint, train

ROOT = Path(__file__).resolve().parents[1]
TEXT = "the quick brown fox jumps over the lazy dog. " * 60


@pytest.fixture
def corpus(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def tiny(corpus: str, out, **kw) -> TrainConfig:
    base = dict(data=corpus, layers=1, dim=16, heads=2, block_size=16, batch_size=4, steps=16,
                eval_interval=8, log_interval=2, out=str(out), progress=False, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- schedules


def test_cosine_schedule_warms_up_linearly_then_decays_to_min_lr_at_the_last_step():
    cfg = TrainConfig(steps=2000, warmup=100, lr=1e-3, min_lr=1e-4, schedule="cosine")
    assert learning_rate(0, cfg) == pytest.approx(1e-3 / 101)
    assert learning_rate(99, cfg) == pytest.approx(1e-3 * 100 / 101)
    assert learning_rate(100, cfg) == pytest.approx(1e-3)
    assert learning_rate(1999, cfg) == pytest.approx(1e-4)
    after = [learning_rate(s, cfg) for s in range(100, 2000)]
    assert all(a >= b for a, b in zip(after[:-1], after[1:], strict=True))
    assert learning_rate(1049, cfg) == pytest.approx(5.5e-4, rel=1e-3)  # the midpoint


def test_noam_schedule_peaks_at_lr_after_warmup_and_decays_as_inverse_square_root():
    cfg = TrainConfig(steps=10_000, warmup=400, lr=2e-3, min_lr=0.0, schedule="noam")
    assert learning_rate(399, cfg) == pytest.approx(2e-3)
    assert learning_rate(199, cfg) == pytest.approx(1e-3)
    assert learning_rate(1599, cfg) == pytest.approx(1e-3)  # t = 4w: lr / 2
    assert max(learning_rate(s, cfg) for s in range(2000)) == pytest.approx(2e-3)
    floored = replace(cfg, min_lr=5e-4)
    assert learning_rate(9999, floored) == pytest.approx(5e-4)


def test_constant_schedule_without_warmup_is_constant():
    cfg = TrainConfig(lr=3e-4, warmup=0, schedule="constant")
    assert {learning_rate(s, cfg) for s in range(0, 5000, 97)} == {3e-4}


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(schedule="linear"), "unknown schedule"),
        (dict(schedule="noam", warmup=0), "warmup >= 1"),
        (dict(min_lr=1.0, lr=0.1), "min_lr"),
        (dict(steps=0), "steps"),
    ],
)
def test_invalid_training_settings_raise_value_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw)


# ----------------------------------------------------------------------------- training


def test_training_lowers_validation_loss_far_below_uniform(corpus, tmp_path):
    summary = train(tiny(corpus, tmp_path / "run", dim=32, steps=80, eval_interval=40, lr=3e-3,
                         warmup=10, min_lr=3e-4))
    vals = [r["val_loss"] for r in records(tmp_path / "run") if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0]
    assert summary["val_loss"] == vals[1] < 0.5 * math.log(28)  # 28 symbols in TEXT
    assert not summary["diverged"] and summary["step"] == 80
    assert summary["val_bpc"] == pytest.approx(summary["val_loss"] / math.log(2))


def test_checkpoint_is_written_atomically_and_rebuilds_the_trained_model(corpus, tmp_path):
    out = tmp_path / "run"
    summary = train(tiny(corpus, out, dropout=0.1))
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "metrics.jsonl"]
    model, ckpt, vocab = load_checkpoint(out)
    assert ckpt["step"] == 16 and len(ckpt["rng"]) == 1 and not model.training
    assert vocab.decode(vocab.encode("lazy dog")) == "lazy dog"
    corpus_ids = vocab.encode(TEXT[-200:])
    loss = lm_train.evaluate(model, corpus_ids, 16, 4, torch.device("cpu"))
    assert loss == pytest.approx(
        lm_train.evaluate(model, corpus_ids, 16, 4, torch.device("cpu")), rel=0
    )
    assert summary["val_loss"] == pytest.approx(ckpt["val_loss"])


def test_metrics_record_training_and_validation_at_their_intervals(corpus, tmp_path):
    train(tiny(corpus, tmp_path / "run"))
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs if "train_loss" in r] == list(range(2, 17, 2))
    assert [r["step"] for r in recs if "val_loss" in r] == [8, 16]
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in recs if "train_loss" in r)


def test_tensorboard_events_are_written_when_tensorboard_is_installed(corpus, tmp_path):
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is not installed")
    train(tiny(corpus, tmp_path / "run", tensorboard=True, steps=4, eval_interval=4))
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_interrupted_run_resumes_to_exactly_the_uninterrupted_result(
    corpus, tmp_path, monkeypatch, schedule
):
    # dropout exercises the saved random state; the interruption falls between checkpoints
    kw = dict(dropout=0.2, schedule=schedule, warmup=3, steps=16, eval_interval=6)
    straight = train(tiny(corpus, tmp_path / "a", **kw))

    calls = {"n": 0}
    real_get_batch = lm_train.get_batch

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 10:  # during step 10, after the checkpoint of step 6
            raise KeyboardInterrupt
        return real_get_batch(*args, **kwargs)

    monkeypatch.setattr(lm_train, "get_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(corpus, tmp_path / "b", **kw))
    assert max(r["step"] for r in records(tmp_path / "b")) == 8  # logged past the checkpoint
    monkeypatch.setattr(lm_train, "get_batch", real_get_batch)
    resumed = train(tiny(corpus, tmp_path / "b", resume=True, **kw))

    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=True) for d in ("a", "b"))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert resumed["val_loss"] == straight["val_loss"]
    strip = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records(tmp_path / "a")]
    again = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records(tmp_path / "b")]
    assert again == strip


def test_existing_checkpoint_is_not_overwritten_without_resume(corpus, tmp_path):
    train(tiny(corpus, tmp_path / "run", steps=2, eval_interval=2))
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        train(tiny(corpus, tmp_path / "run", steps=2, eval_interval=2))


def test_resume_refuses_changed_model_settings(corpus, tmp_path):
    train(tiny(corpus, tmp_path / "run", steps=2, eval_interval=2))
    with pytest.raises(ValueError, match=r"layers \(1 in the checkpoint, 2 now\)"):
        train(tiny(corpus, tmp_path / "run", steps=4, layers=2, resume=True))


def test_resume_may_extend_training(corpus, tmp_path):
    train(tiny(corpus, tmp_path / "run", steps=4, eval_interval=4, schedule="constant"))
    summary = train(tiny(corpus, tmp_path / "run", steps=8, eval_interval=4, resume=True,
                         schedule="constant"))
    assert summary["step"] == 8
    assert [r["step"] for r in records(tmp_path / "run") if "val_loss" in r] == [4, 8]


# ----------------------------------------------------------------------------- divergence


@pytest.mark.parametrize(
    "lr, reason", [(10.0, "smoothed loss"), (1e30, "non-finite")], ids=["exploding", "nan"]
)
def test_divergence_is_detected_recorded_and_keeps_the_last_good_checkpoint(
    corpus, tmp_path, lr, reason
):
    out = tmp_path / "run"
    summary = train(tiny(corpus, out, lr=lr, min_lr=0.0, schedule="constant", warmup=0,
                         grad_clip=0.0, steps=50, eval_interval=1, log_interval=1))
    assert summary["diverged"] and reason in summary["divergence"]["reason"]
    stop = summary["divergence"]["step"]
    assert stop < 50
    saved = json.loads((out / "diverged.json").read_text())
    assert saved["step"] == stop and reason in saved["reason"]
    events = [r for r in records(out) if r.get("event") == "diverged"]
    assert len(events) == 1 and events[0]["step"] == stop
    if lr == 1e30:  # the first update already overflows: no state was ever good enough to save
        assert not (out / "ckpt.pt").exists()
        return
    _, ckpt, _ = load_checkpoint(out)
    assert 1 <= ckpt["step"] < stop
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_load_checkpoint_rejects_other_files(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a flowattn language-model checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing")


# ----------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_trains_with_two_gloo_processes(corpus, tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        "-m", "flowattn", "lm", "train", "--data", corpus, "--layers", "1", "--dim", "16",
        "--heads", "2", "--block-size", "16", "--batch-size", "4", "--steps", "6",
        "--eval-interval", "3", "--out", str(out), "--no-progress", "--no-tensorboard",
        "--threads", "1", "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[:3000] + " ... " + done.stderr[-2000:]
    summaries = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1  # only the first process reports
    assert summaries[0]["world_size"] == 2 and summaries[0]["step"] == 6
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    assert not torch.equal(ckpt["rng"][0]["batches"], ckpt["rng"][1]["batches"])
