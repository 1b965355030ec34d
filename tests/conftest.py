"""Fixtures shared by the test modules."""

import collections
import os
import traceback

import pytest
import torch

from flowattn.attention.contractive import ContractiveAttention


def pytest_configure(config):
    """Under pytest-xdist (``-n auto``) every worker keeps to one core: torch's default of one
    thread per core in each of them, and in the commands they start, would oversubscribe the
    machine several-fold."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture
def float64_default():
    """Run a test with float64 as torch's default dtype (numerical checks), then restore it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def certificate_calls(monkeypatch):
    """``certificate_calls(model)``: a one-element list counting from now on the certificate
    evaluations of every contractive attention module in ``model`` (the model itself too)."""

    def count(model):
        calls = [0]
        for module in model.modules():
            if isinstance(module, ContractiveAttention):
                def counted(*args, evaluate=module._certificate, **kwargs):
                    calls[0] += 1
                    return evaluate(*args, **kwargs)

                monkeypatch.setattr(module, "_certificate", counted)
        return calls

    return count


@pytest.fixture
def host_reads():
    """``host_reads(fn, device_only=False)``: the calls that read a tensor's value back to
    Python while ``fn`` runs (``item``, ``bool``, ``float``, ``int``, ``tolist``), counted by
    call site ("file.py:line"); with ``device_only``, only reads of tensors off the CPU (host
    synchronisations)."""
    names = ("item", "__bool__", "__float__", "__int__", "tolist")

    def count(fn, device_only=False):
        originals = {name: getattr(torch.Tensor, name) for name in names}
        reads = collections.Counter()

        def wrap(name):
            def read(self, *args, **kwargs):
                if not device_only or self.device.type != "cpu":
                    frame = traceback.extract_stack(limit=2)[0]
                    reads[f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"] += 1
                return originals[name](self, *args, **kwargs)

            return read

        try:
            for name in names:
                setattr(torch.Tensor, name, wrap(name))
            fn()
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        return reads

    return count
