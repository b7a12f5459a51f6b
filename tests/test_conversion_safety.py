"""Converters never leave a half-written folder and say in one line what is wrong with a bad input.

A conversion writes into a hidden staging folder and puts it in place only after the reload check: killed at any
moment (SIGKILL while the weights are written, and after they are written), it leaves nothing under the output's
name, and a rerun into the same path succeeds; SIGTERM removes the staging folder; an existing empty output folder is
kept (a mount point, a folder's mode and group). Truncated or foreign inputs get one line naming the cause.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from workflow_helpers import word_tokenizer

from longreach.cli import main
from longreach.conversion import convert_locost_original_checkpoint as locost_converter
from longreach.conversion.conversion_utils import ConversionError

REPO = Path(__file__).resolve().parents[1]

# Runs the LOCOST converter, pausing at one point (`stage`) after writing a marker file, so the test can SIGKILL it
# exactly there.
KILLED_CONVERSION = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from longreach.conversion import conversion_utils, convert_locost_original_checkpoint as converter
    from safetensors import torch as safetensors_torch

    source, output, marker, stage = sys.argv[1:5]

    def pause():
        Path(marker).write_text("ready")
        time.sleep(60)

    if stage == "while_writing_weights":
        write = safetensors_torch.save_file
        def save_file(tensors, filename, *args, **kwargs):
            # half the bytes on disk, then the kill
            Path(filename).write_bytes(b"\\0" * 1024)
            pause()
        safetensors_torch.save_file = save_file
        import transformers.modeling_utils as modeling_utils
        if hasattr(modeling_utils, "safe_save_file"):
            modeling_utils.safe_save_file = save_file
    else:  # after the weights are written: during the reload check
        verify = conversion_utils.verify_tensors
        def verify_tensors(*args, **kwargs):
            verify(*args, **kwargs)
            pause()
        conversion_utils.verify_tensors = verify_tensors
    converter.convert_locost_checkpoint(source, output)
    """
)


