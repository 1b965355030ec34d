"""Tests for flowattn.lm.data: corpora, splits, vocabulary, formats, batches and bad input."""

from pathlib import Path

import pytest
import torch

from flowattn.errors import DataError
from flowattn.lm.data import (
    DEFAULT_CORPUS,
    CharVocab,
    check_block_size,
    default_corpus_text,
    eval_windows,
    get_batch,
    load_corpus,
    looks_like_ptb_char,
    parse_ptb_char,
    read_text,
)

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare/input.txt"


def write(tmp_path, name: str, content) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_split_is_first_90_percent_train_last_10_percent_validation(tmp_path):
    text = "".join(chr(ord("a") + i % 7) for i in range(1000))
    corpus = load_corpus(write(tmp_path, "t.txt", text))
    assert corpus.vocab.decode(corpus.train) == text[:900]
    assert corpus.vocab.decode(corpus.val) == text[900:]
    assert corpus.format == "text" and corpus.unknown_count == 0


def test_vocabulary_comes_from_training_split_and_unseen_validation_chars_map_to_unknown(tmp_path):
    text = "ab" * 45 + "abcz" + "a" * 6  # "c" and "z" only in the last 10%
    corpus = load_corpus(write(tmp_path, "t.txt", text))
    vocab = corpus.vocab
    assert vocab.chars == ["a", "b"] and vocab.unknown and vocab.size == 3
    assert corpus.unknown_count == 2
    assert vocab.decode(corpus.val) == "ab\ufffd\ufffd" + "a" * 6


def test_vocab_encode_decode_round_trip_and_rejects_unknown_without_unknown_id():
    vocab = CharVocab.from_text("héllo wörld\n")
    text = "hölé dr\nwo"
    assert vocab.decode(vocab.encode(text)) == text
    assert CharVocab.from_dict(vocab.to_dict()).chars == vocab.chars
    with pytest.raises(ValueError, match="not in the vocabulary"):
        vocab.encode("xyz")


def test_empty_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        read_text(write(tmp_path, "e.txt", ""))
    with pytest.raises(ValueError, match="holds only whitespace"):
        read_text(write(tmp_path, "w.txt", " \n\t\n"))


def test_binary_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="binary"):
        read_text(write(tmp_path, "b.bin", b"PK\x03\x04\x00\x00data"))


def test_non_utf8_file_is_refused_with_the_offending_offset(tmp_path):
    latin1 = "caf\u00e9 au lait".encode("latin-1")
    with pytest.raises(ValueError, match=r"not UTF-8 text: invalid byte 0xe9 at offset 3"):
        read_text(write(tmp_path, "l.txt", latin1))


@pytest.mark.parametrize("encoding,mark", [("utf-16", "fffe"), ("utf-16-be", "feff"),
                                           ("utf-32", "fffe")])
def test_utf16_and_utf32_text_is_named_as_such(tmp_path, encoding, mark):
    text = "to be or not to be"
    raw = text.encode(encoding)
    if encoding == "utf-16-be":
        raw = b"\xfe\xff" + raw  # the big-endian codec writes no mark of its own
    with pytest.raises(DataError, match=f"UTF-16 or UTF-32 text \\(byte-order mark {mark}\\)"):
        read_text(write(tmp_path, "u.txt", raw))
    assert read_text(write(tmp_path, "u8.txt", text.encode("utf-8-sig"))) == text


def test_missing_file_and_directory_are_refused(tmp_path):
    with pytest.raises(DataError, match="nope.txt: no such file"):
        read_text(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="directory"):
        read_text(tmp_path)


def test_byte_order_mark_is_dropped(tmp_path):
    assert read_text(write(tmp_path, "bom.txt", "\ufeffhello".encode())) == "hello"


