"""Tests for the ``flowattn lm`` command line: train, eval, sample, invert-check and bad input."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowattn.cli import main

ROOT = Path(__file__).resolve().parents[1]
TEXT = "to be or not to be, that is the question. " * 50
TINY = ["--layers", "1", "--dim", "16", "--heads", "2", "--block-size", "16",
        "--batch-size", "4", "--no-progress", "--no-tensorboard"]


@pytest.fixture
def corpus(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def trained(corpus, tmp_path, capsys) -> tuple[Path, dict]:
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, "lm", "train", "--data", corpus, *TINY, "--steps", "20",
                          "--eval-every", "10", "--out", out, "--json")
    assert code == 0
    return out, last_json(stdout)


def test_train_json_summary_is_the_last_stdout_line(trained):
    out, summary = trained
    assert summary["step"] == 20 and not summary["diverged"]
    assert summary["out"] == str(out) and (out / "checkpoint.pt").exists()


def test_eval_reports_the_validation_loss_of_the_checkpoint_in_nats_and_bits(trained, capsys):
    out, summary = trained
    code, stdout, _ = run(capsys, "lm", "eval", "--checkpoint", out, "--json")
    result = last_json(stdout)
    assert code == 0
    assert result["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-9)
    assert result["bpc"] == pytest.approx(result["val_loss"] / math.log(2))
    assert result["characters"] == len(TEXT) - int(0.9 * len(TEXT))


def test_eval_of_a_model_whose_activations_overflow_fails_instead_of_scoring_nan(trained,
                                                                                capsys):
    out, _ = trained
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    checkpoint["model"]["tok_emb.weight"] *= 1e30  # finite weights, overflowing activations
    torch.save(checkpoint, out / "overflowing.pt")
    code, stdout, err = run(capsys, "lm", "eval", "--checkpoint", out / "overflowing.pt",
                            "--json")
    assert code == 2 and stdout == ""  # it printed "val loss nan" and exited 0
    assert "val loss on this text is nan" in err and "Traceback" not in err


def test_sample_continues_the_prompt_with_characters_of_the_vocabulary(trained, capsys):
    out, _ = trained
    code, stdout, _ = run(capsys, "lm", "sample", "--checkpoint", out, "--prompt", "to be",
                          "--max-new-tokens", "30", "--seed", "1", "--json")
    text = last_json(stdout)["text"]
    assert code == 0 and text.startswith("to be") and len(text) == 35
    assert set(text) <= set(TEXT)
    again = last_json(run(capsys, "lm", "sample", "--checkpoint", out, "--prompt", "to be",
                          "--max-new-tokens", "30", "--seed", "1", "--json")[1])["text"]
    assert again == text


def test_sample_reports_the_tokens_drawn_on_stderr_unless_told_not_to(trained, capsys):
    # a long draw (--max-new-tokens 10^8) ran for hours without a word
    out, _ = trained
    code, stdout, err = run(capsys, "lm", "sample", "--checkpoint", out, "--max-new-tokens",
                            "12", "--json")
    assert code == 0 and len(last_json(stdout)["text"]) == 13
    assert err.startswith("sampling: token 12/12 (100%)"), err  # the closing line of a log
    assert "s/token" in err
    code, stdout, err = run(capsys, "lm", "sample", "--checkpoint", out, "--max-new-tokens",
                            "12", "--no-progress", "--json")
    assert code == 0 and err == ""


def test_invert_check_reconstructs_embeddings_of_an_invertible_lm_below_1e_4(
    corpus, tmp_path, capsys
):
    out = tmp_path / "inv"
    code, _, _ = run(capsys, "lm", "train", "--data", corpus, *TINY, "--invertible",
                     "--steps", "10", "--eval-every", "10", "--out", out)
    assert code == 0
    code, stdout, _ = run(capsys, "lm", "invert-check", "--checkpoint", out, "--json")
    report = last_json(stdout)
    assert code == 0 and report["passed"]
    assert report["max_error"] <= 1e-4 and report["dtype"] == "float32"
    assert report["token_accuracy"] == 1.0 and report["max_branch_bound"] < 1.0
    code, stdout, _ = run(capsys, "lm", "invert-check", "--checkpoint", out, "--threshold",
                          "1e-30", "--json")
    assert code == 1 and not last_json(stdout)["passed"]
    # the line says the verdict and the threshold it was taken against
    assert stdout.splitlines()[0].endswith(": FAILED (--threshold 1e-30)")
    code, stdout, _ = run(capsys, "lm", "invert-check", "--checkpoint", out)
    assert code == 0 and stdout.strip().endswith(": passed (--threshold 0.0001)")
    # an inverse that does not converge fails the check (status 1, its report), naming the flags
    code, stdout, err = run(capsys, "lm", "invert-check", "--checkpoint", out, "--max-iter", "1",
                            "--json")
    report = last_json(stdout)
    assert code == 1 and not report["passed"] and not report["converged"] and not err
    assert "--max-iter" in stdout and "--method anderson" in stdout


def one_line_error(capsys, *argv, code=2) -> str:
    """Run argv, expect ``code`` and exactly one line on stderr; return that line."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse usage errors
        status = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == code
    assert len(err) == 1, err
    return err[0]


