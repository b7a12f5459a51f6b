"""Faults while longreach writes files: nothing a user had is lost, nothing is left half-written under its final name,
the error says what happened, and a rerun recovers."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from workflow_helpers import save_tiny_locost, tiny_locost

from longreach import LocostForConditionalGeneration

REPO = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


def same_weights(model, other) -> bool:
    theirs = other.state_dict()
    return all(torch.equal(tensor, theirs[key]) for key, tensor in model.state_dict().items())


def test_a_save_that_fails_midway_keeps_the_earlier_checkpoint_and_a_rerun_saves(tmp_path, monkeypatch):
    # transformers' own save_pretrained writes the weights over the earlier ones: a full disk halfway leaves a
    # model.safetensors that no longer loads
    import transformers.modeling_utils as modeling_utils

    folder = save_tiny_locost(tmp_path / "model")
    (folder / "notes.txt").write_text("the user's own", encoding="utf-8")
    before = snapshot(folder)
    retrained = tiny_locost(seed=5)

    def disk_full(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(modeling_utils, "safe_save_file", disk_full)
        with pytest.raises(OSError, match=f"while saving to {folder}: the checkpoint already there is kept") as caught:
            retrained.save_pretrained(folder)
    assert caught.value.errno == errno.ENOSPC
    assert snapshot(folder) == before
    assert sorted(path.name for path in folder.iterdir()) == sorted(before)  # no staging folder left behind
    assert not same_weights(retrained, LocostForConditionalGeneration.from_pretrained(folder))

    retrained.save_pretrained(folder)
    assert same_weights(retrained, LocostForConditionalGeneration.from_pretrained(folder))
    assert (folder / "notes.txt").read_text(encoding="utf-8") == "the user's own"
    assert sorted(path.name for path in folder.iterdir()) == sorted(before)



def test_a_save_into_a_new_folder_that_fails_midway_leaves_no_weights_under_their_name(tmp_path, monkeypatch):
    import transformers.modeling_utils as modeling_utils

    def disk_full(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    folder = tmp_path / "model"
    monkeypatch.setattr(modeling_utils, "safe_save_file", disk_full)
    with pytest.raises(OSError, match=f"while saving to {folder}: nothing was written under the names of its files"):
        tiny_locost().save_pretrained(folder)
    assert list(folder.iterdir()) == []

KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import transformers.modeling_utils as modeling_utils
    sys.path.insert(0, "tests")
    from workflow_helpers import tiny_locost

    def killed(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\\0" * 100)  # part of the weights on disk, then the kill
        os.kill(os.getpid(), signal.SIGKILL)

    modeling_utils.safe_save_file = killed
    tiny_locost(seed=5).save_pretrained(sys.argv[1])
    """
)


def test_a_save_killed_while_writing_keeps_the_earlier_checkpoint_and_the_next_save_clears_its_leftovers(tmp_path):
    folder = save_tiny_locost(tmp_path / "model")
    before = snapshot(folder)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(folder)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == -signal.SIGKILL, process.stderr[-2000:]
    assert snapshot(folder) == before
    leftovers = [path for path in folder.iterdir() if path.is_dir()]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".longreach-save-")
    LocostForConditionalGeneration.from_pretrained(folder)  # still the complete earlier checkpoint

    retrained = tiny_locost(seed=5)
    retrained.save_pretrained(folder)
    assert not leftovers[0].exists()
    assert same_weights(retrained, LocostForConditionalGeneration.from_pretrained(folder))


def test_a_save_clears_a_day_old_staging_folder_of_another_machine_and_keeps_a_recent_one(tmp_path):
    """A save killed on another node or in another container cannot be told dead by its process id: its partial copy
    of the weights is removed once untouched for a day (no save takes that long); a recent one may be a live save."""
    folder = save_tiny_locost(tmp_path / "model")
    old, recent = (folder / f".longreach-save-1-another-host-{name}" for name in ("old", "recent"))
    for staging in (old, recent):
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"partial")
    day_and_a_minute_ago = time.time() - 24 * 3600 - 60
    os.utime(old, (day_and_a_minute_ago, day_and_a_minute_ago))
    tiny_locost(seed=5).save_pretrained(folder)
    assert not old.exists() and recent.exists()


@pytest.mark.parametrize("first, second", [("100KB", "50GB"), ("50GB", "100KB"), ("60KB", "100KB")])
def test_a_save_over_another_sharding_leaves_only_the_new_weights(tmp_path, first, second):
    """The files transformers leaves, less the earlier save's other layout: transformers leaves a single
    `model.safetensors` beside new shards, and `from_pretrained` then reads it, the earlier weights, without a word."""
    from transformers import PreTrainedModel

    def weight_files(folder):
        return sorted(name for name in os.listdir(folder) if name.startswith(("model.", "model-")))

    earlier, model = tiny_locost(), tiny_locost(seed=5)
    for saver, folder in ((lambda m, *args, **kwargs: m.save_pretrained(*args, **kwargs), tmp_path / "ours"),
                          (PreTrainedModel.save_pretrained, tmp_path / "transformers")):
        saver(earlier, folder, max_shard_size=first)
        (folder / "model-notes.txt").write_text("kept", encoding="utf-8")  # starts like a shard's name, is not one
        saver(model, folder, max_shard_size=second)
    ours, theirs = weight_files(tmp_path / "ours"), weight_files(tmp_path / "transformers")
    sharded = (tmp_path / "ours" / "model.safetensors.index.json").exists() and not (
        tmp_path / "ours" / "model.safetensors").exists()
    other_layout = "model.safetensors" if sharded else "model.safetensors.index.json"
    assert ours == [name for name in theirs if name != other_layout]
    assert "model-notes.txt" in ours
    assert same_weights(model, LocostForConditionalGeneration.from_pretrained(tmp_path / "ours"))


