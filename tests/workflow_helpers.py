"""Tiny models, tokenizers and documents for the workflow tests (pipeline, Hub, CLI, demo, examples)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizer_helpers import word_level_tokenizer
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 99
WORDS = [f"w{i}" for i in range(VOCAB_SIZE - 3)]


def word_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer ``<pad>`` 0, ``</s>`` 1 (appended to every sequence), ``<unk>`` 2, ``w0``..."""
    return word_level_tokenizer(WORDS[: vocab_size - 3])


def document(num_words: int, offset: int = 0) -> str:
    """A deterministic "document" of ``num_words`` known words (one token each, plus ``</s>``)."""
    return " ".join(WORDS[(offset + 7 * i) % len(WORDS)] for i in range(num_words))


def tiny_locost(vocab_size: int = VOCAB_SIZE, seed: int = 0):
    from longreach import LocostConfig, LocostForConditionalGeneration

    torch.manual_seed(seed)
    config = LocostConfig(vocab_size=vocab_size, d_model=32, d_state=8, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    model = LocostForConditionalGeneration(config).eval()
    model.generation_config.max_new_tokens = 8
    return model


#: The seed of `save_tiny_locost`'s weights. With seed 0 the tiny model ends every summary at once (EOS first), so tests
#: comparing summaries (corpus command against the pipeline, a resumed run against an uninterrupted one, 1 process
#: against 2) would compare empty strings; with 13 its 4-token summaries of the tests' documents are non-empty and
#: differ from document to document (5 different ones over 16 documents).
SUMMARIZING_SEED = 13


def save_tiny_locost(folder: str | Path, seed: int = SUMMARIZING_SEED) -> Path:
    """A Hub-ready tiny LOCOST folder with its tokenizer."""
    folder = Path(folder)
    tiny_locost(seed=seed).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


#: transformers v4's `task_specific_params["summarization"]` of a T5 checkpoint (prefix, beams, lengths), made up.
T5_SUMMARIZATION_PARAMS = {"prefix": "w90 w91 ", "num_beams": 3, "min_length": 5, "max_length": 8,
                           "no_repeat_ngram_size": 3}


def tiny_t5_with_summarization_params(vocab_size: int = VOCAB_SIZE) -> tuple[torch.nn.Module, list[dict]]:
    """A plain transformers T5 with `T5_SUMMARIZATION_PARAMS`, and the list its `generate()` records its keyword
    arguments in, call by call."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=vocab_size, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0,
        task_specific_params={"summarization": dict(T5_SUMMARIZATION_PARAMS)})).eval()
    calls = []
    generate = t5.generate
    t5.generate = lambda **kwargs: calls.append(kwargs) or generate(**kwargs)
    return t5, calls
