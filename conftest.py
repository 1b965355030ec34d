"""Test-wide settings: one intra-op thread, and ``torch``/``math`` in the doctest namespace."""

import math

import pytest
import torch

# The suite works on tiny tensors, where a second OpenMP thread only adds synchronisation (and,
# on a loaded machine, waits of milliseconds per operation).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace["torch"] = torch
    doctest_namespace["math"] = math
