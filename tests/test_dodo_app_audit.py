"""Dodo through the application layers (audit): `longreach summarize` on a Dodo folder whose generation_config samples,
as a Llama-2 base's does (`convert dodo` now writes a greedy one; a folder saved by hand may not), and a corpus run's
--max_input_length that no document fits."""

from __future__ import annotations

import json

import pytest
import torch
from test_workflows_vcc_t5_dodo import llama_word_tokenizer, tiny_dodo
from transformers import pipeline
from workflow_helpers import document

from longreach.cli import main as cli_main


@pytest.fixture(scope="module")
def sampling_dodo(tmp_path_factory):
    """A tiny Dodo folder whose generation_config samples (Llama-2-7b-hf's settings), and its greedy summary."""
    folder = tmp_path_factory.mktemp("dodo_app") / "dodo"
    model, tokenizer = tiny_dodo(), llama_word_tokenizer()
    model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = document(200)
    greedy = pipeline("long-summarization", model=model, tokenizer=tokenizer)(text, do_sample=False)
    return folder, text, greedy[0]["summary_text"]


def test_summarize_no_do_sample_overrides_a_sampling_checkpoint(sampling_dodo, tmp_path, capsys):
    folder, text, greedy = sampling_dodo
    file = tmp_path / "doc.txt"
    file.write_text(text, encoding="utf-8")
    summaries = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        assert cli_main(["summarize", "--model", str(folder), str(file), "--no-do_sample"]) == 0
        summaries.append(capsys.readouterr().out.strip())
    assert summaries == [greedy, greedy]
    torch.manual_seed(0)
    assert cli_main(["summarize", "--model", str(folder), str(file)]) == 0
    assert capsys.readouterr().out.strip() != greedy  # without the option, the checkpoint's sampling


def test_corpus_no_do_sample_is_a_recorded_setting(sampling_dodo, tmp_path, capsys):
    folder, text, greedy = sampling_dodo
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(text, encoding="utf-8")
    output = tmp_path / "out.jsonl"
    command = ["summarize", "--model", str(folder), "--input", str(tmp_path / "docs"), "--output", str(output)]
    assert cli_main([*command, "--no-do_sample"]) == 0
    assert [json.loads(line)["summary"] for line in output.read_text().splitlines()] == [greedy]
    settings = json.loads((tmp_path / "out.settings.json").read_text())
    assert settings["generation"] == {"do_sample": False}
    capsys.readouterr()
    assert cli_main([*command, "--do_sample"]) == 2  # another setting: refused, not mixed into the same file
    assert "do_sample" in capsys.readouterr().err


def test_corpus_max_input_length_that_leaves_no_room_is_refused_once(sampling_dodo, tmp_path, capsys):
    """At or under Dodo's prompt prefix (BOS and "[INST]"), every document failed on its own into the errors file and
    the run exited 3; it is one usage error now, before any document and before OUT is written."""
    folder, text, _ = sampling_dodo
    (tmp_path / "docs").mkdir()
    for name in ("a", "b"):
        (tmp_path / "docs" / f"{name}.txt").write_text(text, encoding="utf-8")
    output = tmp_path / "out.jsonl"
    assert cli_main(["summarize", "--model", str(folder), "--input", str(tmp_path / "docs"), "--output", str(output),
                     "--max_input_length", "2", "--no-do_sample"]) == 2
    error = capsys.readouterr().err
    assert ("--max_input_length 2: `max_input_length` must leave room for the document after the 2 prefix tokens"
            in error)
    assert not output.exists() and not (tmp_path / "out.errors.jsonl").exists()
    assert not (tmp_path / "out.settings.json").exists()
