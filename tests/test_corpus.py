"""`longreach summarize --input SRC --output OUT.jsonl`: readers, length-bucketed batches, resumable output (SIGKILL
and rerun), errors file, sharding under torchrun, ROUGE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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


def test_the_batches_are_planned_from_token_counts_made_a_slice_at_a_time(model_folder, tmp_path, monkeypatch):
    """The corpus's token counts were made by tokenizing every document at once: about 170 bytes per token of peak
    memory (1 GB for 2,000 documents of 3,000 words) before the first summary, only to be counted."""
    import tracemalloc

    summarizer = pipeline("summarization", model=str(model_folder), trust_remote_code=True)
    count = 300
    corpus = corpus_module.Corpus(ids=[f"d{k}" for k in range(count)], texts=[document(5000, offset=k)
                                                                              for k in range(count)])
    corpus.references = [None] * count
    planned = []

    class Planned(Exception):
        pass

    def plan_batches(lengths, *args):
        planned.append((lengths, tracemalloc.get_traced_memory()[1]))
        raise Planned

    monkeypatch.setattr(corpus_module, "plan_batches", plan_batches)
    tracemalloc.start()
    try:
        with pytest.raises(Planned):
            corpus_module.summarize_corpus(summarizer, corpus, tmp_path / "out.jsonl", progress=False)
    finally:
        tracemalloc.stop()
    ((lengths, peak),) = planned
    assert lengths == [5001] * count  # 5,000 words and </s> each
    assert peak < 8 * 2**20  # 1.5 million tokens: 23 MiB of Python objects at their peak before, 2.1 MiB now


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
                 "--max_batch_tokens", "300", *GENERATION]) == 3  # finished, with a document in the errors file
    records = read_output(output)
    assert list(records) == ["a.txt", "b.md", "sub/c.txt", "sub/d.txt"]  # corpus order, relative paths
    # the comparisons in this file mean something only if the tiny model writes summaries, and not all the same one
    assert all(record["summary"] for record in records.values())
    assert len({record["summary"] for record in records.values()}) > 1
    assert len(calls) < len(texts)  # batched: the encoder ran once per batch
    summarizer = pipeline("summarization", model=str(model_folder), trust_remote_code=True)
    for name, text in texts.items():
        assert records[name]["summary"] == summarizer(text, max_new_tokens=4)[0]["summary_text"]
        assert records[name]["input_tokens"] == len(text.split()) + 1 and records[name]["truncated"] is False
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [error["id"] for error in errors] == ["latin1.txt"] and "not UTF-8" in errors[0]["error"]
    assert "1 document could not be summarized" in capsys.readouterr().err


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
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == metrics
    truncated = sum(record["truncated"] for record in records.values())  # counted at the end, as the help says
    assert f"{truncated} document{'s' * (truncated != 1)} of this run cut to --max_input_length 50" in captured.err
    assert main(["summarize", "--model", str(model_folder), "--input", str(rows_bad), "--output",
                 str(tmp_path / "bad-out.jsonl"), "--id_column", "doc_id", *GENERATION]) == 3
    assert "1 document could not be summarized: see" in capsys.readouterr().err
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
    # the closing line counts every process's documents (it showed rank 0's as if each had done as many)
    assert "10 documents (" in result.stderr and "by 2 processes" in result.stderr, result.stderr[-2000:]
    assert {"corpus.jsonl", "one.jsonl", "two.jsonl"} <= {path.name for path in tmp_path.iterdir()}
    assert not list(tmp_path.glob("two.jsonl.part-*"))  # the parts were merged and removed


def summarize_args(model_folder, source: Path, output: Path, *options: str) -> list[str]:
    return ["summarize", "--model", str(model_folder), "--input", str(source), "--output", str(output), *GENERATION,
            *options]


def test_a_file_that_is_not_our_output_is_refused_and_left_as_it_was(model_folder, tmp_path, capsys):
    source = tmp_path / "d.jsonl"
    source.write_text('{"id": "a", "text": "w1 w2"}\n{"id": "b", "text": "w3 w4"}')  # no final newline
    before = source.read_bytes()
    assert main(summarize_args(model_folder, source, source, "--id_column", "id")) == 2
    assert "is the --input file" in capsys.readouterr().err
    other = tmp_path / "mine.jsonl"  # someone's file, not summaries: neither read as finished nor cut short
    for content in ('{"doc_id": "a"}\n{"doc_id": "b"}', '{"id": "a", "text": "w1"}\n', '{"doc_id": "a"}'):
        other.write_text(content)
        assert main(summarize_args(model_folder, source, other, "--id_column", "id")) == 2
        assert "not one of our summary records" in capsys.readouterr().err
        assert other.read_text() == content
        assert not (tmp_path / "mine.settings.json").exists()  # refused before anything was written beside it
    assert source.read_bytes() == before
    # someone's file where the settings would go, beside an output not yet written: refused, left as it was
    (tmp_path / "run.settings.json").write_text('{"lr": 0.1}')
    assert main(summarize_args(model_folder, source, tmp_path / "run.jsonl", "--id_column", "id")) == 2
    assert "run.settings.json exists and is not the settings file of a summary run" in capsys.readouterr().err
    assert (tmp_path / "run.settings.json").read_text() == '{"lr": 0.1}' and not (tmp_path / "run.jsonl").exists()


def test_ids_with_unicode_line_separators_and_undecodable_file_names_are_kept(model_folder, tmp_path):
    source = tmp_path / "d.jsonl"
    ids = ["a\u2028b", "c\u2029d", "e\x85f", "g\u00e9"]
    source.write_text("".join(json.dumps({"id": i, "text": document(8, offset=k)}) + "\n" for k, i in enumerate(ids)))
    output = tmp_path / "out.jsonl"
    assert main(summarize_args(model_folder, source, output, "--id_column", "id")) == 0
    assert list(corpus_module.finished_records(output)) == ids
    assert main(summarize_args(model_folder, source, output, "--id_column", "id")) == 0  # a rerun reads it back
    assert len(corpus_module.json_lines(output)) == 4
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "ok.txt").write_text(document(10))
    with open(os.fsencode(folder) + b"/caf\xe9.txt", "w") as handle:  # a Latin-1 file name
        handle.write(document(12, offset=2))
    assert main(summarize_args(model_folder, folder, tmp_path / "docs.jsonl")) == 0
    assert sorted(corpus_module.finished_records(tmp_path / "docs.jsonl")) == ["caf\\xe9.txt", "ok.txt"]


def test_csv_ids_stay_text_and_bad_jsonl_lines_go_to_the_errors_file(model_folder, tmp_path, capsys):
    table = tmp_path / "t.csv"
    table.write_text(f"id,text\n001,{document(6)}\n002,\n,{document(7)}\n1,{document(8)}\n")
    output = tmp_path / "csv.jsonl"
    assert main(summarize_args(model_folder, table, output, "--id_column", "id")) == 3
    assert list(corpus_module.finished_records(output)) == ["001", "1"]
    assert {e["id"] for e in corpus_module.json_lines(tmp_path / "csv.errors.jsonl")} == {"002", "<row 2>"}
    lines = tmp_path / "l.jsonl"
    lines.write_text(json.dumps({"id": "a", "text": document(6)}) + "\n{\"id\": \"b\", \"te\n[1, 2]\n"
                     + json.dumps({"id": "c", "text": document(9)}) + "\n")
    assert main(summarize_args(model_folder, lines, tmp_path / "l-out.jsonl", "--id_column", "id")) == 3
    assert list(corpus_module.finished_records(tmp_path / "l-out.jsonl")) == ["a", "c"]
    errors = corpus_module.json_lines(tmp_path / "l-out.errors.jsonl")
    assert [e["id"] for e in errors] == ["<line 2>", "<line 3>"] and errors[0]["error"].startswith("not JSON")
    capsys.readouterr()
    (tmp_path / "empty.jsonl").write_text("")
    assert main(summarize_args(model_folder, tmp_path / "empty.jsonl", tmp_path / "e.jsonl")) == 2
    assert "holds no records" in capsys.readouterr().err


def test_options_that_do_not_apply_are_refused(model_folder, tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(document(10))
    write_jsonl(tmp_path / "corpus.jsonl", 2)
    cases = [
        (summarize_args(model_folder, folder, tmp_path / "o.jsonl", "--reference_column", "summary"),
         "--reference_column applies to table files"),
        (summarize_args(model_folder, folder / "a.txt", tmp_path / "o.jsonl", "--text_column", "body", "--split", "x"),
         "--split / --text_column apply to table files"),
        (summarize_args(model_folder, tmp_path / "corpus.jsonl", tmp_path / "o.jsonl", "--split", "validation"),
         "--split applies to Hub datasets"),
        (summarize_args(model_folder, "missing.jsonl", tmp_path / "o.jsonl"), "missing.jsonl: no such file"),
        (summarize_args(model_folder, folder, tmp_path / "o.jsonl", "--repetition_penalty", "-1"),
         "--repetition_penalty: expected a positive number, got -1"),
        (summarize_args(model_folder, folder, tmp_path / "o.jsonl", "--length_penalty", "nan"),
         "--length_penalty: expected a finite number, got nan"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
    with pytest.raises(ValueError, match="`max_batch_size` must be a positive integer"):
        corpus_module.plan_batches([3, 4], 100, max_batch_size=0)


def test_a_rerun_with_another_process_count_keeps_the_finished_parts(model_folder, tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", 6)
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", tmp_path / "one.jsonl", "--id_column", "doc_id")
    assert main(arguments) == 0
    reference = corpus_module.json_lines(tmp_path / "one.jsonl")
    # What an interrupted 2-process run leaves: two finished summaries in one part, a stale errors file of the parts.
    output = tmp_path / "two.jsonl"
    part = tmp_path / "two.jsonl.part-1-of-2.jsonl"
    part.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in reference[:2]))
    (tmp_path / "two.jsonl.part-0-of-2.errors.jsonl").write_text('{"id": "d005", "error": "old"}\n')
    (tmp_path / "two.errors.jsonl").write_text('{"id": "d004", "error": "old"}\n')
    calls = []
    original = corpus_module._summarize_batch
    corpus_module._summarize_batch = lambda summarizer, corpus, batch, *rest: (
        calls.extend(corpus.ids[i] for i in batch) or original(summarizer, corpus, batch, *rest))
    try:
        assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", output, "--id_column", "doc_id")) == 0
    finally:
        corpus_module._summarize_batch = original
    assert sorted(calls) == sorted(record["id"] for record in reference[2:])  # the parts' summaries are not redone
    assert corpus_module.json_lines(output) == reference
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("two")) == ["two.jsonl",
                                                                                         "two.settings.json"]
    # merge_parts of a multi-process run with no errors leaves no earlier run's errors file behind
    (tmp_path / "two.errors.jsonl").write_text('{"id": "d004", "error": "old"}\n')
    corpus = corpus_module.read_corpus(str(tmp_path / "corpus.jsonl"), id_column="doc_id")
    assert len(corpus_module.merge_parts(output, corpus, world_size=2)) == 6
    assert not (tmp_path / "two.errors.jsonl").exists()


def test_a_rerun_with_other_settings_is_refused_instead_of_mixing_runs(model_folder, tmp_path, capsys):
    write_jsonl(tmp_path / "corpus.jsonl", 4)
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", tmp_path / "out.jsonl", "--id_column", "doc_id")
    assert main(arguments) == 0
    settings = json.loads((tmp_path / "out.settings.json").read_text())
    assert settings["generation"] == {"max_new_tokens": 4} and settings["max_input_length"] is None
    assert settings["model"] == str(Path(model_folder).resolve())
    before = (tmp_path / "out.jsonl").read_bytes()
    assert main(arguments + ["--max_input_length", "20"]) == 2
    error = capsys.readouterr().err
    assert "holds summaries made with other settings (max_input_length: None then, 20 now)" in error
    assert (tmp_path / "out.jsonl").read_bytes() == before
    assert main(arguments + ["--cache_implementation", "static"]) == 0  # the same summaries: not a change
    assert (tmp_path / "out.jsonl").read_bytes() == before
    (tmp_path / "out.jsonl").unlink()  # nothing left to mix with: the new settings are recorded
    assert main(arguments + ["--max_input_length", "20"]) == 0
    assert json.loads((tmp_path / "out.settings.json").read_text())["max_input_length"] == 20


def test_json_ids_stay_as_written_and_row_numbers_count_bad_lines(tmp_path):
    """Arrow reads a column of JSON numbers with one float in it as floats: ids 1, 2 became "1.0", "2.0" (so a rerun
    after a 2.5 joined the file redid and duplicated them) and 2**53 + 1 became 2**53 (a false duplicate)."""
    read = corpus_module.read_corpus
    source = tmp_path / "ids.jsonl"
    source.write_text('{"id": 1, "text": "w1 w2"}\n{"id": 2, "text": "w3 w4"}\n')
    assert read(str(source), id_column="id").ids == ["1", "2"]
    with open(source, "a") as handle:
        handle.write('{"id": 2.5, "text": "w5"}\n{"id": 9007199254740993, "text": "w6"}\n{"id": 9007199254740992, '
                     '"text": "w7"}\n')
    assert read(str(source), id_column="id").ids == ["1", "2", "2.5", "9007199254740993", "9007199254740992"]
    (tmp_path / "ids.json").write_text('[{"id": 1, "text": "a"}, {"id": 3.0, "text": "b"}]')
    assert read(str(tmp_path / "ids.json"), id_column="id").ids == ["1", "3.0"]
    # numbers mixed with strings: Arrow made "007" the number 7 (a silent rename, or a false duplicate of 7)
    source.write_text('{"id": 8, "text": "w1"}\n{"id": "007", "text": "w2"}\n{"id": 7, "text": "w3"}\n')
    assert read(str(source), id_column="id").ids == ["8", "007", "7"]

    # without --id_column the ids are row numbers: a bad line keeps its number, so that once it is fixed the rows
    # after it keep their ids (a resume would otherwise file the summaries under the wrong ids)
    broken = tmp_path / "rows.jsonl"
    broken.write_text('{"text": "w1 w2"}\n{"text": "w3 oops\n\n{"text": "w5 w6"}\nnull\n{"text": "w7"}\n')
    corpus = read(str(broken))
    assert corpus.ids == ["0", "2", "4"] and corpus.texts == ["w1 w2", "w5 w6", "w7"]
    assert [error["id"] for error in corpus.errors] == ["<line 2>", "<line 5>"]
    broken.write_text('{"text": "w1 w2"}\n{"text": "w3 fixed"}\n\n{"text": "w5 w6"}\n{"text": "w8"}\n{"text": "w7"}\n')
    assert read(str(broken)).ids == ["0", "1", "2", "3", "4"]
    # a byte-order mark does not cost the first record when another line is bad
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "w1"}\n{"id": "b", "te\n{"id": "c", "text": "w3"}\n')
    assert read(str(tmp_path / "bom.jsonl"), id_column="id").ids == ["a", "c"]


def test_empty_references_are_none_and_empty_tables_hold_no_records(tmp_path):
    read = corpus_module.read_corpus
    (tmp_path / "refs.jsonl").write_text('{"text": "a", "ref": ""}\n{"text": "b", "ref": "  "}\n{"text": "c", "ref": "x"}\n'
                                         '{"text": "d"}\n')
    assert read(str(tmp_path / "refs.jsonl"), reference_column="ref").references == [None, None, "x", None]
    (tmp_path / "refs.csv").write_text('text,ref\na,\nb,"  "\nc,x\n')
    assert read(str(tmp_path / "refs.csv"), reference_column="ref").references == [None, None, "x"]
    for name, content in [("header.csv", "id,text\n"), ("empty.csv", ""), ("empty.json", "[]"), ("blank.jsonl", "\n")]:
        (tmp_path / name).write_text(content)
        with pytest.raises(corpus_module.CorpusError, match=f"--input {tmp_path / name}: the file holds no records"):
            read(str(tmp_path / name))
    (tmp_path / "bad.jsonl").write_text("nope\n{bad\n")
    with pytest.raises(corpus_module.CorpusError,
                       match=r"the file holds no records \(<line 1>: not JSON: Expecting value \(column 1\)\)"):
        read(str(tmp_path / "bad.jsonl"))


def test_output_paths_and_empty_values_are_refused_before_the_model_loads(model_folder, tmp_path, capsys, monkeypatch):
    from longreach import cli

    write_jsonl(tmp_path / "corpus.jsonl", 2)
    monkeypatch.setattr(cli, "load_summarizer", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "folder.jsonl").mkdir()
    cases = [(["--output", str(tmp_path / "folder.jsonl")], "is a folder; give a file path ending in .jsonl"),
             (["--output", str(tmp_path / "corpus.jsonl" / "out.jsonl")], "corpus.jsonl is a file, so no folder"),
             (["--output", str(tmp_path / "o.jsonl"), "--text_column", ""], "--text_column: expected a non-empty value"),
             (["--output", str(tmp_path / "o.jsonl"), "--tokenizer", " "], "--tokenizer: expected a non-empty value")]
    for options, expected in cases:
        assert main(["summarize", "--model", str(model_folder), "--input", str(tmp_path / "corpus.jsonl"),
                     *options]) == 2
        assert expected in capsys.readouterr().err
    assert main(["summarize", "--model", str(model_folder), "--input", "", "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "--input: expected a non-empty value, got ''" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.jsonl", "folder.jsonl"]  # nothing written


def test_a_reference_column_without_references_says_so(model_folder, tmp_path, capsys):
    source = tmp_path / "c.jsonl"
    source.write_text('{"text": "w1 w2 w3", "ref": null}\n{"text": "w4 w5", "ref": ""}\n')
    assert main(summarize_args(model_folder, source, tmp_path / "o.jsonl", "--reference_column", "ref")) == 0
    assert "no summarized document has a reference in --reference_column 'ref': no ROUGE" in capsys.readouterr().err
    assert not (tmp_path / "o.metrics.json").exists()


def test_a_missing_datasets_or_rouge_score_is_named_before_the_model_loads(model_folder, tmp_path, monkeypatch, capsys):
    """Table files and Hub datasets need 🤗 datasets, --reference_column needs rouge-score (both in the [train]
    extra): named with the install command before the model loads, instead of a bare ModuleNotFoundError (datasets)
    or a failure after every summary was written (rouge-score)."""
    import importlib.util

    from longreach import cli

    write_jsonl(tmp_path / "corpus.jsonl", 2)
    find_spec = importlib.util.find_spec
    loads = []
    monkeypatch.setattr(cli, "load_summarizer", lambda *args: loads.append(1))
    for missing, options in (("datasets", []), ("rouge_score", ["--reference_column", "summary"])):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *args, missing=missing: None if name == missing else find_spec(name, *args))
        assert main(["summarize", "--model", str(model_folder), "--input", str(tmp_path / "corpus.jsonl"), "--output",
                     str(tmp_path / "out.jsonl"), "--id_column", "doc_id", *options, *GENERATION]) == 1
        assert f"{missing} is not installed: pip install 'longreach[train]'" in capsys.readouterr().err
    assert not loads and not (tmp_path / "out.jsonl").exists()


def test_a_rerun_with_another_input_or_column_is_refused(model_folder, tmp_path, capsys):
    """Ids alone key the finished summaries: another input file or text column under the same ids kept the first
    run's summaries of other texts ("0 documents, 4 already done")."""
    write_jsonl(tmp_path / "corpus.jsonl", 4)
    (tmp_path / "other.jsonl").write_text((tmp_path / "corpus.jsonl").read_text())
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", tmp_path / "out.jsonl", "--id_column", "doc_id")
    assert main(arguments + ["--text_column", "summary"]) == 0
    before = (tmp_path / "out.jsonl").read_bytes()
    assert main(arguments) == 2
    assert "(text_column: 'summary' then, 'text' now)" in capsys.readouterr().err
    other = summarize_args(model_folder, tmp_path / "other.jsonl", tmp_path / "out.jsonl", "--id_column", "doc_id")
    assert main(other + ["--text_column", "summary"]) == 2
    changed = f"input: {str(tmp_path / 'corpus.jsonl')!r} then, {str(tmp_path / 'other.jsonl')!r} now"
    assert changed in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_bytes() == before
    # an output whose settings were recorded before the input was: finished as it was, not refused
    settings = json.loads((tmp_path / "out.settings.json").read_text())
    for key in ("input", "text_column", "id_column"):
        del settings[key]
    (tmp_path / "out.settings.json").write_text(json.dumps(settings))
    (tmp_path / "out.jsonl").write_bytes(before.split(b"\n", 1)[1])  # one summary to redo
    assert main(arguments + ["--text_column", "summary"]) == 0
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_lone_surrogates_go_to_the_errors_file_and_the_run_goes_on(model_folder, tmp_path, capsys):
    """A JSON escape such as "\\ud800" alone has no UTF-8: in an id it stopped every run at the write, in a text it
    stopped the whole corpus at the tokenizer."""
    source = tmp_path / "s.jsonl"
    records = [{"id": "\ud800x", "text": "w1 w2 w3"}, {"id": "b", "text": "w4 \udc00 w5"}, {"id": "c", "text": "w6 w7"}]
    source.write_text("".join(json.dumps(record) + "\n" for record in records))  # JSON escapes: "\\ud800x"
    output = tmp_path / "out.jsonl"
    for _ in range(2):  # and a rerun goes on the same way
        assert main(summarize_args(model_folder, source, output, "--id_column", "id")) == 3
        assert list(corpus_module.finished_records(output)) == ["c"]
        errors = corpus_module.json_lines(tmp_path / "out.errors.jsonl")
        assert [(e["id"], e["error"]) for e in errors] == [
            ("\\ud800x", "the id is not valid Unicode: a lone surrogate U+D800 at character 0"),
            ("b", "the text is not valid Unicode: a lone surrogate U+DC00 at character 3")]
    assert "2 documents could not be summarized" in capsys.readouterr().err


