"""Dodo conversion from the authors' formats, and parity with the authors' outputs (shared/fixtures/dodo).

The references were written by the original code (``nugget.codec`` on transformers 4.32 + peft 0.4.0, CPU, float32).
Both conversion routes (the Lightning ``weights.ckpt`` and the PEFT folders + scorer file) must reproduce them. The
tolerances are the issue's contract: indices and greedy tokens exact; features, scores and nugget K/V <= 1e-5;
decoder logits <= 1e-4; losses <= 1e-5. These tests never skip.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import longreach  # noqa: F401  (registers the Auto classes)
from longreach import DodoLlamaForCausalLM
from longreach.conversion import convert_dodo_original_checkpoint as converter
from longreach.conversion.conversion_utils import ConversionError

ROUTES = ("lightning", "peft_plain_scorer", "peft_nugget_package_scorer")


def convert(route: str, fixtures: Path, output: Path, **options) -> Path:
    if route == "lightning":
        return converter.convert_dodo_checkpoint(fixtures / "dodo_ckpt" / "weights.ckpt", output, **options)
    scorer = "scorer.pt" if route == "peft_plain_scorer" else "scorer_nugget_pkg.ckpt"
    return converter.convert_dodo_peft_folders(
        fixtures / "adapters" / "encoder",
        fixtures / "adapters" / "decoder",
        fixtures / scorer,
        fixtures / "base",
        output,
        soft_prompt_path=fixtures / "dodo_ckpt" / "weights.ckpt",
        nugget_layer=3,
        nugget_ratio=0.1,
        **options,
    )


@pytest.fixture(scope="module")
def dodo_fixtures(fixtures_dir) -> Path:
    return fixtures_dir / "dodo"


@pytest.fixture(scope="module")
def converted(dodo_fixtures, tmp_path_factory) -> dict[str, Path]:
    return {route: convert(route, dodo_fixtures, tmp_path_factory.mktemp(route) / "out") for route in ROUTES}


@pytest.fixture(scope="module")
def refs(dodo_fixtures) -> dict[str, torch.Tensor]:
    return load_file(str(dodo_fixtures / "refs.safetensors"))


@pytest.fixture(scope="module", params=ROUTES)
def converted_model(request, converted) -> DodoLlamaForCausalLM:
    return DodoLlamaForCausalLM.from_pretrained(converted[request.param], attn_implementation="eager").eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def stacked_kv(nuggets) -> torch.Tensor:
    """[layers, k/v, batch, kv_heads, K, head_dim], the fixtures' layout."""
    return torch.stack([torch.stack([key, value]) for key, value in nuggets.key_values])


