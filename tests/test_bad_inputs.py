"""Bad input gets a ValueError naming the argument, the value and the valid range, for all three models: token ids
outside the vocabulary (input ids, decoder ids, labels other than -100, Dodo's context ids) and attention-mask rows
without a single real token (which would otherwise generate a repeated token silently)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import warnings

import pytest
import torch
from test_modeling_dodo import tiny_model as tiny_dodo
from test_modeling_vcc_t5 import tiny_model as tiny_vcc
from transformers import TrainingArguments
from workflow_helpers import tiny_locost


@pytest.fixture(params=["locost", "vcc"])
def seq2seq(request):
    torch.manual_seed(0)
    return tiny_locost() if request.param == "locost" else tiny_vcc()


def vocab(model) -> int:
    return model.get_input_embeddings().num_embeddings


def test_seq2seq_token_ids_outside_the_vocabulary(seq2seq):
    size = vocab(seq2seq)
    good = torch.randint(3, size, (2, 12))
    decoder = torch.randint(3, size, (2, 4))
    for name, value in (("input_ids", size), ("input_ids", -1)):
        bad = good.clone()
        bad[1, 5] = value
        with pytest.raises(ValueError, match=rf"`{name}` holds the token id {value}.*\[0, {size}\)"):
            seq2seq(input_ids=bad, decoder_input_ids=decoder)
        with pytest.raises(ValueError, match=rf"`{name}` holds the token id {value}"):
            seq2seq.generate(input_ids=bad, max_new_tokens=2)
    bad_decoder = decoder.clone()
    bad_decoder[0, 0] = size + 5
    with pytest.raises(ValueError, match=rf"`decoder_input_ids` holds the token id {size + 5}"):
        seq2seq(input_ids=good, decoder_input_ids=bad_decoder)
    labels = decoder.clone()
    labels[0, 3] = -100  # ignored positions are fine
    assert torch.isfinite(seq2seq(input_ids=good, labels=labels).loss)
    labels[1, 0] = size
    with pytest.raises(ValueError, match=rf"`labels` holds the token id {size}.*besides -100"):
        seq2seq(input_ids=good, labels=labels)


def test_seq2seq_rows_without_a_real_token(seq2seq):
    input_ids = torch.randint(3, vocab(seq2seq), (3, 10))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1] = 0
    with pytest.raises(ValueError, match=r"`attention_mask` has rows with no real token \(rows \[1\]"):
        seq2seq.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=2)


@pytest.mark.parametrize("value", [2, 0.5])
def test_seq2seq_masks_hold_zeros_and_ones(seq2seq, value):
    """A mask value other than 0/1 changed the result silently (keys multiplied by it, a huge positive bias)."""
    input_ids = torch.randint(3, vocab(seq2seq), (2, 12))
    attention_mask = torch.ones(2, 12)
    attention_mask[0, 5:8] = value
    with pytest.raises(ValueError, match=(rf"`attention_mask` must hold 0 \(padding\) and 1 \(a "
                                          rf"token\) only, got the value {value}")):
        seq2seq(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids[:, :3])


def test_seq2seq_hidden_states_given_by_the_caller_are_checked(seq2seq):
    """Embeddings and encoder outputs of another hidden size, and masks or decoder masks that do not fit them, are
    named (they failed deep in a matmul or an attention kernel, or were broadcast over the rows)."""
    d_model = seq2seq.config.d_model
    input_ids = torch.randint(3, vocab(seq2seq), (2, 12))
    decoder_input_ids = input_ids[:, :3]
    with pytest.raises(ValueError, match=(rf"`inputs_embeds` must be a floating-point tensor of "
                                          rf"shape \[batch, length, {d_model}\]")):
        seq2seq(inputs_embeds=torch.randn(2, 12, d_model + 3), decoder_input_ids=decoder_input_ids)
    with pytest.raises(ValueError, match=r"`inputs_embeds` must be a floating-point tensor"):
        seq2seq(inputs_embeds=torch.ones(2, 12, d_model, dtype=torch.long), decoder_input_ids=decoder_input_ids)
    with pytest.raises(ValueError, match=(rf"`encoder_outputs` must be a floating-point tensor of "
                                          rf"shape \[batch, length, {d_model}\]")):
        seq2seq(encoder_outputs=(torch.randn(2, 12, d_model + 3),), decoder_input_ids=decoder_input_ids)
    with pytest.raises(ValueError, match=(r"`attention_mask` must have the shape \[batch, "
                                          r"length\] = \(2, 12\) of `encoder_outputs`")):
        seq2seq(encoder_outputs=(torch.randn(2, 12, d_model),), attention_mask=torch.ones(2, 9),
                decoder_input_ids=decoder_input_ids)
    with pytest.raises(ValueError, match=r"`decoder_inputs_embeds` must be a floating-point tensor"):
        seq2seq(input_ids=input_ids, decoder_inputs_embeds=torch.randn(2, 3, d_model + 1))
    with pytest.raises(ValueError, match=r"`decoder_attention_mask` has 1 rows but the decoder inputs have 2"):
        seq2seq(input_ids=input_ids, decoder_input_ids=decoder_input_ids, decoder_attention_mask=torch.ones(1, 3))


def test_dodo_generate_checks_the_prompt_and_its_mask_shapes():
    """generate() drops an all-ones mask before forward() sees it: a mask of another shape was accepted; a prompt of
    the wrong shape failed deep or with a message about nuggets."""
    model = tiny_dodo()
    prompt, context = torch.randint(3, vocab(model), (2, 6)), torch.randint(3, vocab(model), (2, 20))
    with pytest.raises(ValueError, match=(r"`attention_mask` must have the shape \[batch, "
                                          r"length\] = \(2, 6\) of `input_ids`")):
        model.generate(prompt, attention_mask=torch.ones(2, 3), context_input_ids=context, max_new_tokens=2)
    for bad in (prompt[0], prompt[..., None], prompt[:, :0]):
        with pytest.raises(ValueError, match=r"`input_ids` must"):
            model.generate(bad, context_input_ids=context, max_new_tokens=2)
    with pytest.raises(ValueError, match=(rf"`inputs_embeds` must be a floating-point tensor of shape "
                                          rf"\[batch, length, {model.config.hidden_size}\]")):
        model(inputs_embeds=torch.randn(2, 6, model.config.hidden_size + 1))


def test_dodo_token_ids_outside_the_vocabulary_and_empty_rows():
    model = tiny_dodo()
    size = vocab(model)
    prompt = torch.randint(3, size, (2, 6))
    context = torch.randint(3, size, (2, 20))
    bad_prompt = prompt.clone()
    bad_prompt[0, 2] = size
    with pytest.raises(ValueError, match=rf"`input_ids` holds the token id {size}.*\[0, {size}\)"):
        model(input_ids=bad_prompt, context_input_ids=context)
    bad_context = context.clone()
    bad_context[1, 7] = -3
    with pytest.raises(ValueError, match=r"`context_input_ids` holds the token id -3"):
        model(input_ids=prompt, context_input_ids=bad_context)
    with pytest.raises(ValueError, match=r"`input_ids` holds the token id -3"):
        model.compress(bad_context)
    labels = prompt.clone()
    labels[:, :2] = -100
    assert torch.isfinite(model(input_ids=prompt, context_input_ids=context, labels=labels).loss)
    labels[1, 4] = size + 1
    with pytest.raises(ValueError, match=rf"`labels` holds the token id {size + 1}"):
        model(input_ids=prompt, context_input_ids=context, labels=labels)
    attention_mask = torch.ones_like(prompt)
    attention_mask[0] = 0
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        model.generate(input_ids=prompt, attention_mask=attention_mask, context_input_ids=context, max_new_tokens=2)


def test_dodo_refuses_a_static_cache_instead_of_ignoring_it():
    """Dodo keeps its nuggets and the new tokens in its own growing DodoCache: a static cache asked for (in the call
    or in the generation config) would be ignored, so it is refused, and the CLI refuses it before reading documents."""
    from transformers import GenerationConfig

    from longreach.cli import UsageError, _check_generation_options

    model = tiny_dodo()
    prompt = torch.randint(3, vocab(model), (1, 6))
    context = torch.randint(3, vocab(model), (1, 20))
    with pytest.raises(ValueError, match=r"`cache_implementation`='static' is not supported by Dodo.*'dynamic'"):
        model.generate(input_ids=prompt, context_input_ids=context, max_new_tokens=2, cache_implementation="static")
    with pytest.raises(ValueError, match=r"`cache_implementation`='static'"):
        model.generate(input_ids=prompt, context_input_ids=context,
                       generation_config=GenerationConfig(max_new_tokens=2, cache_implementation="static"))
    assert model.generate(input_ids=prompt, context_input_ids=context, max_new_tokens=2,
                          cache_implementation="dynamic").shape == (1, 8)
    with pytest.raises(UsageError, match="--cache_implementation static: DodoLlamaForCausalLM"):
        _check_generation_options(argparse.Namespace(cache_implementation="static"), model)
    _check_generation_options(argparse.Namespace(cache_implementation="dynamic"), model)


@pytest.mark.parametrize("config_class, field, value, message", [
    ("LocostConfig", "relative_attention_num_buckets", 0, "must be an integer >= 2, got 0"),
    ("LocostConfig", "relative_attention_max_distance", 8, "must exceed half of `relative_attention_num_buckets`"),
    ("LocostConfig", "layer_norm_epsilon", -1.0, "`layer_norm_epsilon` must be a positive number, got -1.0"),
    ("LocostConfig", "dropout_rate", 1.5, "`dropout_rate` must be a number in [0, 1), got 1.5"),
    ("LocostConfig", "dropout_rate", "x", "`dropout_rate` must be a number in [0, 1), got 'x'"),
    ("LocostConfig", "feed_forward_proj", "bogus", "`feed_forward_proj` must be an activation name"),
    ("LocostConfig", "d_model", True, "`d_model` must be a positive integer, got True"),
    ("VCCT5Config", "num_vanilla_layers", True, "`num_vanilla_layers` must be an integer between 0 and"),
    ("VCCT5Config", "feed_forward_proj", "gated-nonsense", "`feed_forward_proj` must be an activation name"),
    ("VCCT5Config", "initializer_factor", 0.0, "`initializer_factor` must be a positive number, got 0.0"),
])
def test_t5_config_fields_are_checked_at_construction(config_class, field, value, message):
    import longreach

    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(longreach, config_class)(**{field: value})


def test_dodo_config_runs_llamas_own_checks():
    from longreach import DodoLlamaConfig

    sizes = dict(vocab_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=re.escape("The hidden size (66) is not a multiple of the number of attention")):
        DodoLlamaConfig(hidden_size=66, **sizes)
    with pytest.raises(ValueError, match="Missing required keys in `rope_parameters`.*factor"):
        DodoLlamaConfig(hidden_size=64, rope_parameters={"rope_type": "linear", "rope_theta": 1e4}, **sizes)
    assert DodoLlamaConfig(hidden_size=64, **sizes).hidden_size == 64


def test_seq2seq_decoder_rows_must_match_the_encoder_rows(seq2seq):
    input_ids = torch.randint(3, vocab(seq2seq), (2, 40))
    decoder_rows = torch.randint(3, vocab(seq2seq), (1, 5))
    with pytest.raises(ValueError, match=re.escape("`decoder_input_ids` has 1 rows but the encoder input has 2")):
        seq2seq(input_ids, decoder_input_ids=decoder_rows)
    with pytest.raises(ValueError, match=re.escape("`labels` must be [batch, length] with one row per encoder input (2)")):
        seq2seq(input_ids, labels=decoder_rows)
    with pytest.raises(ValueError, match=re.escape("`labels` must have the [batch, length] shape (2, 5)")):
        seq2seq(input_ids, decoder_input_ids=decoder_rows.repeat(2, 1), labels=decoder_rows.repeat(2, 2))


def test_seq2seq_cache_must_be_an_encoder_decoder_cache(seq2seq):
    """A `DynamicCache` (what decoder-only examples pass) or a transformers 4 tuple failed deep inside, with
    "'DynamicCache' object has no attribute 'is_updated'" (T5 takes the DynamicCache and writes the encoder's keys into
    the decoder's self-attention cache: wrong logits, silently)."""
    from transformers import DynamicCache, EncoderDecoderCache

    from longreach.modeling.input_checks import cache_of

    input_ids = torch.randint(3, vocab(seq2seq), (2, 40))
    decoder_input_ids = torch.randint(3, vocab(seq2seq), (2, 3))
    with torch.no_grad():
        cache = cache_of(seq2seq(input_ids, decoder_input_ids=decoder_input_ids, use_cache=True))
        assert isinstance(cache, EncoderDecoderCache)
        legacy = tuple((layer.keys, layer.values) for layer in cache.self_attention_cache.layers)
        for given, shown in ((DynamicCache(), "an empty DynamicCache"), (cache.self_attention_cache, "a DynamicCache"),
                             (legacy, "a tuple")):
            with pytest.raises(ValueError, match=re.escape(
                    f"The cache (`cache`, or `past_key_values`) must be an EncoderDecoderCache (self-attention and "
                    f"cross-attention caches, e.g. `EncoderDecoderCache(DynamicCache(), DynamicCache())`) or None; got "
                    f"{shown}")):
                seq2seq(input_ids, decoder_input_ids=decoder_input_ids[:, :1], past_key_values=given, use_cache=True)


def test_dodo_autoregressive_mode_refuses_position_ids_it_would_ignore():
    """The autoregressive mode numbers its tokens itself (they move when older ones are compressed): `position_ids`
    passed to it, on the first call or on a decoding step, were ignored without a word (packed rows, a shifted
    start); compressor mode uses them."""
    model = tiny_dodo(recent_window=4, compression_stride=6)
    tokens = torch.randint(3, vocab(model), (1, 8), generator=torch.Generator().manual_seed(3))
    message = re.escape("`position_ids` are not taken in the autoregressive mode (`config.recent_window`), which "
                        "numbers the tokens itself; got a torch.int64 tensor of shape (1, ")
    with torch.no_grad():
        with pytest.raises(ValueError, match=message):
            model(tokens, position_ids=torch.arange(8)[None] + 5)
        cache = model(tokens[:, :7], use_cache=True).past_key_values
        with pytest.raises(ValueError, match=message):
            model(tokens[:, 7:], past_key_values=cache, position_ids=torch.tensor([[7]]))


def test_dodo_context_errors_name_the_context_arguments():
    model = tiny_dodo()
    generator = torch.Generator().manual_seed(1)
    context = torch.randint(3, 100, (2, 30), generator=generator)
    prompt = torch.randint(3, 100, (2, 6), generator=generator)
    with torch.no_grad():
        with pytest.raises(ValueError, match="`context_attention_mask` must have the shape .* of `context_input_ids`"):
            model(prompt, context_input_ids=context, context_attention_mask=torch.ones(2, 5, dtype=torch.long))
        empty_row = torch.ones_like(context) * torch.tensor([[1], [0]])
        with pytest.raises(ValueError, match=re.escape("rows [1] of `context_attention_mask` have no real token")):
            model(prompt, context_input_ids=context, context_attention_mask=empty_row)
        for call in (model, model.generate):
            with pytest.raises(ValueError, match="`context_attention_mask` was given without `context_input_ids`"):
                call(prompt, context_attention_mask=torch.ones_like(context))
        # no prompt: one BOS row per context, not one row for all
        assert model.generate(context_input_ids=context, max_new_tokens=2).shape == (2, 3)


def test_cut_to_length_refuses_a_length_below_one():
    from longreach.modeling.input_checks import cut_to_length

    assert cut_to_length([5, 6, 7, 1], 3, eos_token_id=1) == ([5, 6, 1], 1)
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match="`max_length` .* must be a positive integer or None"):
            cut_to_length([5, 6, 7, 1], bad, eos_token_id=1)


