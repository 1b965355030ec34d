"""The memory check before a training step: what autograd saves, what the host has left, and
the refusal of a batch that would not fit (instead of the operating system killing the run)."""

from __future__ import annotations

import pytest
import torch

from flowattn.errors import ConfigError
from flowattn.sets.config import SetsRunConfig, build_flow
from flowattn.sets.train import SetsTask, fit
from flowattn.training import memory
from flowattn.training.checkpoint import read_checkpoint
from flowattn.training.memory import available_memory, check_fits, item_bytes, saved_bytes

GIB = 2**30
TINY = {"data": "gaussian-sets", "num_train": 64, "batch_size": 8, "blocks": 1, "hidden": 8,
        "steps": 4, "eval_every": 2, "checkpoint_every": 2, "val_sets": 16, "warmup": 1}


def fit_tiny(out, **changes) -> dict:
    config = SetsRunConfig.build({**TINY, **changes})
    return fit(config, out, progress=False, tensorboard=False, plots=False)


def test_saved_bytes_counts_each_saved_storage_once():
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    _, exp = saved_bytes(lambda: x.exp())  # exp saves its result
    assert exp == 8000
    _, views = saved_bytes(lambda: (x[:500] * x[500:]).sum())  # two views of one storage
    assert views == 8000
    _, none = saved_bytes(lambda: x.detach() * 2)
    assert none == 0


