"""flowattn.sets with large sets: initialisation, evaluation batches and plots at N >> 100."""

import json

import pytest
import torch

from flowattn.cli import main
from flowattn.sets import SetsRunConfig
from flowattn.sets.budget import eval_batch_size
from flowattn.sets.plots import sample_count
from flowattn.sets.train import INIT_SETS, SetsTask
from flowattn.training.distributed import Distributed


def test_small_batches_initialise_the_centroid_actnorm_from_64_sets():
    config = SetsRunConfig.build({"data": "surface-clouds", "set_size": 30, "batch_size": 2,
                                  "num_train": 100})
    task = SetsTask(config, Distributed.join("cpu"), plots=False)
    task.initialise()
    flow, train = task.flow, task.train_data
    actnorm = flow.transform._transforms[0].centroid_flow._transforms[0]
    with torch.no_grad():
        u, _ = flow.standardisation(train.x[:INIT_SETS].double().float())
        centres = actnorm(u.mean(1))[0].double()
    # standardised over the first 64 sets' centroids, not over the 2 of the first batch
    assert centres.mean(0).abs().max().item() < 1e-4
    assert (centres.var(0, correction=0) - 1).abs().max().item() < 1e-3


def test_eval_of_a_built_in_name_scores_the_fitted_set_size(tmp_path, capsys):
    out = tmp_path / "run"
    settings = {"blocks": 1, "hidden": 8, "steps": 2, "batch_size": 4, "eval_every": 2,
                "checkpoint_every": 2, "val_sets": 4, "warmup": 1}
    (tmp_path / "config.json").write_text(json.dumps(settings))
    assert main(["sets", "fit", "--data", "surface-clouds", "--set-size", "12",
                 "--num-train", "16", "--no-progress", "--no-tensorboard",
                 "--config", str(tmp_path / "config.json"), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    assert main(["sets", "eval", "--checkpoint", str(out), "--data", "surface-clouds",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the test split of the fitted run (N = 12, exact log-dets), not one of the default N = 1000
    assert result["logdet"] == "exact" and result["num_sets"] == summary["test_sets"] == 100
    assert result["nll"] == pytest.approx(summary["test_nll"], rel=1e-6)
    assert result["nll_per_dim"] == pytest.approx(result["nll"] / 36)


def test_evaluation_batches_and_plotted_samples_shrink_only_for_large_sets():
    assert [eval_batch_size(256, n) for n in (8, 128, 129, 1000, 1448, 1449, 10_000)] == [
        256, 256, 252, 4, 2, 1, 1]
    assert [sample_count(500, n) for n in (8, 91, 92, 1000)] == [500, 500, 495, 6]


def test_a_tiny_standard_error_is_printed_with_its_digits():
    from flowattn.sets.cli import _logdet_note

    assert _logdet_note("estimated", 2.16e-5).endswith("standard error 2.2e-05 nats/dim")
    assert _logdet_note("estimated", 0.0123).endswith("standard error 0.0123 nats/dim")
    assert _logdet_note("exact", 0.0) == "exact log-det"
