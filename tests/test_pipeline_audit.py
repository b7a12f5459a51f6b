"""Audit of the summarization pipeline against transformers v4's ``SummarizationPipeline`` with a plain T5: the
checkpoint's ``task_specific_params["summarization"]`` under a caller's lengths, and ``save_pretrained`` of a pipeline
around a plain model."""

from __future__ import annotations

import json

import torch
from remote_code_helpers import run_without_longreach
from transformers import T5ForConditionalGeneration, pipeline
from workflow_helpers import document, tiny_t5_with_summarization_params, word_tokenizer

from longreach import LongSummarizationPipeline


def _options(calls):
    return {key: value for key, value in calls[-1].items() if key not in ("input_ids", "attention_mask")}


def test_a_callers_length_replaces_only_the_same_bound_of_the_task_specific_parameters():
    """v4 applied the checkpoint's `task_specific_params` (here min_length=5, max_length=8) key by key under the
    caller's options: a caller's min_length keeps the checkpoint's max_length (the summary did not grow to the
    generic 20 tokens), a caller's max_length keeps its min_length; only a contradicting bound is left out."""
    t5, calls = tiny_t5_with_summarization_params()
    summarizer = LongSummarizationPipeline(model=t5, tokenizer=word_tokenizer())
    doc = document(30)
    ids = summarizer(doc, min_length=3, return_tensors=True)[0]["summary_token_ids"]
    assert _options(calls) == {"num_beams": 3, "max_length": 8, "no_repeat_ngram_size": 3, "min_length": 3,
                               "max_new_tokens": None, "min_new_tokens": None}
    with torch.no_grad():
        expected = T5ForConditionalGeneration.generate(
            t5, **summarizer.tokenizer("w90 w91 " + doc, return_tensors="pt"), num_beams=3, min_length=3,
            max_length=8, no_repeat_ngram_size=3)
    assert ids.tolist() == expected[0].tolist()[: len(ids)] and len(ids) <= 8

    summarizer(doc, max_length=12)
    assert _options(calls) == {"num_beams": 3, "min_length": 5, "no_repeat_ngram_size": 3, "max_length": 12,
                               "max_new_tokens": None, "min_new_tokens": None}
    summarizer(doc, min_new_tokens=9)  # longer than the checkpoint's max_length=8 allows: that maximum goes
    assert _options(calls) == {"num_beams": 3, "no_repeat_ngram_size": 3, "min_new_tokens": 9}
    summarizer(doc, max_new_tokens=6)  # the checkpoint's min_length=5 (4 summary tokens) fits under it and stays
    assert _options(calls) == {"num_beams": 3, "min_length": 5, "no_repeat_ngram_size": 3, "max_new_tokens": 6,
                               "min_new_tokens": None}


def test_a_saved_plain_t5_pipeline_reloads_as_summarization(tmp_path, isolated_hf_env):
    """`save_pretrained` of the pipeline around a plain T5 names it `custom_pipelines["summarization"]`, as longreach
    models do: before, it was saved as "long-summarization", so `pipeline("summarization", model=folder,
    trust_remote_code=True)` raised transformers' KeyError (task removed) and `pipeline("long-summarization",
    model=folder)` asked for `trust_remote_code` although the pipeline is registered in this process."""
    t5, _ = tiny_t5_with_summarization_params()
    del t5.generate  # the recording wrapper is not saved
    summarizer = pipeline("long-summarization", model=t5, tokenizer=word_tokenizer())
    folder = tmp_path / "t5"
    summarizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["custom_pipelines"] == {"summarization": {
        "impl": "pipeline_summarization.LongSummarizationPipeline", "pt": ["AutoModelForSeq2SeqLM"], "type": "text"}}
    doc = document(12)
    expected = summarizer(doc, return_tensors=True)[0]["summary_token_ids"].tolist()
    reloaded = pipeline("long-summarization", model=str(folder))
    assert isinstance(reloaded, LongSummarizationPipeline)
    assert reloaded(doc, return_tensors=True)[0]["summary_token_ids"].tolist() == expected
    result = run_without_longreach(
        f"""
        import json
        from transformers import pipeline
        summarizer = pipeline("summarization", model={str(folder)!r}, trust_remote_code=True)
        print(json.dumps({{"ids": summarizer({doc!r}, return_tensors=True)[0]["summary_token_ids"].tolist(),
                           "pipeline_class": type(summarizer).__name__}}))
        """,
        tmp_path,
    )
    assert result == {"ids": expected, "pipeline_class": "LongSummarizationPipeline"}
