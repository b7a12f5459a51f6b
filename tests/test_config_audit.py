"""LOCOST and VCC-T5 as a T5 user drives them after loading: settings assigned to `model.config` that the models read
at every call are checked there (an invalid one was used silently, gave NaN, hung or failed deep inside), and those
that only change how they compute take effect."""

from __future__ import annotations

import re

import pytest
import torch
from test_modeling_locost import tiny_config as tiny_locost_config
from test_modeling_vcc_t5 import batch as vcc_batch
from test_modeling_vcc_t5 import tiny_model as tiny_vcc

from longreach import LocostForConditionalGeneration


def tiny_locost(**overrides) -> LocostForConditionalGeneration:
    return LocostForConditionalGeneration(tiny_locost_config(**overrides)).eval()


def _inputs(kind: str) -> dict:
    if kind == "locost":
        return {"input_ids": torch.randint(2, 99, (2, 40))}
    input_ids, attention_mask, vip_mask = vcc_batch()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "vip_mask": vip_mask}


@pytest.mark.parametrize("kind", ["locost", "vcc"])
@pytest.mark.parametrize("value", [1, 0, -3])
def test_logn_length_assigned_after_loading_is_checked_when_the_decoder_runs(kind, value):
    """The decoder reads `cross_attention_logn_length` at every call: 1 gave NaN logits (ln 1 = 0 as divisor), 0 and
    negative values a bare "math domain error"."""
    model = tiny_locost() if kind == "locost" else tiny_vcc()
    inputs = _inputs(kind)
    model.config.cross_attention_logn_length = value
    message = re.escape(f"`cross_attention_logn_length` must be None or an integer >= 2 (the number of encoder tokens "
                        f"the model was trained on), got {value}.")
    with torch.no_grad():
        with pytest.raises(ValueError, match=message):
            model(**inputs, decoder_input_ids=inputs["input_ids"][:, :3])
        with pytest.raises(ValueError, match=message):
            model.generate(**inputs, max_new_tokens=2)
        model.config.cross_attention_logn_length = 16  # a valid edit is what the next call uses
        scaled = model(**inputs, decoder_input_ids=inputs["input_ids"][:, :3]).logits
        model.config.cross_attention_logn_length = None
        plain = model(**inputs, decoder_input_ids=inputs["input_ids"][:, :3]).logits
    assert torch.isfinite(scaled).all() and not torch.allclose(scaled, plain)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_vanilla_layers", 99, "`num_vanilla_layers` must be an integer between 0 and `num_layers` (3), got 99."),
        # was used silently: every layer but the last vanilla, the last one a VCC layer
        ("num_vanilla_layers", -1, "`num_vanilla_layers` must be an integer between 0 and `num_layers` (3), got -1."),
        ("num_refined_blocks", 0, "`num_refined_blocks` must be a positive integer, got 0."),  # was used silently
        ("block_size", 0, "`block_size` must be a positive integer, got 0."),  # was: ZeroDivisionError
        ("segment_length", 0, "`segment_length` must be a positive integer or None, got 0."),  # ZeroDivisionError
        ("num_vip_slots", 0, "`num_vip_slots` must be a positive integer, got 0."),  # was: "cannot reshape tensor ..."
        ("block_size", 32, "`segment_length` (32) and `block_size` (32) do not fit `num_vip_slots` (8)"),  # was: a hang
        ("num_vip_slots", 3, "`segment_length` (32) and `block_size` (4) do not fit `num_vip_slots` (3)"),  # a hang
    ],
)
def test_vcc_settings_assigned_after_loading_are_checked_when_the_encoder_runs(field, value, message):
    """VCC-T5 reads its compression settings at every call; `save_pretrained` checks them, but only then."""
    model = tiny_vcc()
    inputs = _inputs("vcc")
    setattr(model.config, field, value)
    with torch.no_grad():
        for call in (lambda: model(**inputs, decoder_input_ids=inputs["input_ids"][:, :3]),
                     lambda: model.generate(**inputs, max_new_tokens=2),
                     lambda: model.get_encoder()(**inputs)):
            with pytest.raises(ValueError, match=re.escape(message)):
                call()
    if "do not fit" in message:  # what hung: the config's own length helper, which users call too
        with pytest.raises(ValueError, match=re.escape(message)):
            model.config.padded_length(150)


def test_vcc_num_layers_changed_after_loading_is_refused():
    """With `num_layers` lowered to `num_vanilla_layers`, the encoder counted no VCC layer and ran 1 of its 3 layers."""
    model = tiny_vcc()
    model.config.num_layers = 1
    with pytest.raises(ValueError, match=re.escape("`config.num_layers` was changed to 1 after the encoder was built "
                                                   "with 3 layers")):
        model.get_encoder()(**_inputs("vcc"))


