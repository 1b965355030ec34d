"""``--preset small|medium|large``: documented values, explicit settings win, the default run is
unchanged without one, resumed runs keep the values they started with."""

import json
import re
from pathlib import Path

import pytest

from flowattn.cli import main
from flowattn.errors import ConfigError
from flowattn.sets import SetsRunConfig, fit
from flowattn.sets import config as sets_config
from flowattn.training.config import from_sources
from flowattn.training.device import cpp_compiler
from flowattn.training.run import plan_run

DOCS = Path(__file__).resolve().parents[1] / "docs" / "sets.md"
# the values docs/sets.md states, written out: a change of PRESETS must change this too
DOCUMENTED = {
    "small": {"flow": "coupling", "coupling_layers": 8, "coupling_hidden": 64,
              "coupling_blocks": 2, "coupling_bins": 8, "steps": 1500, "keep_best": True,
              "ema": 0.999},
    "medium": {"flow": "coupling", "coupling_layers": 8, "coupling_hidden": 64,
               "coupling_blocks": 2, "coupling_bins": 8, "steps": 3000, "keep_best": True,
               "ema": 0.999},
    "large": {"flow": "coupling", "coupling_layers": 12, "coupling_hidden": 64,
              "coupling_blocks": 2, "coupling_bins": 8, "steps": 4500, "keep_best": True,
              "ema": 0.999},
}


def test_without_a_preset_the_default_run_is_unchanged():
    default = SetsRunConfig.build({})
    assert default.flow.preset == "none"
    assert default == SetsRunConfig.build({"preset": "none"}) == from_sources(SetsRunConfig)
    flat = default.flat()
    pinned = {"data": "gaussian-sets", "flow": "resflow", "interaction": "auto", "blocks": 4,
              "hidden": 64, "heads": 1, "coeff": 0.9, "train_logdet": "auto", "steps": 1500,
              "batch_size": 64, "lr": 0.003, "coupling_layers": None, "coupling_hidden": None,
              "coupling_blocks": None, "coupling_bins": None}
    assert {key: flat[key] for key in pinned} == pinned


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_each_preset_resolves_to_the_values_in_the_docs(name):
    flat = SetsRunConfig.build({"preset": name}).flat()
    assert {key: flat[key] for key in DOCUMENTED[name]} == DOCUMENTED[name]
    assert sets_config.PRESETS[name] == DOCUMENTED[name]
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"docs/sets.md needs one table row for the {name} preset"
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    values = DOCUMENTED[name]
    assert cells[1:9] == [values["flow"], str(values["coupling_layers"]),
                          str(values["coupling_hidden"]), str(values["coupling_blocks"]),
                          str(values["coupling_bins"]), str(values["steps"]),
                          {True: "best", False: "last"}[values["keep_best"]],
                          str(values["ema"])]
    assert str(values["steps"]) in SetsRunConfig.model_fields["flow"].annotation \
        .model_fields["preset"].description


def test_stored_runs_without_keep_best_keep_ending_with_their_last_state():
    stored = SetsRunConfig.build({"preset": "large"}).to_dict()
    del stored["train"]["keep_best"]  # a run stored before the setting existed
    assert SetsRunConfig.from_stored(stored).train.keep_best is False
    assert SetsRunConfig.build(stored).train.keep_best is True  # a new run: the preset's
    stored["train"]["keep_best"] = True
    assert SetsRunConfig.from_stored(stored).train.keep_best is True


def test_settings_from_a_file_or_flags_override_the_preset(tmp_path):
    file = tmp_path / "run.json"
    file.write_text(json.dumps({"preset": "large", "steps": 100}))
    config = from_sources(SetsRunConfig, file, {"coupling_layers": 4})
    assert (config.flow.coupling_layers, config.train.steps) == (4, 100)
    assert (config.flow.coupling_hidden, config.flow.coupling_bins) == (64, 8)  # the preset's
    file.write_text(json.dumps({"coupling_bins": 16}))  # the preset as a flag, a file setting
    config = from_sources(SetsRunConfig, file, {"preset": "medium"})
    assert (config.flow.coupling_bins, config.train.steps) == (16, 3000)


