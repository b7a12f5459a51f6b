"""The summarization pipeline: registration, generation pass-through, no silent truncation, batching, fallbacks, and
``pipeline("summarization", model=path, trust_remote_code=True)`` in a process where longreach cannot be imported.

VCC-T5 and Dodo go through the same ``prepare_summarization_inputs`` protocol; their model-specific pipeline tests
(VIP marking, the Dodo prompt and nuggets) are added with those models.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from remote_code_helpers import run_without_longreach
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration, pipeline
from transformers.pipelines import PIPELINE_REGISTRY
from workflow_helpers import document, save_tiny_locost, tiny_locost, tiny_t5_with_summarization_params, word_tokenizer

import longreach
from longreach import LongSummarizationPipeline


@pytest.fixture(scope="module")
def model():
    return tiny_locost()


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


@pytest.fixture
def summarizer(model, tokenizer):
    return pipeline("long-summarization", model=model, tokenizer=tokenizer)


def _generate_text(model, tokenizer, documents, **generate_kwargs):
    inputs, _ = model.prepare_summarization_inputs(tokenizer, documents)
    with torch.no_grad():
        ids = model.generate(**inputs, **generate_kwargs)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def test_import_registers_long_summarization(summarizer):
    assert "long-summarization" in PIPELINE_REGISTRY.get_supported_tasks()
    assert isinstance(summarizer, LongSummarizationPipeline)
    assert longreach.LongSummarizationPipeline is LongSummarizationPipeline


def test_summary_is_generate_output_and_options_pass_through(summarizer, model, tokenizer):
    doc = document(300)
    out = summarizer(doc, max_new_tokens=6, num_beams=3, length_penalty=0.5, return_tensors=True)
    assert isinstance(out, list) and len(out) == 1 and set(out[0]) == {"summary_text", "summary_token_ids"}
    assert out[0]["summary_text"] == _generate_text(model, tokenizer, [doc], max_new_tokens=6, num_beams=3,
                                                    length_penalty=0.5)[0]
    assert len(out[0]["summary_token_ids"]) <= 1 + 6  # decoder start + at most 6 new tokens
    greedy = summarizer(doc, generate_kwargs={"max_new_tokens": 6})
    assert greedy[0]["summary_text"] == _generate_text(model, tokenizer, [doc], max_new_tokens=6)[0]


def test_constructor_options_are_defaults_that_calls_extend(model, tokenizer):
    summarizer = pipeline("long-summarization", model=model, tokenizer=tokenizer, max_new_tokens=3)
    doc = document(200, offset=3)
    calls = []
    original = model.generate

    def spy(*args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")})
        return original(*args, **kwargs)

    model.generate = spy
    try:
        summarizer(doc)
        summarizer(doc, num_beams=2)
        summarizer(doc, max_new_tokens=5)
    finally:
        del model.generate
    assert calls == [{"max_new_tokens": 3}, {"max_new_tokens": 3, "num_beams": 2}, {"max_new_tokens": 5}]


def test_long_input_is_never_truncated_silently(summarizer, model, tokenizer):
    doc = document(3000)
    seen = []
    original = model.generate
    model.generate = lambda **kwargs: seen.append(kwargs["input_ids"].shape[1]) or original(**kwargs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning at all when nothing is dropped
            summarizer(doc, max_new_tokens=2)
        with pytest.warns(UserWarning, match=r"last 2951 tokens were dropped \(max_input_length=50\)"):
            truncated = summarizer(doc, max_new_tokens=4, max_input_length=50)
    finally:
        del model.generate
    assert seen == [3001, 50]  # all 3000 words + </s>; then 49 words + </s>
    kept = " ".join(doc.split()[:49])
    assert truncated[0]["summary_text"] == _generate_text(model, tokenizer, [kept], max_new_tokens=4)[0]


def test_lists_batches_and_multiple_sequences(model, tokenizer):
    summarizer = pipeline("long-summarization", model=model, tokenizer=tokenizer, max_new_tokens=5)
    docs = [document(120, offset=1), document(40, offset=2), document(75, offset=3)]
    one_by_one = summarizer(docs)
    assert [r["summary_text"] for r in one_by_one] == [summarizer(d)[0]["summary_text"] for d in docs]
    batched = summarizer(docs, batch_size=2)
    expected = _generate_text(model, tokenizer, docs[:2], max_new_tokens=5) + _generate_text(
        model, tokenizer, docs[2:], max_new_tokens=5)
    assert [r["summary_text"] for r in batched] == expected
    several = summarizer(docs[0], num_beams=3, num_return_sequences=2)
    assert len(several) == 2 and all("summary_text" in r for r in several)
    several_each = summarizer(docs[:2], num_beams=3, num_return_sequences=2)
    assert [len(records) for records in several_each] == [2, 2]


def test_datasets_and_generators_stream_through(summarizer):
    from datasets import Dataset
    from transformers.pipelines.pt_utils import KeyDataset

    dataset = Dataset.from_dict({"document": [document(50), document(60, 1), document(70, 2)]})
    expected = [summarizer(d, max_new_tokens=3)[0]["summary_text"] for d in dataset["document"]]
    streamed = summarizer(KeyDataset(dataset, "document"), max_new_tokens=3)
    assert [records[0]["summary_text"] for records in streamed] == expected
    assert [r["summary_text"] for r in summarizer(dataset["document"], max_new_tokens=3)] == expected  # a Column
    generated = summarizer((d for d in dataset["document"]), max_new_tokens=3, batch_size=2)
    assert len(list(generated)) == 3


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: s("   "), "empty document"),
        (lambda s: s(42), "must be a string or a non-empty list of strings"),
        (lambda s: s([]), "must be a string or a non-empty list of strings"),
        (lambda s: s(["w1", 3]), "items of types \\['int', 'str'\\]"),
        (lambda s: s({"document": "w1"}), "got dict"),
        (lambda s: s("w1 w2", max_input_length=0), "`max_input_length` must be a positive integer"),
        (lambda s: s("w1 w2", truncation=True), "never truncates on its own"),
        (lambda s: s("w1 w2", max_new_tokens=2, generate_kwargs={"max_new_tokens": 3}), "give each once"),
    ],
)
def test_bad_calls_raise_value_errors(summarizer, call, message):
    with pytest.raises(ValueError, match=message):
        call(summarizer)


@pytest.mark.parametrize("question", ["What is it?", ["What is it?"]])
def test_locost_refuses_a_question(summarizer, question):
    """LOCOST was trained to summarize only: a question is refused before anything runs, naming the argument."""
    refused = "`question`: LocostForConditionalGeneration has no question format"
    with pytest.raises(ValueError, match=re.escape(refused)):
        summarizer([document(30)], question=question)
    with pytest.raises(ValueError, match=re.escape("`question`")):
        pipeline("long-summarization", model=summarizer.model, tokenizer=summarizer.tokenizer, question="Why?")


def test_models_without_the_protocol_get_plain_tokenization_and_prefix(tokenizer):
    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                             decoder_start_token_id=0)).eval()
    t5.config.prefix = "w90 w91 "
    assert not hasattr(t5, "prepare_summarization_inputs")
    summarizer = LongSummarizationPipeline(model=t5, tokenizer=tokenizer, max_new_tokens=4)
    doc = document(30)
    expected_ids = tokenizer("w90 w91 " + doc, return_tensors="pt")
    with torch.no_grad():
        expected = tokenizer.decode(t5.generate(**expected_ids, max_new_tokens=4)[0], skip_special_tokens=True)
    assert summarizer(doc)[0]["summary_text"] == expected
    with pytest.warns(UserWarning, match="last 23 tokens were dropped"):
        summarizer(doc, max_input_length=10)  # 2 + 30 words + </s> = 33 tokens


def test_the_truncation_warning_is_shown_every_time_and_remembered_nowhere(summarizer):
    """A server summarizing long documents: ``warnings.warn`` kept each text it showed (one per document length) in
    its caller's ``__warningregistry__``, a dict that grew by one entry per truncated document, and an identical
    document truncated again was not reported."""
    import sys

    def remembered():
        return sum(isinstance(key, tuple) and "tokens were dropped" in str(key[0])
                   for module in list(sys.modules.values())
                   for key in getattr(module, "__dict__", {}).get("__warningregistry__", {}))

    documents = [document(20 + k, offset=k) for k in range(12)] + [document(20)]  # the last one again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own setting outside pytest
        for doc in documents:
            summarizer(doc, max_input_length=10, max_new_tokens=2)
        assert remembered() == 0  # was 12
    dropped = [str(warning.message) for warning in caught if "tokens were dropped" in str(warning.message)]
    assert len(dropped) == len(documents)  # the repeated document too (was 12)
    assert dropped[-1] == dropped[0] == (f"The document ({len(documents[0])} characters) is longer than the model may "
                                         "read: its last 11 tokens were dropped (max_input_length=10).")
    assert all(warning.category is UserWarning for warning in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # filters still apply
        with pytest.raises(UserWarning, match="tokens were dropped"):
            summarizer(documents[0], max_input_length=10, max_new_tokens=2)


def test_decoder_only_models_return_only_new_tokens(tokenizer):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                         bos_token_id=1)).eval()
    summarizer = LongSummarizationPipeline(model=llama, tokenizer=tokenizer, max_new_tokens=5)
    docs = [document(20, offset=5), document(9, offset=6)]
    records = summarizer(docs, batch_size=2, return_tensors=True)
    # Left padding, and the prompt removed: the records hold exactly what generate() appended.
    encoded = tokenizer(docs)["input_ids"]
    input_ids = torch.zeros(2, 21, dtype=torch.long)
    attention_mask = torch.zeros(2, 21, dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, 21 - len(ids):] = torch.tensor(ids)
        attention_mask[row, 21 - len(ids):] = 1
    with torch.no_grad():
        full = llama.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5)
    for record, row in zip(records, full):
        assert record["summary_token_ids"].tolist() == row[21:].tolist()
        assert record["summary_text"] == tokenizer.decode(row[21:], skip_special_tokens=True)


def test_saved_pipeline_carries_custom_pipeline(summarizer, tmp_path):
    summarizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["custom_pipelines"] == {
        "summarization": {"impl": "pipeline_summarization.LongSummarizationPipeline", "pt": ["AutoModelForSeq2SeqLM"],
                          "type": "text"}
    }
    assert (tmp_path / "pipeline_summarization.py").is_file() and (tmp_path / "tokenizer.json").is_file()


def test_pipeline_summarization_works_where_longreach_cannot_be_imported(tmp_path, isolated_hf_env):
    folder = save_tiny_locost(tmp_path / "tiny-locost")
    source = (folder / "pipeline_summarization.py").read_text()
    assert re.search(r"^\s*(from|import)\s+(longreach|\.)", source, re.M) is None  # stdlib, torch, transformers only
    doc = document(500, offset=4)
    local = pipeline("summarization", model=str(folder), trust_remote_code=True)
    expected = local(doc, max_new_tokens=6, num_beams=2, return_tensors=True)[0]
    result = run_without_longreach(
        f"""
        import json, warnings
        from transformers import pipeline
        summarizer = pipeline("summarization", model={str(folder)!r}, trust_remote_code=True)
        inferred = pipeline(model={str(folder)!r}, trust_remote_code=True)
        doc = {doc!r}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cut = summarizer(doc, max_new_tokens=3, max_input_length=100)
        print(json.dumps({{
            "summary": summarizer(doc, max_new_tokens=6, num_beams=2)[0]["summary_text"],
            "ids": summarizer(doc, max_new_tokens=6, num_beams=2, return_tensors=True)[0]["summary_token_ids"].tolist(),
            "inferred_task": inferred.task,
            "pipeline_class": type(summarizer).__module__ + "." + type(summarizer).__name__,
            "model_class": type(summarizer.model).__module__,
            "warnings": [str(w.message) for w in caught if "dropped" in str(w.message)],
        }}))
        """,
        tmp_path,
    )
    assert result["summary"] == expected["summary_text"]
    assert result["ids"] == expected["summary_token_ids"].tolist() and len(result["ids"]) > 1
    assert result["inferred_task"] == "summarization"
    assert result["pipeline_class"].startswith("transformers_modules.") and result["pipeline_class"].endswith(
        "pipeline_summarization.LongSummarizationPipeline")
    assert result["model_class"].startswith("transformers_modules.")
    assert result["warnings"] == [f"The document ({len(doc)} characters) is longer than the model may read: its last "
                                  "401 tokens were dropped (max_input_length=100)."]


def test_plain_calls_log_no_warnings(model, tokenizer):
    """A user who only asks for a summary (with or without generation options) sees no transformers warning: no
    "Both `max_new_tokens` and `max_length` seem to have been set", no deprecated cache name."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    model.generation_config.max_new_tokens = 8  # as in converted folders
    summarizer = pipeline("long-summarization", model=model, tokenizer=tokenizer)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            summarizer(document(80))
            summarizer(document(80), max_new_tokens=4, num_beams=2)
            summarizer([document(30), document(60)], max_new_tokens=3, batch_size=2)
    finally:
        transformers_logger.removeHandler(handler)
    assert [record.getMessage() for record in records if record.levelno >= logging.WARNING] == []


