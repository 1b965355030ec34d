"""The baselines every language-model table carries: count-based n-grams and the same model
without attention."""

import json
import math
from collections import Counter

import pytest
import torch

from flowattn.cli import main
from flowattn.errors import InputError
from flowattn.lm.config import LMConfig
from flowattn.lm.model import NoAttention, build_model
from flowattn.lm.ngram import CharNGram, ngram_baselines


def brute_force_log_probs(train: list[int], ids: list[int], order: int, vocab: int,
                          alpha: float) -> list[float]:
    """Add-alpha n-gram log-probabilities counted with dictionaries, context as available."""
    out = []
    for t in range(1, len(ids)):
        k = min(order - 1, t)
        full = Counter(tuple(train[i - k : i + 1]) for i in range(k, len(train)))
        ctx = Counter(tuple(train[i - k : i]) for i in range(k, len(train)))
        context = tuple(ids[t - k : t])
        out.append(math.log((full[(*context, ids[t])] + alpha) /
                            (ctx[context] + alpha * vocab)))
    return out


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_ngram_log_probabilities_equal_counting_by_hand(order):
    g = torch.Generator().manual_seed(order)
    train = torch.randint(5, (400,), generator=g)
    ids = torch.randint(5, (40,), generator=g)
    model = CharNGram(train, order, vocab_size=5, alpha=0.3)
    expected = brute_force_log_probs(train.tolist(), ids.tolist(), order, 5, 0.3)
    got = model.log_probs(ids)
    assert got.shape == (39,) and got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0,
                               atol=1e-12)
    # a proper distribution over the next character at every position
    for t in (1, 5, 39):
        total = sum(math.exp(float(model.log_probs(torch.cat([ids[:t], torch.tensor([c])]))[-1]))
                    for c in range(5))
        assert total == pytest.approx(1.0, abs=1e-12)


def test_ngram_baselines_choose_alpha_on_held_out_text_and_use_context():
    g = torch.Generator().manual_seed(0)
    # a second-order Markov chain: the trigram knows the next character, the unigram does not
    ids = [0, 1]
    for _ in range(3000):
        ids.append((ids[-1] + ids[-2] + int(torch.rand((), generator=g) < 0.05)) % 4)
    ids = torch.tensor(ids)
    records = ngram_baselines(ids[:2500], ids[2500:], 4, orders=(1, 2, 3))
    losses = [r["val_loss"] for r in records]
    assert losses[0] == pytest.approx(math.log(4), abs=0.05)  # near uniform
    assert losses[1] > 1.3  # one character of context tells nothing about a sum of two
    assert losses[2] < 0.3  # two characters tell almost everything
    assert all(r["val_bpc"] == pytest.approx(r["val_loss"] / math.log(2)) for r in records)
    with pytest.raises(InputError, match="too few"):
        ngram_baselines(ids[:3], ids[3:], 4, orders=(3,))


def test_ngram_command_prints_every_order(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text("abcabcabd " * 40)
    assert main(["lm", "ngram", "--data", str(path), "--orders", "1", "3", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert [r["order"] for r in result["ngrams"]] == [1, 3]
    assert "3-gram" in out[-2]


def test_the_attention_free_model_sees_no_other_token():
    config = LMConfig(vocab_size=9, attention="none", layers=2, dim=8, heads=2, block_size=6)
    model = build_model(config).eval()
    assert all(isinstance(block.attn, NoAttention) for block in model.blocks)
    idx = torch.randint(9, (3, 6), generator=torch.Generator().manual_seed(0))
    logits, _ = model(idx)
    changed = idx.clone()
    changed[:, :-1] = (changed[:, :-1] + 1) % 9  # every token but the last
    other, _ = model(changed)
    torch.testing.assert_close(other[:, -1], logits[:, -1], rtol=0, atol=0)
    with_attention = build_model(LMConfig(**{**config.to_dict(), "attention": "dp"})).eval()
    assert not torch.equal(with_attention(changed)[0][:, -1], with_attention(idx)[0][:, -1])


def test_attention_none_on_the_command_line_is_the_baseline_not_the_default(capsys):
    for value, expected in (("none", "none"), ("dp", "dp")):
        assert main(["lm", "train", "--attention", value, "--norm", "none",
                     "--print-config", "json"]) == 0
        network = json.loads(capsys.readouterr().out)["network"]
        assert network["attention"] == expected and network["norm"] == "none"


def test_a_perfectly_predicted_corpus_scores_zero_not_minus_zero():
    ids = torch.zeros(200, dtype=torch.long)  # one character: every prediction is certain
    records = ngram_baselines(ids[:150], ids[150:], 1, orders=(1, 2))
    assert all(r["val_loss"] == 0.0 and math.copysign(1.0, r["val_loss"]) == 1.0
               for r in records)