def test_print_config_shows_the_preset_and_its_values(capsys):
    assert main(["sets", "fit", "--preset", "large", "--steps", "7", "--print-config",
                 "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["flow"]["preset"] == "large" and printed["flow"]["coupling_layers"] == 12
    assert printed["train"]["steps"] == 7


def test_a_bad_preset_name_or_a_contradicting_flow_is_one_line_config_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"flow: preset: Input should be 'none', 'small', "
                       r"'medium' or 'large' \(got 'huge'\)"):
        SetsRunConfig.build({"preset": "huge"})
    with pytest.raises(ConfigError, match=r"flow: preset: Input should be"):
        SetsRunConfig.build({"preset": ["large"]})
    with pytest.raises(ConfigError, match=r"preset='large' is a coupling flow, but "
                       r"flow='resflow' was given: drop one of them"):
        SetsRunConfig.build({"preset": "large", "flow": "resflow"})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"preset": "huge"}))
    out = tmp_path / "run"
    assert main(["sets", "fit", "--config", str(bad), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "preset" in err and "'huge'" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_resumed_run_keeps_the_preset_values_it_started_with(tmp_path, monkeypatch):
    out = tmp_path / "run"
    config = SetsRunConfig.build({
        "preset": "small", "data": "gaussian-sets", "num_train": 64, "val_sets": 8,
        "batch_size": 8, "steps": 2, "eval_every": 2, "checkpoint_every": 2,
        "coupling_layers": 1, "coupling_hidden": 8, "coupling_blocks": 0})
    fit(config, out, progress=False, tensorboard=False, plots=False)
    # the preset's values change in a later version: the run keeps those it was started with
    monkeypatch.setitem(sets_config.PRESETS, "small",
                        {**sets_config.PRESETS["small"], "coupling_bins": 3, "steps": 9})
    plan = plan_run(out, "sets", SetsRunConfig, resume=True, flags={"steps": 4})
    assert (plan.config.flow.preset, plan.config.flow.coupling_bins) == ("small", 8)
    assert (plan.config.flow.coupling_layers, plan.config.train.steps) == (1, 4)
    with pytest.raises(ConfigError, match=re.escape("preset ('small' in the run, 'large' now)")):
        plan_run(out, "sets", SetsRunConfig, resume=True, flags={"preset": "large"})


# ----------------------------------------------------------------------------- data defaults

# the data sets' own defaults as docs/sets.md states them, written out
DATA_DOCUMENTED = {
    "dw4": {"blocks": 12, "mlp": False, "coeff": 0.97, "radial_max_slope": 4.0, "steps": 12000,
            "batch_size": 128, "warmup": 100, "eval_every": 1000, "checkpoint_every": 1000,
            "val_sets": 1000, "compile": True},
    "lj13": {"blocks": 8, "mlp": False, "radial_max_slope": 4.0, "steps": 5000, "warmup": 100,
             "eval_every": 500, "checkpoint_every": 500, "keep_best": True, "compile": True},
    "lj55": {"blocks": 8, "mlp": False, "radial_basis": 32, "steps": 400, "batch_size": 32,
             "warmup": 50, "eval_every": 100, "checkpoint_every": 100, "val_sets": 200},
    "repulsive-sets": {"interaction": "radial", "radial_max_slope": 4.0},
}


@pytest.mark.parametrize("data", list(DATA_DOCUMENTED))
def test_particle_data_get_their_documented_defaults(data):
    assert sets_config.DATA_DEFAULTS[data] == DATA_DOCUMENTED[data]
    flat = SetsRunConfig.build({"data": data}).flat()
    resolved = dict(DATA_DOCUMENTED[data])
    if "compile" in resolved and cpp_compiler() is None:
        resolved["compile"] = False  # compiled only where torch.compile can build kernels
    assert {key: flat[key] for key in DATA_DOCUMENTED[data]} == resolved
    radial = SetsRunConfig.build({"data": data, "interaction": "radial"}).flat()
    assert flat == {**radial, "interaction": DATA_DOCUMENTED[data].get("interaction", "auto")}
    section = DOCS.read_text().split("### Defaults of the built-in data sets", 1)[1]
    rows = [line for line in section.split("\n## ", 1)[0].splitlines()
            if line.startswith(f"| `{data}` |")]
    assert len(rows) == 1, f"docs/sets.md needs one table row for the {data} defaults"
    cell = rows[0].strip("|").split("|")[1].replace("`", "").strip()
    shown = {key: {True: "yes", False: "no"}[value] if isinstance(value, bool) else str(value)
             for key, value in DATA_DOCUMENTED[data].items()}
    assert dict(item.split(" ") for item in cell.split(", ")) == shown, rows[0]


def test_the_dw4_default_compiles_only_where_a_compiler_can_build_kernels(
        monkeypatch, tmp_path, capsys):
    from flowattn.training import device

    monkeypatch.setattr(device, "cpp_compiler", lambda: "/usr/bin/g++")
    assert SetsRunConfig.build({"data": "dw4"}).train.compile is True
    monkeypatch.setattr(device, "cpp_compiler", lambda: None)
    assert SetsRunConfig.build({"data": "dw4"}).train.compile is False  # eager, not refused
    out = tmp_path / "run"  # asked for explicitly: refused in one line, nothing written
    assert main(["sets", "fit", "--data", "gaussian-sets", "--compile", "--steps", "1",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--compile" in err and "C++ compiler" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_data_defaults_yield_to_given_settings_and_apply_only_to_radial_residual_flows():
    general = SetsRunConfig.build({}).flat()
    config = from_sources(SetsRunConfig, None, {"data": "dw4", "blocks": 3, "steps": 50})
    assert (config.flow.blocks, config.train.steps, config.flow.coeff) == (3, 50, 0.97)
    for other in ({"flow": "cnf"}, {"interaction": "attention"}, {"interaction": "linear"}):
        flat = SetsRunConfig.build({"data": "dw4", **other}).flat()
        assert {key: flat[key] for key in DATA_DOCUMENTED["dw4"]} == \
            {key: general[key] for key in DATA_DOCUMENTED["dw4"]}, other
    assert SetsRunConfig.build({"data": "gaussian-sets"}).flat() == general
    # shape-sets: only the mirror average of its own default (MIRROR_DATA)
    assert SetsRunConfig.build({"data": "shape-sets"}).flat() == \
        {**general, "data": "shape-sets", "symmetry": "reflections"}
    # defaults measured with radial interactions: any other interaction, an explicit auto
    # (attention on these data) included, starts from the general defaults
    for interaction in ("auto", "attention", "linear", "none"):
        flat = SetsRunConfig.build({"data": "repulsive-sets", "interaction": interaction}).flat()
        assert flat == {**general, "data": "repulsive-sets", "interaction": interaction}


def test_runs_saved_before_the_data_defaults_keep_the_settings_they_ran_with():
    from flowattn.sets.config import legacy_settings

    settings = SetsRunConfig.build({"data": "dw4", "blocks": 4, "steps": 1500}).flat()
    general = SetsRunConfig.build({}).flat()
    assert settings["radial_max_slope"] == 4.0  # today's dw4 default
    for key in ("radial_max_slope", "radial_inverse", "val_sets", "warmup"):
        del settings[key]  # a format-1 checkpoint written before these settings existed
    config = SetsRunConfig.build(legacy_settings(settings)).flat()
    assert config["radial_max_slope"] is None and config["warmup"] == general["warmup"]
    assert config["val_sets"] == general["val_sets"] and config["blocks"] == 4


def test_mirror_symmetric_data_take_the_mirror_average_unless_told_otherwise():
    from flowattn.data import DATASETS
    from flowattn.sets.config import MIRROR_DATA, legacy_settings

    # both shape data sets, whose invariance the tests of the data check for each name here
    assert set(MIRROR_DATA) == {"shape-sets", "shape-sets-varsize"} and \
        set(MIRROR_DATA) <= set(DATASETS)
    for data in MIRROR_DATA:
        for preset in ("none", "small", "large"):
            config = SetsRunConfig.build({"data": data, "preset": preset})
            assert config.flow.symmetry == "reflections", (data, preset)
        for flow in ("resflow", "cnf", "coupling"):
            assert SetsRunConfig.build({"data": data, "flow": flow}).flow.symmetry == \
                "reflections"
        assert SetsRunConfig.build({"data": data, "symmetry": "none"}).flow.symmetry == "none"
        # turned sets are not what the mirror average trains on: it stays off
        assert SetsRunConfig.build({"data": data, "augment": "rotations"}).flow.symmetry == \
            "none"
        # a run stored before the setting existed scored the flow's own density, and still does
        stored = SetsRunConfig.from_stored({"data": {"data": data}, "flow": {"blocks": 2}})
        assert stored.flow.symmetry == "none"
        assert SetsRunConfig.build(legacy_settings({"data": data})).flow.symmetry == "none"
        # every setting is stored explicitly: the default holds on resume
        again = SetsRunConfig.from_stored(SetsRunConfig.build({"data": data}).to_dict())
        assert again.flow.symmetry == "reflections"
    for data in ("gaussian-sets", "cluster-sets", "repulsive-sets", "dw4"):
        assert SetsRunConfig.build({"data": data}).flow.symmetry == "none"
