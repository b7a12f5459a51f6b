"""VCC-T5 conversion (original HF copy, Lightning .ckpt, plain T5 + VCC options) and parity with the authors' outputs.

The references in shared/fixtures/vcc were written by the original code (awslabs/vip-token-centric-compression) on
CPU in float32. These tests never skip. Tolerances are the issue's contract: encoder output 1e-5, logits 1e-4,
loss 1e-5, generated ids and refined blocks exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

import longreach  # noqa: F401  (registers the Auto classes)
from longreach import VCCT5ForConditionalGeneration
from longreach.conversion import convert_vcc_original_checkpoint as converter
from longreach.conversion.conversion_utils import ConversionError

CHECKPOINT = "lightning/epoch=00000-step=00000001.ckpt"
FORMATS = ("hf_ckpt", CHECKPOINT)


@pytest.fixture(scope="module")
def converted(fixtures_dir, tmp_path_factory) -> dict[str, Path]:
    """Both original formats, converted once for the module (the .ckpt with the HF copy's config.json)."""
    folders = {}
    for name in FORMATS:
        folder = tmp_path_factory.mktemp("converted") / "out"
        config_path = fixtures_dir / "vcc" / "hf_ckpt" / "config.json" if name.endswith(".ckpt") else None
        converter.convert_vcc_checkpoint(fixtures_dir / "vcc" / name, folder, config_path=config_path)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def refs(fixtures_dir) -> dict[str, torch.Tensor]:
    return load_file(str(fixtures_dir / "vcc" / "refs.safetensors"))


@pytest.fixture(scope="module", params=[(name, attention) for name in FORMATS for attention in ("sdpa", "eager")],
                ids=lambda param: f"{param[0].split('/')[0]}-{param[1]}")
def converted_model(request, converted) -> VCCT5ForConditionalGeneration:
    name, attention = request.param
    model = VCCT5ForConditionalGeneration.from_pretrained(converted[name]).eval()
    model.set_attn_implementation(attention)
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def intermediate_tolerance(model) -> float:
    """For intermediates (pre-norm states up to ~20), which the contract does not cover: eager attention reproduces
    the original bit for bit on every CPU (``reproducible_softmax``); sdpa's fused CPU kernel (used without autograd)
    differs by up to ~1.2e-5 there."""
    return 1e-5 if model.config._attn_implementation == "eager" else 5e-5


def fixture_inputs(refs) -> dict[str, torch.Tensor]:
    return {"input_ids": refs["input_ids"], "attention_mask": refs["attention_mask"],
            "vip_mask": refs["encoder_input_important_mask"]}


# ---------------------------------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------------------------------


def test_encoder_logits_and_loss_match_the_original(converted_model, refs):
    with torch.no_grad():
        out = converted_model(**fixture_inputs(refs), labels=refs["labels"], output_hidden_states=True)
    assert max_diff(out.encoder_last_hidden_state, refs["encoder_last_hidden_state"]) <= 1e-5
    assert max_diff(out.logits, refs["logits"]) <= 1e-4
    assert max_diff(out.loss.view(1), refs["loss"]) <= 1e-5
    assert torch.all(out.encoder_last_hidden_state[refs["attention_mask"] == 0] == 0)
    # The vanilla (segment-local) layer's output before compression (hidden_states[1]).
    assert max_diff(out.encoder_hidden_states[1], refs["debug.block0.output_full"]) <= intermediate_tolerance(
        converted_model)


def test_generation_matches_the_original(converted_model, refs):
    with torch.no_grad():
        generated = converted_model.generate(**fixture_inputs(refs), max_length=11)
        assert torch.equal(generated, refs["generated_ids"])
        # the original's max_decoder_length (counting the start token) is the converted generation default, as
        # max_new_tokens: no max_length is left in the folder's generation config
        assert torch.equal(converted_model.generate(**fixture_inputs(refs)), refs["generated_ids"])
        assert converted_model.generation_config.max_new_tokens == 10
        saved = json.loads((Path(converted_model.name_or_path) / "generation_config.json").read_text())
        assert "max_length" not in saved


def test_refined_blocks_and_compression_steps_match_the_original(converted_model, refs):
    with torch.no_grad():
        info = converted_model.encoder(**fixture_inputs(refs), output_compression_info=True).compression_info
    assert info.padded_length == 512
    assert torch.equal(info.vip_sort_order, refs["debug.vip_sort_order"])
    assert torch.equal(info.coarse_token_positions, refs["debug.coarse_token_positions"])
    assert torch.equal(info.coarse_token_mask, refs["debug.coarse_token_mask"])
    refined_tokens = 8 * 8
    for layer in range(3):
        fine = refs[f"debug.vcc_layer{layer}.fine_block_indices"]
        assert torch.equal(info.fine_block_indices[layer], fine), f"refined blocks of VCC layer {layer}"
        assert max_diff(info.selection_scores[layer], refs[f"debug.vcc_layer{layer}.selection_logits"]) <= 1e-5
        # Remaining blocks: the same set; fully padded blocks tie, and the original's order among them is a torch
        # CPU sort detail, so the compressed outputs of the block means are compared block by block.
        ours_coarse, ref_coarse = info.coarse_block_indices[layer], refs[f"debug.vcc_layer{layer}.coarse_block_indices"]
        compressed, ref_compressed = info.compressed_hidden_states[layer], refs[f"debug.block{layer + 1}.output_compressed"]
        close = dict(atol=intermediate_tolerance(converted_model), rtol=0)
        torch.testing.assert_close(compressed[:, :refined_tokens], ref_compressed[:, :refined_tokens], **close)
        torch.testing.assert_close(compressed[:, -16:], ref_compressed[:, -16:], **close)
        for row in range(2):
            assert sorted(ours_coarse[row].tolist()) == sorted(ref_coarse[row].tolist())
            ours_by_block = dict(zip(ours_coarse[row].tolist(), compressed[row, refined_tokens:-16]))
            for position, block in enumerate(ref_coarse[row].tolist()):
                torch.testing.assert_close(ours_by_block[block], ref_compressed[row, refined_tokens + position], **close)


def test_both_formats_give_identical_weights_and_load_with_auto_classes(converted):
    weights = [load_file(str(converted[name] / "model.safetensors")) for name in FORMATS]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    # One shared relative-bias table, as in T5 (the original's per-block copies were checked equal and dropped).
    assert [key for key in weights[0] if "encoder" in key and "relative_attention_bias" in key] == [
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    model = AutoModelForSeq2SeqLM.from_pretrained(converted["hf_ckpt"])
    assert type(model) is VCCT5ForConditionalGeneration
    assert (model.config.model_type, model.config.num_vanilla_layers, model.config.num_vip_slots) == ("vcc_t5", 1, 16)
    config = json.loads((converted["hf_ckpt"] / "config.json").read_text())
    for junk in ("pl_module", "pretrained_config", "max_decoder_length", "encoder_layers", "num_important_tokens"):
        assert junk not in config
    assert config["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_vcc_t5.VCCT5ForConditionalGeneration"
    assert (converted["hf_ckpt"] / "modeling_vcc_t5.py").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# (c) plain transformers T5 + VCC options
# ---------------------------------------------------------------------------------------------------------------------


def _save_plain_t5(folder: Path, feed_forward_proj: str, tie: bool, num_layers: int = 3) -> T5ForConditionalGeneration:
    config = T5Config(vocab_size=120, d_model=32, d_kv=8, d_ff=64, num_layers=num_layers, num_decoder_layers=2,
                      num_heads=4, feed_forward_proj=feed_forward_proj, decoder_start_token_id=0, dropout_rate=0.0,
                      tie_word_embeddings=tie)
    model = T5ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("feed_forward_proj, tie", [("relu", True), ("gated-gelu", False)])
def test_plain_t5_with_compression_off_options_equals_t5(tmp_path, feed_forward_proj, tie):
    reference = _save_plain_t5(tmp_path / "t5", feed_forward_proj, tie)
    options = dict(num_vanilla_layers=3, segment_length=64, num_vip_slots=8, block_size=4, num_refined_blocks=2)
    assert converter.main(["--checkpoint_path", str(tmp_path / "t5"), "--pytorch_dump_folder_path",
                           str(tmp_path / "vcc"), *[f"--{k}={v}" for k, v in options.items()]]) == 0
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "vcc").eval()
    assert type(model) is VCCT5ForConditionalGeneration and model.config.tie_word_embeddings is tie
    assert model.config.vocab_size == 120
    input_ids = torch.randint(2, 120, (2, 64))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 40:] = 0
    decoder_input_ids = torch.randint(2, 120, (2, 5))
    with torch.no_grad():  # all layers vanilla and one segment covering the input: exactly T5
        expected = reference(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        got = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_plain_t5_with_a_preset(tmp_path):
    _save_plain_t5(tmp_path / "t5", "relu", True, num_layers=6)
    converter.convert_vcc_checkpoint(tmp_path / "t5", tmp_path / "vcc", vcc_preset="base",
                                     vcc_options={"num_vip_slots": 48})
    config = VCCT5ForConditionalGeneration.from_pretrained(tmp_path / "vcc").config
    assert (config.num_vanilla_layers, config.segment_length, config.block_size, config.num_refined_blocks,
            config.num_vip_slots, config.num_layers) == (4, 512, 16, 90, 48, 6)


def test_plain_t5_folder_loads_directly_as_vcc_initialisation(tmp_path):
    """Parameter names are T5's: `from_pretrained` on a T5 folder gives every T5 weight unchanged (VCC options as
    config kwargs), as the authors' continued pretraining from t5-base does."""
    reference = _save_plain_t5(tmp_path / "t5", "relu", True, num_layers=5)
    model, loading = VCCT5ForConditionalGeneration.from_pretrained(
        tmp_path / "t5", output_loading_info=True, segment_length=64, block_size=4, num_vip_slots=8,
        num_refined_blocks=2,
    )
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    assert (model.config.model_type, model.config.num_vanilla_layers, model.config.segment_length) == ("vcc_t5", 4, 64)
    expected = reference.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())


# ---------------------------------------------------------------------------------------------------------------------
# Safety rules
# ---------------------------------------------------------------------------------------------------------------------


def test_converter_refuses_unsafe_or_incomplete_requests(fixtures_dir, tmp_path, capsys):
    source = fixtures_dir / "vcc"
    with pytest.raises(ConversionError, match="holds no model config"):
        converter.convert_vcc_checkpoint(source / CHECKPOINT, tmp_path / "a")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        converter.convert_vcc_checkpoint(source / "hf_ckpt", tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    _save_plain_t5(tmp_path / "t5", "relu", True)
    with pytest.raises(ConversionError, match="vcc_preset"):
        converter.convert_vcc_checkpoint(tmp_path / "t5", tmp_path / "b")
    with pytest.raises(ConversionError, match="num_vanilla_layers"):  # the preset needs at least 4 encoder layers
        converter.convert_vcc_checkpoint(tmp_path / "t5", tmp_path / "c", vcc_preset="base")
    assert converter.main(["--checkpoint_path", str(tmp_path / "t5"), "--pytorch_dump_folder_path",
                           str(tmp_path / "d")]) == 1
    assert "plain T5" in capsys.readouterr().err


def _tampered_copy(fixtures_dir, folder: Path, change) -> Path:
    state_dict = torch.load(fixtures_dir / "vcc" / "hf_ckpt" / "pytorch_model.bin", weights_only=True)
    state_dict = {key: value.clone() for key, value in state_dict.items()}
    change(state_dict)
    folder.mkdir()
    torch.save(state_dict, folder / "pytorch_model.bin")
    (folder / "config.json").write_text((fixtures_dir / "vcc" / "hf_ckpt" / "config.json").read_text())
    return folder


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda sd: sd["encoder.block.2.layer.0.SelfAttention.relative_attention_bias.weight"].add_(1.0), "tied copy"),
        (lambda sd: sd.pop("encoder.block.1.layer.1.DenseReluDense.wo.weight"), "Missing keys"),
        (lambda sd: sd.__setitem__("encoder.block.1.extra.weight", torch.zeros(2)), "Unexpected keys"),
        (lambda sd: sd["lm_head.weight"].add_(1.0), "tied copy"),
    ],
)
def test_converter_is_loud_about_mismatching_weights(fixtures_dir, tmp_path, change, message):
    source = _tampered_copy(fixtures_dir, tmp_path / "tampered", change)
    with pytest.raises(ConversionError, match=message):
        converter.convert_vcc_checkpoint(source, tmp_path / "out")