@pytest.mark.parametrize("kind, field, value, message", [
    ("locost", "encoder_chunk_length", 0, "`encoder_chunk_length` must be a positive integer or None, got 0"),
    ("locost", "cross_attention_logn_length", 1, "`cross_attention_logn_length` must be None or an integer >= 2"),
    ("locost", "num_ssm_heads", 2, "`num_ssm_heads` must be 1"),
    ("locost", "hidden_size", 0, "`d_model` must be a positive integer, got 0"),  # an alias of d_model
    ("vcc", "num_vanilla_layers", 7, "`num_vanilla_layers` must be an integer between 0 and `num_layers` (3), got 7"),
    ("vcc", "num_refined_blocks", 0, "`num_refined_blocks` must be a positive integer, got 0"),
    ("dodo", "nugget_ratio", 0.0, "`nugget_ratio` must be in (0, 1] (nuggets per token), got 0.0"),
])
def test_from_pretrained_overrides_are_validated_with_the_stored_config(tmp_path, kind, field, value, message):
    """transformers' `from_dict` sets `field=value` overrides on the config after construction, where the config's
    checks had already run; they are checked with the stored values instead, at load time."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    model = {"locost": tiny_locost, "vcc": lambda: tiny_vcc(num_layers=3), "dodo": tiny_dodo}[kind]()
    model.save_pretrained(tmp_path)
    auto_model = AutoModelForCausalLM if kind == "dodo" else AutoModelForSeq2SeqLM
    for load in (type(model.config).from_pretrained, AutoConfig.from_pretrained, auto_model.from_pretrained):
        with pytest.raises(ValueError, match=re.escape(message)):
            load(tmp_path, **{field: value})


def test_from_pretrained_overrides_keep_transformers_return_unused_kwargs_contract(tmp_path):
    from transformers import AutoConfig

    tiny_locost().save_pretrained(tmp_path)
    config, unused = AutoConfig.from_pretrained(
        tmp_path, encoder_chunk_length=16, num_attention_heads=2, output_attentions=True, not_a_field=1,
        return_unused_kwargs=True,
    )
    assert (config.encoder_chunk_length, config.num_heads, config.output_attentions) == (16, 2, True)
    assert unused == {"not_a_field": 1}


@pytest.mark.parametrize("feed_forward_proj", ["relu", "gated-gelu"])
def test_vcc_loads_a_t5_checkpoint_that_needs_the_overrides(tmp_path, feed_forward_proj):
    """A 3-layer T5 is valid for VCC-T5 only with the override `num_vanilla_layers=3` (the default 4 is not): the
    override is validated with the stored values, not after a check with the default."""
    from transformers import T5Config, T5ForConditionalGeneration

    from longreach import VCCT5ForConditionalGeneration

    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.0, feed_forward_proj=feed_forward_proj,
    )).eval()
    t5.save_pretrained(tmp_path)
    model = VCCT5ForConditionalGeneration.from_pretrained(tmp_path, num_vanilla_layers=3, segment_length=None).eval()
    assert (model.config.num_vanilla_layers, model.config.segment_length) == (3, None)
    input_ids, decoder_input_ids = torch.randint(3, 200, (2, 40)), torch.randint(3, 200, (2, 4))
    with torch.no_grad():
        expected = t5(input_ids, decoder_input_ids=decoder_input_ids).logits
        torch.testing.assert_close(model(input_ids, decoder_input_ids=decoder_input_ids).logits, expected)
    # an override still wins over a stored value that __post_init__ applies after the fields
    from longreach import VCCT5Config

    config = VCCT5Config.from_pretrained(tmp_path, num_vanilla_layers=3, tie_word_embeddings=False)
    assert "scale_decoder_outputs" in t5.config.to_dict() and config.tie_word_embeddings is False


def test_prepare_summarization_inputs_takes_one_document_as_a_string(seq2seq):
    """A string is one document, as for Dodo (it was split into one document per character)."""
    from workflow_helpers import word_tokenizer

    tokenizer = word_tokenizer()
    inputs, dropped = seq2seq.prepare_summarization_inputs(tokenizer, "w1 w2 w3 w4")
    expected, expected_dropped = seq2seq.prepare_summarization_inputs(tokenizer, ["w1 w2 w3 w4"])
    assert inputs.keys() == expected.keys() and inputs["input_ids"].shape[0] == 1
    assert all(torch.equal(inputs[name], expected[name]) for name in inputs)
    assert dropped == expected_dropped == [0]
    with pytest.raises(ValueError, match="`documents` must hold at least one document, got an empty list"):
        seq2seq.prepare_summarization_inputs(tokenizer, [])


@pytest.mark.parametrize("field, value", [("pad_token_id", "0"), ("decoder_start_token_id", "0"),
                                          ("eos_token_id", [1, "2"]), ("eos_token_id", True)])
def test_t5_style_configs_refuse_token_ids_that_are_not_integers(field, value):
    """A string id in a config.json loaded, then crashed deep in generation or the loss; T5Config refuses it."""
    from longreach import LocostConfig, VCCT5Config

    for config_class in (LocostConfig, VCCT5Config):
        with pytest.raises(ValueError, match=rf"`{field}` must be a token id"):
            config_class(**{field: value})
        config_class(eos_token_id=[1, 2], pad_token_id=None)  # lists of ids and None stay fine


_DODO_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, nugget_layer=1)


@pytest.mark.parametrize("config_class, field, value, expected", [
    ("LocostConfig", "bidirectional", "false", "bool"),  # a truthy string would have switched it on
    ("LocostConfig", "ssm_authors_fft_size", 0, "bool"),
    ("LocostConfig", "encoder_chunk_length", True, "int | None"),  # True would have been a chunk of 1 token
    ("LocostConfig", "ssm_kernel_cache_lengths", True, "int"),
    ("LocostConfig", "ssm_dt_min", "0.001", "float"),  # was a TypeError from a comparison
    ("LocostConfig", "use_cache", "yes", "bool"),
    ("VCCT5Config", "scale_correction", "no", "bool"),
    ("VCCT5Config", "scale_decoder_outputs", "yes", "bool | None"),
    ("VCCT5Config", "exploration_probability", True, "float"),
    ("VCCT5Config", "tie_word_embeddings", "x", "bool"),
    ("DodoLlamaConfig", "force_last_nugget", "no", "bool"),
    ("DodoLlamaConfig", "lora_r", True, "int"),
    ("DodoLlamaConfig", "lora_dropout", "0.1", "float"),  # was a TypeError from a comparison
    ("DodoLlamaConfig", "nugget_threshold", "0.5", "float | None"),
    ("DodoLlamaConfig", "lora_target_modules", [1], "list[str] | None"),
])
def test_config_fields_have_their_annotated_types(tmp_path, config_class, field, value, expected):
    """Each field our configs declare is checked against its annotation (huggingface_hub's `type_validator`, as
    transformers' `@strict` T5Config and LlamaConfig are), at construction and when a config.json is loaded; a float
    field takes an int and a list field a tuple, as before."""
    import json

    import longreach

    cls = getattr(longreach, config_class)
    sizes = _DODO_SIZES if config_class == "DodoLlamaConfig" else {}
    message = f"`{field}` must be of type {expected}, got {value!r}."
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**sizes, **{field: value})
    config = cls(**sizes)
    with pytest.raises(ValueError, match=re.escape(message)):  # on assignment too, as T5Config and LlamaConfig
        setattr(config, field, value)
    assert getattr(config, field) == getattr(cls(**sizes), field)  # the refused value was not stored
    config.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**stored, field: value}))
    with pytest.raises(ValueError, match=re.escape(message)):
        cls.from_pretrained(tmp_path)


def test_config_float_fields_take_ints_and_list_fields_tuples():
    from longreach import DodoLlamaConfig, LocostConfig, VCCT5Config

    assert LocostConfig(dropout_rate=0, layer_norm_epsilon=1).dropout_rate == 0
    assert VCCT5Config(exploration_probability=1).exploration_probability == 1
    config = DodoLlamaConfig(**_DODO_SIZES, lora_alpha=16, lora_target_modules=("q_proj", "v_proj"))
    assert config.lora_alpha == 16 and list(config.lora_target_modules) == ["q_proj", "v_proj"]
    config.lora_dropout, config.lora_target_modules = 0, ("q_proj",)  # assigned: the same rules
    assert config.lora_dropout == 0 and list(config.lora_target_modules) == ["q_proj"]


def test_config_aliases_are_type_checked_on_assignment():
    """`attribute_map` aliases (T5's `hidden_size` for `d_model`) are checked as the field they stand for."""
    from longreach import LocostConfig, VCCT5Config

    for config in (LocostConfig(), VCCT5Config()):
        config.hidden_size = 64
        assert config.d_model == 64
        with pytest.raises(ValueError, match=re.escape("`d_model` must be of type int, got '64'.")):
            config.hidden_size = "64"


@pytest.mark.parametrize("config_class, field, value, message", [
    ("LocostConfig", "d_state", 3, "`d_state` must be a positive even integer"),
    ("LocostConfig", "ssm_dt_min", 5.0, "`ssm_dt_min` and `ssm_dt_max` must satisfy 0 < min <= max"),
    ("VCCT5Config", "num_vanilla_layers", 99, "`num_vanilla_layers` must be an integer between 0 and `num_layers` (12)"),
    ("DodoLlamaConfig", "nugget_layer", 99, "`nugget_layer` (ι) must be an integer in [0, num_hidden_layers=2]"),
    ("DodoLlamaConfig", "num_attention_heads", 3, "is not a multiple of the number of attention heads (3)"),
])
def test_config_changed_after_construction_is_validated_before_it_is_saved(tmp_path, config_class, field, value,
                                                                           message):
    """transformers' `save_pretrained` runs the config's `validate()` before writing (its save-time check): ours runs
    the model's own checks too, so a setting the model cannot run, assigned after construction, is refused there and
    nothing is written, instead of a folder that fails when it is loaded."""
    import longreach

    cls = getattr(longreach, config_class)
    config = cls(**(_DODO_SIZES if config_class == "DodoLlamaConfig" else {}))
    setattr(config, field, value)  # the right type: accepted when assigned, as transformers' configs do
    with pytest.raises(ValueError, match=re.escape(message)):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_token_ids_of_other_integer_dtypes_and_non_binary_masks_are_named():
    """From an audit: int32 labels, uint8 or int16 ids failed deep inside torch (cross_entropy, the embedding); a
    decoder_attention_mask of 0.5, and Dodo's attention_mask of 2 or context_attention_mask of 0.5, were read as
    0 or 1 silently."""
    for model in (tiny_locost(), tiny_vcc(), tiny_dodo()):
        ids = torch.randint(3, vocab(model), (2, 12))
        extra = {"context_input_ids": ids} if model.config.model_type == "dodo_llama" else {}
        with pytest.raises(ValueError, match=r"`labels` must be a torch.long \(int64\) tensor, got a torch.int32"):
            model(input_ids=ids[:, :5], labels=ids[:, :5].int(), **extra)
        for dtype in (torch.uint8, torch.int16):
            with pytest.raises(ValueError, match=rf"`input_ids` must be a torch.long \(int64\) tensor or int32, got a "
                                                 rf"{dtype}"):
                model(input_ids=ids.to(dtype), **({"decoder_input_ids": ids[:, :3]} if not extra else extra))
        with torch.no_grad():  # int32 ids are what embeddings take: the same result
            if extra:
                same = model(input_ids=ids[:, :5].int(), **extra).logits, model(input_ids=ids[:, :5], **extra).logits
            else:
                same = (model(input_ids=ids.int(), decoder_input_ids=ids[:, :3]).logits,
                        model(input_ids=ids, decoder_input_ids=ids[:, :3]).logits)
        assert torch.equal(*same)
    model, ids = tiny_locost(), torch.randint(3, vocab(tiny_locost()), (2, 8))
    with pytest.raises(ValueError, match=r"`decoder_attention_mask` must hold 0 \(padding\) and 1 \(a token\) only, got "
                                         r"the value 0.5"):
        model(input_ids=ids, decoder_input_ids=ids[:, :3], decoder_attention_mask=torch.full((2, 3), 0.5))
    dodo = tiny_dodo()
    prompt, context = torch.randint(3, vocab(dodo), (2, 6)), torch.randint(3, vocab(dodo), (2, 20))
    for name, value in (("attention_mask", 2), ("context_attention_mask", 0.5)):
        masks = {"attention_mask": torch.ones_like(prompt), "context_attention_mask": torch.ones_like(context)}
        masks[name] = torch.full_like(masks[name], value, dtype=torch.float)
        with pytest.raises(ValueError, match=rf"`{name}` must hold 0 \(padding\) and 1 \(a token\) only, got the value "
                                             rf"{value}"):
            dodo(input_ids=prompt, context_input_ids=context, **masks)


def test_dodo_checks_a_later_turns_prompt_and_takes_embeddings_of_another_dtype():
    """A chat's next turn (a prompt after a cache) was not checked against the vocabulary (an IndexError); float16
    `inputs_embeds` in a float32 model failed inside sdpa once nuggets were there (Llama takes them)."""
    model = tiny_dodo()
    size = vocab(model)
    prompt, context = torch.randint(3, size, (1, 6)), torch.randint(3, size, (1, 20))
    with torch.no_grad():
        cache = model(input_ids=prompt, context_input_ids=context).past_key_values
        later = torch.tensor([[5, size, 7]])
        with pytest.raises(ValueError, match=rf"`input_ids` holds the token id {size}"):
            model(input_ids=later, past_key_values=cache)
        with pytest.raises(ValueError, match=rf"`input_ids` holds the token id {size}"):
            model.generate(torch.cat([prompt, later], dim=1), context_input_ids=context, max_new_tokens=2)
        embeds = model.get_input_embeddings()(prompt)
        expected = model(inputs_embeds=embeds, context_input_ids=context).logits
        for dtype in (torch.float16, torch.bfloat16):
            logits = model(inputs_embeds=embeds.to(dtype), context_input_ids=context).logits
            assert logits.dtype == torch.float32 and (logits - expected).abs().max() < 0.05


def test_dodo_autoregressive_mode_refuses_left_padded_rows_once_they_would_differ():
    """The autoregressive mode compresses every row at the same columns (as `DodoLlamaConfig.recent_window` says): a
    left-padded row got other nuggets than alone (logits 0.48 apart, another greedy output) with only a warning. Each
    row's result is its own until the first compression, so a left-padded batch runs until a call would compress, and
    is refused there (before the call changes the cache); right padding keeps each row's result."""
    from longreach import DodoCache

    model = tiny_dodo(recent_window=4, compression_stride=6)  # the first compression after 4 + 6 columns
    generator = torch.Generator().manual_seed(5)

    def rows(lengths, side):
        """The rows alone, and padded on `side` to one batch with its mask."""
        tokens = [torch.randint(3, vocab(model), (1, n), generator=generator) for n in lengths]
        order = 1 if side == "right" else -1  # [row, padding] or [padding, row]
        pads = [torch.zeros(1, max(lengths) - n, dtype=torch.long) for n in lengths]
        input_ids = torch.cat([torch.cat([row, pad][::order], 1) for row, pad in zip(tokens, pads)])
        mask = torch.cat([torch.cat([torch.ones_like(row), pad][::order], 1) for row, pad in zip(tokens, pads)])
        return tokens, input_ids, mask

    message = re.escape("Dodo's autoregressive mode (`config.recent_window`) compresses all rows of a batch at the "
                        "same columns, and this call reaches a compression (after 10 columns): rows padded on the "
                        "left would not give the results they give alone. Pad the batch on the right "
                        "(`tokenizer.padding_side = 'right'`)")
    with torch.no_grad():
        (long_row, short_row), input_ids, attention_mask = rows([20, 13], "right")
        right = model(input_ids, attention_mask=attention_mask).logits
        assert (right[1, :13] - model(short_row).logits[0]).abs().max() < 1e-5
        (long_row, short_row), input_ids, attention_mask = rows([20, 13], "left")
        with pytest.raises(ValueError, match=message):
            model(input_ids, attention_mask=attention_mask)
        # no compression yet: each left-padded row gives what it gives alone, in forward() and in generate()
        (long_row, short_row), input_ids, attention_mask = rows([9, 5], "left")
        left = model(input_ids, attention_mask=attention_mask).logits
        assert (left[0] - model(long_row).logits[0]).abs().max() < 1e-5
        assert (left[1, 4:] - model(short_row).logits[0]).abs().max() < 1e-5
        (long_row, short_row), input_ids, attention_mask = rows([6, 3], "left")
        options = dict(do_sample=False, pad_token_id=0)
        batched = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, **options)  # 10 columns
        assert torch.equal(batched[0], model.generate(long_row, max_new_tokens=5, **options)[0])
        assert torch.equal(batched[1, 3:], model.generate(short_row, max_new_tokens=5, **options)[0])
        # generate() refuses before its first step when its length can reach a compression (it used to fail there,
        # after the steps before it); forward() is never called
        calls = []
        hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
        try:
            # a cache that a refused forward() left behind has read nothing: generate() starts it again, and refuses
            refused_cache = DodoCache(model.config)
            with pytest.raises(ValueError, match=message):
                model(torch.cat([input_ids, input_ids], 1), attention_mask=torch.cat([attention_mask] * 2, 1),
                      cache=refused_cache)
            calls.clear()
            for lengths_and_max in ({"max_new_tokens": 6}, {"max_length": 12},
                                    {"max_new_tokens": 6, "cache": refused_cache}):
                with pytest.raises(ValueError, match=re.escape(
                        "this generate() call can reach a compression (after 10 columns; the prompt's 6 and up to 6 "
                        "new tokens): rows padded on the left would not give the results they give alone. Generate "
                        "the rows one at a time, keep `max_new_tokens` at most 5, or give the context")):
                    model.generate(input_ids, attention_mask=attention_mask, **lengths_and_max, **options)
            assert calls == []
        finally:
            hook.remove()
        # a chat's next turn on the cache of a left-padded batch: the cache's uncompressed columns count too
        first = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2,
                               return_dict_in_generate=True, **options)
        cache = first.past_key_values
        assert cache.left_padded and cache.seen_tokens == 7  # the prompt's 6 columns and the first new token
        turn = torch.cat([first.sequences, torch.full((2, 1), 7)], 1)  # the 8 columns so far and one more token
        turn_mask = torch.cat([attention_mask, torch.ones(2, 3, dtype=attention_mask.dtype)], 1)
        with pytest.raises(ValueError, match=re.escape(
                "can reach a compression (after 10 columns; the cache's 7 uncompressed columns, the prompt's 2 and up "
                "to 3 new tokens): rows padded on the left would not give the results they give alone. Generate the "
                "rows one at a time, keep `max_new_tokens` at most 2, or give")):
            model.generate(turn, attention_mask=turn_mask, cache=cache, max_new_tokens=3, **options)
        assert cache.seen_tokens == 7  # refused before the cache read anything
        model.generate(turn, attention_mask=turn_mask, cache=cache, max_new_tokens=2, **options)  # 10 columns
        # a prompt past the first compression: no number of new tokens helps, and none is suggested
        (long_row, short_row), input_ids, attention_mask = rows([12, 3], "left")
        with pytest.raises(ValueError, match=r"Generate the rows one at a time, or give the context"):
            model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=1, **options)


