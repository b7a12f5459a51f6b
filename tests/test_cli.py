"""The ``longreach`` command: convert (the converters' own options), summarize (progress on stderr), push, model-cards.

`longreach demo` is covered by test_demo.py.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
from huggingface_hub import ModelCard
from transformers import pipeline
from workflow_helpers import document, save_tiny_locost, word_tokenizer

from longreach import hub
from longreach.cli import CONVERTERS, main


@pytest.fixture(scope="module")
def converted_locost(tmp_path_factory, fixtures_dir):
    """The LOCOST fixture checkpoint converted with `longreach convert locost`, with a local tokenizer."""
    root = tmp_path_factory.mktemp("cli")
    word_tokenizer(vocab_size=128).save_pretrained(root / "tokenizer")
    code = main(["convert", "locost", "--checkpoint_path", str(fixtures_dir / "locost" / "hf_checkpoint"),
                 "--pytorch_dump_folder_path", str(root / "locost-hf"), "--tokenizer_name_or_path",
                 str(root / "tokenizer")])
    assert code == 0
    return root / "locost-hf"


def test_convert_locost_writes_a_hub_ready_folder_with_its_card(converted_locost, fixtures_dir):
    assert hub.hub_files(converted_locost)  # complete: code files, auto_map, custom_pipelines, safetensors
    assert {"tokenizer.json", "model.safetensors", "pipeline_summarization.py"} <= set(hub.hub_files(converted_locost))
    card = ModelCard.load(converted_locost / "README.md")
    assert card.data.pipeline_tag == "summarization" and "custom_code" in card.data.tags
    assert hub.read_card_state(converted_locost / "README.md")["converted_from"] == str(
        fixtures_dir / "locost" / "hf_checkpoint")


def test_convert_passes_options_through(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "locost", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: longreach convert locost") and "--pytorch_dump_folder_path" in out
    assert main(["convert", "locost", "--checkpoint_path", str(tmp_path / "missing"), "--pytorch_dump_folder_path",
                 str(tmp_path / "out")]) == 1  # the converter's own error handling and exit code
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["vcc", "dodo"])
def test_convert_imports_other_converters_only_when_asked(name, capsys):
    available = importlib.util.find_spec(CONVERTERS[name]) is not None
    if available:
        with pytest.raises(SystemExit) as exit_info:
            main(["convert", name, "--help"])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: longreach convert {name}")
    else:
        assert main(["convert", name, "--help"]) == 1
        assert "is not part of this longreach installation" in capsys.readouterr().err


def test_convert_rejects_unknown_converters(capsys):
    assert main(["convert", "bart"]) == 2
    assert "unknown converter 'bart'" in capsys.readouterr().err


def test_summarize_console_script(converted_locost, tmp_path):
    doc = document(3000)  # a long file, read whole
    (tmp_path / "doc.txt").write_text(doc)
    script = shutil.which("longreach") or pytest.fail("the `longreach` console script is not installed")
    result = subprocess.run([script, "summarize", "--model", str(converted_locost), str(tmp_path / "doc.txt"),
                             "--max_new_tokens", "5", "--num_beams", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    expected = pipeline("summarization", model=str(converted_locost), trust_remote_code=True)(
        doc, max_new_tokens=5, num_beams=2)[0]["summary_text"]
    assert result.stdout == expected + "\n"
    assert "3001 tokens" in result.stderr and "generating:" in result.stderr and "done in" in result.stderr


def test_summarize_stdin_output_file_and_dropped_tokens(converted_locost, tmp_path, monkeypatch, capsys):
    doc = document(400)
    monkeypatch.setattr(sys, "stdin", type("Stdin", (), {"read": staticmethod(lambda: doc)})())
    code = main(["summarize", "--model", str(converted_locost), "-", "--max_new_tokens", "3",
                 "--max_input_length", "100", "--output", str(tmp_path / "summary.txt")])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "its last 301 tokens were dropped (max_input_length=100)" in captured.err
    with pytest.warns(UserWarning, match="its last 301 tokens were dropped"):
        expected = pipeline("summarization", model=str(converted_locost), trust_remote_code=True)(
            doc, max_new_tokens=3, max_input_length=100)[0]["summary_text"]
    assert (tmp_path / "summary.txt").read_text().strip() == expected


def test_summarize_reports_unreadable_input(converted_locost, tmp_path, capsys):
    assert main(["summarize", "--model", str(converted_locost), str(tmp_path / "absent.txt")]) == 1
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("  \n")
    assert main(["summarize", "--model", str(converted_locost), str(tmp_path / "empty.txt")]) == 1
    assert "holds no text" in capsys.readouterr().err


def test_push_command_uploads_through_our_client(tmp_path, monkeypatch, capsys):
    uploads = []
    monkeypatch.setattr(hub, "push_folder_to_hub", lambda folder, repo_id, **kw: uploads.append(
        (str(folder), repo_id, kw)) or type("Commit", (), {"commit_url": "https://hub/commit"})())
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    folder = save_tiny_locost(tmp_path / "tiny")
    assert main(["push", str(folder), "someone/tiny", "--private"]) == 0
    assert uploads == [(str(folder), "someone/tiny", {"private": True, "commit_message": None})]
    assert capsys.readouterr().out.strip() == "https://hub/commit"


def test_model_cards_command(tmp_path, capsys):
    assert main(["model-cards", "--output_dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dodo_llama.md", "locost.md", "vcc_t5.md"]
    assert capsys.readouterr().out.split()[0].endswith("locost.md")


def test_summarize_refuses_to_write_over_its_document(converted_locost, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(document(30))
    before = (tmp_path / "doc.txt").read_text()
    assert main(["summarize", "--model", str(converted_locost), str(tmp_path / "doc.txt"), "--max_new_tokens", "2",
                 "--output", str(tmp_path / "." / "doc.txt")]) == 2
    assert "is the document FILE" in capsys.readouterr().err
    assert (tmp_path / "doc.txt").read_text() == before
    assert main(["summarize", "--model", str(converted_locost), str(tmp_path / "doc.txt"), "--max_new_tokens", "2",
                 "--output", str(tmp_path / "new-folder" / "s.txt")]) == 0  # its folder is made, as a corpus's is
    assert sorted(path.name for path in tmp_path.iterdir()) == ["doc.txt", "new-folder"]
    assert [path.name for path in (tmp_path / "new-folder").iterdir()] == ["s.txt"]  # no temporary file left behind



def test_summarize_writes_through_a_symlinked_output_and_into_a_device(converted_locost, tmp_path):
    import os

    (tmp_path / "doc.txt").write_text(document(30))
    (tmp_path / "real.txt").write_text("old\n")
    (tmp_path / "link.txt").symlink_to(tmp_path / "real.txt")
    (tmp_path / "null.txt").symlink_to(os.devnull)  # as /dev/stdout is /proc/self/fd/1: renamed over, it was a file
    for name in ("link.txt", "null.txt"):
        assert main(["summarize", "--model", str(converted_locost), str(tmp_path / "doc.txt"), "--max_new_tokens", "2",
                     "--output", str(tmp_path / name)]) == 0
    assert (tmp_path / "link.txt").is_symlink() and (tmp_path / "null.txt").is_symlink()
    assert (tmp_path / "real.txt").read_text() not in ("old\n", "")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["doc.txt", "link.txt", "null.txt", "real.txt"]

def test_model_cards_keep_files_that_are_not_our_cards(tmp_path, capsys):
    (tmp_path / "locost.md").write_text("MINE")
    assert main(["model-cards", "--output_dir", str(tmp_path)]) == 2
    assert "holds locost.md, which are not longreach model cards" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locost.md"] and (tmp_path / "locost.md").read_text() == "MINE"
    (tmp_path / "locost.md").unlink()
    assert main(["model-cards", "--output_dir", str(tmp_path)]) == 0
    assert main(["model-cards", "--output_dir", str(tmp_path)]) == 0  # our own cards are regenerated in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dodo_llama.md", "locost.md", "vcc_t5.md"]
    (tmp_path / "afile").write_text("x")
    assert main(["model-cards", "--output_dir", str(tmp_path / "afile")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_summarize_device_help_names_the_default_transformers_chooses(converted_locost, monkeypatch, capsys):
    """`--device`'s help said "default: cuda if present", but with no --device the pipeline takes transformers'
    choice, which is mps on Apple Silicon (no CUDA there): the help names it."""
    import torch
    import transformers.pipelines.base as pipeline_base

    from longreach.cli import load_summarizer

    with pytest.raises(SystemExit):
        main(["summarize", "--help"])
    device_help = " ".join(capsys.readouterr().out.split("--device DEVICE")[-1].split("--dtype")[0].split())
    # a Mac: no CUDA, mps present; the model's move there is recorded instead of done
    monkeypatch.setattr(pipeline_base, "is_torch_cuda_available", lambda: False)
    monkeypatch.setattr(pipeline_base, "is_torch_mps_available", lambda: True)
    moves = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda module, *args, **kwargs: moves.append(args) or module)
    assert load_summarizer(str(converted_locost)).device.type == "mps" and moves
    assert "cuda if present" not in device_help and "mps on Apple Silicon" in device_help, device_help
    assert "else cpu" in device_help, device_help