def target_labels(tokens: torch.Tensor, mask: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """The original's loss: targets at or after `skip`, padding ignored (shifted inside the model)."""
    labels = tokens.masked_fill(~mask.bool(), -100)
    for row, prompt_length in enumerate(skip.tolist()):
        labels[row, :prompt_length] = -100
    return labels


# --------------------------------------------------------------------------------------------------------------------
# Conversion results
# --------------------------------------------------------------------------------------------------------------------


def test_all_routes_give_the_same_checkpoint(converted, dodo_fixtures):
    reference = load_file(str(converted["lightning"] / "model.safetensors"))
    for route in ROUTES[1:]:
        other = load_file(str(converted[route] / "model.safetensors"))
        assert set(other) == set(reference) and all(torch.equal(other[k], reference[k]) for k in reference)
    config = json.loads((converted["lightning"] / "config.json").read_text())
    assert config["model_type"] == "dodo_llama" and config["auto_map"]["AutoModelForCausalLM"].startswith(
        "modeling_dodo."
    )
    assert (config["nugget_layer"], config["nugget_ratio"], config["lora_r"], config["lora_alpha"]) == (
        3,
        0.1,
        32,
        32.0,
    )
    assert (
        config["soft_prompt_length"] == 1 and config["score_in_forward"] and config["nugget_count_rounding"] == "dodo"
    )
    assert not config["legacy_decoder_mask_order"]
    generation = json.loads((converted["lightning"] / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 10 and generation["eos_token_id"] == 2  # new_tokens of the checkpoint
    # Every trainable tensor of the original round-trips bit for bit; soft_emb_tc (never used) is the one drop.
    original = torch.load(dodo_fixtures / "dodo_ckpt" / "weights.ckpt", weights_only=True)["state_dict"]
    assert original["nugget.decoder.soft_emb.weight"].equal(reference["soft_prompt.weight"])
    assert original["nugget.encoder.scorer.0.weight"].equal(reference["nugget_scorer.0.weight"])
    key = "nugget.lora_llama.base_model.model.model.layers.2.self_attn.v_proj.lora_B.encoder.weight"
    assert original[key].equal(reference["model.layers.2.self_attn.v_proj.lora_B.encoder.weight"])
    assert not any("soft_emb_tc" in name for name in reference)
    base = load_file(str(dodo_fixtures / "base" / "model.safetensors"))
    assert base["model.layers.1.self_attn.q_proj.weight"].equal(
        reference["model.layers.1.self_attn.q_proj.base_layer.weight"]
    )


def test_half_precision_conversion_keeps_the_trainable_weights_float32(converted, dodo_fixtures, tmp_path):
    """`--dtype bfloat16`: the base in bfloat16, the adapters, scorer and soft prompt float32 (the authors' and PEFT's
    layout, what `from_pretrained(dtype=torch.bfloat16)` loads), bit for bit the float32 conversion's. They were
    rounded to bfloat16 with the rest."""
    output = convert("lightning", dodo_fixtures, tmp_path / "out", dtype="bfloat16")
    half = load_file(str(output / "model.safetensors"))
    reference = load_file(str(converted["lightning"] / "model.safetensors"))
    assert set(half) == set(reference)
    for key, tensor in half.items():
        if ".lora_" in key or key.startswith(("nugget_scorer.", "soft_prompt.")):
            assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[key]), key
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference[key].bfloat16()), key
    assert json.loads((output / "config.json").read_text())["dtype"] == "bfloat16"


# --------------------------------------------------------------------------------------------------------------------
# Parity: per row (the bug-free references), from every route
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", [0, 1])
def test_per_row_parity(converted_model, refs, row):
    context_length = int(refs["src_attention_mask"][row].sum())
    target_length = int(refs["tgt_attention_mask"][row].sum())
    context = refs["src_input_ids"][row : row + 1, :context_length]
    target = refs["tgt_input_ids"][row : row + 1, :target_length]
    skip = int(refs["skip"][row])
    with torch.no_grad():
        nuggets = converted_model.compress(context, output_features=True)
        assert torch.equal(nuggets.indices, refs[f"row{row}_nugget_index"])
        assert nuggets.mask.all()
        assert max_diff(nuggets.features[0], refs["scorer_features"][row, :context_length]) <= 1e-5
        assert max_diff(nuggets.all_scores, refs[f"row{row}_scores_all"]) <= 1e-5
        assert max_diff(nuggets.scores, refs[f"row{row}_nugget_scores"]) <= 1e-5
        assert max_diff(stacked_kv(nuggets), refs[f"row{row}_nugget_kv"]) <= 1e-5
        labels = target_labels(target, torch.ones_like(target), refs["skip"][row : row + 1])
        output = converted_model(target, nuggets=nuggets, labels=labels)
        assert max_diff(output.logits, refs[f"row{row}_decoder_logits"]) <= 1e-4
        assert max_diff(output.loss.view(1), refs[f"row{row}_decoder_loss"]) <= 1e-5
        generated = converted_model.generate(target[:, :skip], nuggets=nuggets, max_new_tokens=10, do_sample=False)
    # the original returns the last prompt token followed by the new tokens; we return the whole prompt first
    assert torch.equal(generated[:, :skip], target[:, :skip])
    assert torch.equal(generated[:, skip - 1 :], refs[f"row{row}_generated"])


def test_batched_row0_parity_and_row1_fix(converted_model, refs):
    """Row 0 of the batch is unaffected by the original's mask-order bug; row 1 (3 of 4 nugget slots) follows the
    bug-free per-row references."""
    with torch.no_grad():
        nuggets = converted_model.compress(refs["src_input_ids"], refs["src_attention_mask"])
        assert torch.equal(nuggets.indices, refs["nugget_index"]) and torch.equal(nuggets.mask, refs["nugget_mask"])
        assert max_diff(nuggets.scores, refs["nugget_scores"]) <= 1e-5
        assert max_diff(stacked_kv(nuggets), refs["nugget_kv"]) <= 1e-5
        output = converted_model(refs["tgt_input_ids"], attention_mask=refs["tgt_attention_mask"], nuggets=nuggets)
        generated = converted_model.generate(
            refs["tgt_input_ids"][:, :6], nuggets=nuggets, max_new_tokens=10, do_sample=False
        )
    assert max_diff(output.logits[0], refs["decoder_logits"][0]) <= 1e-4
    assert torch.equal(generated[0, 5:], refs["generated"][0])
    assert max_diff(output.logits[1, :10], refs["row1_decoder_logits"][0]) <= 1e-4
    assert torch.equal(generated[1, 5:], refs["row1_generated"][0])


def test_legacy_mask_order_reproduces_the_original_batch(converted, refs):
    model = DodoLlamaForCausalLM.from_pretrained(
        converted["lightning"], attn_implementation="eager", legacy_decoder_mask_order=True
    ).eval()
    labels = target_labels(refs["tgt_input_ids"], refs["tgt_attention_mask"], refs["skip"])
    with torch.no_grad():
        nuggets = model.compress(refs["src_input_ids"], refs["src_attention_mask"])
        output = model(refs["tgt_input_ids"], attention_mask=refs["tgt_attention_mask"], nuggets=nuggets, labels=labels)
        generated = model.generate(refs["tgt_input_ids"][:, :6], nuggets=nuggets, max_new_tokens=10, do_sample=False)
    assert max_diff(output.logits, refs["decoder_logits"]) <= 1e-4  # both rows, padded positions included
    assert max_diff(output.loss.view(1), refs["decoder_loss"]) <= 1e-5
    assert torch.equal(generated[:, 5:], refs["generated"])
    assert max_diff(output.logits[1, :10], refs["row1_decoder_logits"][0]) > 0.1  # the bug changes row 1


def test_sdpa_matches_the_references_too(converted, refs):
    model = DodoLlamaForCausalLM.from_pretrained(converted["lightning"], attn_implementation="sdpa").eval()
    with torch.no_grad():
        for row in (0, 1):
            n = int(refs["src_attention_mask"][row].sum())
            m = int(refs["tgt_attention_mask"][row].sum())
            nuggets = model.compress(refs["src_input_ids"][row : row + 1, :n])
            assert torch.equal(nuggets.indices, refs[f"row{row}_nugget_index"])
            assert max_diff(stacked_kv(nuggets), refs[f"row{row}_nugget_kv"]) <= 1e-5
            logits = model(refs["tgt_input_ids"][row : row + 1, :m], nuggets=nuggets).logits
            assert max_diff(logits, refs[f"row{row}_decoder_logits"]) <= 1e-4


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_auto_checkpoint_reproduces_the_reencoding_references(dodo_fixtures, tmp_path, refs, attention):
    """The original's experimental ``auto=True`` encoder (spec §4; `auto_*` references, row 0 alone): a checkpoint
    with ``auto: true`` converts to ``nugget_encoding="reencode"`` and reproduces it."""
    auto = copy_checkpoint(dodo_fixtures, tmp_path / "auto", hparams=lambda hp: {**hp, "auto": True})
    output = converter.convert_dodo_checkpoint(auto, tmp_path / "out", base_model_path=dodo_fixtures / "base")
    assert json.loads((output / "config.json").read_text())["nugget_encoding"] == "reencode"
    model = DodoLlamaForCausalLM.from_pretrained(output, attn_implementation=attention).eval()
    context_length = int(refs["src_attention_mask"][0].sum())
    with torch.no_grad():
        nuggets = model.compress(refs["src_input_ids"][:1, :context_length])
        logits = model(refs["tgt_input_ids"][:1], nuggets=nuggets).logits
    assert torch.equal(nuggets.indices, refs["auto_nugget_index"]) and torch.equal(nuggets.mask, refs["auto_nugget_mask"])
    assert max_diff(nuggets.scores, refs["auto_nugget_scores"]) <= 1e-5
    assert max_diff(stacked_kv(nuggets), refs["auto_nugget_kv"]) <= 1e-5
    assert max_diff(logits, refs["auto_decoder_logits"]) <= 1e-4
    assert max_diff(stacked_kv(nuggets), refs["row0_nugget_kv"]) > 0.1  # not the encoder-pass nuggets
    if attention == "eager":  # the PEFT-folder route, from the command line
        code = converter.main([
            "--encoder_adapter_path", str(dodo_fixtures / "adapters" / "encoder"),
            "--decoder_adapter_path", str(dodo_fixtures / "adapters" / "decoder"),
            "--scorer_path", str(dodo_fixtures / "scorer.pt"),
            "--soft_prompt_path", str(dodo_fixtures / "dodo_ckpt" / "weights.ckpt"),
            "--base_model_path", str(dodo_fixtures / "base"),
            "--nugget_encoding", "reencode",
            "--pytorch_dump_folder_path", str(tmp_path / "peft_route"),
        ])
        assert code == 0
        peft_route = DodoLlamaForCausalLM.from_pretrained(tmp_path / "peft_route", attn_implementation="eager").eval()
        with torch.no_grad():
            other = peft_route.compress(refs["src_input_ids"][:1, :context_length])
        assert max_diff(stacked_kv(other), refs["auto_nugget_kv"]) <= 1e-5


def test_cli_with_legacy_flag_and_explicit_paths(dodo_fixtures, tmp_path, refs):
    output = tmp_path / "cli"
    code = converter.main(
        [
            "--checkpoint_path",
            str(dodo_fixtures / "dodo_ckpt" / "weights.ckpt"),
            "--hparams_path",
            str(dodo_fixtures / "dodo_ckpt" / "hparams.yaml"),
            "--base_model_path",
            str(dodo_fixtures / "base"),
            "--pytorch_dump_folder_path",
            str(output),
            "--legacy_decoder_mask_order",
        ]
    )
    assert code == 0
    model = AutoModelForCausalLM.from_pretrained(output, attn_implementation="eager").eval()
    assert type(model) is DodoLlamaForCausalLM and model.config.legacy_decoder_mask_order
    with torch.no_grad():
        nuggets = model.compress(refs["src_input_ids"], refs["src_attention_mask"])
        generated = model.generate(refs["tgt_input_ids"][:, :6], nuggets=nuggets, max_new_tokens=10, do_sample=False)
    assert torch.equal(generated[:, 5:], refs["generated"])


# --------------------------------------------------------------------------------------------------------------------
# Export back to PEFT folders
# --------------------------------------------------------------------------------------------------------------------


def test_export_to_peft_folders_loads_in_peft_with_matching_logits(converted, dodo_fixtures, tmp_path):
    exported = tmp_path / "peft"
    assert (
        converter.main(["--export_peft_from", str(converted["lightning"]), "--pytorch_dump_folder_path", str(exported)])
        == 0
    )
    model = DodoLlamaForCausalLM.from_pretrained(converted["lightning"], attn_implementation="eager").eval()
    base = LlamaForCausalLM.from_pretrained(dodo_fixtures / "base", attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, exported / "encoder", adapter_name="encoder")
    peft_model.load_adapter(exported / "decoder", adapter_name="decoder")
    peft_model.eval()
    tokens = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        for name in ("encoder", "decoder"):
            peft_model.set_adapter(name)
            model.set_active_adapter(name)
            ours = model.lm_head(model.model(tokens).last_hidden_state)
            assert max_diff(peft_model(tokens).logits, ours) <= 1e-6
    scorer = torch.load(exported / "scorer.pt", weights_only=True)  # the original's load_scorer format
    assert set(scorer) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert scorer["0.weight"].equal(torch.load(dodo_fixtures / "scorer.pt", weights_only=True)["0.weight"])
    assert load_file(str(exported / "soft_prompt.safetensors"))["soft_prompt.weight"].shape == (1, 64)


# --------------------------------------------------------------------------------------------------------------------
# Safety rules and input handling
# --------------------------------------------------------------------------------------------------------------------


def copy_checkpoint(dodo_fixtures: Path, folder: Path, state_dict=None, hparams=None) -> Path:
    """A writable copy of ``dodo_ckpt/`` next to a ``base/`` link, optionally with a modified state dict/hparams."""
    folder.mkdir(parents=True)
    (folder / "base").symlink_to(dodo_fixtures / "base", target_is_directory=True)
    (folder / "dodo_ckpt").mkdir()
    checkpoint = torch.load(dodo_fixtures / "dodo_ckpt" / "weights.ckpt", weights_only=True)
    if state_dict is not None:
        checkpoint["state_dict"] = state_dict(checkpoint["state_dict"])
    if hparams is not None:
        checkpoint["hyper_parameters"] = hparams(checkpoint["hyper_parameters"])
    torch.save(checkpoint, folder / "dodo_ckpt" / "weights.ckpt")
    return folder / "dodo_ckpt" / "weights.ckpt"


def test_missing_and_unexpected_keys_stop_the_conversion(dodo_fixtures, tmp_path):
    key = "nugget.lora_llama.base_model.model.model.layers.1.self_attn.o_proj.lora_A.decoder.weight"
    missing = copy_checkpoint(
        dodo_fixtures, tmp_path / "missing", state_dict=lambda sd: {k: v for k, v in sd.items() if k != key}
    )
    with pytest.raises(ConversionError, match="Missing keys.*layers.1.self_attn.o_proj.lora_A.decoder"):
        converter.convert_dodo_checkpoint(missing, tmp_path / "out1")
    extra = copy_checkpoint(
        dodo_fixtures, tmp_path / "extra", state_dict=lambda sd: {**sd, "nugget.mystery": torch.ones(1)}
    )
    with pytest.raises(ConversionError, match="Unexpected keys.*nugget.mystery"):
        converter.convert_dodo_checkpoint(extra, tmp_path / "out2")
    assert not (tmp_path / "out1" / "model.safetensors").exists()


def test_output_folder_rules(dodo_fixtures, tmp_path):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        converter.convert_dodo_checkpoint(dodo_fixtures / "dodo_ckpt" / "weights.ckpt", occupied)
    assert (
        converter.main(
            [
                "--checkpoint_path",
                str(dodo_fixtures / "dodo_ckpt" / "weights.ckpt"),
                "--pytorch_dump_folder_path",
                str(occupied),
            ]
        )
        == 1
    )
    checkpoint = copy_checkpoint(dodo_fixtures, tmp_path / "copy")
    with pytest.raises(ConversionError, match="overlaps"):  # never inside an input folder (here the base model)
        converter.convert_dodo_checkpoint(checkpoint, tmp_path / "copy" / "base" / "inside")
    with pytest.raises(ConversionError, match="overlaps"):
        converter.convert_dodo_peft_folders(
            dodo_fixtures / "adapters" / "encoder",
            None,
            dodo_fixtures / "scorer.pt",
            dodo_fixtures / "base",
            dodo_fixtures / "adapters",
            soft_prompt_length=0,
        )


def test_pickles_are_read_with_weights_only(dodo_fixtures, tmp_path):
    import argparse

    checkpoint = copy_checkpoint(dodo_fixtures, tmp_path / "copy")
    payload = torch.load(checkpoint, weights_only=True)
    payload["hyper_parameters"]["args"] = argparse.Namespace(seed=0)  # an object outside the allow-list
    torch.save(payload, checkpoint)
    with pytest.raises(ConversionError, match="weights_only=True"):
        converter.convert_dodo_checkpoint(checkpoint, tmp_path / "out")
    output = converter.convert_dodo_checkpoint(checkpoint, tmp_path / "out2", allow_pickle_code_execution=True)
    assert (output / "model.safetensors").is_file()


def test_hyper_parameters_and_base_model_resolution(dodo_fixtures, tmp_path):
    bad = copy_checkpoint(dodo_fixtures, tmp_path / "bad", hparams=lambda hp: {**hp, "encoder_type": "compress"})
    with pytest.raises(ConversionError, match="disagree"):  # hparams.yaml next to it? none here; the ckpt says compress
        converter.convert_dodo_checkpoint(
            bad, tmp_path / "o1", hparams_path=dodo_fixtures / "dodo_ckpt" / "hparams.yaml"
        )
    with pytest.raises(ConversionError, match="encoder_type"):
        converter.convert_dodo_checkpoint(bad, tmp_path / "o2")
    no_ind_scorer = copy_checkpoint(
        dodo_fixtures, tmp_path / "auto", hparams=lambda hp: {**hp, "auto": True, "ind_scorer": False}
    )
    with pytest.raises(ConversionError, match="auto=True needs ind_scorer=True"):
        converter.convert_dodo_checkpoint(no_ind_scorer, tmp_path / "o3")
    nowhere = copy_checkpoint(
        dodo_fixtures, tmp_path / "nowhere", hparams=lambda hp: {**hp, "pretrained": "meta-llama/Llama-2-7b-chat-hf"}
    )
    with pytest.raises(ConversionError, match="base_model_path"):
        converter.convert_dodo_checkpoint(nowhere, tmp_path / "o4")
    output = converter.convert_dodo_checkpoint(nowhere, tmp_path / "o5", base_model_path=dodo_fixtures / "base")
    assert (output / "model.safetensors").is_file()
    with pytest.raises(ConversionError, match="ZeRO"):
        converter.convert_dodo_checkpoint(dodo_fixtures / "dodo_ckpt", tmp_path / "o6")


def test_peft_route_needs_a_soft_prompt_or_an_explicit_zero(dodo_fixtures, tmp_path):
    adapters = dodo_fixtures / "adapters"
    with pytest.raises(ConversionError, match="soft_prompt_path"):
        converter.convert_dodo_peft_folders(
            adapters / "encoder",
            adapters / "decoder",
            dodo_fixtures / "scorer.pt",
            dodo_fixtures / "base",
            tmp_path / "o1",
        )
    output = converter.convert_dodo_peft_folders(
        adapters / "encoder",
        adapters / "decoder",
        dodo_fixtures / "scorer.pt",
        dodo_fixtures / "base",
        tmp_path / "o2",
        soft_prompt_length=0,
    )
    model = DodoLlamaForCausalLM.from_pretrained(output)
    assert model.soft_prompt is None and model.config.soft_prompt_length == 0
    # a scorer file with other keys is refused
    save_file({"weight": torch.zeros(1, 64)}, str(tmp_path / "scorer.safetensors"))
    with pytest.raises(ConversionError, match="scorer FFN keys"):
        converter.convert_dodo_peft_folders(
            adapters / "encoder",
            adapters / "decoder",
            tmp_path / "scorer.safetensors",
            dodo_fixtures / "base",
            tmp_path / "o3",
            soft_prompt_length=0,
        )
    # adapters with different LoRA settings are refused
    shutil.copytree(adapters / "decoder", tmp_path / "decoder16")
    config_file = tmp_path / "decoder16" / "adapter_config.json"
    config_file.write_text(config_file.read_text().replace('"lora_alpha": 32', '"lora_alpha": 16'))
    with pytest.raises(ConversionError, match="differ"):
        converter.convert_dodo_peft_folders(
            adapters / "encoder",
            tmp_path / "decoder16",
            dodo_fixtures / "scorer.pt",
            dodo_fixtures / "base",
            tmp_path / "o4",
            soft_prompt_length=0,
        )


def test_ind_scorer_false_and_freeze_decoder_checkpoints(dodo_fixtures, tmp_path):
    """``ind_scorer=False`` puts LoRA on layers >= ι only; ``freeze_decoder=True`` has no decoder adapter (the decoder
    then runs with the encoder adapter, spec §8.3)."""

    def only_late_layers(state_dict):
        return {k: v for k, v in state_dict.items() if not any(f"layers.{i}." in k for i in range(3))}

    late = copy_checkpoint(
        dodo_fixtures, tmp_path / "late", state_dict=only_late_layers, hparams=lambda hp: {**hp, "ind_scorer": False}
    )
    model = DodoLlamaForCausalLM.from_pretrained(converter.convert_dodo_checkpoint(late, tmp_path / "o1"))
    assert model.config.lora_layers == [3] and model.config.scorer_features == "encoder_hidden"
    assert not any(".lora_" in name for name in model.state_dict() if "layers.0." in name)

    def encoder_only(state_dict):
        return {k: v for k, v in state_dict.items() if ".decoder.weight" not in k or "soft_emb" in k}

    frozen = copy_checkpoint(
        dodo_fixtures, tmp_path / "frozen", state_dict=encoder_only, hparams=lambda hp: {**hp, "freeze_decoder": True}
    )
    model = DodoLlamaForCausalLM.from_pretrained(converter.convert_dodo_checkpoint(frozen, tmp_path / "o2"))
    assert model.config.adapter_names == ["encoder"] and model.config.decoder_adapter_name == "encoder"
    assert not any(".decoder." in name for name in model.state_dict() if ".lora_" in name)
    with torch.no_grad():
        assert model(torch.tensor([[1, 5, 7]]), context_input_ids=torch.tensor([[1, 9, 8, 7, 6]])).logits.shape == (
            1,
            3,
            128,
        )


# --------------------------------------------------------------------------------------------------------------------
# Bad inputs: clear errors naming the file or option
# --------------------------------------------------------------------------------------------------------------------


def test_export_peft_from_refuses_a_folder_that_is_not_a_dodo_model(fixtures_dir, tmp_path, capsys):
    """A LOCOST folder's config would otherwise build a default (7B-parameter) Llama; a missing folder would go to
    the Hub."""
    from longreach.conversion import convert_locost_original_checkpoint as locost_converter

    locost = locost_converter.convert_locost_checkpoint(fixtures_dir / "locost" / "hf_checkpoint", tmp_path / "locost")
    for source, message in (
        (locost, f"--export_peft_from {locost} holds a model_type 'locost' model; expected a longreach Dodo folder"),
        (tmp_path / "absent", f"--export_peft_from {tmp_path / 'absent'} is not a folder"),
    ):
        with pytest.raises(ConversionError, match=message):
            converter.export_peft_adapters(source, tmp_path / "out")
        arguments = ["--export_peft_from", str(source), "--pytorch_dump_folder_path", str(tmp_path / "out")]
        assert converter.main(arguments) == 1
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("hparams, message", [
    ({"ratio": "ten percent"}, r"hyper-parameter ratio='ten percent': expected a number"),
    ({"soft": "one"}, r"hyper-parameter soft='one': expected an integer"),
    ({"new_tokens": 0}, r"hyper-parameter new_tokens=0: expected a positive integer"),
    ({"ratio": 5.0}, r"give an invalid Dodo configuration: `nugget_ratio` must be in \(0, 1\]"),
])
def test_bad_hyper_parameters_are_named(dodo_fixtures, tmp_path, hparams, message):
    checkpoint = copy_checkpoint(dodo_fixtures, tmp_path / "copy", hparams=lambda hp: {**hp, **hparams})
    with pytest.raises(ConversionError, match=rf"the hyper-parameters of {checkpoint}.*{message}"):
        converter.convert_dodo_checkpoint(checkpoint, tmp_path / "out")


def test_unreadable_yaml_and_base_config_are_named(dodo_fixtures, tmp_path):
    checkpoint = copy_checkpoint(dodo_fixtures, tmp_path / "copy")
    (tmp_path / "hparams.yaml").write_text("ratio: [0.1\nlora: 32\n")
    with pytest.raises(ConversionError, match=r"hparams\.yaml cannot be read as YAML: while parsing"):
        converter.convert_dodo_checkpoint(checkpoint, tmp_path / "out", hparams_path=tmp_path / "hparams.yaml")
    shutil.copytree(dodo_fixtures / "base", tmp_path / "base")
    (tmp_path / "base" / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ConversionError, match=rf"The base model's {tmp_path / 'base' / 'config.json'} cannot be read"):
        converter.convert_dodo_checkpoint(checkpoint, tmp_path / "out", base_model_path=tmp_path / "base")


def test_truncated_file_with_unsafe_loading_is_a_conversion_error(dodo_fixtures, tmp_path):
    checkpoint = copy_checkpoint(dodo_fixtures, tmp_path / "copy")
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(ConversionError, match="cannot be loaded even with --unsafe_allow_pickle_code_execution"):
        converter.convert_dodo_checkpoint(checkpoint, tmp_path / "out", allow_pickle_code_execution=True)


def _peft_route(dodo_fixtures: Path, output: Path, encoder: Path | None = None, scorer: Path | None = None):
    return converter.convert_dodo_peft_folders(
        encoder or dodo_fixtures / "adapters" / "encoder", dodo_fixtures / "adapters" / "decoder",
        scorer or dodo_fixtures / "scorer.pt", dodo_fixtures / "base", output, soft_prompt_length=0,
    )


def test_integer_and_non_tensor_values_are_named(dodo_fixtures, tmp_path):
    scorer = torch.load(dodo_fixtures / "scorer.pt", weights_only=True)
    torch.save({**scorer, "0.weight": scorer["0.weight"].long()}, tmp_path / "long.pt")
    with pytest.raises(ConversionError, match=r"nugget_scorer\.0\.weight: checkpoint torch\.int64, expected a float"):
        _peft_route(dodo_fixtures, tmp_path / "out", scorer=tmp_path / "long.pt")
    torch.save({**scorer, "0.bias": 2}, tmp_path / "int.pt")
    with pytest.raises(ConversionError, match=r"int\.pt \(scorer\): '0\.bias' holds a value of type int"):
        _peft_route(dodo_fixtures, tmp_path / "out", scorer=tmp_path / "int.pt")
    shutil.copytree(dodo_fixtures / "adapters" / "encoder", tmp_path / "encoder")
    torch.save([1, 2, 3], tmp_path / "encoder" / "adapter_model.bin")
    with pytest.raises(ConversionError, match=r"adapter_model\.bin: expected a state dict .*got list"):
        _peft_route(dodo_fixtures, tmp_path / "out", encoder=tmp_path / "encoder")
    key = "nugget.encoder.scorer.0.bias"
    checkpoint = copy_checkpoint(dodo_fixtures, tmp_path / "copy", state_dict=lambda sd: {**sd, key: 3})
    with pytest.raises(ConversionError, match=rf"weights\.ckpt \('state_dict'\): '{key}' holds a value of type int"):
        converter.convert_dodo_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, message", [
    ("r", "32", "r='32', expected an integer"),
    ("lora_alpha", "abc", "lora_alpha='abc', expected a number"),
    ("target_modules", "(unclosed", "target_modules '(unclosed' is not a valid regular expression"),
    ("target_modules", 5, "target_modules 5: expected a regular expression or a list of module names"),
])
def test_bad_adapter_config_values_name_the_file(dodo_fixtures, tmp_path, field, value, message):
    shutil.copytree(dodo_fixtures / "adapters" / "encoder", tmp_path / "encoder")
    config_file = tmp_path / "encoder" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), field: value}))
    with pytest.raises(ConversionError) as error:
        _peft_route(dodo_fixtures, tmp_path / "out", encoder=tmp_path / "encoder")
    assert str(error.value).startswith(f"{config_file}: {message}")