def test_host_memory_is_meminfo_or_the_cgroup_limit_left_whichever_is_smaller(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 9000 kB\nMemAvailable:    4000 kB\n")
    assert memory._host_available(tmp_path) == 4000 * 1024
    group = tmp_path / "sys/fs/cgroup"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("max\n")  # no limit
    (group / "memory.current").write_text("100\n")
    assert memory._host_available(tmp_path) == 4000 * 1024
    (group / "memory.max").write_text("3000000\n")
    (group / "memory.current").write_text("1000000\n")
    assert memory._host_available(tmp_path) == 2000000
    assert memory._host_available(tmp_path / "nothing") is None
    free = available_memory(torch.device("cpu"))  # this machine's
    assert free is None or 0 < free < 2**50
    assert available_memory(torch.device("meta")) is None


def test_a_step_that_does_not_fit_is_refused_with_the_largest_batch_that_does(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 10 * GIB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    check_fits(GIB, 4, torch.device("cpu"))  # 4 * 2.5 GiB = 10 GiB: fits
    with pytest.raises(ConfigError) as error:
        check_fits(GIB, 5, torch.device("cpu"), hints=("adjoint true",))
    message = str(error.value)
    assert "12.5 GiB" in message and "10.0 GiB is available" in message
    assert "batch_size 4 or less; or adjoint true" in message
    with pytest.raises(ConfigError, match=r"batch_size 1 alone needs 25.0 GiB"):
        check_fits(10 * GIB, 1, torch.device("cpu"))
    # four processes on four hosts: 5 items each; the advice counts the whole step's items
    with pytest.raises(ConfigError, match=r"5 items in each of 4 processes\).*batch_size 16 or"):
        check_fits(GIB, 20, torch.device("cpu"), processes=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes share the host
    check_fits(GIB, 4, torch.device("cpu"), processes=2)  # 2 * 2 * 2.5 GiB = 10 GiB: fits
    with pytest.raises(ConfigError, match=r"3 items in each of 2 processes, 2 processes on "
                                          r"this host.*batch_size 4 or less"):
        check_fits(GIB, 6, torch.device("cpu"), processes=2)
    monkeypatch.setattr(memory, "available_memory", lambda device: None)
    check_fits(100 * GIB, 100, torch.device("cpu"))  # unknown: no check


def _one_and_eight(flow_settings: dict) -> tuple[int, int]:
    config = SetsRunConfig.build({**TINY, **flow_settings})
    torch.manual_seed(0)
    flow = build_flow(config.flow, 2, 4, False)
    x = torch.randn(8, 4, 2)
    with torch.no_grad():
        flow.log_prob(x)  # data-dependent initialisation
    return (saved_bytes(lambda: flow.log_prob(x[:1]))[1],
            saved_bytes(lambda: flow.log_prob(x))[1])


@pytest.mark.parametrize("flow_settings", [{}, {"flow": "cnf", "t1": 1.0}],
                         ids=["resflow", "cnf"])
def test_one_sets_saved_bytes_scale_to_the_batch(flow_settings):
    one, eight = _one_and_eight(flow_settings)
    assert one > 0
    assert eight <= 1.1 * 8 * one  # the estimate from one set is not short
    if flow_settings:  # where the solve's activations dominate (not the weights, saved once)
        assert eight >= 0.8 * 8 * one  # nor too large


def test_a_sets_run_that_would_not_fit_is_refused_before_writing_anything(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 1000)
    with pytest.raises(ConfigError, match=r"batch_size .*\(at most|less memory per item"):
        fit_tiny(tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    with pytest.raises(ConfigError) as error:
        fit_tiny(tmp_path / "cnf", flow="cnf")
    message = str(error.value)
    assert "adjoint true" in message and "divergence hutchinson" in message
    with pytest.raises(ConfigError) as error:
        fit_tiny(tmp_path / "adjoint", flow="cnf", adjoint=True, divergence="hutchinson")
    assert "adjoint true" not in str(error.value)
    assert "divergence hutchinson" not in str(error.value)


@pytest.mark.parametrize("changes", [{"hidden": 64}, {"flow": "cnf", "divergence": "hutchinson"}],
                         ids=["power-iteration-buffers", "random-probes"])
def test_the_check_leaves_the_run_as_it_would_be_without_it(tmp_path, monkeypatch, changes):
    checked = fit_tiny(tmp_path / "checked", **changes)
    monkeypatch.setattr(SetsTask, "check_memory", lambda self: None)
    plain = fit_tiny(tmp_path / "plain", **changes)
    assert checked["test_nll"] == plain["test_nll"]
    one = read_checkpoint(tmp_path / "checked" / "checkpoint.pt", "sets")["model"]
    two = read_checkpoint(tmp_path / "plain" / "checkpoint.pt", "sets")["model"]
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_item_bytes_puts_back_the_buffers_a_training_pass_updates():
    from flowattn.branches.mlp import SpectralLinear

    torch.manual_seed(0)
    layer = SpectralLinear(64, 64, coeff=0.9)  # power iteration on every training call
    before = {name: b.clone() for name, b in layer.named_buffers()}
    x = torch.randn(1, 64)
    n = item_bytes(layer, lambda: layer(x).sum())
    assert n > 0
    assert all(torch.equal(b, before[name]) for name, b in layer.named_buffers())
    layer(x)  # without it, the pass moves them
    assert not all(torch.equal(b, before[name]) for name, b in layer.named_buffers())


def test_a_resumed_run_is_checked_too(tmp_path, monkeypatch):
    fit_tiny(tmp_path / "run", steps=2)
    monkeypatch.setattr(memory, "available_memory", lambda device: 1000)
    with pytest.raises(ConfigError, match="a training step would need"):
        fit(out=tmp_path / "run", resume=True, flags={"steps": 4}, progress=False,
            tensorboard=False, plots=False)


def test_a_language_model_run_that_would_not_fit_is_refused(tmp_path, monkeypatch):
    from flowattn.lm.config import LMRunConfig
    from flowattn.lm.train import train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question. " * 50)
    config = LMRunConfig.build({"data": str(corpus), "layers": 1, "dim": 16, "heads": 2,
                                "block_size": 16, "batch_size": 4, "steps": 2})
    seen = []

    def available(device):
        seen.append(device)
        return 1000

    monkeypatch.setattr(memory, "available_memory", available)
    with pytest.raises(ConfigError, match=r"batch_size .*block_size, dim or layers"):
        train(config, tmp_path / "lm", progress=False, tensorboard=False)
    assert seen == [torch.device("cpu")]
