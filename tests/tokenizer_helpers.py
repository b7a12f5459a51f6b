"""Tokenizers built locally (no Hub): a T5-style word-level tokenizer with pad=0, eos=1, unk=2."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]


def word_level_tokenizer(words: list[str] | None = None, vocab_size: int = 99) -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer; ``</s>`` is appended to every sequence (as T5's tokenizer does)."""
    if words is None:
        words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
