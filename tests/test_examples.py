"""Every script in examples/ runs in its quick mode and prints what it promises."""

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
EXPECTED = {
    "certified_attention.py": "certified 0.9",
    "set_density.py": "test NLL",
    "nflows_composition.py": "round-trip error",
}


def test_every_example_is_covered():
    assert {p.name for p in EXAMPLES} == set(EXPECTED)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_in_quick_mode(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), "--quick"])
    runpy.run_path(str(path), run_name="__main__")
    assert EXPECTED[path.name] in capsys.readouterr().out