def test_token_ids_are_the_same_batched_or_one_by_one():
    """`return_tensors=True`: a batch pads its finished rows to the longest; the ids end at the end of sequence."""
    from workflow_helpers import document, tiny_locost, word_tokenizer

    model = tiny_locost()
    summarizer = pipeline("long-summarization", model=model, tokenizer=word_tokenizer())
    eos = model.generation_config.eos_token_id
    documents = [document(length, offset) for length, offset in ((300, 1), (12, 2), (90, 3), (5, 4), (150, 7))]
    options = dict(max_new_tokens=8, return_tensors=True, suppress_tokens=[0], sequence_bias={(eos,): 3.2})
    # (a tiny random model: the padding token suppressed and the end of sequence favoured, so rows end at other steps)
    one_by_one = [summarizer(doc, **options)[0]["summary_token_ids"].tolist() for doc in documents]
    batched = [record["summary_token_ids"].tolist() for record in summarizer(documents, batch_size=5, **options)]
    assert batched == one_by_one and len({len(ids) for ids in one_by_one}) > 1
    with pytest.raises(ValueError, match="the output would be empty"):
        summarizer(documents[0], return_text=False)


def test_num_return_sequences_from_a_generation_config_gives_one_record_each(model, tokenizer):
    """Several sequences asked for by a `generation_config` passed in the call are several records (they were glued
    into one), as when asked for by keyword."""
    import copy

    summarizer = pipeline("long-summarization", model=model, tokenizer=tokenizer)
    config = copy.deepcopy(model.generation_config)
    config.update(num_beams=3, num_return_sequences=2, max_new_tokens=4)
    documents = [document(40, offset=2), document(25, offset=3)]
    records = summarizer(documents, generation_config=config, return_tensors=True)
    inputs, _ = model.prepare_summarization_inputs(tokenizer, documents[:1])
    with torch.no_grad():
        expected = model.generate(**inputs, generation_config=config)
    assert [len(per_document) for per_document in records] == [2, 2]
    assert [record["summary_token_ids"].tolist() for record in records[0]] == expected.tolist()
    by_keyword = summarizer(documents, num_beams=3, num_return_sequences=2, max_new_tokens=4, return_tensors=True)
    assert [[r["summary_token_ids"].tolist() for r in doc] for doc in records] == [
        [r["summary_token_ids"].tolist() for r in doc] for doc in by_keyword]