def test_sample_refuses_bad_temperatures_and_seeds_and_draws_no_unknown_character(
        trained, capsys, tmp_path):
    out, _ = trained
    for flag, value in (("--temperature", "nan"), ("--temperature", "inf"),
                        ("--temperature", "0"), ("--seed", str(2**64)), ("--seed", "-1")):
        line = one_line_error(capsys, "lm", "sample", "--checkpoint", out, flag, value)
        assert value in line or "temperature" in line, line
    # a temperature far below float32's range: greedy decoding, no NaN probabilities
    code, stdout, _ = run(capsys, "lm", "sample", "--checkpoint", out, "--prompt", "to be",
                          "--max-new-tokens", "20", "--temperature", "1e-300", "--json")
    assert code == 0 and len(last_json(stdout)["text"]) == 25
    # a vocabulary with an unknown-character id (validation text the training text lacks):
    # hot samples never draw it
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text(TEXT)
    val.write_text(TEXT[:400] + "$%&#@" * 20)
    run_dir = tmp_path / "unknown"
    code, _, _ = run(capsys, "lm", "train", "--data", train, "--val-data", val, *TINY,
                     "--steps", "2", "--eval-every", "2", "--out", run_dir)
    assert code == 0
    code, stdout, _ = run(capsys, "lm", "sample", "--checkpoint", run_dir, "--prompt", "to be",
                          "--max-new-tokens", "400", "--temperature", "50", "--json")
    assert code == 0 and "\ufffd" not in last_json(stdout)["text"]


def test_a_checkpoint_with_non_finite_weights_is_refused(trained, capsys, tmp_path):
    out, _ = trained
    record = torch.load(out / "checkpoint.pt", weights_only=True)
    name = next(iter(record["model"]))
    record["model"][name] = torch.full_like(record["model"][name], math.nan)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    torch.save(record, damaged / "checkpoint.pt")
    for command in (["eval"], ["sample"]):
        line = one_line_error(capsys, "lm", *command, "--checkpoint", damaged)
        assert "weights hold NaN or Inf values" in line and name in line


def test_each_bad_number_of_sample_and_invert_check_is_named_with_its_value(trained, capsys):
    out, _ = trained
    for command, flag, value, message in (
            ("sample", "--temperature", "0", "--temperature must be a positive number, got 0.0"),
            ("sample", "--top-k", "0", "--top-k must be >= 1, got 0"),
            ("invert-check", "--tol", "-1", "--tol must be a positive number, got -1.0"),
            ("invert-check", "--threshold", "nan",
             "--threshold must be a positive number, got nan"),
            ("invert-check", "--max-iter", "0", "--max-iter must be >= 1, got 0")):
        line = one_line_error(capsys, "lm", command, "--checkpoint", out, flag, value)
        assert message in line, line


def test_eval_on_text_with_characters_the_model_never_saw_names_the_file_and_them(
        trained, capsys, tmp_path):
    out, _ = trained
    other = tmp_path / "other.txt"
    other.write_text(TEXT + "$%&" * 30)
    line = one_line_error(capsys, "lm", "eval", "--checkpoint", out, "--data", other)
    assert f"{other}: 3 character(s) the model never saw ('$%&')" in line
    assert "has no unknown id" in line


