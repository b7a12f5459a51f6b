"""`longreach summarize --input SRC --output OUT.jsonl`: readers, length-bucketed batches, resumable output (SIGKILL
and rerun), errors file, sharding under torchrun, ROUGE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import pipeline
from workflow_helpers import document, save_tiny_locost

from longreach import corpus as corpus_module
from longreach.cli import main

REPO = Path(__file__).resolve().parents[1]
GENERATION = ["--max_new_tokens", "4"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_locost(tmp_path_factory.mktemp("corpus") / "tiny")


def write_jsonl(path: Path, count: int) -> list[dict]:
    rows = [{"doc_id": f"d{k:03d}", "text": document(10 + (k * 37) % 150, offset=k),
             "summary": document(5, offset=k)} for k in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return rows


def read_output(path: Path) -> dict[str, dict]:
    return {record["id"]: record for record in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


def test_plan_batches_respects_the_padded_token_budget():
    lengths = [5, 100, 7, 30, 31, 400, 6]
    batches = corpus_module.plan_batches(lengths, max_batch_tokens=100)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert batches[0] == [5]  # longest first, alone: it exceeds the budget by itself
    for batch in batches[1:]:
        assert len(batch) * max(lengths[i] for i in batch) <= 100
    assert batches[2] == [4, 3, 2] and batches[3] == [6, 0]  # neighbours in length share a batch


def test_a_folder_corpus_equals_the_pipeline_and_reports_unreadable_files(model_folder, tmp_path, monkeypatch, capsys):
    source = tmp_path / "docs"
    (source / "sub").mkdir(parents=True)
    texts = {"a.txt": document(40), "b.md": document(120, offset=3), "sub/c.txt": document(41, offset=5),
             "sub/d.txt": document(9, offset=1)}
    for name, text in texts.items():
        (source / name).write_text(text, encoding="utf-8")
    (source / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    (source / "ignored.json").write_text("{}")

    calls = []
    from transformers import GenerationMixin

    generate = GenerationMixin.generate
    monkeypatch.setattr(GenerationMixin, "generate", lambda self, *a, **k: calls.append(1) or generate(self, *a, **k))
    output = tmp_path / "out.jsonl"
    assert main(["summarize", "--model", str(model_folder), "--input", str(source), "--output", str(output),
                 "--max_batch_tokens", "300", *GENERATION]) == 0
    records = read_output(output)
    assert list(records) == ["a.txt", "b.md", "sub/c.txt", "sub/d.txt"]  # corpus order, relative paths
    assert len(calls) < len(texts)  # batched: the encoder ran once per batch
    summarizer = pipeline("summarization", model=str(model_folder), trust_remote_code=True)
    for name, text in texts.items():
        assert records[name]["summary"] == summarizer(text, max_new_tokens=4)[0]["summary_text"]
        assert records[name]["input_tokens"] == len(text.split()) + 1 and records[name]["truncated"] is False
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [error["id"] for error in errors] == ["latin1.txt"] and "not UTF-8" in errors[0]["error"]
    assert "1 documents could not be summarized" in capsys.readouterr().err


def test_a_jsonl_corpus_with_references_gets_rouge(model_folder, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "corpus.jsonl", 12)
    rows_bad = tmp_path / "bad.jsonl"
    rows_bad.write_text(json.dumps({"doc_id": "x", "text": "   ", "summary": "s"}) + "\n"
                        + json.dumps({"doc_id": "y", "text": document(12), "summary": "s"}) + "\n")
    output = tmp_path / "out.jsonl"
    assert main(["summarize", "--model", str(model_folder), "--input", str(tmp_path / "corpus.jsonl"), "--output",
                 str(output), "--id_column", "doc_id", "--reference_column", "summary", "--max_input_length", "50",
                 *GENERATION]) == 0
    records = read_output(output)
    assert list(records) == [row["doc_id"] for row in rows]
    assert any(record["truncated"] for record in records.values())
    assert all(record["input_tokens"] <= 50 for record in records.values())
    metrics = json.loads((tmp_path / "out.metrics.json").read_text())
    assert set(metrics) == {"rouge1", "rouge2", "rougeLsum", "documents"} and metrics["documents"] == 12
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == metrics
    assert main(["summarize", "--model", str(model_folder), "--input", str(rows_bad), "--output",
                 str(tmp_path / "bad-out.jsonl"), "--id_column", "doc_id", *GENERATION]) == 0
    assert list(read_output(tmp_path / "bad-out.jsonl")) == ["y"]
    assert "no text to summarize" in (tmp_path / "bad-out.errors.jsonl").read_text()


def test_a_static_cache_gives_the_same_summaries(model_folder, tmp_path, monkeypatch):
    """`--cache_implementation static` reaches every generate() call and changes no summary (on a GPU it is what lets
    generate() compile the decoding step)."""
    write_jsonl(tmp_path / "corpus.jsonl", 6)
    from transformers import GenerationMixin

    from longreach.modeling.input_checks import cache_of

    caches = []
    generate = GenerationMixin.generate

    def recording_generate(self, *args, **kwargs):
        output = generate(self, *args, **kwargs, return_dict_in_generate=True)
        cache = cache_of(output).self_attention_cache
        caches.append((kwargs.get("cache_implementation"), type(cache).__name__))
        return output.sequences

    monkeypatch.setattr(GenerationMixin, "generate", recording_generate)
    runs = {}
    for name, options in (("dynamic", []), ("static", ["--cache_implementation", "static"])):
        output = tmp_path / f"{name}.jsonl"
        assert main(["summarize", "--model", str(model_folder), "--input", str(tmp_path / "corpus.jsonl"), "--output",
                     str(output), "--id_column", "doc_id", "--max_batch_tokens", "300", *GENERATION, *options]) == 0
        runs[name] = read_output(output)
    assert runs["static"] == runs["dynamic"] and len(runs["static"]) == 6
    assert {cache for cache in caches if cache[0] is None} == {(None, "DynamicCache")}
    assert {cache for cache in caches if cache[0] is not None} == {("static", "StaticCache")}


def test_bad_corpus_arguments_are_one_line(model_folder, tmp_path, capsys):
    write_jsonl(tmp_path / "corpus.jsonl", 3)
    assert main(["summarize", "--model", str(model_folder), "--input", str(tmp_path / "corpus.jsonl"),
                 "--output", str(tmp_path / "o.jsonl"), "--text_column", "body"]) == 2
    assert "--text_column 'body' is not a column" in capsys.readouterr().err
    (tmp_path / "dup.jsonl").write_text('{"id": "a", "text": "w1 w2"}\n{"id": "a", "text": "w3"}\n')
    assert main(["summarize", "--model", str(model_folder), "--input", str(tmp_path / "dup.jsonl"),
                 "--output", str(tmp_path / "o.jsonl"), "--id_column", "id"]) == 2
    assert "ids must be unique" in capsys.readouterr().err
    assert main(["summarize", "--model", str(model_folder), "--input", str(tmp_path / "corpus.jsonl"),
                 "--output", str(tmp_path / "o.txt")]) == 2
    assert "--output OUT.jsonl" in capsys.readouterr().err


def test_a_killed_run_resumes_without_losing_or_duplicating(model_folder, tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", 40)
    command = [sys.executable, "-m", "longreach.cli", "summarize", "--model", str(model_folder), "--input",
               str(tmp_path / "corpus.jsonl"), "--id_column", "doc_id", "--max_batch_tokens", "160", *GENERATION]
    reference = tmp_path / "uninterrupted.jsonl"
    assert main(command[3:] + ["--output", str(reference)]) == 0

    resumed = tmp_path / "resumed.jsonl"
    process = subprocess.Popen(command + ["--output", str(resumed)], cwd=REPO, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (resumed.exists() and resumed.read_text().count("\n") >= 3):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done_before = len(read_output_lenient(resumed))
    assert 3 <= done_before < 40  # killed midway
    with open(resumed, "a", encoding="utf-8") as handle:
        handle.write('{"id": "d0')  # a line cut short by the crash
    assert main(command[3:] + ["--output", str(resumed)]) == 0
    assert read_output(resumed) == read_output(reference)  # same ids, same summaries, none twice
    assert len(resumed.read_text().splitlines()) == 40


def read_output_lenient(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.endswith("}")]


def test_torchrun_shards_give_the_same_summaries(model_folder, tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", 10)
    arguments = ["summarize", "--model", str(model_folder), "--input", str(tmp_path / "corpus.jsonl"), "--id_column",
                 "doc_id", *GENERATION]
    assert main(arguments + ["--output", str(tmp_path / "one.jsonl")]) == 0
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
         "longreach.cli", *arguments, "--output", str(tmp_path / "two.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},  # torchrun's scratch folders go here
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_output(tmp_path / "two.jsonl") == read_output(tmp_path / "one.jsonl")
    assert {"corpus.jsonl", "one.jsonl", "two.jsonl"} <= {path.name for path in tmp_path.iterdir()}
    assert not list(tmp_path.glob("two.jsonl.part-*"))  # the parts were merged and removed
