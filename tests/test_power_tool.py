"""tools/power.py: every mutant it lists still applies to today's code (the list does not rot)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _power():
    spec = importlib.util.spec_from_file_location("power_tool", ROOT / "tools" / "power.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


POWER = _power()


@pytest.mark.parametrize("mutant", POWER.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_changes_valid_code_and_names_existing_tests(mutant):
    source = (ROOT / mutant.file).read_text()
    mutated = mutant.apply(source)
    assert mutated != source
    ast.parse(mutated)
    for test in mutant.tests:  # a file or directory, or one test by its node id
        path, _, name = test.partition("::")
        assert (ROOT / path).exists(), test
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), test


def test_halving_wraps_every_return_of_the_function_only():
    source = ("def f(x):\n    if x > 0:\n        return x + 1\n    return (x -\n            2)\n\n"
              "def g():\n    return 3\n")
    namespace = {}
    exec(compile(POWER.Halved("m.py", "f", ()).apply(source), "m.py", "exec"), namespace)
    assert namespace["f"](4) == 2.5  # both returns halved, the multi-line one too
    assert namespace["f"](0) == -1.0
    assert namespace["g"]() == 3  # another function is left alone
