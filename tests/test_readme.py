"""Every snippet of the README's "Guides" section runs, in order, as a user would run it.

The stage: a working folder holding the authors' original checkpoints (the parity fixtures), a text file, a small
dataset, and a tokenizer built locally. Two substitutions stand in for what CI cannot reach: the Hub tokenizer names
(LongT5's, T5's) become the local tokenizer folder, and a recorder replaces the Hub client (checking what would be
uploaded).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from longreach import cli, hub
from hub_recorder import RecordingHubApi
from tokenizer_helpers import word_level_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


def guide_snippets() -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block between "## Guides" and the next "## " heading, in order."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Guides\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)


def bash_commands(code: str) -> list[list[str]]:
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split("  #", 1)[0].strip()
        if line:
            commands.append(shlex.split(line))
    return commands


@pytest.fixture
def stage(tmp_path, fixtures_dir, monkeypatch):
    shutil.copytree(fixtures_dir / "locost" / "hf_checkpoint", tmp_path / "locost-original")
    (tmp_path / "vcc-original").mkdir()
    shutil.copytree(fixtures_dir / "vcc" / "hf_ckpt", tmp_path / "vcc-original" / "hf_ckpt")
    (tmp_path / "dodo-original").mkdir()
    for part in ("dodo_ckpt", "base"):
        shutil.copytree(fixtures_dir / "dodo" / part, tmp_path / "dodo-original" / part)
    word_level_tokenizer(vocab_size=128).save_pretrained(tmp_path / "local-tokenizer")
    words = [f"w{i}" for i in range(3, 120)]
    (tmp_path / "report.txt").write_text(" ".join(words[i % len(words)] for i in range(600)))
    for split, rows in (("train", 4), ("val", 2)):
        with open(tmp_path / f"{split}.jsonl", "w") as handle:
            for row in range(rows):
                document = " ".join(words[(row * 7 + i) % len(words)] for i in range(200))
                handle.write(json.dumps({"document": document, "summary": " ".join(words[row:row + 5])}) + "\n")
    with open(tmp_path / "qa.jsonl", "w") as handle:
        for row in range(3):
            context = " ".join(words[(row * 5 + i) % len(words)] for i in range(150))
            handle.write(json.dumps({"id": f"q{row}", "context": context, "question": f"What is {words[row]}?"}) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    RecordingHubApi.instances = []
    monkeypatch.setattr(hub, "HfApi", RecordingHubApi)
    monkeypatch.setattr(cli, "push_preflight", lambda: None)  # uploads go to the recorder, offline
    return tmp_path


def run_bash(commands: list[list[str]], workdir: Path) -> None:
    for argv in commands:
        argv = ["local-tokenizer" if arg in ("google/long-t5-local-base", "google-t5/t5-base") else arg for arg in argv]
        if argv[0] == "longreach":
            assert cli.main(argv[1:]) in (0, None), argv
        elif argv[0] == "python":
            script = REPO_ROOT / argv[1]
            done = subprocess.run([sys.executable, str(script), *argv[2:]], cwd=workdir, capture_output=True,
                                  text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
        else:
            raise AssertionError(f"unexpected command in the README guides: {argv}")


def test_guides_run_in_order(stage):
    snippets = guide_snippets()
    assert [language for language, _ in snippets].count("python") >= 5
    # Conversion first: the other guides use its output folders.
    convert = [code for language, code in snippets if language == "bash" and "longreach convert" in code]
    assert len(convert) == 1
    run_bash(bash_commands(convert[0]), stage)

    namespace: dict = {"__name__": "__readme__"}
    for language, code in snippets:
        if code is convert[0]:
            continue
        if language == "python":
            exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own documentation
        else:
            run_bash(bash_commands(code), stage)

    # What the snippets produced is real, not just "no exception".
    assert namespace["summary_ids"].shape[0] == 1
    assert namespace["answer_ids"].shape[0] == 1
    assert isinstance(namespace["answer"], str) and len(namespace["answers"]) == 2
    answers = [json.loads(line) for line in (stage / "answers.jsonl").read_text().splitlines()]
    assert [(record["id"], record["question"]) for record in answers] == [(f"q{row}", f"What is w{row + 3}?")
                                                                          for row in range(3)]
    assert namespace["continuation"].shape[1] > namespace["prompt"].shape[1]
    assert namespace["continuation"].tolist() == namespace["same"].tolist()
    assert (stage / "locost-ft" / "model.safetensors").is_file()
    pushed = [commit for api in RecordingHubApi.instances for commit in api.commits]
    assert [commit["repo_id"] for commit in pushed] == ["you/locost-ft", "you/locost-ft"]
    for commit in pushed:
        assert {"config.json", "model.safetensors", "modeling_locost.py", "README.md"} <= set(commit["files"])
        assert b"longreach" in commit["files"]["README.md"]