def test_a_full_disk_while_the_corpus_output_is_merged_keeps_every_summary_and_leaves_no_hidden_copy(tmp_path,
                                                                                                    monkeypatch):
    from longreach import corpus as corpus_module

    corpus = corpus_module.Corpus(ids=["a", "b"], texts=["x y", "z w"], references=["x", "z"])
    output = tmp_path / "out.jsonl"
    output.write_text(json.dumps({"id": "a", "summary": "one"}) + "\n", encoding="utf-8")
    part = tmp_path / "out.jsonl.part-1-of-2.jsonl"
    part.write_text(json.dumps({"id": "b", "summary": "two"}) + "\n", encoding="utf-8")
    before = snapshot(tmp_path)
    append = corpus_module._append

    def disk_full(handle, records):
        handle.write("{\"id\": ")
        handle.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(corpus_module, "_append", disk_full)
        with pytest.raises(OSError):
            corpus_module.merge_parts(output, corpus, world_size=1)
        assert snapshot(tmp_path) == before  # the output and its part as they were, no hidden half-written copy

    def half_written(path, text, *args, **kwargs):
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", half_written)
        with pytest.raises(OSError):
            corpus_module.write_run_settings(output, {"model": "m", "generation": {}})
        with pytest.raises(OSError):
            corpus_module.corpus_rouge(output, corpus, [{"id": "a", "summary": "x"}])
        assert snapshot(tmp_path) == before
    assert corpus_module._append is append
    merged = corpus_module.merge_parts(output, corpus, world_size=1)  # the rerun finishes the merge
    assert merged == [{"id": "a", "summary": "one"}, {"id": "b", "summary": "two"}]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_full_disk_during_a_conversion_is_one_line_naming_the_output_and_leaves_nothing(fixtures_dir, tmp_path,
                                                                                         monkeypatch, capsys):
    import transformers.modeling_utils as modeling_utils

    from longreach.cli import main

    def disk_full(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    output = tmp_path / "out"
    command = ["convert", "locost", "--checkpoint_path", str(fixtures_dir / "locost" / "hf_checkpoint"),
               "--pytorch_dump_folder_path", str(output)]
    with monkeypatch.context() as patch:
        patch.setattr(modeling_utils, "safe_save_file", disk_full)
        assert main(command) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"error: No space left on device while writing the converted checkpoint to {output}; nothing "
                     "was written there: free some space or choose a folder on another disk.")
    assert list(tmp_path.iterdir()) == []
    assert main(command) == 0 and (output / "model.safetensors").is_file()  # the rerun, with room


@pytest.mark.parametrize("state", ["", '{"global_step": 7, "best_met'])
def test_a_checkpoint_whose_trainer_state_was_cut_short_is_skipped_when_resuming(tmp_path, capsys, state):
    # a full disk or a machine crash while Trainer wrote trainer_state.json, its last file: resuming from that
    # checkpoint failed at every rerun with "error: Unterminated string starting at: line 1 column 20"
    from types import SimpleNamespace

    from longreach.finetuning import resume_checkpoint

    for step, text in ((3, '{"global_step": 3}'), (7, state)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"")
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(text)
    args = SimpleNamespace(output_dir=str(tmp_path), max_steps=20, num_train_epochs=3, resume_from_checkpoint=None)
    assert resume_checkpoint(args) == str(tmp_path / "checkpoint-3")
    assert "(skipping the incomplete checkpoint-7)" in capsys.readouterr().err


def safetensors_disk_full(tensors, filename, *args, **kwargs):
    """What safetensors raises on a full disk (seen on a full tmpfs): a SafetensorError, which is not an OSError."""
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_while_safetensors_writes_the_weights_is_named_and_keeps_the_earlier_checkpoint(tmp_path,
                                                                                                   monkeypatch):
    import transformers.modeling_utils as modeling_utils

    folder = save_tiny_locost(tmp_path / "model")
    before = snapshot(folder)
    monkeypatch.setattr(modeling_utils, "safe_save_file", safetensors_disk_full)
    with pytest.raises(OSError, match=f"while saving to {folder}: the checkpoint already there is kept") as caught:
        tiny_locost(seed=5).save_pretrained(folder)
    assert caught.value.errno == errno.ENOSPC
    assert snapshot(folder) == before and sorted(path.name for path in folder.iterdir()) == sorted(before)


def test_a_full_disk_while_a_conversion_writes_the_weights_is_one_line(fixtures_dir, tmp_path, monkeypatch, capsys):
    import transformers.modeling_utils as modeling_utils

    from longreach.cli import main

    output = tmp_path / "out"
    monkeypatch.setattr(modeling_utils, "safe_save_file", safetensors_disk_full)
    assert main(["convert", "locost", "--checkpoint_path", str(fixtures_dir / "locost" / "hf_checkpoint"),
                 "--pytorch_dump_folder_path", str(output)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: No space left on device while writing the converted checkpoint to {output}; nothing was written "
        "there: free some space or choose a folder on another disk.")
    assert list(tmp_path.iterdir()) == []