def test_csv_words_that_pandas_reads_as_missing_stay_text_and_a_bad_row_is_named(tmp_path):
    read = corpus_module.read_corpus
    (tmp_path / "na.csv").write_text("id,text,ref\nNA,None,null\nnull,w2,NA\nnan,w3,\nN/A,w4,x\n,w5,x\n")
    corpus = read(str(tmp_path / "na.csv"), id_column="id", reference_column="ref")
    assert corpus.ids == ["NA", "null", "nan", "N/A"] and corpus.texts == ["None", "w2", "w3", "w4"]
    assert corpus.references == ["null", "NA", None, "x"]  # only an empty cell is missing
    assert corpus.errors == [{"id": "<row 4>", "error": "no id in --id_column 'id'"}]
    (tmp_path / "bad.csv").write_text("id,text\na,w1 w2\nb,w3,extra\nc,w4\n")
    with pytest.raises(corpus_module.CorpusError, match="Expected 2 fields in line 3, saw 3"):
        read(str(tmp_path / "bad.csv"), id_column="id")


def test_a_tilde_after_the_equals_sign_is_the_home_folder(model_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    write_jsonl(tmp_path / "home" / "corpus.jsonl", 2)
    assert main(["summarize", "--model", str(model_folder), "--input=~/corpus.jsonl", "--output=~/res/out.jsonl",
                 "--id_column", "doc_id", *GENERATION]) == 0
    assert len(corpus_module.finished_records(tmp_path / "home" / "res" / "out.jsonl")) == 2
    assert not (tmp_path / "~").exists()
    assert f"2 summaries in {tmp_path / 'home' / 'res' / 'out.jsonl'}" in capsys.readouterr().err


def test_each_process_of_a_distributed_run_takes_its_own_gpu(monkeypatch):
    """`--device cuda` under torchrun put every process on GPU 0."""
    import torch

    from longreach.cli import process_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    for available in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert process_device("cuda", 2) == "cuda:1"
        assert process_device(None, 2) == ("cuda:1" if available else "cpu")
        assert process_device("cpu", 2) == "cpu" and process_device("cuda:0", 2) == "cuda:0"
        assert process_device("cuda", 1) == "cuda" and process_device(None, 1) is None


def test_a_tail_of_nul_bytes_left_by_a_machine_crash_is_redone(model_folder, tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", 3)
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", tmp_path / "out.jsonl", "--id_column", "doc_id")
    assert main(arguments) == 0
    complete = (tmp_path / "out.jsonl").read_bytes()
    first, second, _ = complete.split(b"\n", 2)
    for tail in (b"\0" * 64, second[:10] + b"\0" * 64):
        (tmp_path / "out.jsonl").write_bytes(first + b"\n" + tail)
        assert list(corpus_module.finished_records(tmp_path / "out.jsonl")) == [json.loads(first)["id"]]
        assert (tmp_path / "out.jsonl").read_bytes() == first + b"\n"  # the tail is gone, not appended to
        assert main(arguments) == 0
        assert (tmp_path / "out.jsonl").read_bytes() == complete


def test_a_plain_t5_corpus_gets_its_task_specific_generation_settings_as_in_the_pipeline(tmp_path):
    """A v4-era T5 checkpoint's `task_specific_params["summarization"]`: the corpus command applied its prefix (the
    pipeline's input preparation) but not its beams and lengths, which the pipeline applies under the caller's own
    options; the same summaries now, and the same `generate()` options."""
    from workflow_helpers import tiny_t5_with_summarization_params, word_tokenizer

    from longreach import LongSummarizationPipeline

    tokenizer = word_tokenizer()
    t5, calls = tiny_t5_with_summarization_params(vocab_size=len(tokenizer))
    summarizer = LongSummarizationPipeline(model=t5, tokenizer=tokenizer)
    texts = [document(30), document(12, offset=4)]
    for caller_options in ({}, {"num_beams": 1, "max_new_tokens": 3}):
        expected = [summarizer(text, **caller_options)[0]["summary_text"] for text in texts]
        pipeline_options = calls[-2:]
        output = tmp_path / f"out-{len(caller_options)}.jsonl"
        corpus = corpus_module.Corpus(ids=["a", "b"], texts=texts, references=[None, None])
        corpus_module.summarize_corpus(summarizer, corpus, output, max_batch_tokens=1, generate_kwargs=caller_options,
                                       progress=False)
        assert [read_output(output)[key]["summary"] for key in ("a", "b")] == expected
        corpus_options = calls[-2:]  # one document per batch (max_batch_tokens=1), the longer ("a") first
        assert [options["input_ids"][0].tolist() for options in corpus_options] == [
            tokenizer("w90 w91 " + text)["input_ids"] for text in texts]
        assert [{key: value for key, value in options.items() if key not in ("input_ids", "attention_mask")}
                for options in corpus_options] == [
            {key: value for key, value in options.items() if key not in ("input_ids", "attention_mask")}
            for options in pipeline_options]


def test_a_rerun_reads_the_finished_output_once(tmp_path, monkeypatch):
    """Resuming, one process read OUT twice (as OUT and as its own part, the same file when it writes OUT itself)."""
    from workflow_helpers import tiny_locost, word_tokenizer

    from longreach import LongSummarizationPipeline

    summarizer = LongSummarizationPipeline(model=tiny_locost(), tokenizer=word_tokenizer())
    output = tmp_path / "out.jsonl"
    corpus = corpus_module.Corpus(ids=["a", "b"], texts=[document(20), document(9, offset=2)], references=[None] * 2)
    corpus_module.summarize_corpus(summarizer, corpus, output, generate_kwargs={"max_new_tokens": 2}, progress=False)
    finished = output.read_text(encoding="utf-8")
    corpus = corpus_module.Corpus(ids=["a", "b", "c"], texts=[*corpus.texts, document(12, offset=5)],
                                  references=[None] * 3)
    reads = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: reads.append(path) or read_bytes(path))
    stats = corpus_module.summarize_corpus(summarizer, corpus, output, generate_kwargs={"max_new_tokens": 2},
                                           progress=False)
    assert reads.count(output) == 1
    assert stats["skipped_already_done"] == 2 and stats["documents"] == 1
    assert output.read_text(encoding="utf-8").startswith(finished) and set(read_output(output)) == {"a", "b", "c"}


def test_answer_scores_follow_squads_definitions():
    from longreach.metrics import answer_scores, normalize_answer

    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"  # no article, punctuation
    assert answer_scores(["the cat"], ["Cat."]) == {"exact_match": 100.0, "f1": 100.0}
    # 2 words shared of 3 predicted and 4 expected: precision 2/3, recall 1/2, F1 4/7
    assert answer_scores(["in Paris France"], ["Paris in northern Europe"]) == {"exact_match": 0.0, "f1": 57.14}
    assert answer_scores(["", "a"], ["", "dog"]) == {"exact_match": 50.0, "f1": 50.0}  # empty only matches empty
    assert answer_scores(["x y", "x"], ["x y", "z"]) == {"exact_match": 50.0, "f1": 50.0}
    with pytest.raises(ValueError, match="Got 1 predictions for 2 references"):
        answer_scores(["x"], ["x", "y"])


def test_a_rerun_of_a_finished_corpus_leaves_its_output_in_place(model_folder, tmp_path, monkeypatch):
    """A rerun of a finished corpus rewrote OUT whole, unchanged, and read it four times (to check it is ours, for what
    was done, to merge, for ROUGE). Now it is kept in place (the same file, not a rewritten copy) and scored from the
    merged records: three reads."""
    write_jsonl(tmp_path / "corpus.jsonl", 5)
    output = tmp_path / "out.jsonl"
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", output, "--id_column", "doc_id",
                               "--reference_column", "summary")
    assert main(arguments) == 0
    finished, inode = output.read_bytes(), output.stat().st_ino
    assert [record["id"] for record in corpus_module.json_lines(output)] == [f"d{k:03d}" for k in range(5)]
    metrics_path = tmp_path / "out.metrics.json"
    metrics = json.loads(metrics_path.read_text())
    metrics_path.unlink()
    reads = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: reads.append(path) or read_bytes(path))
    assert main(arguments) == 0
    assert reads.count(output) == 3
    assert output.stat().st_ino == inode and output.read_bytes() == finished
    assert json.loads(metrics_path.read_text()) == metrics and metrics["documents"] == 5