@pytest.mark.parametrize("flag, value, message", [
    ("--nugget_ratio", "nan", "--nugget_ratio nan: expected a number in (0, 1]"),
    ("--nugget_ratio", "0", "--nugget_ratio 0.0: expected a number in (0, 1]"),
    ("--nugget_layer", "-1", "--nugget_layer -1: expected a layer index >= 0"),
    ("--max_new_tokens", "0", "--max_new_tokens 0: expected a positive integer"),
    ("--max_new_tokens", "-5", "--max_new_tokens -5: expected a positive integer"),
])
def test_peft_route_numeric_flags_are_checked(dodo_fixtures, tmp_path, capsys, flag, value, message):
    adapters = dodo_fixtures / "adapters"
    with pytest.raises(SystemExit):
        converter.main(["--encoder_adapter_path", str(adapters / "encoder"), "--scorer_path",
                        str(dodo_fixtures / "scorer.pt"), "--base_model_path", str(dodo_fixtures / "base"),
                        "--soft_prompt_length", "0", "--pytorch_dump_folder_path", str(tmp_path / "out"), flag, value])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, value", [("use_rslora", True), ("use_dora", True), ("alpha_pattern", {"q_proj": 64}),
                                           ("rank_pattern", {"v_proj": 4}), ("fan_in_fan_out", True)])
