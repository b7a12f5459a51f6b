"""The command line on other systems, simulated here: a Windows console's cp1252 standard output, Windows line
endings piped in."""

from __future__ import annotations

import io
import sys

import pytest
from workflow_helpers import document, save_tiny_locost

from longreach import cli
from longreach.cli import main


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_locost(tmp_path_factory.mktemp("portability") / "tiny")


@pytest.mark.parametrize("encoding, errors, expected", [
    ("cp1252", "strict", "Résumé — \\u8981\\u7d04 \\u2713\n"),
    ("ascii", "surrogateescape", "R\\xe9sum\\xe9 \\u2014 \\u8981\\u7d04 \\u2713\n"),
], ids=["windows", "LC_ALL=C"])
def test_a_summary_that_standard_output_cannot_encode_is_printed_with_escapes(model_folder, tmp_path, monkeypatch,
                                                                               capsys, encoding, errors, expected):
    """Windows writes a redirected standard output (``longreach summarize doc.txt > summary.txt``) in cp1252: a
    summary with other characters failed with 'UnicodeEncodeError: 'charmap' codec can't encode' after it was made,
    and was lost. Under ``LC_ALL=C`` (``PYTHONUTF8=0``, ``PYTHONCOERCECLOCALE=0``) Python's standard output is ASCII
    with the "surrogateescape" handler, which raised the same error."""
    summary = "Résumé — 要約 ✓"
    load = cli.load_summarizer

    def non_ascii_summarizer(*args, **kwargs):
        real = load(*args, **kwargs)
        return type("Summarizer", (), {"model": real.model, "tokenizer": real.tokenizer,
                                       "__call__": lambda self, *a, **k: [{"summary_text": summary}]})()

    monkeypatch.setattr(cli, "load_summarizer", non_ascii_summarizer)
    (tmp_path / "doc.txt").write_text(document(20), encoding="utf-8")
    written = io.BytesIO()
    console = io.TextIOWrapper(written, encoding=encoding, errors=errors, write_through=True)
    monkeypatch.setattr(sys, "stdout", console)
    assert main(["summarize", "--model", str(model_folder), str(tmp_path / "doc.txt")]) == 0
    assert written.getvalue().decode(encoding) == expected
    err = capsys.readouterr().err
    assert f"standard output's encoding ({encoding}) lacks characters of the summary" in err and "--output" in err
    assert console.errors == errors  # main() leaves the stream as it found it


def test_a_document_piped_in_with_windows_line_endings_is_the_document_of_the_file(tmp_path, monkeypatch):
    """``type doc.txt | longreach summarize -`` on Windows: the FILE was read with universal newlines, standard input
    kept every '\\r' (byte-level tokenizers such as Llama's read an extra token per line)."""
    data = "first line\r\nsecond line\r\nthird\rfourth\n".encode("utf-8")
    (tmp_path / "doc.txt").write_bytes(data)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    piped = cli._read_document("-")
    assert piped == cli._read_document(str(tmp_path / "doc.txt")) == "first line\nsecond line\nthird\nfourth\n"


@pytest.mark.parametrize("corpus", [False, True], ids=["FILE", "--input"])
def test_an_output_that_names_the_document_in_another_spelling_is_refused(model_folder, tmp_path, monkeypatch,
                                                                          capsys, corpus):
    """macOS and Windows file systems ignore case by default: ``--output Doc.txt`` for FILE ``doc.txt`` compared
    unequal as paths, and the summary was renamed over the document. A hard link is such a second spelling here."""
    document_file = tmp_path / "doc.txt"
    document_file.write_text(document(30), encoding="utf-8")
    other_spelling = tmp_path / ("Doc.txt" if not corpus else "Doc.jsonl")
    if corpus:  # a one-record JSONL corpus, its output another name of it
        document_file = tmp_path / "doc.jsonl"
        document_file.write_text('{"text": "%s"}\n' % document(30), encoding="utf-8")
    import os

    os.link(document_file, other_spelling)
    monkeypatch.setattr(cli, "load_summarizer", lambda *a, **k: pytest.fail("the model was loaded"))
    source = ["--input", str(document_file)] if corpus else [str(document_file)]
    assert main(["summarize", "--model", str(model_folder), *source, "--output", str(other_spelling)]) == 2
    err = capsys.readouterr().err
    assert ("is the document FILE" if not corpus else "is the --input file") in err, err