def test_merge_parts_rewrites_an_output_whose_lines_are_not_its_records(tmp_path):
    """Kept in place only when OUT already holds exactly the merged records: an id written twice (two runs appended to
    one file) and a part whose record of an id differs from OUT's are written out, as the merge returns them."""
    corpus = corpus_module.Corpus(ids=["a", "b"], texts=["x y", "z w"], references=[None, None])
    output = tmp_path / "out.jsonl"

    def write(path, *records):
        path.write_text("".join(json.dumps({"id": i, "summary": s}) + "\n" for i, s in records), encoding="utf-8")

    write(output, ("a", "one"), ("b", "two"), ("a", "one"))
    merged = corpus_module.merge_parts(output, corpus, world_size=1)
    assert corpus_module.json_lines(output) == merged == [{"id": "a", "summary": "one"}, {"id": "b", "summary": "two"}]
    inode = output.stat().st_ino
    assert corpus_module.merge_parts(output, corpus, world_size=1) == merged and output.stat().st_ino == inode
    write(tmp_path / "out.jsonl.part-1-of-2.jsonl", ("b", "three"))
    merged = corpus_module.merge_parts(output, corpus, world_size=1)
    expected = [{"id": "a", "summary": "one"}, {"id": "b", "summary": "three"}]
    assert corpus_module.json_lines(output) == merged == expected
    assert not (tmp_path / "out.jsonl.part-1-of-2.jsonl").exists()