def test_eval_sample_and_ngram_take_threads(trained, corpus, capsys, monkeypatch):
    # the commands that load a run set torch's threads as training does
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    out, _ = trained
    for command in (["eval", "--checkpoint", out], ["sample", "--checkpoint", out,
                                                    "--max-new-tokens", "2"],
                    ["ngram", "--data", corpus, "--orders", "1"]):
        code, _, err = run(capsys, "lm", *command, "--threads", "1")
        assert code == 0, err
    assert seen == [1, 1, 1]
    line = one_line_error(capsys, "lm", "invert-check", "--checkpoint", out, "--threads", "0")
    assert "--threads must be >= 1, got 0" in line


def test_invert_check_refuses_a_non_invertible_checkpoint(trained, capsys):
    out, _ = trained
    line = one_line_error(capsys, "lm", "invert-check", "--checkpoint", out)
    assert "non-invertible" in line


def write(tmp_path, name, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary"),
        ("na\u00efve caf\u00e9 ".encode("latin-1") * 20, "not UTF-8"),
    ],
    ids=["empty", "binary", "latin-1"],
)
def test_bad_text_gives_a_one_line_error_and_nonzero_exit(tmp_path, capsys, content, message):
    data = write(tmp_path, "bad.txt", content)
    line = one_line_error(capsys, "lm", "train", "--data", data, *TINY, "--out", tmp_path / "o")
    assert message in line and line.startswith("flowattn lm train: error:")


def test_block_size_longer_than_the_corpus_is_a_one_line_error(tmp_path, capsys):
    data = write(tmp_path, "short.txt", b"just a few characters here\n")
    line = one_line_error(capsys, "lm", "train", "--data", data, *TINY, "--block-size", "64",
                          "--out", tmp_path / "o")
    assert "block size 64 is longer than the corpus" in line


def test_unknown_attention_type_is_a_one_line_usage_error(corpus, tmp_path, capsys):
    line = one_line_error(capsys, "lm", "train", "--data", corpus, "--attention", "linear",
                          "--out", tmp_path / "o")
    assert "invalid choice: 'linear'" in line


@pytest.mark.parametrize("command", [["lm", "train"], ["lm", "eval", "--checkpoint", "x"],
                                     ["sets", "fit"]])
def test_an_unknown_flag_is_reported_by_the_command_it_was_given_to(capsys, command):
    # reported by the top-level parser it pointed at `flowattn --help`, which lists no flags
    line = one_line_error(capsys, *command, "--stesp", "5")
    prog = " ".join(["flowattn", *command[:2]])
    assert line == f"{prog}: error: unrecognized arguments: --stesp 5 (see {prog} --help)"


def test_invertible_with_post_norm_is_a_one_line_error(corpus, tmp_path, capsys):
    line = one_line_error(capsys, "lm", "train", "--data", corpus, *TINY, "--invertible",
                          "--norm-position", "post", "--out", tmp_path / "o")
    assert "invalid combination" in line and "post-norm" in line
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    line = one_line_error(capsys, "lm", "eval", "--checkpoint", tmp_path / "nothing")
    assert "no checkpoint" in line


def test_prompt_with_unseen_characters_is_a_one_line_error(trained, capsys):
    out, _ = trained
    line = one_line_error(capsys, "lm", "sample", "--checkpoint", out, "--prompt", "ZZ")
    assert "never saw" in line


@pytest.mark.parametrize("text, prompt", [("ab\nba\n" * 40, "\n"), ("ab ba " * 40, " "),
                                          ("abba" * 60, "a")],
                         ids=["newline", "space", "first-character"])
def test_the_default_prompt_is_a_character_the_model_saw(tmp_path, capsys, text, prompt):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    out = tmp_path / "run"
    code, _, err = run(capsys, "lm", "train", "--data", corpus, *TINY, "--steps", "1",
                       "--out", out)
    assert code == 0, err
    code, stdout, err = run(capsys, "lm", "sample", "--checkpoint", out, "--max-new-tokens",
                            "5", "--json")
    assert code == 0, err
    sample = last_json(stdout)
    assert sample["prompt"] == prompt and sample["text"].startswith(prompt)
    assert len(sample["text"]) == 6


def test_divergence_exits_with_status_3_and_reports_it_in_the_json(corpus, tmp_path, capsys):
    code, stdout, _ = run(capsys, "lm", "train", "--data", corpus, *TINY, "--lr", "10",
                          "--min-lr", "0", "--schedule", "constant", "--warmup", "0",
                          "--grad-clip", "none", "--steps", "50", "--out", tmp_path / "d",
                          "--json")
    summary = last_json(stdout)
    assert code == 3 and summary["diverged"]
    assert (tmp_path / "d" / "diverged.json").exists()


