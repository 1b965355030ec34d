"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture
def float64_default():
    """Run a test with float64 as torch's default dtype (numerical checks), then restore it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
