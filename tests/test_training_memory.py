"""The memory check before a training step: what autograd saves, what the host has left, and
the refusal of a batch that would not fit (instead of the operating system killing the run)."""

from __future__ import annotations

import pytest
import torch

from flowattn.errors import ConfigError
from flowattn.sets import train as sets_train
from flowattn.sets.config import SetsRunConfig, build_flow
from flowattn.sets.train import SetsTask, fit
from flowattn.training import memory
from flowattn.training.checkpoint import read_checkpoint
from flowattn.training.memory import (
    PassBytes,
    available_memory,
    check_fits,
    pass_bytes,
    saved_bytes,
    state_bytes,
)

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
    monkeypatch.setattr(memory, "PEAK_FACTOR", 2.0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cpu = torch.device("cpu")
    check_fits(PassBytes(0, GIB), 5, cpu)  # 5 * 2 GiB = 10 GiB: fits
    with pytest.raises(ConfigError) as error:
        check_fits(PassBytes(0, GIB), 6, cpu, hints=("--adjoint",))
    message = str(error.value)
    assert "12.0 GiB" in message and "10.0 GiB is available" in message
    assert "batch_size (--batch-size) 5 or less; or --adjoint" in message
    with pytest.raises(ConfigError, match=r"batch_size \(--batch-size\) 1 alone needs 20.0 GiB"):
        check_fits(PassBytes(0, 10 * GIB), 1, cpu)
    # 2 GiB whatever the batch: (2 + 3) * 2 GiB fits, one item more does not
    check_fits(PassBytes(2 * GIB, GIB), 3, cpu)
    with pytest.raises(ConfigError, match=r"4 items, and 2048 MiB whatever the batch\).*"
                                          r"batch_size \(--batch-size\) 3 or less"):
        check_fits(PassBytes(2 * GIB, GIB), 4, cpu)
    with pytest.raises(ConfigError, match=r"batch_size \(--batch-size\) 1 alone needs 12.0 GiB"):
        check_fits(PassBytes(5 * GIB, GIB), 1, cpu)
    # four processes on four hosts: 6 items each; the advice counts the whole step's items
    with pytest.raises(ConfigError, match=r"6 items in each of 4 processes\).*"
                                          r"batch_size \(--batch-size\) 20 or"):
        check_fits(PassBytes(0, GIB), 24, cpu, processes=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes share the host
    check_fits(PassBytes(0, GIB), 4, cpu, processes=2)  # 2 * 2 * 2 GiB = 8 GiB: fits
    with pytest.raises(ConfigError, match=r"3 items in each of 2 processes; 2 processes on "
                                          r"this host.*batch_size \(--batch-size\) 4 or less"):
        check_fits(PassBytes(0, GIB), 5, cpu, processes=2)
    # below a MiB per item the size is in KiB (it read "0 MiB"), counts with separators
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"\(24.0 KiB saved for the backward pass per item, "
                                          r"1,000,000,000 items\).*"
                                          r"batch_size \(--batch-size\) 218,453 or less"):
        check_fits(PassBytes(0, 24 * 2**10), 10**9, cpu)
    monkeypatch.setattr(memory, "available_memory", lambda device: None)
    check_fits(PassBytes(0, 100 * GIB), 100, cpu)  # unknown: no check


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
    # no room for a batch (the flow's gradients and optimiser state left out: see below)
    monkeypatch.setattr(memory, "available_memory", lambda device: 1000)
    monkeypatch.setattr(sets_train, "state_bytes", lambda model, average=False: 0)
    with pytest.raises(ConfigError, match=r"batch_size .*\(at most|less memory per item"):
        fit_tiny(tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    with pytest.raises(ConfigError) as error:
        fit_tiny(tmp_path / "cnf", flow="cnf")
    message = str(error.value)
    assert "--adjoint" in message and "--divergence hutchinson" in message
    with pytest.raises(ConfigError) as error:
        fit_tiny(tmp_path / "adjoint", flow="cnf", adjoint=True, divergence="hutchinson")
    assert "--adjoint" not in str(error.value)
    assert "--divergence hutchinson" not in str(error.value)


def test_training_state_is_counted_and_alone_refuses_a_model_that_cannot_train(monkeypatch):
    # gradients and AdamW's two moments per trainable parameter, the average's copy with ema
    layer = torch.nn.Linear(10, 100)
    layer.bias.requires_grad_(False)
    layer.register_buffer("count", torch.zeros(5, dtype=torch.float64))
    assert state_bytes(layer) == 3 * 1000 * 4
    assert state_bytes(layer, average=True) == 3 * 1000 * 4 + 1100 * 4 + 5 * 8
    monkeypatch.setattr(memory, "available_memory", lambda device: 10 * GIB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cpu = torch.device("cpu")
    check_fits(PassBytes(0, GIB), 4, cpu, state=2 * GIB)  # 2 + 4 * 2 GiB = 10 GiB: fits
    with pytest.raises(ConfigError, match=r"about 12.0 GiB .*; 2048 MiB of gradients and "
                                          r"optimiser state\).*batch_size \(--batch-size\) 4 or "
                                          r"less"):
        check_fits(PassBytes(0, GIB), 5, cpu, state=2 * GIB)
    with pytest.raises(ConfigError, match=r"^training this model would need about 11.0 GiB on "
                                          r"cpu for its gradients and optimiser state alone, and "
                                          r"10.0 GiB is available: use fewer --layers$"):
        check_fits(PassBytes(0, GIB), 1, cpu, state=11 * GIB, smaller="fewer --layers")
    with pytest.raises(ConfigError, match=r"about 11.0 GiB .* state alone"):  # without a pass
        check_fits(PassBytes(0, 0), 1, cpu, state=11 * GIB)
    check_fits(PassBytes(0, 0), 1, cpu, state=9 * GIB)


def test_a_model_too_large_to_train_is_refused_before_it_is_built(monkeypatch):
    # lm train --layers 100000 (2 * 10^10 parameters) built for minutes until the system
    # killed it; it is counted on the meta device and refused in seconds
    monkeypatch.setattr(memory, "available_memory", lambda device: 10 * GIB)
    built = []

    def build(k):
        built.append(torch.empty(0).device.type)  # where each build runs
        return torch.nn.Sequential(*(torch.nn.Linear(1000, 1000) for _ in range(k)))

    # 1,001,000 parameters a layer, 16 bytes each with gradients and AdamW: 670 layers fit
    memory.check_model_fits(build, 670, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^this model \(671,671,000 parameters\) would need "
                                          r"about 10.0 GiB on cpu for its weights, gradients and "
                                          r"optimiser state alone, and 10.0 GiB is available: "
                                          r"use fewer --layers$"):
        memory.check_model_fits(build, 671, torch.device("cpu"), smaller="fewer --layers")
    assert set(built) == {"meta"}
    with pytest.raises(ConfigError, match="about 12.5 GiB"):  # the average's copy
        memory.check_model_fits(build, 671, torch.device("cpu"), average=True)


def test_every_language_model_is_counted_on_the_meta_device_in_a_fresh_process():
    # the many-body branch computed a constant at import with a default-device tensor's
    # .item(): imported first under torch.device("meta") (the invertible model's build), it
    # failed, and the check was skipped
    import subprocess
    import sys

    code = ("import torch\n"
            "from flowattn.lm.config import LMConfig\n"
            "from flowattn.lm.model import build_model\n"
            "with torch.device('meta'):\n"
            "    m = build_model(LMConfig(vocab_size=65, attention='contractive-l2', "
            "invertible=True, layers=2))\n"
            "print(sum(p.numel() for p in m.parameters()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) > 0


def test_lm_train_refuses_a_model_too_large_to_train_before_writing_anything(tmp_path, capsys,
                                                                           monkeypatch):
    from flowattn.cli import main

    # 200 layers (36 M parameters, 0.5 GiB to train) against 100 MiB: small enough that the
    # model would still be built in a second if the check were gone
    monkeypatch.setattr(memory, "available_memory", lambda device: 100 * 2**20)
    out = tmp_path / "run"
    corpus = tmp_path / "text.txt"
    corpus.write_text("abcdefgh " * 400)
    assert main(["lm", "train", "--data", str(corpus), "--layers", "200", "--steps", "1",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "for its weights, gradients and optimiser state alone" in err, err
    assert "use a smaller --dim or fewer --layers" in err and len(err.splitlines()) == 1
    assert not out.exists()


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


def test_pass_bytes_puts_back_the_buffers_a_training_pass_updates():
    from flowattn.branches.mlp import SpectralLinear

    torch.manual_seed(0)
    layer = SpectralLinear(64, 64, coeff=0.9)  # power iteration on every training call
    before = {name: b.clone() for name, b in layer.named_buffers()}
    x = torch.randn(1, 64)
    saved = pass_bytes(layer, lambda k: layer(x.repeat(k, 1)).sum())
    assert saved.per_item > 0
    assert all(torch.equal(b, before[name]) for name, b in layer.named_buffers())
    layer(x)  # without it, the pass moves them
    assert not all(torch.equal(b, before[name]) for name, b in layer.named_buffers())


def test_pass_bytes_leaves_out_what_a_pass_saves_whatever_its_batch():
    model = torch.nn.Sequential(torch.nn.Linear(10, 1000), torch.nn.Linear(1000, 1000))
    # the second product saves its 4 MB of weights, whatever the batch, and its input row
    assert saved_bytes(lambda: model(torch.ones(1, 10)).sum())[1] > 4_000_000
    assert pass_bytes(model, lambda k: model(torch.ones(k, 10)).sum()) == (0, 40 + 4000)

    class Scaled(torch.nn.Module):  # a weight made anew by every pass (a parametrisation)
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1000, 1000))

        def forward(self, x):
            return (x @ (2 * self.w)).sum()  # saves the new weight and the input rows

    scaled = Scaled()
    x = torch.ones(1, 1000, requires_grad=True)
    assert pass_bytes(scaled, lambda k: scaled(x.repeat(k, 1))) == (4_000_000, 4000)


def test_pass_bytes_draws_the_same_random_numbers_in_both_passes():
    class Roulette(torch.nn.Module):  # saves as many tensors as it draws terms
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            terms = int(torch.randint(1, 50, ()))
            for _ in range(terms):  # saves exp's and tanh's results, and the first input
                x = (x * self.w).exp().tanh()
            return x.sum()

    model = Roulette()
    torch.manual_seed(5)
    state = torch.get_rng_state()
    sizes = {pass_bytes(model, lambda k: model(torch.ones(k, 100))).per_item for _ in range(5)}
    assert torch.equal(torch.get_rng_state(), state)  # the caller's stream is left as it was
    assert len(sizes) == 1
    terms = int(torch.randint(1, 50, (), generator=torch.Generator().manual_seed(0)))
    assert sizes == {(2 * terms + 1) * 400}  # float32 rows of 100 per item


def test_a_resumed_run_is_checked_too(tmp_path, monkeypatch):
    fit_tiny(tmp_path / "run", steps=2)
    monkeypatch.setattr(memory, "available_memory", lambda device: 1000)
    with pytest.raises(ConfigError, match="training this model would need"):  # the state
        fit(out=tmp_path / "run", resume=True, flags={"steps": 4}, progress=False,
            tensorboard=False, plots=False)


def test_a_language_model_run_that_would_not_fit_is_refused(tmp_path, monkeypatch):
    from flowattn.lm import train as lm_train
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
    # no room for a batch (the model's weights and training state left out: tested above)
    monkeypatch.setattr(lm_train, "check_model_fits", lambda *args, **kwargs: None)
    monkeypatch.setattr(lm_train, "state_bytes", lambda model, average=False: 0)
    with pytest.raises(ConfigError, match=r"batch_size \(--batch-size\) .*"
                                          r"--block-size, --dim or --layers"):
        train(config, tmp_path / "lm", progress=False, tensorboard=False)
    assert seen == [torch.device("cpu")]