def _copy_with_config(fixtures_dir, folder: Path, **changes) -> Path:
    source = _tampered_copy(fixtures_dir, folder, lambda sd: None)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (source / "config.json").write_text(json.dumps(config))
    return source


@pytest.mark.parametrize("field", ["scale_decoder_outputs", "tie_word_embeddings"])
def test_boolean_config_fields_must_be_json_booleans(fixtures_dir, tmp_path, field):
    source = _copy_with_config(fixtures_dir, tmp_path / "edited", **{field: "false"})  # bool("false") is True
    with pytest.raises(ConversionError, match=rf"edited/config\.json: {field} is 'false'; expected true or false"):
        converter.convert_vcc_checkpoint(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [0, 1, "eleven", 11.5])
def test_max_decoder_length_is_checked_up_front(fixtures_dir, tmp_path, capsys, value):
    source = _copy_with_config(fixtures_dir, tmp_path / "edited", max_decoder_length=value)
    assert converter.main(["--checkpoint_path", str(source), "--pytorch_dump_folder_path", str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert f"config.json: max_decoder_length is {value!r}; expected an integer >= 2" in error
    assert "max_new_tokens" not in error and not (tmp_path / "out").exists()


def test_bad_config_values_name_the_file(fixtures_dir, tmp_path):
    source = _copy_with_config(fixtures_dir, tmp_path / "edited", encoder_layers="src.t5.models.layers.T5Block")
    with pytest.raises(ConversionError, match=r"edited/config\.json: unsupported original VCC configuration"):
        converter.convert_vcc_checkpoint(source, tmp_path / "out")
    source = _copy_with_config(fixtures_dir, tmp_path / "edited2", d_model="64")
    with pytest.raises(ConversionError, match=r"edited2/config\.json: invalid VCC-T5 configuration: `d_model`"):
        converter.convert_vcc_checkpoint(source, tmp_path / "out")


@pytest.mark.parametrize("value, message", [
    (7, r"pytorch_model\.bin: 'shared\.weight' holds a value of type int; expected .*tensor"),
    (torch.zeros(128), r"'shared\.weight' \(the token embedding\) is a 1-D tensor; expected a \[vocab_size, d_model\]"),
])
def test_a_token_embedding_that_is_no_matrix_is_named(fixtures_dir, tmp_path, value, message):
    source = _tampered_copy(fixtures_dir, tmp_path / "tampered", lambda sd: sd.__setitem__("shared.weight", value))
    with pytest.raises(ConversionError, match=message):
        converter.convert_vcc_checkpoint(source, tmp_path / "out")