def _tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                        bos_token_id=1)).eval()


def test_decoder_only_summary_lengths_count_the_summary_alone(tokenizer):
    """The pipeline's own prompt (the document, for a plain decoder-only model; Dodo's instruction) is not counted in
    `max_length` / `min_length`, which bound the summary as they do for encoder-decoders."""
    summarizer = LongSummarizationPipeline(model=_tiny_llama(), tokenizer=tokenizer)
    doc = document(20, offset=5)  # 21 prompt tokens: `max_length=7` used to be shorter than the prompt
    for length in (3, 7):
        records = summarizer(doc, max_length=length, min_length=length, return_tensors=True)
        assert len(records[0]["summary_token_ids"]) == length


@pytest.mark.parametrize("decoder_only", [False, True])
def test_summary_token_ids_end_at_the_callers_eos_even_first(model, tokenizer, decoder_only):
    """`summary_token_ids` end at the end-of-sequence id the call asked for, also when it is a decoder-only model's
    first new token (an encoder-decoder's first token is the decoder start, which may share the EOS id)."""
    summarizer = LongSummarizationPipeline(model=_tiny_llama() if decoder_only else model, tokenizer=tokenizer)
    stop, other, first = 5, 6, (0 if decoder_only else 1)

    def allowed(row, ids):  # row 0 ends at once with `stop`; row 1 goes on with `other`
        return [stop] if row == 0 else [other]

    records = summarizer([document(30, offset=2), document(30, offset=4)], batch_size=2, max_new_tokens=5,
                         eos_token_id=stop, prefix_allowed_tokens_fn=allowed, return_tensors=True)
    assert records[0]["summary_token_ids"].tolist()[first:] == [stop]
    assert records[1]["summary_token_ids"].tolist()[first:] == [other] * 5


