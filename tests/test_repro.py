"""Reproductions of Kim et al. (2021): each runs, writes its files and shows the paper's effect."""

import argparse
import csv
import json
import math

import pytest
import torch

from flowattn.attention import L2MHA
from flowattn.errors import InputError
from flowattn.lipschitz import jacobian
from flowattn.repro import REPRODUCTIONS, run_reproduction
from flowattn.repro.bound_tightness import attention_row, row_jacobian_norm
from flowattn.repro.cli import add_repro_subparsers
from flowattn.repro.common import glorot_init_, uniform_sets
from flowattn.repro.invertibility import fixed_point_errors

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Every reproduction on its quick grid, run once for the whole module."""
    out = tmp_path_factory.mktemp("repro")
    return out, {name: run_reproduction(name, grid="quick", out=out) for name in REPRODUCTIONS}


def _csv_rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("name", list(REPRODUCTIONS))
def test_each_reproduction_writes_png_csv_and_json(quick, name):
    out, results = quick
    result = results[name]
    assert set(result.files) == {"png", "csv", "json"}
    png = out / f"{name.replace('-', '_')}.png"
    assert str(png) == result.files["png"]
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) < 150_000
    rows = _csv_rows(result.files["csv"])
    assert len(rows) == len(result.rows) > 0
    payload = json.loads(open(result.files["json"]).read())
    assert payload["name"] == name and payload["grid"] == "quick"
    assert payload["summary"].keys() == result.summary.keys()


@pytest.mark.slow
def test_bound_tightness_upper_bound_dominates_optimised_lower_bound(quick):
    rows = quick[1]["bound-tightness"].rows
    assert [r["n"] for r in rows] == [8, 16, 32]
    for r in rows:
        assert r["upper_bound"] >= r["lower_bound"] > 0
        # the optimised row is one row of the full Jacobian the library computes
        assert r["full_jacobian_norm"] >= r["lower_bound"] * (1 - 1e-12)
        assert r["upper_bound_printed"] >= r["upper_bound"]
        # the optimisation gets close: the bound is not loose by orders of magnitude
        assert r["lower_over_upper"] > 0.5
    lowers = [r["lower_bound"] for r in rows]
    assert lowers == sorted(lowers)  # grows with N, like the bound


def test_attention_row_matches_the_module_output_row():
    torch.manual_seed(0)
    attn = L2MHA(6, 3).double()
    x = torch.randn(4, 9, 6, dtype=torch.float64)
    full = attn(x)
    for i in (0, 4, -1):
        torch.testing.assert_close(attention_row(attn, x, i), full[:, i], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="out of range"):
        attention_row(attn, x, 9)
    with pytest.raises(ValueError, match="tied"):
        attention_row(L2MHA(6, 3, tied=False).double(), x)


def test_row_jacobian_norm_is_the_max_row_sum_of_the_first_element_rows():
    torch.manual_seed(1)
    attn = L2MHA(4, 2).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    norms = row_jacobian_norm(attn, x, 0)
    for b in range(2):
        jac = jacobian(lambda z: attn(z.unsqueeze(0)).squeeze(0), x[b])  # (N D) x (N D)
        expected = jac[:4].abs().sum(dim=1).max()  # rows of output element 0
        torch.testing.assert_close(norms[b], expected, rtol=1e-12, atol=0)


@pytest.mark.slow
def test_invertibility_l2_converges_and_dot_product_does_not(quick):
    cases = quick[1]["invertibility"].summary["cases"]
    l2 = [c for c in cases if c["attention"] == "l2"]
    dp = [c for c in cases if c["attention"] == "dp"]
    assert len(l2) == len(dp) == 3
    for case in l2:
        assert case["final_error"] < 1e-5
        assert case["library_inverse"] == "converged"
    assert min(c["final_error"] for c in l2 if c["c"] == 0.5) < 1e-10
    for case in dp:
        # not one iterate of 25 comes within 0.1 of the true input, for any c
        assert case["min_error"] > 0.1
        assert case["library_inverse"] == "not converged"


def test_fixed_point_errors_decay_geometrically_for_a_contraction():
    x = torch.linspace(-2, 2, 12, dtype=torch.float64).reshape(1, 4, 3)
    errors = fixed_point_errors(torch.tanh, x, 0.5, 30)
    assert len(errors) == 31
    steps = zip(errors[:-1], errors[1:], strict=True)
    assert all(b <= 0.5 * a + 1e-15 for a, b in steps)  # rate Lip(c tanh) = c = 0.5
    assert errors[-1] < 1e-9


def test_fixed_point_errors_record_divergence_as_infinite():
    x = torch.ones(1, 2, 2, dtype=torch.float64)
    errors = fixed_point_errors(lambda z: z**3, x, 2.0, 20)
    assert len(errors) == 21 and math.isinf(errors[-1])


@pytest.mark.slow
def test_histograms_dot_product_outputs_spread_wider_than_l2(quick):
    result = quick[1]["histograms"]
    by = {(r["source"], r["attention"]): r for r in result.rows}
    assert set(by) == {(s, a) for s in ("random", "trained") for a in ("l2", "dp")}
    for source in ("random", "trained"):
        assert by[source, "dp"]["output_absmax"] > by[source, "l2"]["output_absmax"]
        assert by[source, "dp"]["output_std"] > by[source, "l2"]["output_std"]
        assert by[source, "l2"]["output_absmax"] <= by[source, "l2"]["input_absmax"]
    assert result.summary["training"]["dp"]["step"] == 3


@pytest.mark.slow
def test_runtime_reports_every_variant_relative_to_dot_product(quick):
    result = quick[1]["runtime"]
    lm = [r for r in result.rows if r["benchmark"] == "lm-step"]
    mod = [r for r in result.rows if r["benchmark"] == "attention-fwd-bwd"]
    assert len(lm) == 2 * 4 and len(mod) == 2 * 5
    for r in result.rows:
        assert r["seconds"] > 0 and math.isfinite(r["seconds"])
        if r["attention"] == "dp":
            assert r["ratio_to_dp"] == 1.0
    # each variant's ratio is its own time over dot product's (timings belong in benchmarks:
    # only the bookkeeping is checked here)
    def size(r):
        return r["benchmark"], r["layers"], r["n"]

    dp = {size(r): r["seconds"] for r in result.rows if r["attention"] == "dp"}
    for r in result.rows:
        assert r["ratio_to_dp"] == pytest.approx(r["seconds"] / dp[size(r)])


@pytest.mark.slow
def test_dp_divergence_dot_product_norm_grows_while_l2_stays_certified(quick):
    result = quick[1]["dp-divergence"]
    summary = result.summary
    assert summary["l2_below_bound"]
    assert all(r["l2_norm"] <= summary["l2_bound"] for r in result.rows)
    assert summary["dp_max_over_initial"] > 10
    assert summary["dp_exceeds_l2_bound"]
    assert summary["restarts"][0]["dp_growth_per_step"] > 0


@pytest.mark.slow
def test_layernorm_measured_norms_stay_below_the_appendix_n_bound(quick):
    result = quick[1]["layernorm"]
    assert result.summary["measured_below_bound"]
    for r in result.rows:
        assert r["measured"] <= r["bound"]
        # sigma = 0 gives eps^{-1/2} (I - 11^T / D), row sums 2 (D - 1) / D
        assert r["flat"] == pytest.approx(r["flat_input_limit"], rel=1e-12)
        # optimising at the right scale finds the peak; random inputs are far from it
        assert r["optimised_small"] > 0.9 * r["flat_input_limit"]
        assert r["random"] < 0.1 * r["bound"]


def test_cli_runs_a_reproduction_and_rejects_bad_arguments(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="flowattn")
    add_repro_subparsers(parser.add_subparsers(dest="group", required=True))
    args = parser.parse_args(
        ["repro", "bound-tightness", "--quick", "--out", str(tmp_path), "--seed", "3"]
    )
    assert (args.repro_command, args.grid, args.seed) == ("bound-tightness", "quick", 3)
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert "upper_above_lower_everywhere: True" in printed
    assert (tmp_path / "bound_tightness.png").exists()
    assert json.loads((tmp_path / "bound_tightness.json").read_text())["config"]["seed"] == 3
    assert parser.parse_args(["repro", "all"]).grid == "default"
    for bad in (["repro", "nope"], ["repro", "layernorm", "--full", "--quick"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_run_reproduction_rejects_unknown_names_grids_and_fields():
    with pytest.raises(ValueError, match="unknown reproduction"):
        run_reproduction("fig-42")
    with pytest.raises(ValueError, match="unknown grid"):
        run_reproduction("layernorm", grid="huge")
    with pytest.raises(ValueError, match="dimz"):
        run_reproduction("layernorm", grid="quick", dimz=(4,))


def test_an_output_folder_that_is_a_file_is_refused_before_any_work(tmp_path, monkeypatch):
    import flowattn.repro.layernorm as layernorm
    from flowattn.errors import RunError

    def work(*args):
        raise AssertionError("the reproduction ran")

    monkeypatch.setattr(layernorm, "run_layernorm", work)
    taken = tmp_path / "taken"
    taken.write_text("")
    with pytest.raises(RunError, match="taken is a file, not a folder"):
        run_reproduction("layernorm", grid="quick", out=taken)


def test_inputs_have_a_zero_first_element_and_glorot_weights_have_the_right_scale():
    g = torch.Generator().manual_seed(0)
    x = uniform_sets(3, 5, 4, 2.5, g)
    assert (x[:, 0] == 0).all() and x.abs().max() <= 2.5 and x[:, 1:].abs().min() > 0
    with pytest.raises(ValueError, match="spread"):
        uniform_sets(3, 5, 4, 0.0, g)
    module = glorot_init_(torch.nn.Linear(64, 3 * 64), g)
    limit = math.sqrt(6 / 128)  # Glorot for each 64 x 64 block
    assert module.weight.abs().max() <= limit and module.weight.abs().max() > 0.9 * limit
    assert (module.bias == 0).all()


@pytest.mark.parametrize("name, overrides, message", [
    ("bound-tightness", {"ns": ()}, r"ns: Tuple should have at least 1 item"),
    ("bound-tightness", {"ns": (2.5,)}, r"ns\.0: Input should be a valid integer \(got 2\.5\)"),
    ("layernorm", {"eps": float("nan")}, r"eps: Input should be a finite number \(got nan\)"),
    ("layernorm", {"samples": 0}, r"samples: Input should be greater than or equal to 1"),
    ("invertibility", {"coeffs": (1.2,)}, r"coeffs\.0: Input should be less than 1"),
    ("invertibility", {"sizes": ((4, 0),)}, r"sizes\.0\.1: .* greater than or equal to 1"),
    ("runtime", {"attentions": ()}, r"attentions: Tuple should have at least 1 item"),
    ("dp-divergence", {"lr": -1.0}, r"lr: Input should be greater than 0 \(got -1\.0\)"),
    ("dp-divergence", {"steps": True}, r"steps: Input should be a valid integer \(got True\)"),
])
def test_overrides_of_the_wrong_kind_are_refused_naming_the_field(name, overrides, message):
    with pytest.raises(InputError, match=message):
        run_reproduction(name, "quick", **overrides)


def test_overrides_are_converted_to_the_fields_kind():
    from flowattn.repro.bound_tightness import PRESETS, BoundTightnessConfig
    from flowattn.repro.common import grid_config

    config = grid_config(BoundTightnessConfig, PRESETS, "quick", 3, {"ns": [2, 3], "lr": 1})
    assert config.ns == (2, 3) and config.lr == 1.0 and config.seed == 3
    assert config.steps == BoundTightnessConfig(**PRESETS["quick"]).steps  # the grid's own