def test_a_full_disk_midway_names_the_output_and_a_rerun_finishes_without_losing_or_duplicating(model_folder, tmp_path,
                                                                                                capsys, monkeypatch):
    import errno

    write_jsonl(tmp_path / "corpus.jsonl", 30)
    reference, output = tmp_path / "uninterrupted.jsonl", tmp_path / "out.jsonl"
    options = ("--id_column", "doc_id", "--max_batch_tokens", "160")
    assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", reference, *options)) == 0
    append, calls = corpus_module._append, []

    def disk_full_at_the_third_batch(handle, records):
        calls.append(1)
        if len(calls) == 3:
            handle.write('{"id": "d0')  # the part of a line that still fitted
            handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        append(handle, records)

    with monkeypatch.context() as patch:
        patch.setattr(corpus_module, "_append", disk_full_at_the_third_batch)
        capsys.readouterr()
        assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", output, *options)) == 1
    error = capsys.readouterr().err
    assert f"error: cannot write {output}: No space left on device; the summaries written before are kept" in error
    assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", output, *options)) == 0
    assert read_output(output) == read_output(reference)
    assert len(output.read_text().splitlines()) == 30


def test_a_callers_end_token_ends_the_corpus_summary_as_in_the_pipeline(tmp_path, monkeypatch):
    """generate() fills the rows of a batch that finished first with the pad id, or with the end token itself when
    there is no pad id (Llama tokenizers): a caller's `eos_token_id` that is not a special token then stayed in the
    corpus summary, repeated up to the batch's longest row, while the pipeline's summary ends at its first one."""
    import torch
    from workflow_helpers import tiny_locost, word_tokenizer

    from longreach import LongSummarizationPipeline

    tokenizer = word_tokenizer()
    summarizer = LongSummarizationPipeline(model=tiny_locost(), tokenizer=tokenizer)
    start, end = summarizer.model.config.decoder_start_token_id, tokenizer.convert_tokens_to_ids("w9")
    words = tokenizer.convert_tokens_to_ids(["w5", "w6", "w7", "w8"])
    generated = torch.tensor([[start, words[0], end, end, end], [start, words[1], words[2], words[3], end]])
    monkeypatch.setattr(summarizer.model, "generate", lambda *args, **kwargs: generated[: len(kwargs["input_ids"])])
    texts = [document(30), document(12, offset=4)]  # the longer first, as the corpus batches them
    expected = [record["summary_text"] for record in summarizer(texts, batch_size=2, eos_token_id=end)]
    assert expected == ["w5 w9", "w6 w7 w8 w9"]
    output = tmp_path / "out.jsonl"
    corpus = corpus_module.Corpus(ids=["a", "b"], texts=texts, references=[None, None])
    corpus_module.summarize_corpus(summarizer, corpus, output, generate_kwargs={"eos_token_id": end}, progress=False)
    assert [read_output(output)[key]["summary"] for key in ("a", "b")] == expected