def test_block_size_longer_than_a_split_is_refused_with_sizes(tmp_path):
    corpus = load_corpus(write(tmp_path, "s.txt", "abcdefghij" * 10))  # 90 + 10 characters
    check_block_size(corpus, 9)
    with pytest.raises(ValueError, match=r"block size 10 is longer .* validation split .* 10 "):
        check_block_size(corpus, 10)
    # a separate validation file that is too short is named itself, not as a split of the corpus
    short = write(tmp_path, "v.txt", b"abcde")
    corpus = load_corpus(tmp_path / "s.txt", val_path=short)
    with pytest.raises(ValueError, match=r"corpus: \S*v.txt has 5 characters, at least 11 "):
        check_block_size(corpus, 10)
    with pytest.raises(ValueError, match=r"the training split of \S*s.txt has 100 characters"):
        check_block_size(corpus, 100)


PTB = " a e r _ b a n k n o t e\n t h e _ e n d _ <\n"


def test_ptb_char_format_decodes_underscores_to_spaces_and_keeps_sentences():
    assert looks_like_ptb_char(PTB)
    assert parse_ptb_char(PTB) == "aer banknote\nthe end <\n"
    assert not looks_like_ptb_char("A plain line of text.\nAnother one.\n")
    with pytest.raises(ValueError, match="line 2 is not in the PTB-char format"):
        parse_ptb_char("a _ b\nword c\n")


def test_ptb_char_file_is_detected_and_separate_validation_file_used(tmp_path):
    train = write(tmp_path, "ptb.char.train.txt", PTB * 5)
    valid = write(tmp_path, "ptb.char.valid.txt", " t h e _ b a n k\n")
    corpus = load_corpus(train, val_path=valid)
    assert corpus.format == "ptb-char" and corpus.val_source == str(valid)
    # a validation file that is not in the format: the error names it, not the training file
    bad = write(tmp_path, "bad.txt", " t h e\nword\n")
    with pytest.raises(ValueError, match=r"bad.txt: line 2 is not in the PTB-char format"):
        load_corpus(train, fmt="ptb-char", val_path=bad)
    assert corpus.vocab.decode(corpus.train) == "aer banknote\nthe end <\n" * 5
    assert corpus.vocab.decode(corpus.val) == "the bank\n"
    as_text = load_corpus(train, fmt="text")
    assert "_" in as_text.vocab.chars


def test_embedded_corpus_needs_no_file_and_is_large_and_deterministic():
    text = default_corpus_text()
    assert len(text) > 100_000 and text == default_corpus_text()
    corpus = load_corpus(None)
    assert corpus.source == DEFAULT_CORPUS
    assert len(corpus.train) + len(corpus.val) == len(text)
    check_block_size(corpus, 256)


def test_batches_pair_each_window_with_its_next_characters_and_are_seeded():
    data = torch.arange(1000)
    x, y = get_batch(data, 16, 8, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows
    x2, _ = get_batch(data, 16, 8, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    starts = torch.cat([get_batch(data, 16, 64, torch.Generator().manual_seed(s))[0][:, 0]
                        for s in range(20)])
    assert starts.min() >= 0 and starts.max() <= 1000 - 17
    assert starts.max() > 900  # the last windows are reachable


def test_evaluation_windows_score_every_complete_window_once_and_shards_partition_them():
    data = torch.arange(103)
    batches = list(eval_windows(data, 10, 4))
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x.flatten(), torch.arange(100))
    assert torch.equal(y.flatten(), torch.arange(1, 101))
    shards = [torch.cat([b[0] for b in eval_windows(data, 10, 3, s, 3)]) for s in range(3)]
    merged = torch.cat(shards)[:, 0].sort().values
    assert torch.equal(merged, torch.arange(0, 100, 10))


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"no Tiny Shakespeare at {SHAKESPEARE}")
def test_tiny_shakespeare_splits_as_nanogpt():
    corpus = load_corpus(SHAKESPEARE)
    assert (len(corpus.train), len(corpus.val)) == (1_003_854, 111_540)
    assert corpus.vocab.size == 65 and not corpus.vocab.unknown
