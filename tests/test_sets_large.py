"""flowattn.sets with large sets: initialisation, evaluation batches and plots at N >> 100."""

import torch

from flowattn.sets import SetsRunConfig
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
