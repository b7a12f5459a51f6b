"""LOCOST conversion from the authors' checkpoints, and parity with the authors' outputs (shared/fixtures/locost).

The references were written by running the original code (flbbb/locost-summarization) on CPU in float32 on its
exact convolution path. These tests never skip (on a machine without a C compiler, the parity tests run on the torch
kernel only: the compiled kernel does not exist there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

import longreach  # noqa: F401  (registers the Auto classes)
from longreach import LocostConfig, LocostForConditionalGeneration
from longreach.conversion import convert_locost_original_checkpoint as converter
from longreach.conversion.conversion_utils import ConversionError
from longreach.modeling import ssm_cpu_kernel

FORMATS = ("hf_checkpoint", "lightning/epoch=0-step=1.ckpt")


@pytest.fixture(scope="module")
def converted(fixtures_dir, tmp_path_factory) -> dict[str, Path]:
    """Both original formats, converted once for the module."""
    out = {}
    for name in FORMATS:
        folder = tmp_path_factory.mktemp("converted") / "out"
        converter.convert_locost_checkpoint(fixtures_dir / "locost" / name, folder)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def refs(fixtures_dir) -> dict[str, torch.Tensor]:
    return load_file(str(fixtures_dir / "locost" / "refs.safetensors"))


@pytest.fixture(scope="module", params=FORMATS)
def converted_model(request, converted) -> LocostForConditionalGeneration:
    return LocostForConditionalGeneration.from_pretrained(converted[request.param]).eval()


@pytest.fixture(params=["compiled", "torch"])
def ssm_kernel(request, monkeypatch, converted_model):
    """Each parity test on both CPU SSM kernels (``LONGREACH_SSM_KERNEL``), with the model's kernel cache emptied."""
    if request.param == "compiled" and ssm_cpu_kernel._compiler() is None:
        pytest.skip("no C compiler on this machine: the compiled kernel cannot exist here (the torch one is tested)")
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, request.param)
    for module in converted_model.modules():
        if hasattr(module, "clear_kernel_cache"):
            module.clear_kernel_cache()
    return request.param


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# --------------------------------------------------------------------------------------------------------------------
# Parity (tolerances are the contract)
# --------------------------------------------------------------------------------------------------------------------


def test_logits_loss_and_states_match_the_original(converted_model, refs, ssm_kernel):
    with torch.no_grad():
        out = converted_model(
            refs["input_ids"], attention_mask=refs["attention_mask"], decoder_input_ids=refs["decoder_input_ids"],
            labels=refs["labels"], output_hidden_states=True,
        )
    assert max_diff(out.logits, refs["logits"]) <= 2e-5
    assert max_diff(out.loss.view(1), refs["loss"]) <= 1e-5
    # Encoder states at all positions, padding included (padded positions are non-zero in the original too).
    assert max_diff(out.encoder_last_hidden_state, refs["encoder_last_hidden_state"]) <= 1e-4
    for index in range(3):
        assert max_diff(out.encoder_hidden_states[index], refs[f"encoder_hidden_states.{index}"]) <= 1e-4
    assert max_diff(out.decoder_hidden_states[-1], refs["decoder_last_hidden_state"]) <= 1e-4


def test_layer0_kernel_matches_the_original(converted_model, refs, ssm_kernel):
    length = refs["input_ids"].shape[1]
    with torch.no_grad():
        kernel = converted_model.encoder.block[0].layer[0].ssm.conv.circular_kernel(length)
    assert kernel.shape == refs["encoder.block.0.ssm_kernel"].shape
    assert max_diff(kernel, refs["encoder.block.0.ssm_kernel"]) <= 1e-5


def test_long_sequence_and_unpadded_row_match_the_original(converted_model, refs, ssm_kernel):
    with torch.no_grad():
        long_states = converted_model.get_encoder()(refs["long.input_ids"]).last_hidden_state
        row1 = converted_model.get_encoder()(refs["input_ids"][1:, :13]).last_hidden_state
    assert max_diff(long_states, refs["long.encoder_last_hidden_state"]) <= 1e-4
    assert max_diff(row1, refs["encoder_last_hidden_state_seq1_unpadded"]) <= 1e-4


def test_generation_matches_the_original(converted_model, refs, ssm_kernel):
    inputs = dict(input_ids=refs["input_ids"], attention_mask=refs["attention_mask"], max_new_tokens=10)
    with torch.no_grad():
        generated = converted_model.generate(**inputs, do_sample=False, num_beams=1)
        eos_override = converted_model.generate(**inputs, eos_token_id=int(refs["eos_override_token"]))
        manual = converted_model.generate(**inputs, eos_token_id=None, use_cache=False)
    assert torch.equal(generated, refs["generated_ids"])
    assert torch.equal(eos_override, refs["generated_ids_eos_override"])
    assert torch.equal(manual, refs["greedy_manual_ids"])


