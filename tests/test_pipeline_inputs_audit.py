"""Audit of the summarization pipeline with real-world inputs and options, as a transformers user drives a pipeline:
lists with empty items, length options given as ``None`` or out of range, inputs of the wrong type."""

from __future__ import annotations

import re

import pytest
from transformers import pipeline
from workflow_helpers import document, tiny_locost, word_tokenizer


@pytest.fixture(scope="module")
def summarizer():
    return pipeline("long-summarization", model=tiny_locost(), tokenizer=word_tokenizer(), max_new_tokens=2)


def test_an_empty_item_in_a_list_is_refused_before_anything_is_summarized(summarizer):
    """It was refused only when its batch came (150 documents summarized, then lost), without saying which one."""
    calls = []
    generate = summarizer.model.generate
    summarizer.model.generate = lambda **kwargs: calls.append(1) or generate(**kwargs)
    documents = [document(5, offset=row) for row in range(150)] + [" \n"] + [document(5)] * 3
    try:
        for batch_size in (1, 4):
            with pytest.raises(ValueError, match=re.escape("`documents[150]` is ' \\n': cannot summarize an empty")):
                summarizer(documents, batch_size=batch_size)
    finally:
        del summarizer.model.generate
    assert calls == []
    with pytest.raises(ValueError, match=re.escape("Cannot summarize an empty document (only whitespace), got ''.")):
        summarizer("")


def _tiny_dodo_summarizer(**defaults):
    from test_workflows_vcc_t5_dodo import llama_word_tokenizer, tiny_dodo

    return pipeline("long-summarization", model=tiny_dodo(), tokenizer=llama_word_tokenizer(), **defaults)


@pytest.mark.parametrize("decoder_only", [False, True])
def test_lengths_given_as_none_leave_the_checkpoints_lengths(decoder_only):
    """`max_length=None` (an unset command-line option passed on) crashed LOCOST and VCC-T5 in generate() ("unsupported
    operand type(s) for +: 'NoneType' and 'int'": the checkpoint's `max_new_tokens` was set aside for it), and gave
    Dodo 20 new tokens instead of its checkpoint's 8; T5's and Llama's generate() ignore it."""
    if decoder_only:
        summarizer = _tiny_dodo_summarizer()
        eos = summarizer.model.config.eos_token_id
    else:
        summarizer = pipeline("long-summarization", model=tiny_locost(), tokenizer=word_tokenizer())
        eos = summarizer.model.config.eos_token_id
    never_end = {"suppress_tokens": [eos, 0], "return_tensors": True}
    assert summarizer.model.generation_config.max_new_tokens == 8
    doc = document(30, offset=3)
    expected = summarizer(doc, **never_end)[0]["summary_token_ids"].tolist()
    assert len(expected) == 8 + (0 if decoder_only else 1)  # (an encoder-decoder's decoder start token)
    for options in ({"max_length": None}, {"min_length": None}, {"max_length": None, "min_length": None}):
        assert summarizer(doc, **options, **never_end)[0]["summary_token_ids"].tolist() == expected


@pytest.mark.parametrize("options, message", [
    ({"max_length": 0}, "`max_length` (the summary's tokens) must be an integer >= 1, got 0."),
    ({"max_length": 2.5}, "`max_length` (the summary's tokens) must be an integer >= 1, got 2.5."),
    ({"min_length": -1}, "`min_length` (the summary's tokens) must be an integer >= 0, got -1."),
    ({"min_length": "3"}, "`min_length` (the summary's tokens) must be an integer >= 0, got '3'."),
])
def test_decoder_only_summary_lengths_are_checked_under_their_own_names(options, message):
    """Dodo's `max_length` / `min_length` go to generate() as `max_new_tokens` / `min_new_tokens`: `max_length=0` got
    "`max_new_tokens` must be greater than 0, but is 0", an argument the caller never gave, and `max_length=2.5`
    generated 3 tokens."""
    summarizer = _tiny_dodo_summarizer()
    with pytest.raises(ValueError, match=re.escape(message)):
        summarizer(document(20), **options)


def test_bytes_are_refused_as_bytes(summarizer):
    """A document read in binary mode was taken for a list of its byte values: "got a list of 11 items of types
    ['int']"."""
    with pytest.raises(ValueError, match=re.escape("got bytes (decode it to text first: `documents.decode()`).")):
        summarizer(b"w1 w2 w3 w4")
    with pytest.raises(ValueError, match=re.escape("got bytearray (decode it")):
        summarizer(bytearray(b"w1 w2"))