@pytest.mark.parametrize("stage", ["while_writing_weights", "after_writing_weights"])
def test_a_killed_conversion_leaves_nothing_and_a_rerun_succeeds(fixtures_dir, tmp_path, stage):
    source, output, marker = fixtures_dir / "locost" / "hf_checkpoint", tmp_path / "out", tmp_path / "marker"
    process = subprocess.Popen([sys.executable, "-c", KILLED_CONVERSION, str(source), str(output), str(marker), stage],
                               cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the conversion never reached the kill point"
        time.sleep(0.05)
    staging = [path for path in tmp_path.iterdir() if path.name.startswith(".out.incomplete-")]
    assert len(staging) == 1 and any(staging[0].iterdir())  # the killed run was writing there, not into `out`
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    process.stderr.close()

    assert not output.exists()  # nothing under the output's name: no folder that loads or looks complete
    locost_converter.convert_locost_checkpoint(source, output)  # the rerun works, and cleans the killed run's folder
    assert (output / "model.safetensors").is_file() and (output / "config.json").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["marker", "out"]


def test_a_failed_conversion_leaves_nothing(fixtures_dir, tmp_path, monkeypatch):
    from longreach.conversion import conversion_utils

    def broken(*args, **kwargs):
        raise ConversionError("Verification failed (simulated)")

    monkeypatch.setattr(conversion_utils, "verify_tensors", broken)
    with pytest.raises(ConversionError, match="simulated"):
        locost_converter.convert_locost_checkpoint(fixtures_dir / "locost" / "hf_checkpoint", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_tokenizer_stops_before_anything_is_written(fixtures_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    code = main(["convert", "locost", "--checkpoint_path", str(fixtures_dir / "locost" / "hf_checkpoint"),
                 "--pytorch_dump_folder_path", str(tmp_path / "out"), "--tokenizer_name_or_path",
                 "some-org/some-tokenizer"])
    assert code == 1 and time.monotonic() - start < 20  # no download retries
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "some-org/some-tokenizer" in error and "HF_HUB_OFFLINE" in error
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_beside_the_checkpoint_is_written_with_it(fixtures_dir, tmp_path):
    source = tmp_path / "original"
    shutil.copytree(fixtures_dir / "locost" / "hf_checkpoint", source)
    word_tokenizer(vocab_size=64).save_pretrained(source)
    output = locost_converter.convert_locost_checkpoint(source, tmp_path / "out")
    assert (output / "tokenizer.json").is_file()


def corrupt_inputs(fixtures_dir: Path, folder: Path) -> dict[str, Path]:
    """A LOCOST folder checkpoint with a truncated safetensors file, a truncated Lightning pickle, random bytes."""
    paths = {}
    truncated = folder / "truncated-safetensors"
    shutil.copytree(fixtures_dir / "locost" / "hf_checkpoint", truncated)
    (truncated / "pytorch_model.bin").unlink()
    from safetensors.torch import save_file

    from longreach.conversion.conversion_utils import load_state_dict_from_folder

    weights = load_state_dict_from_folder(fixtures_dir / "locost" / "hf_checkpoint")
    tensors = {key: tensor.clone() for key, tensor in weights.items()}  # tied copies share storage
    save_file(tensors, truncated / "model.safetensors")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    paths["truncated safetensors"] = truncated
    ckpt = fixtures_dir / "locost" / "lightning" / "epoch=0-step=1.ckpt"
    data = ckpt.read_bytes()
    (folder / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    paths["truncated pickle"] = folder / "truncated.ckpt"
    (folder / "random.ckpt").write_bytes(b"\x80\x02" + random.Random(0).randbytes(4094))  # a pickle header, then noise
    paths["random bytes"] = folder / "random.ckpt"
    return paths


@pytest.mark.parametrize("case, cause", [("truncated safetensors", "truncated or corrupt"),
                                         ("truncated pickle", "truncated or corrupt"),
                                         ("random bytes", "not a PyTorch checkpoint")])
def test_corrupt_inputs_get_one_line_naming_the_cause(fixtures_dir, tmp_path, capsys, case, cause):
    (tmp_path / "inputs").mkdir()
    source = corrupt_inputs(fixtures_dir, tmp_path / "inputs")[case]
    code = main(["convert", "locost", "--checkpoint_path", str(source), "--pytorch_dump_folder_path",
                 str(tmp_path / "out")])
    error = capsys.readouterr().err.strip()
    assert code == 1 and len(error.splitlines()) == 1, error
    assert cause in error and str(source.name) in error
    assert "weights_only=False" not in error and "allow-list" not in error
    assert not (tmp_path / "out").exists()


def folder_checkpoint_in(fixtures_dir: Path, model: str, folder: Path, edit) -> Path:
    """A copy of a fixture's folder checkpoint (LOCOST's hf_checkpoint, VCC's hf_ckpt) as safetensors, with its
    tensors changed by ``edit(tensors)``."""
    from safetensors.torch import save_file

    from longreach.conversion.conversion_utils import load_state_dict_from_folder

    source = fixtures_dir / model / {"locost": "hf_checkpoint", "vcc": "hf_ckpt"}[model]
    folder.mkdir(parents=True)
    shutil.copy(source / "config.json", folder / "config.json")
    tensors = {key: tensor.clone() for key, tensor in load_state_dict_from_folder(source).items()}
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("model", ["locost", "vcc"])
def test_a_bfloat16_checkpoint_converts_in_its_own_precision(fixtures_dir, tmp_path, model):
    import torch
    from transformers import AutoModelForSeq2SeqLM

    def to_bfloat16(tensors):
        for key, tensor in tensors.items():
            tensors[key] = tensor.to(torch.bfloat16)

    source = folder_checkpoint_in(fixtures_dir, model, tmp_path / "bf16", to_bfloat16)
    assert main(["convert", model, "--checkpoint_path", str(source), "--pytorch_dump_folder_path",
                 str(tmp_path / "out")]) == 0
    converted = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert converted.dtype == torch.bfloat16
    from safetensors.torch import load_file

    original = load_file(source / "model.safetensors")
    assert torch.equal(converted.get_input_embeddings().weight, original["shared.weight"])


@pytest.mark.parametrize("model", ["locost", "vcc"])
def test_a_wrongly_shaped_tensor_is_named_with_both_shapes(fixtures_dir, tmp_path, capsys, model):
    import torch

    def widen(tensors):
        key = next(key for key in tensors if key.endswith("DenseReluDense.wo.weight") or key.endswith("wo.weight"))
        tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
        widen.key = key

    source = folder_checkpoint_in(fixtures_dir, model, tmp_path / "shape", widen)
    assert main(["convert", model, "--checkpoint_path", str(source), "--pytorch_dump_folder_path",
                 str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert "tensor shapes differ from the model's" in error
    assert "wo.weight: checkpoint [" in error and ", model [" in error
    assert not (tmp_path / "out").exists()


def test_unreadable_inputs_are_one_line_errors_naming_the_file(fixtures_dir, tmp_path, capsys):
    from longreach.conversion import convert_dodo_original_checkpoint as dodo_converter

    broken = tmp_path / "broken-config"
    shutil.copytree(fixtures_dir / "locost" / "hf_checkpoint", broken)
    (broken / "config.json").write_text('{"d_model": 16,')
    assert main(["convert", "locost", "--checkpoint_path", str(broken), "--pytorch_dump_folder_path",
                 str(tmp_path / "out")]) == 1
    assert "config.json is not valid JSON" in capsys.readouterr().err
    adapters = fixtures_dir / "dodo" / "adapters"
    shutil.copytree(adapters / "encoder", tmp_path / "encoder")
    from safetensors.torch import save_file

    from longreach.conversion.conversion_utils import load_weights_file

    weights = load_weights_file(tmp_path / "encoder" / "adapter_model.bin")
    (tmp_path / "encoder" / "adapter_model.bin").unlink()
    save_file({key: tensor.clone() for key, tensor in weights.items()}, tmp_path / "encoder" / "adapter_model.safetensors")
    data = (tmp_path / "encoder" / "adapter_model.safetensors").read_bytes()
    (tmp_path / "encoder" / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "scorer-folder.pt").mkdir()
    for kwargs, message in (
        ({"encoder": tmp_path / "encoder", "scorer": fixtures_dir / "dodo" / "scorer.pt"},
         "adapter_model.safetensors is truncated or corrupt"),
        ({"encoder": adapters / "encoder", "scorer": tmp_path / "scorer-folder.pt"}, "scorer-folder.pt is a folder"),
    ):
        with pytest.raises(ConversionError, match=message):
            dodo_converter.convert_dodo_peft_folders(
                kwargs["encoder"], adapters / "decoder", kwargs["scorer"], fixtures_dir / "dodo" / "base",
                tmp_path / "dodo-out", soft_prompt_length=0)
    assert not (tmp_path / "dodo-out").exists()


def test_output_folder_rules_and_push_preflight_come_before_converting(fixtures_dir, tmp_path, capsys, monkeypatch):
    source = fixtures_dir / "locost" / "hf_checkpoint"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for output, extra, message in (
        (".", [], "is the current folder or a root"),
        ("afile/out", [], "afile is a file, not a folder"),
        ("new/deeper/out", ["--push_to_hub", "me/repo"], "HF_HUB_OFFLINE is set"),
        ("out", ["--push_to_hub", "not a repo"], "is not a Hub repository id"),
    ):
        assert main(["convert", "locost", "--checkpoint_path", str(source), "--pytorch_dump_folder_path", output,
                     *extra]) == 1
        assert message in capsys.readouterr().err
    assert main(["convert", "locost", "--checkpoint_path", str(tmp_path / "absent"), "--pytorch_dump_folder_path",
                 "made/for/nothing/out"]) == 1
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no folder made by a failed conversion
    monkeypatch.setenv("HOME", str(tmp_path))  # "~/conv" is the home folder's, not a folder named "~"
    assert main(["convert", "locost", "--checkpoint_path", str(source), "--pytorch_dump_folder_path", "~/conv"]) == 0
    converted = tmp_path / "conv"
    assert converted.is_dir() and oct(converted.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_text_file_or_a_pickled_function_gets_a_clear_line(tmp_path, capsys):
    import pickle

    (tmp_path / "notes.ckpt").write_text("hello\n")

    class System:  # pickled as a call of os.system, which weights_only=True refuses to load (never runs)
        def __reduce__(self):
            return (os.system, ("echo this must never run",))

    with open(tmp_path / "system.ckpt", "wb") as handle:
        pickle.dump({"state_dict": {}, "payload": System()}, handle, protocol=2)
    for name, message in (("notes.ckpt", "notes.ckpt is not a PyTorch checkpoint (unpickling it failed: KeyError"),
                          ("system.ckpt", f"system.ckpt holds a pickled {os.system.__module__}.system, which "
                                          "torch.load(weights_only=True) does not load")):
        code = main(["convert", "locost", "--checkpoint_path", str(tmp_path / name), "--pytorch_dump_folder_path",
                     str(tmp_path / "out")])
        error = capsys.readouterr().err.strip()
        assert code == 1 and len(error.splitlines()) == 1 and message in error, error
        assert "Check the documentation" not in error
    assert not (tmp_path / "out").exists()


def test_an_unusable_tokenizer_is_named_with_the_whole_cause(fixtures_dir, tmp_path, capsys):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text("{}")  # no vocabulary to build a tokenizer from
    code = main(["convert", "locost", "--checkpoint_path", str(fixtures_dir / "locost" / "hf_checkpoint"),
                 "--pytorch_dump_folder_path", str(tmp_path / "out"), "--tokenizer_name_or_path", str(tokenizer)])
    error = capsys.readouterr().err.strip()
    assert code == 1 and len(error.splitlines()) == 1, error
    assert error.startswith(f"error: --tokenizer_name_or_path {tokenizer}: Couldn't instantiate the backend tokenizer")
    assert "(1) a `tokenizers` library serialization file" in error  # not cut after the first line
    assert not (tmp_path / "out").exists()


def test_an_existing_empty_output_folder_is_kept_with_its_mode_and_group(fixtures_dir, tmp_path):
    """An existing empty output (a container's volume mount, a team folder) was removed and replaced by a renamed
    one: a mount point cannot be (the whole conversion was thrown away), and the folder's mode and setgid bit were
    lost; the weights were 0600 where the other files follow the umask."""
    output = tmp_path / "team" / "out"
    output.mkdir(parents=True)
    output.chmod(0o2770)
    before = output.stat()
    locost_converter.convert_locost_checkpoint(fixtures_dir / "locost" / "hf_checkpoint", output)
    after = output.stat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)  # the same folder, not a replacement
    modes = {path.name: path.stat().st_mode & 0o777 for path in output.iterdir()}
    assert {"config.json", "model.safetensors"} <= set(modes) and not any(name.startswith(".") for name in modes)
    assert set(modes.values()) == {0o666 & ~_umask()}


def test_sigterm_during_a_conversion_leaves_nothing(tmp_path):
    """A scheduler's time limit or `docker stop` (SIGTERM) left the hidden staging folder, full size, behind."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from pathlib import Path
        from longreach.conversion.conversion_utils import staged_output
        with staged_output(Path(sys.argv[1])) as staging:
            (staging / "model.safetensors").write_bytes(b"0" * 1000)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    """)
    for output in (tmp_path / "new" / "out", tmp_path / "empty"):
        if output.name == "empty":
            output.mkdir()
        result = subprocess.run([sys.executable, "-c", code, str(output)], cwd=REPO, capture_output=True, timeout=120)
        assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
        assert sorted(p.name for p in tmp_path.rglob("*")) == (["empty"] if output.name == "empty" else [])


def test_input_paths_with_a_tilde_and_a_missing_config_path_are_named(fixtures_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(fixtures_dir / "locost" / "hf_checkpoint", tmp_path / "ckpt")
    assert main(["convert", "locost", "--checkpoint_path=~/ckpt", "--config_path=~/ckpt/config.json",
                 "--pytorch_dump_folder_path=~/out"]) == 0  # no shell expands a ~ after "="
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert main(["convert", "locost", "--checkpoint_path", str(tmp_path / "ckpt"), "--config_path", "nope.json",
                 "--pytorch_dump_folder_path", str(tmp_path / "out2")]) == 1
    assert "--config_path nope.json does not exist or is not a file" in capsys.readouterr().err


def test_a_staging_folder_left_inside_an_output_folder_by_a_killed_run_is_removed(fixtures_dir, tmp_path):
    output = tmp_path / "out"
    (output / ".incomplete-999999999-x").mkdir(parents=True)  # no such process
    (output / ".incomplete-999999999-x" / "model.safetensors").write_bytes(b"0")
    locost_converter.convert_locost_checkpoint(fixtures_dir / "locost" / "hf_checkpoint", output)
    assert not any(path.name.startswith(".") for path in output.iterdir())


@pytest.mark.parametrize("model, folder", [("locost", "hf_checkpoint"), ("vcc", None)])
def test_a_weights_file_of_a_folder_is_pointed_to_its_folder(fixtures_dir, tmp_path, capsys, model, folder):
    """From an audit: model.safetensors or pytorch_model.bin as --checkpoint_path said "not a Lightning checkpoint"
    with no hint (the converters read a save_pretrained folder whole, with its config.json)."""
    source = fixtures_dir / model / folder if folder else next(
        p for p in (fixtures_dir / model).iterdir() if p.is_dir() and (p / "config.json").is_file())
    weights = next(p for p in source.iterdir() if p.suffix in (".safetensors", ".bin"))
    assert main(["convert", model, "--checkpoint_path", str(weights), "--pytorch_dump_folder_path",
                 str(tmp_path / "out")]) == 1
    assert f"is a weights file of a save_pretrained folder; pass the folder that holds it and its config.json " \
           f"({source})" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Memory: the model exists once (benchmarks/benchmark_conversion_memory.py measures the peak)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model, checkpoint", [("locost", "locost/hf_checkpoint"), ("vcc", "vcc/hf_ckpt")])
def test_a_base_model_hub_id_is_named_in_the_card_and_a_path_is_refused(fixtures_dir, tmp_path, capsys, model,
                                                                        checkpoint):
    """`--base_model_id`, as on `convert dodo`: the card names it as its `base_model` (the Hub's model tree); a path
    given as an id is refused before anything is written."""
    from huggingface_hub import ModelCard

    source = str(fixtures_dir / checkpoint)
    assert main(["convert", model, "--checkpoint_path", source, "--pytorch_dump_folder_path", str(tmp_path / "out"),
                 "--base_model_id", "google-t5/t5-base"]) == 0
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert (card.data.base_model, card.data.to_dict()["base_model_relation"]) == ("google-t5/t5-base", "finetune")
    assert main(["convert", model, "--checkpoint_path", source, "--pytorch_dump_folder_path",
                 str(tmp_path / "refused"), "--base_model_id", source]) == 1
    assert "--base_model_id" in capsys.readouterr().err and not (tmp_path / "refused").exists()


def _conversions(fixtures_dir):
    from longreach.conversion import convert_dodo_original_checkpoint as dodo_converter
    from longreach.conversion import convert_vcc_original_checkpoint as vcc_converter

    dodo = fixtures_dir / "dodo"
    return {
        "locost": lambda out: locost_converter.convert_locost_checkpoint(
            fixtures_dir / "locost" / "lightning" / "epoch=0-step=1.ckpt", out),
        "vcc_t5": lambda out: vcc_converter.convert_vcc_checkpoint(fixtures_dir / "vcc" / "hf_ckpt", out),
        "dodo_lightning": lambda out: dodo_converter.convert_dodo_checkpoint(dodo / "dodo_ckpt" / "weights.ckpt", out),
        "dodo_peft": lambda out: dodo_converter.convert_dodo_peft_folders(
            dodo / "adapters" / "encoder", dodo / "adapters" / "decoder", dodo / "scorer.pt", dodo / "base", out,
            soft_prompt_path=dodo / "dodo_ckpt" / "weights.ckpt"),
    }


@pytest.mark.parametrize("route", ["locost", "vcc_t5", "dodo_lightning", "dodo_peft"])
def test_the_converted_model_is_released_before_the_saved_folder_is_reloaded(fixtures_dir, tmp_path, monkeypatch,
                                                                               route):
    """A converter that kept its model while reloading the saved folder would hold it twice (three times with the
    source): the in-memory model must be gone when from_pretrained runs, and it must never have had weights of its
    own (built on the meta device, the converted tensors assigned to it)."""
    import gc
    import weakref

    from transformers import PreTrainedModel

    saved, at_reload = [], []
    save_pretrained, from_pretrained = PreTrainedModel.save_pretrained, PreTrainedModel.from_pretrained.__func__

    def recording_save(self, *args, **kwargs):
        saved.append(weakref.ref(self))
        return save_pretrained(self, *args, **kwargs)

    def recording_load(cls, *args, **kwargs):
        gc.collect()
        at_reload.append([ref() is None for ref in saved])
        return from_pretrained(cls, *args, **kwargs)

    built_with_weights = []
    init_weights = PreTrainedModel.post_init

    def recording_post_init(self):
        built_with_weights.append(any(not parameter.is_meta for parameter in self.parameters()))
        return init_weights(self)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", recording_save)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(recording_load))
    monkeypatch.setattr(PreTrainedModel, "post_init", recording_post_init)
    _conversions(fixtures_dir)[route](tmp_path / "out")
    assert len(saved) == 1 and at_reload == [[True]]  # one save, and that model was gone at the one reload
    # models built by the converter (before the reload) had only meta weights: no random initialisation, no copy
    assert built_with_weights and not built_with_weights[0]


def test_tensor_fingerprints_tell_every_bit():
    import torch

    from longreach.conversion.conversion_utils import tensor_fingerprint

    base = torch.tensor([0.0, 1.5, float("nan")])
    assert tensor_fingerprint(base) == tensor_fingerprint(base.clone())  # the same bits, NaN included
    assert tensor_fingerprint(base) != tensor_fingerprint(torch.tensor([-0.0, 1.5, float("nan")]))  # equal values
    assert tensor_fingerprint(base) != tensor_fingerprint(base.double())  # the dtype counts
    assert tensor_fingerprint(base) != tensor_fingerprint(base.reshape(3, 1))  # and the shape
    bfloat16 = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert tensor_fingerprint(bfloat16.t()) == tensor_fingerprint(bfloat16.t().contiguous())  # any layout
    assert tensor_fingerprint(torch.tensor(True)) != tensor_fingerprint(torch.tensor(False))  # 0-d and bool


def test_a_checkpoint_of_torch_legacy_format_still_converts(fixtures_dir, tmp_path):
    """torch.save's pre-1.6 format cannot be memory-mapped: it is read whole instead."""
    import torch

    from longreach.conversion import convert_vcc_original_checkpoint as vcc_converter

    source = fixtures_dir / "vcc" / "hf_ckpt"
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(source / "config.json", legacy / "config.json")
    state_dict = torch.load(source / "pytorch_model.bin", weights_only=True)
    torch.save(state_dict, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError, match="mmap"):  # what the converter falls back from
        torch.load(legacy / "pytorch_model.bin", weights_only=True, mmap=True)
    vcc_converter.convert_vcc_checkpoint(source, tmp_path / "reference")
    vcc_converter.convert_vcc_checkpoint(legacy, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "reference" / "model.safetensors").read_bytes()


def test_the_conversion_memory_benchmark_measures_both_converters(tmp_path):
    """benchmarks/benchmark_conversion_memory.py at a tiny size: both conversions run, and their peaks are written
    (atomically) with the converted weights' size they are measured against."""
    import json

    output = tmp_path / "memory.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "benchmark_conversion_memory.py"),
                             "--hidden_size", "64", "--num_layers", "2", "--vocab_size", "128", "--json", str(output)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(output.read_text())
    assert [row["route"] for row in rows] == ["dodo", "vcc"]
    for row in rows:
        assert row["code"] == 0 and row["converted_bytes"] > 0
        assert row["peak_rss"] >= row["rss_before"] > 0 and row["peak_anonymous"] >= row["anonymous_before"] > 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["memory.json"]