def test_a_second_run_on_the_same_output_is_refused_while_the_first_one_writes(model_folder, tmp_path, capsys):
    write_jsonl(tmp_path / "corpus.jsonl", 40)
    options = ("--id_column", "doc_id", "--max_batch_tokens", "160")
    reference, output = tmp_path / "uninterrupted.jsonl", tmp_path / "out.jsonl"
    assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", reference, *options)) == 0
    first = subprocess.Popen([sys.executable, "-m", "longreach.cli",
                              *summarize_args(model_folder, tmp_path / "corpus.jsonl", output, *options)],
                             cwd=REPO, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_text().count("\n") >= 3):
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended before the second started"
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGSTOP)  # midway, as a second terminal or an overlapping cron job finds it
    try:
        before = output.read_bytes()
        capsys.readouterr()
        # the same command (it summarized the rest again, beside the first run) and one with other settings
        for extra in ((), ("--max_new_tokens", "8")):
            assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", output, *options, *extra)) == 2
            assert f"--output {output} is being written by another run" in capsys.readouterr().err
            assert output.read_bytes() == before
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=120) == 0
    assert read_output(output) == read_output(reference) and len(output.read_text().splitlines()) == 40
    assert not (tmp_path / ".out.jsonl.lock").exists()  # removed by the run that held it
    assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", output, *options)) == 0  # a later run goes on


