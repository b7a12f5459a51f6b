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
