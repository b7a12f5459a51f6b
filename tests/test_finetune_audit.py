"""From an audit of the fine-tuning examples as a user runs them (tiny local models and data, a few steps)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_examples import _load_example
from tokenizer_helpers import word_level_tokenizer
from transformers import EvalPrediction


def _summarization_rows(count: int) -> list[dict]:
    """Documents of very different lengths (so that grouping by length reorders them), one-word summaries."""
    return [{"document": " ".join(f"w{3 + (k * 7 + i) % 58}" for i in range(5 + 9 * ((k * 5) % 7))),
             "summary": f"w{10 + k}"} for k in range(count)]


def test_rouge_scores_each_summary_against_its_own_reference_in_any_order(monkeypatch):
    """The evaluation may see the validation examples in another order (`--train_sampling_strategy group_by_length`
    sorts them by length): each generated summary was scored against the reference at its place in the data, another
    example's."""
    example = _load_example("finetune_summarization", monkeypatch)
    tokenizer = word_level_tokenizer(vocab_size=64)
    references = ["w10 w11", "w12", "w13 w14 w15", "w12"]  # two equal references too
    labels = [tokenizer(text_target=reference)["input_ids"] for reference in references]
    compute_metrics = example.build_compute_metrics(tokenizer, references, labels)
    order = [2, 0, 3, 1]
    width = max(len(row) for row in labels)
    label_ids = np.array([labels[i] + [-100] * (width - len(labels[i])) for i in order])
    predictions = np.array([[0] + labels[i] + [0] * (width - len(labels[i])) for i in order])  # perfect summaries
    metrics = compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids))
    assert metrics["rouge1"] == metrics["rougeLsum"] == 100.0


def test_group_by_length_evaluation_scores_against_the_right_references(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    example.smoke_arguments(str(tmp_path / "ft"))
    model = tmp_path / "ft-smoke-inputs" / "tiny-locost"
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _summarization_rows(8)))
    scored = []
    rouge_scores = example.rouge_scores
    monkeypatch.setattr(example, "rouge_scores", lambda summaries, targets, **kw: scored.append(targets) or
                        rouge_scores(summaries, targets, **kw))
    labels_seen = []
    build = example.build_compute_metrics

    def recording_build(tokenizer, *args):
        compute_metrics = build(tokenizer, *args)

        def record(prediction):
            labels_seen.append(tokenizer.batch_decode(np.where(prediction.label_ids >= 0, prediction.label_ids, 0),
                                                      skip_special_tokens=True))
            return compute_metrics(prediction)
        return record

    monkeypatch.setattr(example, "build_compute_metrics", recording_build)
    example.main(["--model_name_or_path", str(model), "--validation_file", str(tmp_path / "val.jsonl"),
                  "--output_dir", str(tmp_path / "eval"), "--report_to", "none", "--use_cpu",
                  "--per_device_eval_batch_size", "2", "--max_target_length", "12",
                  "--train_sampling_strategy", "group_by_length"])
    expected = [row["summary"] for row in _summarization_rows(8)]
    assert labels_seen[0] != expected  # (the test needs an evaluation in another order than the data's)
    assert scored[0] == labels_seen[0]  # each summary against its own example's reference