def test_peft_adapters_with_options_beyond_plain_lora_are_refused(dodo_fixtures, tmp_path, option, value):
    """`use_rslora` adapters converted with the plain scale alpha / r (1.0 instead of PEFT's alpha / sqrt(r), 5.66
    here), silently: another model. Options that change what LoRA computes are refused, naming the file."""
    import json
    import shutil

    adapters = tmp_path / "adapters"
    shutil.copytree(dodo_fixtures / "adapters", adapters)
    config_file = adapters / "encoder" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config[option] = value
    config_file.write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=rf"adapter_config.json sets {option}=.*plain LoRA"):
        converter.convert_dodo_peft_folders(adapters / "encoder", adapters / "decoder", dodo_fixtures / "scorer.pt",
                                            dodo_fixtures / "base", tmp_path / "out", soft_prompt_length=0)
    assert not (tmp_path / "out").exists()
    assert converter.unsupported_lora_options({"use_rslora": False, "alpha_pattern": {}, "modules_to_save": None,
                                               "bias": "none", "layer_replication": None}) == []


def test_a_base_whose_generation_config_samples_gives_a_greedy_model(dodo_fixtures, tmp_path):
    """Llama-2-7b-hf's generation_config.json samples (temperature 0.6, top_p 0.9); copied as it is, the converted Dodo
    sampled, where the authors decode greedily, and two runs of `longreach summarize` disagreed."""
    import shutil

    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copytree(dodo_fixtures / "base", folder / "base")
    shutil.copytree(dodo_fixtures / "dodo_ckpt", folder / "dodo_ckpt")
    generation = json.loads((folder / "base" / "generation_config.json").read_text())
    generation.update(do_sample=True, temperature=0.6, top_p=0.9)
    (folder / "base" / "generation_config.json").write_text(json.dumps(generation))
    output = converter.convert_dodo_checkpoint(folder / "dodo_ckpt" / "weights.ckpt", tmp_path / "out")
    written = json.loads((output / "generation_config.json").read_text())
    assert not written.get("do_sample") and "temperature" not in written and "top_p" not in written, written
    assert written["eos_token_id"] == 2 and written["max_new_tokens"] == 10  # the rest as before
    model = DodoLlamaForCausalLM.from_pretrained(output)
    assert model.generation_config.do_sample is False