def test_encoder_decoder_max_length_wins_over_the_checkpoints_max_new_tokens(tokenizer):
    """generate() prefers `max_new_tokens` to `max_length`, and converted checkpoints set one (LOCOST's converter 512):
    the caller's `max_length` (counting the decoder start token, as in transformers) must bound the summary all the
    same, at the call and as a constructor default; so must `min_length` against the checkpoint's `min_new_tokens`."""
    model = tiny_locost(seed=13)
    model.generation_config.max_new_tokens = 8
    doc = document(50)
    never_end = {"suppress_tokens": [model.config.eos_token_id, model.config.pad_token_id]}
    summarizer = pipeline("long-summarization", model=model, tokenizer=tokenizer)
    record = summarizer(doc, max_length=4, return_tensors=True, **never_end)[0]
    assert len(record["summary_token_ids"]) == 4  # the decoder start token and 3 new tokens
    default = pipeline("long-summarization", model=model, tokenizer=tokenizer, max_length=4, **never_end)
    assert len(default(doc, return_tensors=True)[0]["summary_token_ids"]) == 4
    assert len(summarizer(doc, return_tensors=True, **never_end)[0]["summary_token_ids"]) == 1 + 8  # the checkpoint's
    model.generation_config.min_new_tokens = 8
    ends_at_once = {"forced_eos_token_id": None, "max_new_tokens": 12}
    calls = []
    original = model.generate

    def spy(*args, **kwargs):
        calls.append(kwargs.get("min_new_tokens", "absent"))
        return original(*args, **kwargs)

    model.generate = spy
    try:
        summarizer(doc, min_length=2, **ends_at_once)
    finally:
        del model.generate
    assert calls == [None]  # the checkpoint's min_new_tokens=8 does not override the caller's min_length