def test_an_output_that_is_a_pipe_or_a_device_is_refused_before_the_model_loads(model_folder, tmp_path, capsys,
                                                                                  monkeypatch):
    from longreach import cli

    write_jsonl(tmp_path / "corpus.jsonl", 2)
    monkeypatch.setattr(cli, "load_summarizer", lambda *a, **k: pytest.fail("the model was loaded"))
    os.mkfifo(tmp_path / "fifo.jsonl")  # its records were read before: the run waited forever for a writer
    (tmp_path / "null.jsonl").symlink_to(os.devnull)
    # a writer that comes after a while, so that a run reading the FIFO fails here instead of hanging
    writer = threading.Timer(10, lambda: os.close(os.open(tmp_path / "fifo.jsonl", os.O_WRONLY)))
    writer.daemon = True
    writer.start()
    for name in ("fifo.jsonl", "null.jsonl"):
        assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", tmp_path / name, "--id_column",
                                   "doc_id")) == 2
        assert f"--output {tmp_path / name} is not a regular file (a pipe or a device)" in capsys.readouterr().err
    assert (tmp_path / "fifo.jsonl").is_fifo() and os.readlink(tmp_path / "null.jsonl") == os.devnull
    writer.cancel()


def test_an_output_that_is_a_symlink_stays_one_and_its_target_gets_the_summaries(model_folder, tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", 12)
    options = ("--id_column", "doc_id")
    reference = tmp_path / "uninterrupted.jsonl"
    assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", reference, *options)) == 0
    (tmp_path / "big-disk").mkdir()
    link = tmp_path / "out.jsonl"
    link.symlink_to(tmp_path / "big-disk" / "out.jsonl")
    for _ in range(2):  # the run, and a rerun of the finished corpus
        assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", link, *options)) == 0
        assert link.is_symlink()  # the merge in corpus order renamed a regular file over it
        assert (tmp_path / "big-disk" / "out.jsonl").read_bytes() == reference.read_bytes()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be made")
def test_an_output_where_no_file_can_be_written_is_refused_before_the_model_loads(model_folder, tmp_path, capsys,
                                                                                    monkeypatch):
    from longreach import cli

    write_jsonl(tmp_path / "corpus.jsonl", 2)
    monkeypatch.setattr(cli, "load_summarizer", lambda *a, **k: pytest.fail("the model was loaded"))
    for output in ("/proc/out.jsonl", "/proc/new-folder/out.jsonl"):
        assert main(summarize_args(model_folder, tmp_path / "corpus.jsonl", Path(output), "--id_column", "doc_id")) == 2
        error = capsys.readouterr().err
        assert f"error: cannot write --output {output}: No such file or directory (/proc/" in error, error


def test_a_rerun_after_documents_were_removed_from_the_input_says_their_summaries_stay(model_folder, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "corpus.jsonl", 5)
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", tmp_path / "out.jsonl", "--id_column", "doc_id")
    assert main(arguments) == 0
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:3]), encoding="utf-8")
    capsys.readouterr()
    assert main(arguments) == 0
    error = capsys.readouterr().err
    assert f"warning: {tmp_path / 'out.jsonl'} holds 2 summaries of ids no longer in --input" in error, error
    assert "['d003', 'd004']" in error and len(read_output(tmp_path / "out.jsonl")) == 5  # kept: nothing is lost


