"""The examples run as they are (their smoke modes, as CI runs them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from huggingface_hub import ModelCard

from longreach import hub

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_finetune_summarization_smoke(tmp_path):
    output_dir = tmp_path / "finetuned"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_summarization.py"), "--smoke", "--output_dir", str(output_dir)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics["train_loss"] > 0 and metrics["epoch"] > 0
    for key in ("eval_rouge1", "eval_rouge2", "eval_rougeLsum"):  # generation during evaluation, scored offline
        assert 0.0 <= metrics[key] <= 100.0
    assert metrics["eval_gen_len"] > 0
    assert "summary of the first validation document:" in result.stdout  # reloaded through pipeline("summarization")
    assert {"model.safetensors", "modeling_locost.py", "pipeline_summarization.py", "tokenizer.json"} <= set(
        hub.hub_files(output_dir))
    assert "Fine-tuned with `examples/finetune_summarization.py`" in ModelCard.load(output_dir / "README.md").text


def test_finetune_summarization_pushes_with_our_card(tmp_path, monkeypatch):
    """`--push_to_hub` uploads through longreach (the Trainer's own upload would replace our model card)."""
    import importlib.util
    from types import SimpleNamespace

    uploads = []

    class RecordingHubApi:
        def __init__(self, **kwargs):
            pass

        def create_repo(self, repo_id, **kwargs):
            return SimpleNamespace(repo_id=repo_id)

        def create_commit(self, repo_id, operations, **kwargs):
            uploads.append((repo_id, {op.path_in_repo: op.path_or_fileobj for op in operations}))
            return SimpleNamespace(commit_url="https://hub/commit")

    monkeypatch.setattr(hub, "HfApi", RecordingHubApi)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = importlib.util.spec_from_file_location("finetune_summarization", EXAMPLES / "finetune_summarization.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # dataclasses look their module up there
    spec.loader.exec_module(example)
    example.main(["--smoke", "--output_dir", str(tmp_path / "ft"), "--push_to_hub", "--hub_model_id", "someone/ft",
                  "--max_steps", "1", "--do_eval", "false"])
    ((repo_id, files),) = uploads
    assert repo_id == "someone/ft"
    assert {"README.md", "model.safetensors", "modeling_locost.py", "tokenizer.json"} <= set(files)
    assert "training_args.bin" not in files
    assert "Fine-tuned with `examples/finetune_summarization.py`" in files["README.md"].decode()
