"""The package namespace: ``import flowattn`` is cheap, subpackages load on first access."""

import os
import subprocess
import sys
from pathlib import Path

import flowattn

ROOT = Path(flowattn.__file__).resolve().parents[1]


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True)
    return result.stdout.strip()


def test_import_flowattn_does_not_import_torch():
    code = "import sys, flowattn; print('torch' in sys.modules, flowattn.__version__)"
    assert _run(code) == f"False {flowattn.__version__}"


def test_subpackages_and_convenience_names_load_on_first_access():
    code = (
        "import sys, flowattn; f = flowattn.flows.set_flow; "
        "print(f.__module__, flowattn.L2MHA.__name__, flowattn.errors.InputError.__name__, "
        "'torch' in sys.modules)"
    )
    assert _run(code) == "flowattn.flows.builders L2MHA InputError True"


def test_unknown_attributes_raise_attribute_error():
    assert not hasattr(flowattn, "no_such_module")
    assert {"flows", "attention", "L2MHA"} <= set(dir(flowattn))
