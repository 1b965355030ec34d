"""Character-level language models with Lipschitz, contractive and invertible self-attention."""

from .data import CharCorpus, CharVocab, load_corpus
from .model import LSTMLM, LMConfig, TransformerLM, build_model

__all__ = [
    "CharCorpus",
    "CharVocab",
    "LMConfig",
    "LSTMLM",
    "TransformerLM",
    "build_model",
    "load_corpus",
]