def test_return_text_false_counts_the_constructors_return_tensors(model, tokenizer):
    """`return_text` / `return_tensors` given at the call are checked together with the constructor's: the tensors the
    constructor asked for are an output, and turning them off at the call with no text left is refused."""
    summarizer = pipeline("long-summarization", model=model, tokenizer=tokenizer, return_tensors=True)
    record = summarizer(document(50), return_text=False, max_new_tokens=3)[0]
    assert set(record) == {"summary_token_ids"}
    ids_only = pipeline("long-summarization", model=model, tokenizer=tokenizer, return_text=False, return_tensors=True)
    with pytest.raises(ValueError, match=re.escape("the output would be empty")):
        ids_only(document(50), max_new_tokens=3, return_tensors=False)


def test_dodo_batches_with_a_tokenizer_without_a_pad_token():
    """Llama-2's tokenizer has no pad token; Dodo pads its own inputs, but transformers' collation refused
    `batch_size > 1` ("Pipeline with tokenizer without pad_token cannot do batching")."""
    from test_workflows_vcc_t5_dodo import llama_word_tokenizer, tiny_dodo

    tokenizer = llama_word_tokenizer()
    summarizer = pipeline("long-summarization", model=tiny_dodo(), tokenizer=tokenizer, max_new_tokens=4,
                          return_tensors=True)
    documents = [document(40, offset=1), document(70, offset=3), document(25, offset=5)]
    one_by_one = summarizer(documents)
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    batched = summarizer(documents, batch_size=3)
    assert [r["summary_token_ids"].tolist() for r in batched] == [r["summary_token_ids"].tolist() for r in one_by_one]
    question = summarizer(documents, batch_size=2, question=["w1 w2", "w3", "w4 w5 w6"])
    assert len(question) == 3


