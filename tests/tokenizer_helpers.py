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


def byte_level_bpe_tokenizer(texts: list[str], vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (GPT-2's scheme, as the demo trains one), with pad=0, eos=1,
    unk=2 and ``</s>`` appended: one whose tokens transformers can match stop strings against."""
    from tokenizers import decoders, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