def test_inputs_are_prepared_where_the_model_is_and_empty_documents_are_refused():
    """From an audit: Dodo's `prepare_*_inputs` returned CPU tensors for a model elsewhere (VCC-T5's and LOCOST's
    follow the model), and VCC-T5 answered an empty document from its question alone. (An empty document to
    summarize stays accepted by the preparation: fine-tuning reads its training data through it; the pipeline and
    the corpus command refuse it.)"""
    from test_workflows_vcc_t5_dodo import llama_word_tokenizer, t5_word_tokenizer

    dodo = tiny_dodo().to("meta")  # stands in for an accelerator: only the device is read
    inputs, _ = dodo.prepare_question_inputs(llama_word_tokenizer(), "w3 w4", ["w5 w6 w7"])
    assert {tensor.device.type for tensor in inputs.values()} == {"meta"}
    inputs, _ = dodo.prepare_summarization_inputs(llama_word_tokenizer(), ["w5 w6 w7"])
    assert {tensor.device.type for tensor in inputs.values()} == {"meta"}
    vcc = tiny_vcc()
    tokenizer = t5_word_tokenizer(vocab(vcc))
    for document in ("", "   "):
        with pytest.raises(ValueError, match=r"Every document must be a non-empty string, got .* for document 1"):
            vcc.prepare_question_inputs(tokenizer, "w3 w4", ["w5 w6", document])