def test_without_posix_locks_the_run_lock_is_a_no_op(tmp_path, monkeypatch):
    """Where `fcntl` does not exist (Windows), OUT's run lock guards nothing instead of raising an ImportError that
    would stop every corpus run there. (Two runs are refused by the lock where it exists: a test above, in processes
    of their own, since POSIX locks belong to a process.)"""
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` raises ImportError
    output = tmp_path / "out.jsonl"
    with corpus_module.output_lock(output), corpus_module.output_lock(output):
        assert not corpus_module.lock_path_of(output).exists()


def test_a_rerun_summarizes_again_the_documents_edited_since_and_only_those(model_folder, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "corpus.jsonl", 5)
    output = tmp_path / "out.jsonl"
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", output, "--id_column", "doc_id")
    assert main(arguments) == 0
    first = read_output(output)
    assert first["d001"]["text_digest"] == corpus_module.text_digest(rows[1]["text"])
    rows[1]["text"] = document(30, offset=17)  # d001 edited under the same id
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    calls = []
    original = corpus_module._summarize_batch
    corpus_module._summarize_batch = lambda summarizer, corpus, batch, *rest: (
        calls.extend(corpus.ids[i] for i in batch) or original(summarizer, corpus, batch, *rest))
    capsys.readouterr()
    try:
        assert main(arguments) == 0
    finally:
        corpus_module._summarize_batch = original
    assert calls == ["d001"]
    assert f"1 document edited since {output} summarized them" in capsys.readouterr().err
    records = read_output(output)
    assert list(records) == [row["doc_id"] for row in rows] and len(output.read_text().splitlines()) == 5
    summarizer = pipeline("summarization", model=str(model_folder), trust_remote_code=True)
    assert records["d001"]["summary"] == summarizer(rows[1]["text"], max_new_tokens=4)[0]["summary_text"]
    assert records["d001"]["text_digest"] == corpus_module.text_digest(rows[1]["text"])
    unchanged = [key for key in first if key != "d001"]
    assert [records[key] for key in unchanged] == [first[key] for key in unchanged]
    # records written before the digest existed count as done, as they did then
    old = [{key: value for key, value in record.items() if key != "text_digest"} for record in records.values()]
    output.write_text("".join(json.dumps(record) + "\n" for record in old), encoding="utf-8")
    corpus_module._summarize_batch = lambda *args: pytest.fail("a record without a digest was summarized again")
    try:
        assert main(arguments) == 0
    finally:
        corpus_module._summarize_batch = original
    assert corpus_module.json_lines(output) == old


def test_a_part_left_by_an_interrupted_run_does_not_bring_back_the_summary_of_an_edited_document(model_folder,
                                                                                                   tmp_path, capsys):
    """An interrupted 2-process run left d001's summary in a part; d001 is edited and a 1-process rerun summarizes it
    again into OUT. The merge let the part's older record replace the new one (a later file's record won), while the
    run said that the new records replace the old ones."""
    rows = write_jsonl(tmp_path / "corpus.jsonl", 4)
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", tmp_path / "one.jsonl", "--id_column", "doc_id")
    assert main(arguments) == 0
    before = corpus_module.finished_records(tmp_path / "one.jsonl")["d001"]
    output = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.part-1-of-2.jsonl").write_text(json.dumps(before) + "\n", encoding="utf-8")
    rows[1]["text"] = document(40, offset=17)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    arguments = summarize_args(model_folder, tmp_path / "corpus.jsonl", output, "--id_column", "doc_id")
    capsys.readouterr()
    assert main(arguments) == 0
    assert "1 document edited since" in capsys.readouterr().err
    records = corpus_module.json_lines(output)
    assert [record["id"] for record in records] == ["d000", "d001", "d002", "d003"]
    assert records[1]["text_digest"] == corpus_module.text_digest(rows[1]["text"]) != before["text_digest"]
    summarizer = pipeline("summarization", model=str(model_folder), trust_remote_code=True)
    assert records[1]["summary"] == summarizer(rows[1]["text"], max_new_tokens=4)[0]["summary_text"]
    assert not list(tmp_path.glob("out.jsonl.part-*"))
    # the part's record of the text read now is kept over an older one in OUT, as before
    (tmp_path / "out.jsonl.part-1-of-2.jsonl").write_text(json.dumps(records[1]) + "\n", encoding="utf-8")
    with open(output, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(before) + "\n")
    corpus = corpus_module.read_corpus(str(tmp_path / "corpus.jsonl"), id_column="doc_id")
    assert corpus_module.merge_parts(output, corpus, world_size=1) == records
