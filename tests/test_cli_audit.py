"""`longreach summarize` with the files users have: a byte order mark, data formats that are not read, a rerun with
other settings (refused before the model loads)."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
from workflow_helpers import document, save_tiny_locost

from longreach import cli
from longreach.cli import main

GENERATION = ["--max_new_tokens", "4"]
BOM = b"\xef\xbb\xbf"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_locost(tmp_path_factory.mktemp("audit") / "tiny")


def read_output(path: Path) -> dict[str, dict]:
    return {record["id"]: record for record in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


def test_a_byte_order_mark_is_not_part_of_the_document(model_folder, tmp_path, monkeypatch, capsys):
    """Windows editors start UTF-8 files with a BOM; read as text it was glued to the first word (<unk> for the tiny
    word-level tokenizer: the model read another document). Table files already drop it (pandas, the JSON readers)."""
    from longreach.pipelines.pipeline_summarization import LongSummarizationPipeline

    read = []  # the token ids the model is given, per document
    prepare = LongSummarizationPipeline._prepare_inputs

    def recording_prepare(self, documents, *args, **kwargs):
        inputs, dropped = prepare(self, documents, *args, **kwargs)
        read.extend(ids[mask.bool()].tolist() for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"]))
        return inputs, dropped

    monkeypatch.setattr(LongSummarizationPipeline, "_prepare_inputs", recording_prepare)
    text = document(30)
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "plain.txt").write_bytes(text.encode("utf-8"))
    (folder / "with-bom.txt").write_bytes(BOM + text.replace(" ", "\r\n", 3).encode("utf-8"))
    output = tmp_path / "out.jsonl"
    assert main(["summarize", "--model", str(model_folder), "--input", str(folder), "--output", str(output),
                 "--max_batch_tokens", "31", *GENERATION]) == 0  # one document per batch
    records = read_output(output)
    assert records["with-bom.txt"]["summary"] == records["plain.txt"]["summary"]
    capsys.readouterr()
    for name in ("plain.txt", "with-bom.txt"):  # one document: FILE, then standard input
        assert main(["summarize", "--model", str(model_folder), str(folder / name), *GENERATION]) == 0
        assert capsys.readouterr().out.strip() == records["plain.txt"]["summary"]
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((folder / name).read_bytes())))
        assert main(["summarize", "--model", str(model_folder), "-", *GENERATION]) == 0
        assert capsys.readouterr().out.strip() == records["plain.txt"]["summary"]
    unknown = 2  # <unk>
    assert len(read) == 6 and unknown not in read[0] and all(ids == read[0] for ids in read), read


@pytest.mark.parametrize("name, advice", [("corpus.tsv", "write it as .csv"),
                                          ("corpus.jsonl.gz", "decompress it first"),
                                          ("corpus.ndjson", "rename it to .jsonl")])
def test_data_files_of_formats_that_are_not_read_are_refused(model_folder, tmp_path, capsys, name, advice):
    """A .tsv or .ndjson table used to be summarized as ONE document (its rows run together, exit code 0); a
    compressed table got "not UTF-8 text ... convert it with iconv". Refused before the model loads, with the fix."""
    source = tmp_path / name
    rows = [{"id": f"d{k}", "text": document(12, offset=k)} for k in range(3)]
    if name.endswith(".tsv"):
        source.write_text("id\ttext\n" + "".join(f"{row['id']}\t{row['text']}\n" for row in rows))
    elif name.endswith(".gz"):
        import gzip

        source.write_bytes(gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode()))
    else:
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out.jsonl"
    assert main(["summarize", "--model", str(model_folder), "--input", str(source), "--output", str(output),
                 *GENERATION]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"--input {source}" in error and advice in error, error
    assert "Traceback" not in error and not output.exists()
    from longreach import corpus as corpus_module

    with pytest.raises(corpus_module.CorpusError, match=advice):
        corpus_module.read_corpus(str(source))


def test_a_rerun_with_other_settings_is_refused_before_the_model_loads(model_folder, tmp_path, monkeypatch, capsys):
    """The settings check needs no model: a 7B model must not load for minutes only to be told that OUT holds another
    run's summaries. Nor is a settings file written for a run that could not start (a mistyped --tokenizer)."""
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": document(12, offset=k)}) + "\n" for k in range(3)))
    output = tmp_path / "out.jsonl"
    command = ["summarize", "--model", str(model_folder), "--input", str(source), "--output", str(output)]
    assert main([*command, "--max_new_tokens", "3"]) == 0
    settings = (tmp_path / "out.settings.json").read_text()
    capsys.readouterr()

    loads = []
    load_summarizer = cli.load_summarizer
    monkeypatch.setattr(cli, "load_summarizer", lambda *args, **kwargs: loads.append(args) or load_summarizer(
        *args, **kwargs))
    assert main([*command, "--max_new_tokens", "4"]) == 2
    assert "holds summaries made with other settings" in capsys.readouterr().err
    assert loads == []  # refused before loading
    assert (tmp_path / "out.settings.json").read_text() == settings

    fresh = tmp_path / "fresh" / "out.jsonl"
    assert main(["summarize", "--model", str(model_folder), "--tokenizer", str(tmp_path / "no-such-tokenizer"),
                 "--input", str(source), "--output", str(fresh), *GENERATION]) == 2
    assert "no-such-tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "fresh" / "out.settings.json").exists()
    assert main([*command, "--max_new_tokens", "3"]) == 0  # the same settings finish the run, after loading
    assert len(loads) == 2