def test_dodo_refuses_layers_wrapped_by_torchs_checkpoint_wrapper():
    """FSDP's and accelerate's `activation_checkpointing` wrap each layer in torch's CheckpointWrapper, whose replay
    wrote the keys and values into Dodo's cache twice: "The size of tensor a (24) must match the size of tensor b (14)"
    in the backward pass. Refused with a message that names the model's own checkpointing; without gradients (no
    replay) the wrapped layers still run."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from longreach import DodoDataCollator

    model = tiny_dodo().train()
    batch = DodoDataCollator()([{"context_input_ids": list(range(3, 23)), "input_ids": list(range(5, 13))}])
    with torch.no_grad():
        expected = model(**batch).logits
    layers = model.model.layers
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)
    with pytest.raises(ValueError, match=re.escape(
            "Decoder layer 0 is wrapped by torch's CheckpointWrapper (the FSDP config's or accelerate's "
            "`activation_checkpointing`), whose replay would write the layer's keys and values into Dodo's cache a "
            "second time. Turn it off and use the model's own activation checkpointing instead: `model.")) as caught:
        model(**batch)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, expected)

    # The fix it names is the installed transformers' own, not a deprecated alias (in 5.24,
    # `gradient_checkpointing_enable` and `TrainingArguments(gradient_checkpointing=...)` warn: aliases of
    # `activation_...`).
    method, argument = re.search(r"`model\.(\w+)\(\)` or `TrainingArguments\((\w+)=True\)`",
                                 str(caught.value)).groups()
    assert argument == method.removesuffix("_enable")
    assert argument in {field.name for field in dataclasses.fields(TrainingArguments)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        getattr(tiny_dodo().train(), method)()
        TrainingArguments(output_dir="unused", **{argument: True})