def test_vcc_num_vanilla_layers_changed_after_loading_takes_effect_whole():
    """A valid `num_vanilla_layers` assigned after loading gives the model built with it (the attention dropout of
    the layers that changed kind included: VCC layers have none, vanilla layers T5's)."""
    torch.manual_seed(0)
    model = tiny_vcc(dropout_rate=0.1)
    built = tiny_vcc(dropout_rate=0.1, num_vanilla_layers=2)
    built.load_state_dict(model.state_dict())
    model.config.num_vanilla_layers = 2
    inputs = _inputs("vcc")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs, decoder_input_ids=inputs["input_ids"][:, :3]).logits,
                                   built(**inputs, decoder_input_ids=inputs["input_ids"][:, :3]).logits)
    dropouts = [[block.layer[0].SelfAttention.dropout for block in m.encoder.block] for m in (model, built)]
    assert dropouts[0] == dropouts[1] == [0.1, 0.1, 0.0]



@pytest.mark.parametrize("field, value", [("relative_attention_max_distance", 40),
                                          ("relative_attention_num_buckets", 64)])
def test_vcc_relative_attention_settings_are_those_it_was_built_with(field, value):
    """As in T5, whose attention layers keep the bucketing they were built with: VCC-T5's encoder read it from the
    config at every call instead (its decoder did not), so an edit changed the encoder's biases alone, or failed with
    "IndexError: index out of range in self" (more buckets than the table has rows)."""
    model = tiny_vcc()
    inputs = _inputs("vcc")
    with torch.no_grad():
        expected = model(**inputs, decoder_input_ids=inputs["input_ids"][:, :3]).logits
        setattr(model.config, field, value)
        torch.testing.assert_close(model(**inputs, decoder_input_ids=inputs["input_ids"][:, :3]).logits, expected,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("field, value", [
    ("ssm_authors_fft_size", True),  # another function: the saved config said so, the model in memory did not
    ("encoder_chunk_length", 8),
    ("encoder_accelerator_chunk_length", 8),
    ("ssm_kernel_chunk_size", 4),
    ("ssm_kernel_cache_lengths", 0),
    ("ssm_kernel_cache_bytes", 0),
])
def test_locost_encoder_settings_assigned_after_loading_take_effect(field, value):
    """LOCOST's encoder copied these settings when it was built, so an edit of `model.config` after loading was
    ignored, and `save_pretrained` wrote a config describing another computation. They now apply from the next call:
    the model computes what a model built with them computes, the kernel cache of the old settings dropped."""
    torch.manual_seed(0)
    model = tiny_locost()
    built = tiny_locost(**{field: value})
    built.load_state_dict(model.state_dict())
    input_ids = torch.randint(2, 99, (2, 37))  # an even-padded length of 38, not a power of two
    decoder_input_ids = input_ids[:, :3]
    with torch.no_grad():
        model(input_ids, decoder_input_ids=decoder_input_ids)  # (fills the kernel cache with the old settings)
        setattr(model.config, field, value)
        logits = model(input_ids, decoder_input_ids=decoder_input_ids).logits
        torch.testing.assert_close(logits, built(input_ids, decoder_input_ids=decoder_input_ids).logits,
                                   rtol=0, atol=0)

    def settings(m):
        conv = m.encoder.block[1].layer[0].ssm.conv
        return (m.encoder.chunk_length, m.encoder.accelerator_chunk_length, conv.kernel_chunk_size,
                conv.kernel_cache_lengths, conv.kernel_cache_bytes, conv.authors_fft_size)

    assert settings(model) == settings(built)


@pytest.mark.parametrize("field, value, message", [
    ("encoder_chunk_length", 0, "`encoder_chunk_length` must be a positive integer or None, got 0."),
    ("ssm_kernel_chunk_size", -4, "`ssm_kernel_chunk_size` must be a positive integer, got -4."),
    ("ssm_kernel_cache_bytes", -1, "`ssm_kernel_cache_bytes` must be a non-negative integer"),
])
def test_locost_encoder_settings_assigned_after_loading_are_checked(field, value, message):
    model = tiny_locost()
    input_ids = torch.randint(2, 99, (2, 37))
    setattr(model.config, field, value)
    with torch.no_grad():
        for call in (lambda: model(input_ids, decoder_input_ids=input_ids[:, :3]),
                     lambda: model.generate(input_ids, max_new_tokens=2),
                     lambda: model.get_encoder()(input_ids)):
            with pytest.raises(ValueError, match=re.escape(message)):
                call()


def test_vcc_from_pretrained_takes_overrides_under_the_original_names(tmp_path):
    """`VCCT5Config(short_segment_size=64)` takes the original code's names; as `from_pretrained` overrides they were
    left unused (a config kept the stored value, a model failed with "__init__() got an unexpected keyword argument
    'short_segment_size'")."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from longreach import VCCT5Config

    tiny_vcc().save_pretrained(tmp_path)
    for load in (VCCT5Config.from_pretrained, AutoConfig.from_pretrained):
        config, unused = load(tmp_path, short_segment_size=64, num_important_tokens=16, explore_prob=0.5,
                              return_unused_kwargs=True)
        assert (config.segment_length, config.num_vip_slots, config.exploration_probability) == (64, 16, 0.5)
        assert unused == {}
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path, short_segment_size=64).config.segment_length == 64
    with pytest.raises(ValueError, match="The original config sets `selector_type='random'`"):
        VCCT5Config.from_pretrained(tmp_path, selector_type="random")
    with pytest.raises(ValueError, match=re.escape("`segment_length` must be a positive integer or None, got 0.")):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path, short_segment_size=0)
