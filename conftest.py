"""Doctest namespace: examples in docstrings may use ``torch`` and ``math`` without importing."""

import math

import pytest
import torch


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace["torch"] = torch
    doctest_namespace["math"] = math