def test_fast_path_references_differ_from_the_exact_function(converted_model, refs, ssm_kernel):
    """The authors' CUDA path (use_fast_fft_conv=True) computes another function at L = 20 (spec §7); we compute the
    exact one, so we are far from its emulated outputs and close to the exact references."""
    with torch.no_grad():
        states = converted_model.get_encoder()(refs["input_ids"], attention_mask=refs["attention_mask"]).last_hidden_state
    assert max_diff(states, refs["fastpath_emulated.encoder_last_hidden_state"]) > 0.1
    assert max_diff(states, refs["encoder_last_hidden_state"]) <= 1e-4


def test_authors_fft_size_option_reproduces_their_fast_path(converted, refs):
    """Opt-in bit-compatibility with the authors' GPU path (`ssm_authors_fft_size=True`)."""
    model = LocostForConditionalGeneration.from_pretrained(converted["hf_checkpoint"], ssm_authors_fft_size=True).eval()
    with torch.no_grad():
        out = model(refs["input_ids"], attention_mask=refs["attention_mask"], decoder_input_ids=refs["decoder_input_ids"])
    assert max_diff(out.encoder_last_hidden_state, refs["fastpath_emulated.encoder_last_hidden_state"]) <= 1e-4
    assert max_diff(out.logits, refs["fastpath_emulated.logits"]) <= 2e-5


# --------------------------------------------------------------------------------------------------------------------
# The converted folder
# --------------------------------------------------------------------------------------------------------------------


