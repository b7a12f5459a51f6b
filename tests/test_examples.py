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
