"""Fixtures shared by the test modules."""

import pytest
import torch

from flowattn.attention.contractive import ContractiveAttention


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