def test_both_formats_give_identical_tensors(converted):
    first, second = (load_file(str(converted[name] / "model.safetensors")) for name in FORMATS)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_converted_folder_contents(converted):
    folder = converted["hf_checkpoint"]
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "modeling_locost.py"} <= names
    assert not [n for n in names if n.endswith((".bin", ".ckpt", ".pt"))]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "locost" and config["architectures"] == ["LocostForConditionalGeneration"]
    assert config["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_locost.LocostForConditionalGeneration"
    for dropped in ("use_fast_fft_conv", "local_radius", "ssm_type", "encoder_attention_type", "global_block_size"):
        assert dropped not in config
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 512 and generation["decoder_start_token_id"] == 0
    tensors = load_file(str(folder / "model.safetensors"))
    assert "encoder.block.0.layer.0.ssm.conv.A_imag" in tensors
    assert not any("ssm_layer" in key or "layer_prenorm" in key for key in tensors)
    assert isinstance(AutoModelForSeq2SeqLM.from_pretrained(folder), LocostForConditionalGeneration)


def test_original_config_mapping(fixtures_dir):
    original = json.loads((fixtures_dir / "locost" / "hf_checkpoint" / "config.json").read_text())
    assert "model_type" not in original and converter.is_original_locost_config(original)
    config = converter.locost_config_from_original(original)
    assert isinstance(config, LocostConfig)
    assert (config.d_model, config.d_state, config.num_layers, config.vocab_size) == (64, 16, 2, 128)
    assert config.tie_word_embeddings and config.feed_forward_proj == "gated-gelu"


def test_fast_fft_config_warns(fixtures_dir, caplog):
    original = json.loads((fixtures_dir / "locost" / "hf_checkpoint" / "config.json").read_text())
    original["use_fast_fft_conv"] = True
    with caplog.at_level(logging.WARNING):
        converter.locost_config_from_original(original)
    assert "exact convolution" in caplog.text


def test_command_line(fixtures_dir, tmp_path, capsys):
    code = converter.main(["--checkpoint_path", str(fixtures_dir / "locost" / "hf_checkpoint"),
                           "--pytorch_dump_folder_path", str(tmp_path / "cli")])
    assert code == 0 and "written to" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model.safetensors").is_file()


def test_tokenizer_is_saved_with_the_model(fixtures_dir, tmp_path):
    from transformers import AutoTokenizer

    from tokenizer_helpers import word_level_tokenizer

    word_level_tokenizer(vocab_size=128).save_pretrained(tmp_path / "tokenizer")
    converter.convert_locost_checkpoint(fixtures_dir / "locost" / "hf_checkpoint", tmp_path / "out",
                                        tokenizer_name_or_path=str(tmp_path / "tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer("w1 w2").input_ids == [4, 5, 1]


def test_safetensors_input_without_tied_copies(fixtures_dir, tmp_path, refs):
    """A release saved by newer transformers drops the tied copies: they are re-tied to shared.weight."""
    state_dict = torch.load(fixtures_dir / "locost" / "hf_checkpoint" / "pytorch_model.bin", weights_only=True)
    for tied in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        del state_dict[tied]
    source = tmp_path / "safetensors_release"
    source.mkdir()
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(source / "model.safetensors"))
    shutil.copy(fixtures_dir / "locost" / "hf_checkpoint" / "config.json", source / "config.json")
    converter.convert_locost_checkpoint(source, tmp_path / "out")
    model = LocostForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        logits = model(refs["input_ids"], attention_mask=refs["attention_mask"], decoder_input_ids=refs["decoder_input_ids"]).logits
    assert max_diff(logits, refs["logits"]) <= 2e-5


# --------------------------------------------------------------------------------------------------------------------
# Safety rules
# --------------------------------------------------------------------------------------------------------------------


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_input_is_never_modified(fixtures_dir, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(fixtures_dir / "locost", source)
    before = _digest(source)
    converter.convert_locost_checkpoint(source / "hf_checkpoint", tmp_path / "out")
    assert _digest(source) == before


def test_refuses_non_empty_output(fixtures_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    with pytest.raises(ConversionError, match="not empty"):
        converter.convert_locost_checkpoint(fixtures_dir / "locost" / "hf_checkpoint", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"


def test_refuses_output_inside_input(fixtures_dir, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(fixtures_dir / "locost" / "hf_checkpoint", source)
    with pytest.raises(ConversionError, match="overlaps the input"):
        converter.convert_locost_checkpoint(source, source / "converted")
    assert not (source / "converted").exists()


def _copy_with_state_dict(fixtures_dir, tmp_path, edit) -> Path:
    source = tmp_path / "edited"
    source.mkdir()
    shutil.copy(fixtures_dir / "locost" / "hf_checkpoint" / "config.json", source / "config.json")
    state_dict = torch.load(fixtures_dir / "locost" / "hf_checkpoint" / "pytorch_model.bin", weights_only=True)
    edit(state_dict)
    torch.save(state_dict, source / "pytorch_model.bin")
    return source


def test_missing_key_is_named(fixtures_dir, tmp_path):
    source = _copy_with_state_dict(fixtures_dir, tmp_path, lambda sd: sd.pop("encoder.block.1.layer.0.ssm_layer.kernel.log_dt"))
    with pytest.raises(ConversionError, match=r"Missing keys.*encoder\.block\.1\.layer\.0\.ssm\.conv\.log_dt"):
        converter.convert_locost_checkpoint(source, tmp_path / "out")


def test_unexpected_key_is_named(fixtures_dir, tmp_path):
    source = _copy_with_state_dict(fixtures_dir, tmp_path, lambda sd: sd.__setitem__("encoder.block.0.extra.weight", torch.zeros(2)))
    with pytest.raises(ConversionError, match=r"Unexpected keys.*encoder\.block\.0\.extra\.weight"):
        converter.convert_locost_checkpoint(source, tmp_path / "out")


def test_untied_copy_that_differs_is_refused(fixtures_dir, tmp_path):
    def untie(state_dict):
        state_dict["lm_head.weight"] = state_dict["lm_head.weight"].clone() + 1.0

    source = _copy_with_state_dict(fixtures_dir, tmp_path, untie)
    with pytest.raises(ConversionError, match="lm_head.weight.*differs"):
        converter.convert_locost_checkpoint(source, tmp_path / "out")


def test_lightning_checkpoint_config_is_read_through_a_stand_in(fixtures_dir):
    """The .ckpt pickles a ``models_config.LOCOSTConfig`` object: plain ``weights_only=True`` refuses it, our
    allow-listed stand-in reads its attributes, and nothing is imported from the authors' code."""
    path = fixtures_dir / "locost" / "lightning" / "epoch=0-step=1.ckpt"
    with pytest.raises(Exception, match="models_config"):
        torch.load(path, weights_only=True)
    state_dict, config = converter.read_original_checkpoint(path)
    assert len(state_dict) == 69 and not any(key.startswith("model.") for key in state_dict)
    assert config["d_state"] == 16 and config["num_ssm_heads"] == 1
    import sys

    assert "models_config" not in sys.modules


def test_pickle_with_other_globals_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("this must never run",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Evil()}, path)
    with pytest.raises(ConversionError, match="weights_only=True"):
        converter.convert_locost_checkpoint(path, tmp_path / "out")


def test_mixed_float16_and_bfloat16_convert_in_float32(fixtures_dir, tmp_path):
    """Neither half dtype holds the other's values: 2**17 is inf in float16, 1.0009765625 is no bfloat16."""
    def mix(state_dict):
        for key in state_dict:
            state_dict[key] = state_dict[key].half()
        norm = state_dict["encoder.final_layer_norm.weight"].bfloat16()
        norm[0] = 2.0**17
        state_dict["encoder.final_layer_norm.weight"] = norm
        state_dict["decoder.final_layer_norm.weight"][0] = 1.0009765625

    source = _copy_with_state_dict(fixtures_dir, tmp_path, mix)
    converter.convert_locost_checkpoint(source, tmp_path / "out")
    model = LocostForConditionalGeneration.from_pretrained(tmp_path / "out", dtype="auto")
    assert model.dtype == torch.float32
    assert model.encoder.final_layer_norm.weight[0].item() == 2.0**17
    assert model.decoder.final_layer_norm.weight[0].item() == 1.0009765625


def test_a_float64_checkpoint_converts_in_float64(fixtures_dir, tmp_path):
    def to_float64(state_dict):
        for key in state_dict:
            state_dict[key] = state_dict[key].double()

    source = _copy_with_state_dict(fixtures_dir, tmp_path, to_float64)
    converter.convert_locost_checkpoint(source, tmp_path / "out")
    model = LocostForConditionalGeneration.from_pretrained(tmp_path / "out", dtype="auto")
    original = torch.load(source / "pytorch_model.bin", weights_only=True)
    ssm = model.encoder.block[0].layer[0].ssm.conv
    assert model.dtype == torch.float64 and ssm.log_dt.dtype == torch.float64  # the SSM is not cut to float32
    assert torch.equal(ssm.log_dt, original["encoder.block.0.layer.0.ssm_layer.kernel.log_dt"])


def test_an_integer_tensor_for_a_floating_weight_is_named(fixtures_dir, tmp_path):
    key = "encoder.final_layer_norm.weight"
    source = _copy_with_state_dict(fixtures_dir, tmp_path, lambda sd: sd.__setitem__(key, sd[key].long()))
    with pytest.raises(ConversionError, match=rf"{key}: checkpoint torch\.int64, expected a floating dtype"):
        converter.convert_locost_checkpoint(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.__setitem__("encoder.final_layer_norm.weight", 5),
     r"pytorch_model\.bin: 'encoder\.final_layer_norm\.weight' holds a value of type int; expected .*tensor"),
    (lambda sd: sd.__setitem__(7, torch.zeros(1)), r"pytorch_model\.bin: key 7; expected string keys"),
])
def test_a_value_that_is_no_tensor_is_named(fixtures_dir, tmp_path, edit, message):
    source = _copy_with_state_dict(fixtures_dir, tmp_path, edit)
    with pytest.raises(ConversionError, match=message):
        converter.convert_locost_checkpoint(source, tmp_path / "out")


def _lightning_copy(fixtures_dir, tmp_path, edit) -> Path:
    """The Lightning fixture re-saved with ``edit(checkpoint)`` applied (its pickled config read as a dict)."""
    checkpoint_path = fixtures_dir / "locost" / "lightning" / "epoch=0-step=1.ckpt"
    state_dict, config = converter.read_original_checkpoint(checkpoint_path)
    checkpoint = {"state_dict": {f"model.{key}": value for key, value in state_dict.items()},
                  "hyper_parameters": {"config": config}}
    edit(checkpoint)
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    return path


def test_lightning_checkpoint_with_a_config_dict_or_other_value(fixtures_dir, tmp_path, converted):
    source = _lightning_copy(fixtures_dir, tmp_path, lambda checkpoint: None)  # the config as a plain dict
    converter.convert_locost_checkpoint(source, tmp_path / "out")
    assert load_file(str(tmp_path / "out" / "model.safetensors")).keys() == load_file(
        str(converted["hf_checkpoint"] / "model.safetensors")).keys()
    source = _lightning_copy(fixtures_dir, tmp_path, lambda checkpoint: checkpoint["hyper_parameters"].update(
        config="d_model=64"))
    with pytest.raises(ConversionError, match=r"hyper_parameters\['config'\] is a str.*--config_path"):
        converter.convert_locost_checkpoint(source, tmp_path / "out2")
    source = _lightning_copy(fixtures_dir, tmp_path, lambda checkpoint: checkpoint.update(state_dict=[1, 2]))
    with pytest.raises(ConversionError, match=r"edited\.ckpt \('state_dict'\): expected a state dict.*got list"):
        converter.convert_locost_checkpoint(source, tmp_path / "out3")


@pytest.mark.parametrize("field, value, message", [
    ("d_model", "64", r"`d_model` must be a positive integer, got '64'"),
    ("num_heads", [4], r"`num_heads` must be a positive integer, got \[4\]"),
])
def test_bad_config_values_name_the_file(fixtures_dir, tmp_path, capsys, field, value, message):
    source = tmp_path / "edited"
    shutil.copytree(fixtures_dir / "locost" / "hf_checkpoint", source)
    config = json.loads((source / "config.json").read_text())
    config[field] = value
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=rf"edited/config\.json: invalid LOCOST configuration: {message}"):
        converter.convert_locost_checkpoint(source, tmp_path / "out")
    assert converter.main(["--checkpoint_path", str(source), "--pytorch_dump_folder_path", str(tmp_path / "out")]) == 1
    assert "config.json: invalid LOCOST configuration" in capsys.readouterr().err
