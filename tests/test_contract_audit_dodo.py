"""Dodo as a Llama/PEFT user drives it after loading: edits of `model.config` (checked when the model runs or is saved)
and `from_pretrained` settings that would leave checkpoint weights unused."""

from __future__ import annotations

import re

import pytest
import torch
from test_modeling_dodo import ids, tiny_model
from transformers import AutoModelForCausalLM

import longreach  # noqa: F401  (Auto classes)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("nugget_ratio", 2.0, r"`nugget_ratio` must be in \(0, 1\].*got 2.0"),  # was: every token kept, silently
        ("nugget_ratio", -0.5, r"`nugget_ratio` must be in \(0, 1\].*got -0.5"),  # was: a RuntimeError from arange
        ("nugget_layer", -1, r"`nugget_layer` \(ι\) must be an integer in \[0, num_hidden_layers=3\], got -1"),
        ("nugget_layer", 10, r"`nugget_layer` \(ι\) must be an integer in \[0, num_hidden_layers=3\], got 10"),
        ("nugget_count_rounding", "floor", r"`nugget_count_rounding` must be one of .*got 'floor'"),
        ("scorer_features", "hidden", r"`scorer_features` must be one of .*got 'hidden'"),
    ],
)
def test_invalid_settings_assigned_after_loading_are_refused_when_the_model_runs(field, value, message):
    """transformers' configs (and ours) type-check an assignment, and `save_pretrained` validates the values; Dodo's own
    settings are read at every call, so a bad value assigned after loading was used silently before the save refused
    it (a ratio of 2 kept every token; an unknown `scorer_features` scored the raw residual stream, an unknown
    rounding counted as "dodo", ι = -1 ran 2 of 3 layers) or failed deep inside (ratio < 0)."""
    model = tiny_model()
    context, prompt = ids(2, 20), ids(2, 4)
    setattr(model.config, field, value)
    with torch.no_grad():
        with pytest.raises(ValueError, match=message):
            model.compress(context)
        with pytest.raises(ValueError, match=message):
            model(prompt, context_input_ids=context)
        with pytest.raises(ValueError, match=message):
            model.generate(prompt, context_input_ids=context, max_new_tokens=2)


def test_runtime_settings_assigned_after_loading_take_effect_and_bad_ones_are_named():
    model = tiny_model()
    context = ids(1, 20)
    with torch.no_grad():
        assert model.compress(context).num_nuggets.tolist() == [4]
        model.config.nugget_ratio = 0.5  # a valid edit is what the next call uses
        assert model.compress(context).num_nuggets.tolist() == [10]
        windowed = tiny_model(recent_window=4)
        windowed.config.recent_window = -3  # was: "IndexError: argmax(): Expected reduction dim 1 ..."
        with pytest.raises(ValueError, match=r"`recent_window` \(τ\) must be None or a non-negative integer, got -3"):
            windowed(ids(1, 12))


@pytest.mark.parametrize(
    "field, value",
    [
        ("lora_layers", [2]),  # was: the scorer read the φ pass of layers 0-1, which do carry LoRA (wrong scores)
        ("lora_alpha", 32.0),  # was: no effect here, another scale once saved and reloaded
        ("lora_r", 8),
        ("soft_prompt_length", 5),
        ("encoder_adapter_name", "phi"),  # was: "adapters ['encoder'] were added to it"
        ("lora_target_modules", None),  # was: "TypeError: 'NoneType' object is not iterable" (a ValueError before)
    ],
)
def test_settings_the_model_was_built_with_cannot_be_changed_in_its_config(tmp_path, field, value):
    model = tiny_model()
    context, prompt = ids(1, 20), ids(1, 4)
    built = getattr(model.config, field)
    setattr(model.config, field, value)
    message = re.escape(f"`config.{field}` was changed to {value!r} after the model was built with {built!r}")
    with torch.no_grad():
        with pytest.raises(ValueError, match=message):
            model.compress(context)
        with pytest.raises(ValueError, match=message):
            model(prompt)
    with pytest.raises(ValueError, match=message):  # a folder whose config.json does not describe its weights
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "config.json").exists()
    setattr(model.config, field, built)  # set back: the model runs again
    with torch.no_grad():
        assert model(prompt, context_input_ids=context).logits.shape == (1, 4, model.config.vocab_size)


@pytest.mark.parametrize(
    "override, unused",
    [
        ({"lora_layers": [1, 2]}, r"model\.layers\.0\.self_attn\.(q|v|o)_proj\.base_layer\.weight"),
        ({"lora_target_modules": ["v_proj", "o_proj"]}, r"self_attn\.q_proj\.base_layer\.weight"),
        ({"encoder_adapter_name": "phi"}, r"lora_(A|B)\.encoder\.weight"),
    ],
)
def test_from_pretrained_refuses_settings_that_leave_checkpoint_weights_unused(tmp_path, override, unused):
    """Loading a Dodo folder with other LoRA layers or adapter names used to succeed with a load report only: the
    projections the checkpoint stores as ``base_layer`` were left randomly initialised (`lora_layers`,
    `lora_target_modules`), or the trained adapter was replaced by a fresh one (adapter names)."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"has no place for weights of the checkpoint: .*{unused}"):
        AutoModelForCausalLM.from_pretrained(tmp_path, **override)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # the folder's own settings load every weight
    context, prompt = ids(1, 20), ids(1, 4)
    with torch.no_grad():
        assert torch.equal(reloaded(prompt, context_input_ids=context).logits,
                           model(prompt, context_input_ids=context).logits)
