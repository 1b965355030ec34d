"""Character corpora for language modelling: UTF-8 text, PTB-char files and an embedded default."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import DataError, InputError
from ..files import no_such_file
from .config import DEFAULT_CORPUS, FORMATS

__all__ = [
    "CharVocab",
    "CharCorpus",
    "FORMATS",
    "DEFAULT_CORPUS",
    "read_text",
    "parse_ptb_char",
    "looks_like_ptb_char",
    "default_corpus_text",
    "load_corpus",
    "check_block_size",
    "get_batch",
    "eval_windows",
]

UNKNOWN = "\ufffd"  # shown for validation characters never seen in training


class CharVocab:
    """A character vocabulary: one id per character of the training text.

    Characters are sorted by code point (as in nanoGPT's Shakespeare preparation). With
    ``unknown=True`` one extra id, the last, stands for every character outside the vocabulary;
    without it, encoding such a character is an error.

    Arguments:
        chars: the characters, each of length one, without repetition.
        unknown: reserve a final id for unknown characters.

    Examples:
        >>> vocab = CharVocab.from_text("hello")
        >>> vocab.decode(vocab.encode("hole"))
        'hole'
        >>> vocab.size
        4
    """

    def __init__(self, chars: Sequence[str], unknown: bool = False):
        chars = list(chars)
        if any(len(c) != 1 for c in chars):
            raise InputError("a character vocabulary holds strings of length one")
        if len(set(chars)) != len(chars):
            raise InputError("the vocabulary lists a character twice")
        if not chars:
            raise InputError("the vocabulary is empty")
        self.chars, self.unknown = chars, bool(unknown)
        self.index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str, unknown: bool = False) -> CharVocab:
        """The sorted set of characters of ``text``."""
        return cls(sorted(set(text)), unknown=unknown)

    @property
    def size(self) -> int:
        """Number of ids, the unknown id included."""
        return len(self.chars) + int(self.unknown)

    @property
    def unknown_id(self) -> int | None:
        """The id of unknown characters, or ``None`` if the vocabulary has none."""
        return len(self.chars) if self.unknown else None

    def missing(self, text: str) -> list[str]:
        """The distinct characters of ``text`` outside the vocabulary, sorted."""
        return sorted(set(text) - self.index.keys())

    def encode(self, text: str) -> Tensor:
        """Ids of the characters of ``text`` as a LongTensor (unknown id for unseen ones)."""
        if not self.unknown:
            missing = self.missing(text)
            if missing:
                shown = "".join(missing[:20])
                raise InputError(
                    f"{len(missing)} character(s) not in the vocabulary: {shown!r}"
                )
            return torch.tensor([self.index[c] for c in text], dtype=torch.long)
        unk = len(self.chars)
        return torch.tensor([self.index.get(c, unk) for c in text], dtype=torch.long)

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        """The text of a sequence of ids (the unknown id decodes to U+FFFD)."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        table = self.chars + [UNKNOWN] if self.unknown else self.chars
        return "".join(table[i] for i in ids)

    def to_dict(self) -> dict:
        """A plain dict, for checkpoints."""
        return {"chars": "".join(self.chars), "unknown": self.unknown}

    @classmethod
    def from_dict(cls, d: dict) -> CharVocab:
        """Inverse of :meth:`to_dict`."""
        return cls(list(d["chars"]), unknown=bool(d["unknown"]))


@dataclass
class CharCorpus:
    """A character corpus split for training and validation.

    Attributes:
        train: ids of the training text (LongTensor).
        val: ids of the validation text (LongTensor).
        vocab: the vocabulary (built from the training split).
        source: where the text came from (a path, or ``builtin:pydoc-topics``).
        format: ``"text"`` or ``"ptb-char"``.
        val_source: the separate validation file, if one was given.
        sha256: digest of the training and validation texts, to detect a changed corpus.
        unknown_count: validation characters mapped to the unknown id.
    """

    train: Tensor
    val: Tensor
    vocab: CharVocab
    source: str
    format: str
    val_source: str | None
    sha256: str
    unknown_count: int = 0

    def describe(self) -> str:
        """One line: source, sizes and vocabulary."""
        val = f" (validation from {self.val_source})" if self.val_source else ""
        unk = f", {self.unknown_count} unknown validation chars" if self.unknown_count else ""
        return (
            f"{self.source}{val} [{self.format}]: {len(self.train):,} training / "
            f"{len(self.val):,} validation characters, vocabulary {self.vocab.size}{unk}"
        )


def read_text(path: str | Path) -> str:
    """Read a UTF-8 text file, refusing empty, binary and non-UTF-8 files with a clear message.

    A leading UTF-8 byte-order mark is dropped; UTF-16 and UTF-32 text (told by its byte-order
    mark) is refused as such. A file holding a NUL byte is taken to be binary.

    Raises:
        DataError: if ``path`` does not exist, is a directory, is empty or binary, or is not
            valid UTF-8.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(no_such_file(path))
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a text file")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"{path} " + ("holds only whitespace" if raw else "is empty") +
                        ": a corpus needs some text")
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16's byte-order marks (UTF-32's too)
        raise DataError(f"{path} is UTF-16 or UTF-32 text (byte-order mark {raw[:2].hex()}): "
                        "save it as UTF-8")
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{path} looks binary (NUL byte at offset {nul}), not UTF-8 text")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        bad = raw[err.start : err.start + 1].hex()
        raise DataError(
            f"{path} is not UTF-8 text: invalid byte 0x{bad} at offset {err.start}"
        ) from None


def parse_ptb_char(text: str) -> str:
    """Decode the PTB-char format (Mikolov et al.): one sentence per line, characters separated by
    spaces, ``_`` between words. Returns plain text, one sentence per line.

    Examples:
        >>> parse_ptb_char("a _ c a t\\nt h e _ e n d\\n")
        'a cat\\nthe end\\n'
    """
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        tokens = line.split()
        if not tokens:
            continue
        long = next((t for t in tokens if len(t) != 1), None)
        if long is not None:
            raise InputError(
                f"line {number} is not in the PTB-char format (space-separated single "
                f"characters): token {long[:20]!r}"
            )
        lines.append("".join(" " if t == "_" else t for t in tokens))
    if not lines:
        raise InputError("the PTB-char text holds no characters")
    return "\n".join(lines) + "\n"


def looks_like_ptb_char(text: str, sample_lines: int = 1000) -> bool:
    """Whether ``text`` is in the PTB-char format: every one of its first non-empty lines consists
    of space-separated single characters, and ``_`` marks word boundaries."""
    seen = 0
    underscore = False
    for line in text.splitlines():
        tokens = line.split()
        if not tokens:
            continue
        if any(len(t) != 1 for t in tokens) or len(tokens) < 2:
            return False
        underscore = underscore or "_" in tokens
        seen += 1
        if seen >= sample_lines:
            break
    return seen > 0 and underscore


def default_corpus_text() -> str:
    """The embedded default corpus: the help topics that ship with Python (``pydoc_data``).

    About half a million characters of English technical prose; available wherever Python is,
    so training runs without a download. Its exact content depends on the Python version.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # stripped-down Python builds may omit it
        raise InputError(
            "the embedded corpus (pydoc_data.topics) is missing from this Python; pass --data"
        ) from err
    return "".join(topics[key] for key in sorted(topics))


def _decoded(path: str, fmt: str) -> tuple[str, str]:
    if fmt not in FORMATS:
        raise InputError(f"format must be one of {FORMATS}, got {fmt!r}")
    text = default_corpus_text() if path == DEFAULT_CORPUS else read_text(path)
    if fmt == "auto":
        fmt = "ptb-char" if looks_like_ptb_char(text) else "text"
    if fmt == "ptb-char":
        try:
            text = parse_ptb_char(text)
        except InputError as err:  # which file: with a validation file there are two
            raise InputError(f"{path}: {err}") from None
    return text, fmt


def load_corpus(
    path: str | Path | None = None,
    fmt: str = "auto",
    val_path: str | Path | None = None,
    val_fraction: float = 0.1,
    vocab: CharVocab | None = None,
) -> CharCorpus:
    """Load a character corpus and split it for training and validation.

    Without ``val_path`` the first 1 - ``val_fraction`` of the text trains and the rest
    validates, as nanoGPT splits Tiny Shakespeare. The vocabulary is built from the training
    split only; validation characters outside it map to an extra unknown id. With ``vocab``
    given (evaluating a checkpoint), that vocabulary encodes both splits.

    Arguments:
        path: a UTF-8 text or PTB-char file; ``None`` for the embedded corpus.
        fmt: ``"auto"`` (detect PTB-char), ``"text"`` or ``"ptb-char"``.
        val_path: a separate validation file in the same format (e.g. ``ptb.char.valid.txt``).
        val_fraction: share of the text held out when there is no validation file.
        vocab: a fixed vocabulary to encode with.

    Raises:
        ValueError: for unreadable text (see :func:`read_text`), a bad format or fraction, or
            a split without any character.
    """
    source = DEFAULT_CORPUS if path is None else str(path)
    text, fmt = _decoded(source, fmt)
    if val_path is None:
        if not 0.0 < val_fraction < 1.0:
            raise InputError(f"val_fraction must lie in (0, 1), got {val_fraction}")
        split = int(len(text) * (1.0 - val_fraction))
        train_text, val_text = text[:split], text[split:]
    else:
        train_text = text
        val_text, _ = _decoded(str(val_path), fmt)
    if not train_text or not val_text:
        raise InputError(
            f"{source} has {len(text)} character(s): too short to split for training and "
            "validation"
        )
    if vocab is None:
        vocab = CharVocab.from_text(train_text)
        if vocab.missing(val_text):
            vocab = CharVocab(vocab.chars, unknown=True)
    elif not vocab.unknown and (missing := vocab.missing(train_text + val_text)):
        # a model's vocabulary is its training text's characters, with an unknown id only
        # where its validation text had others: without one it cannot score new characters
        raise InputError(
            f"{source if val_path is None else f'{source} and {val_path}'}: "
            f"{len(missing)} character(s) the model never saw ({''.join(missing[:20])!r}); "
            "its vocabulary is the characters of its training text and has no unknown id, so "
            "it cannot score them: evaluate text made of its characters")
    train, val = vocab.encode(train_text), vocab.encode(val_text)
    unknown = 0 if vocab.unknown_id is None else int((val == vocab.unknown_id).sum())
    digest = hashlib.sha256(train_text.encode() + b"\x00" + val_text.encode()).hexdigest()
    return CharCorpus(
        train=train,
        val=val,
        vocab=vocab,
        source=source,
        format=fmt,
        val_source=None if val_path is None else str(val_path),
        sha256=digest,
        unknown_count=unknown,
    )


def check_block_size(corpus: CharCorpus, block_size: int) -> None:
    """Raise ``ValueError`` unless both splits hold at least one window of ``block_size`` + 1
    characters (inputs and shifted targets)."""
    if block_size < 1:
        raise InputError(f"block size must be >= 1, got {block_size}")
    # a separate validation file is named as such; otherwise both are splits of the corpus
    val_where = corpus.val_source or f"the validation split of {corpus.source}"
    for data, where in ((corpus.train, f"the training split of {corpus.source}"),
                        (corpus.val, val_where)):
        if len(data) <= block_size:
            raise InputError(
                f"block size {block_size} is longer than the corpus: {where} has {len(data)} "
                f"characters, at least {block_size + 1} needed"
            )


def get_batch(
    data: Tensor,
    block_size: int,
    batch_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """A random batch of windows: inputs x = data[i : i + T], targets y = data[i + 1 : i + T + 1].

    Offsets are uniform over every complete window, drawn from ``generator`` (on the CPU, so a
    seeded run draws the same batches on every device).

    Examples:
        >>> data = torch.arange(100)
        >>> x, y = get_batch(data, 8, 4, torch.Generator().manual_seed(0))
        >>> bool((y == x + 1).all()), tuple(x.shape)
        (True, (4, 8))
    """
    if len(data) <= block_size:
        raise InputError(f"{len(data)} characters hold no window of {block_size + 1}")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = data[starts[:, None] + offsets]
    x, y = windows[:, :-1], windows[:, 1:]
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y


def eval_windows(
    data: Tensor,
    block_size: int,
    batch_size: int,
    shard: int = 0,
    shards: int = 1,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Every non-overlapping window of a split, in batches: the whole split is scored once.

    Window w covers data[w T : (w + 1) T] with targets shifted by one; the last len mod T
    characters (fewer than one window) are left out. Each position of a window is as likely
    as in randomly placed windows, so the mean loss estimates the same quantity as random
    batches do, without sampling noise. ``shard``/``shards`` split the windows between
    processes.
    """
    n_windows = (len(data) - 1) // block_size
    ids = torch.arange(shard, n_windows, shards)
    offsets = torch.arange(block_size + 1)
    for chunk in ids.split(batch_size):
        windows = data[chunk[:, None] * block_size + offsets]
        yield windows[:, :-1], windows[:, 1:]