def corpus_run_of_three(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A tiny LOCOST folder, a corpus of three documents and the `summarize --input` command that summarizes them into
    `out.jsonl`: ``(model folder, output, command)``."""
    model_folder = save_tiny_locost(tmp_path / "model")
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": document(12, offset=k)}) + "\n" for k in range(3)))
    output = tmp_path / "out.jsonl"
    return model_folder, output, ["summarize", "--model", str(model_folder), "--input", str(source), "--output",
                                  str(output), *GENERATION]


def test_a_rerun_after_the_model_was_retrained_in_the_same_folder_is_refused(tmp_path, capsys):
    """The model's path is the same, its weights are not: the rerun would add the new model's summaries to the old
    one's in one OUT. The weight files' sizes and digests are part of the run's settings."""
    model_folder, output, command = corpus_run_of_three(tmp_path)
    assert main(command) == 0
    assert main(command) == 0  # an unchanged model finishes (here: leaves) the run
    capsys.readouterr()
    save_tiny_locost(model_folder, seed=12345)  # "retrained" into the same folder
    assert main(command) == 2
    error = capsys.readouterr().err
    assert "holds summaries made with other settings (model_files:" in error
    assert len(read_output(output)) == 3


def test_a_rerun_with_a_copy_of_the_same_weights_finishes_the_run(tmp_path, capsys):
    """The same weights copied into place again (new file times: a fresh download, another node's copy) make the same
    summaries: a rerun finishes the run instead of being refused as another model."""
    model_folder, output, command = corpus_run_of_three(tmp_path)
    assert main(command) == 0
    first = read_output(output)
    lines = output.read_text().splitlines()
    output.write_text("\n".join(lines[:1]) + "\n")  # an interrupted run: one summary of three
    for weights in model_folder.glob("*.safetensors"):
        copy = weights.with_name(weights.name + ".copy")
        copy.write_bytes(weights.read_bytes())
        os.utime(copy, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
        copy.replace(weights)
    capsys.readouterr()
    assert main(command) == 0, capsys.readouterr().err
    assert read_output(output) == first


def test_a_byte_that_is_not_utf8_after_a_byte_order_mark_is_named_at_its_offset_in_the_file(model_folder, tmp_path,
                                                                                             monkeypatch, capsys):
    """The mark is three bytes of the file: an error's offset counts them (it was 3 too small, counted after it)."""
    data = BOM + b"abc \xe9t\xe9"  # the first bad byte is the file's 7th: offset 7
    (tmp_path / "doc.txt").write_bytes(data)
    assert main(["summarize", "--model", str(model_folder), str(tmp_path / "doc.txt"), *GENERATION]) == 1
    assert "(byte 0xe9 at offset 7)" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["summarize", "--model", str(model_folder), "-", *GENERATION]) == 1
    assert "(byte 0xe9 at offset 7)" in capsys.readouterr().err
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "doc.txt").write_bytes(data)
    (tmp_path / "docs" / "ok.txt").write_text(document(12))
    output = tmp_path / "out.jsonl"
    main(["summarize", "--model", str(model_folder), "--input", str(tmp_path / "docs"), "--output", str(output),
          *GENERATION])
    errors = (tmp_path / "out.errors.jsonl").read_text()
    assert "(byte 0xe9 at offset 7)" in errors, errors


def test_a_run_started_before_the_settings_recorded_digests_finishes(tmp_path, capsys):
    """A run interrupted under the version that recorded the weight files' sizes and file times (not digests) is
    finished by the same command after the upgrade, as the settings added later are not compared: it was refused as
    made "with other settings" (a time then, a digest now), its summaries only kept by choosing another --output. A
    model retrained in place since is still refused, by its file times as then."""
    model_folder, output, command = corpus_run_of_three(tmp_path)
    assert main(command) == 0
    first = read_output(output)
    output.write_text(output.read_text().splitlines()[0] + "\n")  # interrupted after one summary of three
    settings_path = tmp_path / "out.settings.json"
    settings = json.loads(settings_path.read_text())
    settings["model_files"] = {path.name: [path.stat().st_size, path.stat().st_mtime_ns]  # as the earlier version
                               for path in sorted(model_folder.glob("*.safetensors"))}
    settings_path.write_text(json.dumps(settings))
    capsys.readouterr()
    assert main(command) == 0, capsys.readouterr().err
    assert read_output(output) == first
    assert json.loads(settings_path.read_text()) == settings  # left as that run recorded it
    output.write_text(output.read_text().splitlines()[0] + "\n")
    save_tiny_locost(model_folder, seed=12345)  # then retrained into the same folder
    capsys.readouterr()
    assert main(command) == 2
    assert "holds summaries made with other settings (model_files:" in capsys.readouterr().err
