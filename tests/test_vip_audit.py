"""From an audit of VCC-T5's question answering and VIP-token workflows: SQuAD-style references (several acceptable
answers) and `prepare_vip_inputs`' queries."""

from __future__ import annotations

import json
import re

import pytest
from workflow_helpers import document

from longreach import corpus as corpus_module
from longreach.metrics import answer_scores, rouge_scores


def test_answer_scores_take_the_best_of_several_references_as_squad_does():
    """SQuAD lists several answers per question; its exact match and F1 are the best over them. A list of references
    raised `AttributeError: 'list' object has no attribute 'lower'`."""
    assert answer_scores(["the cat"], [["dog", "Cat."]]) == {"exact_match": 100.0, "f1": 100.0}
    # exact match and F1 are maxima of their own: F1 4/7 against the second answer, 0 against the first
    assert answer_scores(["in Paris France"], [["Rome", "Paris in northern Europe"]]) == {"exact_match": 0.0,
                                                                                          "f1": 57.14}
    assert answer_scores(["x", "y"], [["x"], "z"]) == answer_scores(["x", "y"], ["x", "z"])
    best = rouge_scores(["w1 w2 w3"], [["w7 w8", "w1 w2 w3"]])
    assert best == rouge_scores(["w1 w2 w3"], ["w1 w2 w3"]) and best["rouge1"] == 100.0
    with pytest.raises(ValueError, match="Each reference must be a string or a non-empty list of strings, got "
                                         r"\[\] for prediction 1"):
        answer_scores(["x", "y"], ["x", []])


def test_squad_answers_columns_are_references(tmp_path):
    """`--reference_column answers` of a SQuAD-format table (`{"text": [...], "answer_start": [...]}`, or a list of
    texts) was read as no reference: "no summarized document has a reference", and no scores."""
    rows = [{"id": "a", "context": document(30), "question": "w3", "answers": {"text": ["w5", "w5 w6"],
                                                                                 "answer_start": [0, 0]}},
            {"id": "b", "context": document(20, offset=2), "question": "w4", "answers": {"text": ["", " "],
                                                                                          "answer_start": [0, 0]}}]
    source = tmp_path / "squad.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    corpus = corpus_module.read_corpus(str(source), text_column="context", id_column="id", reference_column="answers",
                                       question_column="question")
    assert corpus.references == [["w5", "w5 w6"], None]  # empty answers are none, as an empty string is
    records = [{"id": "a", "summary": "w5 w6", "question": "w3"}, {"id": "b", "summary": "w1", "question": "w4"}]
    metrics = corpus_module.corpus_rouge(tmp_path / "out.jsonl", corpus, records)
    assert metrics == {"rouge1": 100.0, "rouge2": 100.0, "rougeLsum": 100.0, "exact_match": 100.0, "f1": 100.0,
                       "documents": 1}
    source.write_text(json.dumps({"text": document(5), "answers": ["w1", "w2"]}) + "\n")
    assert corpus_module.read_corpus(str(source), reference_column="answers").references == [["w1", "w2"]]


@pytest.mark.parametrize("queries, contexts, message", [
    ("", [document(20)], "`queries` must be non-empty text, got '' for context 0 (a row without a question: ask "
                         "'summarize', as `prepare_summarization_inputs` does)"),
    (["w1", "  "], [document(20), document(9)], "`queries` must be non-empty text, got '  ' for context 1"),
    ([None], [document(20)], "`queries` must be non-empty text, got None for context 0"),
    ("w1", [document(20), 3], "`contexts` must be a string or a list of strings, got int '3' for context 1"),
])
def test_prepare_vip_inputs_refuses_empty_queries_and_contexts_that_are_not_text(queries, contexts, message):
    """An empty query made the first context token the row's only VIP token, silently (its EOS alone was counted); a
    None query or a non-text context raised Python's `TypeError: unsupported operand type(s) for +`."""
    from workflow_helpers import word_tokenizer

    from longreach import prepare_vip_inputs

    with pytest.raises(ValueError, match=re.escape(message)):
        prepare_vip_inputs(word_tokenizer(), queries, contexts)
    inputs = prepare_vip_inputs(word_tokenizer(), ["w1", "summarize"], [document(20), document(9)])
    assert inputs["vip_mask"].sum(dim=1).tolist() == [2, 2]  # w1 / <unk> and their EOS count


def test_corpus_answers_stay_with_their_documents_when_the_model_returns_several_sequences(tmp_path):
    """A model whose generation config returns several sequences per document (`num_return_sequences`) gave a batch's
    records the first document's sequences in turn: record 2 held document 1's second answer. Each record now holds its
    document's first (best) sequence; asking for several in `generate_kwargs` is refused."""
    from test_workflows_vcc_t5_dodo import tiny_vcc
    from transformers import pipeline
    from workflow_helpers import word_tokenizer

    summarizer = pipeline("long-summarization", model=tiny_vcc(seed=13), tokenizer=word_tokenizer())
    texts, questions = [document(50, offset=3), document(30)], ["w4 w5", "w3"]
    corpus = corpus_module.Corpus(["a", "b"], texts, [None, None], [], questions)
    options = {"max_new_tokens": 4, "num_beams": 3}
    best = [record[0]["summary_text"] for record in summarizer(texts, question=questions, num_return_sequences=3,
                                                                **options)]
    assert best == [record["summary_text"] for record in summarizer(texts, question=questions, **options)]
    config = summarizer.model.generation_config
    config.num_beams, config.num_return_sequences = 3, 3
    try:
        corpus_module.summarize_corpus(summarizer, corpus, tmp_path / "out.jsonl", generate_kwargs=options,
                                       progress=False)
    finally:
        config.num_beams, config.num_return_sequences = 1, 1
    records = {record["id"]: record for record in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [records[key]["summary"] for key in ("a", "b")] == best
    with pytest.raises(ValueError, match=re.escape("`num_return_sequences`=2: a corpus record holds one summary per "
                                                   "document")):
        corpus_module.summarize_corpus(summarizer, corpus, tmp_path / "two.jsonl",
                                       generate_kwargs={**options, "num_return_sequences": 2}, progress=False)