def test_module_entry_point_runs_the_same_command_line():
    done = subprocess.run([sys.executable, "-m", "flowattn", "lm", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for command in ("train", "eval", "sample", "invert-check"):
        assert command in done.stdout


# ----------------------------------------------------------------------------- defaults


def test_print_config_and_help_show_the_auto_defaults(corpus, capsys):
    code, stdout, _ = run(capsys, "lm", "train", "--data", corpus, "--print-config")
    assert code == 0
    for line in ("self_offset: auto", "position_bias: auto", "init: auto", "init_scale: auto",
                 "contractive_norm: auto", "norm_gain: auto", "readout: auto", "heads: auto",
                 "defaults_version: 5", "lr: auto"):
        assert f"  {line}\n" in stdout
    code, stdout, _ = run(capsys, "lm", "train", "--attention", "l2-tied", "--self-offset", "2",
                          "--init-scale", "auto", "--print-config", "json")
    network = json.loads(stdout)["network"]
    assert (network["self_offset"], network["init_scale"]) == (2.0, "auto")
    with pytest.raises(SystemExit):
        run(capsys, "lm", "train", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--self-offset X|auto" in text and "auto: 8 for contractive-l2, 4 for l2-tied" in text
    assert "auto: 1/2 for l2-tied and with --invertible, 1/8 for contractive-l2" in text
    assert "--norm-gain X|auto" in text and "auto: 4 for contractive-l2" in text
    assert "--lr X|auto" in text
    assert "--readout {linear,feed-forward,auto}" in text and "--heads N|auto" in text
    assert "attention heads H (auto: 8 with --invertible, 4 otherwise)" in text
    assert "auto: feed-forward with --invertible, linear otherwise" in text
    assert "auto: 2e-3 for l2-tied and contractive-l2, 6e-3 with --invertible" in text
    # where "none" is a choice of its own, the automatic default is not shown as "none"
    assert "(unset: layernorm; actnorm with --invertible) (default: unset)" in text
    assert "(unset: dp, contractive-l2 with --invertible) (default: unset)" in text
    assert "with --invertible) (default: none)" not in text
    assert "--contractive-norm {inf,'2,inf',2,auto}" in text  # not {inf,2,inf,2,auto}


def test_every_flag_is_its_settings_name_and_format_stays_an_alias(capsys):
    for flag in ("--data-format", "--format"):
        code, stdout, _ = run(capsys, "lm", "train", flag, "ptb-char", "--print-config", "json")
        assert code == 0 and json.loads(stdout)["data"]["data_format"] == "ptb-char"


def test_a_missing_relative_data_file_names_the_folder_it_was_looked_for_in(
        tmp_path, capsys, monkeypatch):
    # relative paths, on the command line and in config files alike, are read from the
    # working directory (not from the config file's folder)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.yaml").write_text("data: only.txt\nsteps: 1\n")
    line = one_line_error(capsys, "lm", "train", "--config", "cfg/run.yaml", "--out", "o")
    assert line.endswith(f"only.txt: no such file (looked for in the working directory "
                         f"{tmp_path})")


def test_a_model_that_overflows_at_initialisation_is_blamed_on_its_settings(
        corpus, tmp_path, capsys):
    # the check of a module's output advised to scale the input down or compute in float64,
    # neither of which a training run can do
    out = tmp_path / "o"
    line = one_line_error(capsys, "lm", "train", "--data", corpus, *TINY, "--weighted-residual",
                          "--residual-alpha", "1e30", "--out", out)
    assert line.startswith("flowattn lm train: error: before its first step, on the run's own "
                           "data: TransformerLM overflowed")
    assert "e.g. init_scale, residual_alpha, norm_gain" in line and "float64" not in line
    assert not out.exists()


def test_print_config_refuses_what_training_refuses(capsys):
    # it printed a config (exit 0) that `lm train` then refused
    line = one_line_error(capsys, "lm", "train", "--print-config", "json",
                          "--residual-alpha", "0.5")
    assert "residual_alpha=0.5 is not read by this model" in line


def test_a_bad_number_or_auto_setting_is_a_one_line_usage_error(corpus, tmp_path, capsys):
    line = one_line_error(capsys, "lm", "train", "--data", corpus, "--init-scale", "big",
                          "--out", tmp_path / "o")
    assert "--init-scale expects a number or auto, got 'big'" in line
    line = one_line_error(capsys, "lm", "train", "--data", corpus, "--self-offset", "-1",
                          "--out", tmp_path / "o")
    assert "self_offset: Input should be greater than or equal to 0 or 'auto' (got -1.0)" in line


def test_eval_sample_and_invert_check_read_checkpoints_stored_before_version_2(
    corpus, tmp_path, capsys
):
    # an invertible model trained with the settings that were the defaults then
    out = tmp_path / "old"
    old = ["--self-offset", "0", "--position-bias", "0", "--init", "default",
           "--contractive-norm", "inf"]  # (init_scale: not read under init default)
    code, _, _ = run(capsys, "lm", "train", "--data", corpus, *TINY, "--invertible", *old,
                     "--steps", "4", "--eval-every", "4", "--out", out)
    assert code == 0
    commands = [["eval"], ["sample", "--prompt", "to be", "--max-new-tokens", "20"],
                ["invert-check"]]
    before = [last_json(run(capsys, "lm", *c, "--checkpoint", out, "--json")[1])
              for c in commands]
    path = out / "checkpoint.pt"
    record = torch.load(path, weights_only=True)
    for network in (record["config"]["network"], record["task"]["model_config"]):
        for key in ("defaults_version", "self_offset", "position_bias", "init", "init_scale",
                    "contractive_norm"):
            del network[key]  # as flowattn stored them before these settings existed
    torch.save(record, path)
    after = [last_json(run(capsys, "lm", *c, "--checkpoint", out, "--json")[1])
             for c in commands]
    assert after == before
    assert before[2]["passed"] and before[2]["max_branch_bound"] <= 0.9 + 1e-9


BASE = ["--layers", "1", "--dim", "16", "--block-size", "16", "--batch-size", "4",
        "--steps", "1", "--no-progress", "--no-tensorboard"]


@pytest.mark.parametrize("flags, message", [
    (["--residual-alpha", "0.5"], "residual_alpha=0.5 is not read by this model: it needs "
                                  "weighted_residual true"),
    (["--contractive-norm", "2"], "contractive_norm='2' .* needs attention contractive-l2"),
    (["--attention", "l2-tied", "--spectral-norms", "squarings"], "spectral_norms="),
    (["--contractive-coeff", "0.5"], "contractive_coeff=0.5 .* or invertible true"),
    (["--attention", "none", "--ortho-attention", "0.1"], "ortho_attention=0.1 .* attention "
                                                          "weights"),
    (["--max-distance", "8"], "max_distance=8 .* needs a position bias"),
    (["--init-scale", "0.5"], "init_scale=0.5 .* needs init glorot-l2"),
    (["--model", "lstm", "--heads", "2", "--ortho-attention", "0.1"],
     "heads, ortho_attention: setting.* the LSTM baseline does not read"),
])
def test_settings_the_model_would_not_read_are_refused_by_name(corpus, tmp_path, capsys,
                                                                flags, message):
    out = tmp_path / "run"
    code, _, err = run(capsys, "lm", "train", "--data", corpus, *BASE, *flags, "--out", out)
    assert code == 2
    assert re.search(message, err), err
    assert not out.exists()


@pytest.mark.parametrize("flags", [
    ["--weighted-residual", "--residual-alpha", "0.5"],
    ["--attention", "l2-tied", "--init-scale", "0.25"],
    ["--invertible", "--contractive-norm", "2", "--contractive-coeff", "0.5"],
    ["--model", "lstm", "--dropout", "0.1"],
    ["--contractive-norm", "auto"],  # the default, typed
])
def test_settings_the_model_reads_are_accepted(corpus, tmp_path, capsys, flags):
    code, _, err = run(capsys, "lm", "train", "--data", corpus, *BASE, *flags,
                       "--out", tmp_path / "run")
    assert code == 0, err


def test_a_config_files_settings_are_checked_as_flags_are(corpus, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("network:\n  residual_alpha: 0.5\n")
    code, _, err = run(capsys, "lm", "train", "--data", corpus, *BASE, "--config", config,
                       "--out", tmp_path / "run")
    assert code == 2 and "residual_alpha=0.5 is not read" in err