def test_the_card_names_the_base_model_given_by_its_hub_id(dodo_fixtures, converted, tmp_path, capsys):
    """A converted Dodo is the base Llama plus the authors' adapters, scorer and soft prompt, but its card named no
    `base_model`: only the local folder was known. `--base_model_id` names it (the Hub's model tree), through either
    route and the command line; a path given as an id is refused before anything is written."""
    from huggingface_hub import ModelCard

    hub_id = "meta-llama/Llama-2-7b-chat-hf"
    for route in ROUTES:  # (converted without it)
        unnamed = ModelCard.load(converted[route] / "README.md").data.to_dict()
        assert "base_model" not in unnamed and "base_model_relation" not in unnamed, route
    peft_route = convert("peft_plain_scorer", dodo_fixtures, tmp_path / "peft_route", base_model_id=hub_id)
    code = converter.main(["--checkpoint_path", str(dodo_fixtures / "dodo_ckpt" / "weights.ckpt"), "--base_model_path",
                           str(dodo_fixtures / "base"), "--base_model_id", hub_id, "--pytorch_dump_folder_path",
                           str(tmp_path / "cli")])
    assert code == 0
    for output in (peft_route, tmp_path / "cli"):
        card = ModelCard.load(output / "README.md")
        assert (card.data.base_model, card.data.to_dict()["base_model_relation"]) == (hub_id, "finetune"), output

    for route in ROUTES[:2]:
        with pytest.raises(ConversionError, match=r"--base_model_id '\./base': expected a Hub repository id"):
            convert(route, dodo_fixtures, tmp_path / "refused", base_model_id="./base")
        assert not (tmp_path / "refused").exists()
    code = converter.main(["--checkpoint_path", str(dodo_fixtures / "dodo_ckpt" / "weights.ckpt"), "--base_model_path",
                           str(dodo_fixtures / "base"), "--base_model_id", str(dodo_fixtures / "base"),
                           "--pytorch_dump_folder_path", str(tmp_path / "refused")])
    assert code == 1 and "--base_model_id" in capsys.readouterr().err and not (tmp_path / "refused").exists()