def test_a_plain_t5_summarizes_with_its_task_specific_parameters(tokenizer):
    """transformers v4's summarization pipeline applied `task_specific_params["summarization"]` (T5 checkpoints:
    the "summarize: " prefix, beams, lengths); v5 keeps them in the config only."""
    t5, calls = tiny_t5_with_summarization_params(vocab_size=99)
    summarizer = LongSummarizationPipeline(model=t5, tokenizer=tokenizer)
    doc = document(6)
    summarizer(doc)
    assert calls[-1]["input_ids"][0].tolist() == tokenizer("w90 w91 " + doc)["input_ids"]
    options = {key: value for key, value in calls[-1].items() if key not in ("input_ids", "attention_mask")}
    assert options == {"num_beams": 3, "min_length": 5, "max_length": 8, "no_repeat_ngram_size": 3,
                       "max_new_tokens": None, "min_new_tokens": None}
    with torch.no_grad():
        expected = T5ForConditionalGeneration.generate(  # not the recording one
            t5, **tokenizer("w90 w91 " + doc, return_tensors="pt"), num_beams=3, min_length=5, max_length=8,
            no_repeat_ngram_size=3)
    assert summarizer(doc, return_tensors=True)[0]["summary_token_ids"].tolist() == expected[0].tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no clash of the caller's length with the checkpoint's min_length
        summarizer(doc, num_beams=1, max_new_tokens=2)  # the caller's options win, and a caller's length replaces all
    options = {key: value for key, value in calls[-1].items() if key not in ("input_ids", "attention_mask")}
    assert options == {"num_beams": 1, "no_repeat_ngram_size": 3, "max_new_tokens": 2}


def test_stop_sequence_ends_the_summary_and_generate_output_dicts_are_read():
    """v4 took `stop_sequence`; here it is transformers' text-generation meaning (`stop_strings`, with the pipeline's
    tokenizer). `return_dict_in_generate=True` crashed on `.shape`."""
    from tokenizer_helpers import byte_level_bpe_tokenizer

    tokenizer = byte_level_bpe_tokenizer(["the cat sat on the mat. a dog ran to the park and back again."] * 20)
    summarizer = pipeline("long-summarization", model=tiny_locost(vocab_size=len(tokenizer)), tokenizer=tokenizer)
    words = [i for token, i in tokenizer.get_vocab().items() if token.lstrip("Ġ").isalpha() and len(token) > 3]

    def sample(**options):
        torch.manual_seed(0)  # sampled whole words: a varied summary, the same until it stops
        return summarizer("the cat sat on the mat", max_new_tokens=12, min_new_tokens=12, do_sample=True,
                          suppress_tokens=[i for i in range(len(tokenizer)) if i not in words], return_tensors=True,
                          **options)[0]

    full = sample()
    ids = full["summary_token_ids"].tolist()
    stop_at = next(k for k in range(2, len(ids)) if ids[k] not in ids[1:k])  # a word not generated before
    stop = tokenizer.decode(ids[stop_at:stop_at + 1])
    for options in ({"stop_sequence": stop}, {"stop_sequence": [stop, "zzz"]}, {"stop_strings": stop}):
        assert sample(**options)["summary_token_ids"].tolist() == ids[:stop_at + 1]
    assert sample(return_dict_in_generate=True, output_scores=True)["summary_text"] == full["summary_text"]
    with pytest.raises(ValueError, match="`stop_sequence` must be a non-empty string"):
        summarizer("the cat", stop_sequence="")


def test_the_text_ends_at_the_callers_end_token_batched_or_not():
    """From an audit: `summary_token_ids` ended at the first end token but `summary_text` decoded the whole row, so
    with a caller's end token that is not special (a newline, a period) a batched document's text ran on through the
    rows' filling ("w64 w64 w64 ..." where alone it was "w64")."""
    from test_workflows_vcc_t5_dodo import llama_word_tokenizer, tiny_dodo

    model, tokenizer = tiny_dodo(), llama_word_tokenizer()
    model.config.pad_token_id = model.generation_config.pad_token_id = None  # as a Llama-2 checkpoint: no pad id
    summarizer = pipeline("long-summarization", model=model, tokenizer=tokenizer, max_new_tokens=8,
                          return_tensors=True)
    documents = [document(150), document(60, offset=4), document(90, offset=8)]
    questions = ["w3 w4 w5 w6", "w7", "w9 w2"]
    stop = tokenizer.convert_tokens_to_ids("w64")
    alone = [summarizer(d, question=q, eos_token_id=stop)[0] for d, q in zip(documents, questions)]
    batched = summarizer(documents, question=questions, eos_token_id=stop, batch_size=3)
    assert any(record["summary_token_ids"].tolist()[-1] == stop for record in alone)  # (a row that stops early)
    for one, row in zip(alone, batched):
        assert one["summary_text"] == row["summary_text"] == tokenizer.decode(one["summary_token_ids"])
