"""Dodo: configuration, adapters and freezing, compression, nugget-conditioned decoding, generation (greedy, sampling,
beam search, right and left padding), autoregressive mode, training, Hub-ready saving, summarization inputs, errors.

Parity with the authors' outputs lives in ``test_convert_dodo.py`` (it needs the converter)."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    pipeline,
)

import longreach
from longreach import DodoDataCollator, DodoLlamaConfig, DodoLlamaForCausalLM, DodoNuggets
from longreach.modeling.modeling_dodo import DodoCache, token_positions
from remote_code_helpers import run_without_longreach

VOCAB = 100


def tiny_config(**overrides) -> DodoLlamaConfig:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        nugget_layer=2,
        nugget_ratio=0.2,
        lora_r=4,
        lora_alpha=8.0,
        lora_dropout=0.0,
        soft_prompt_length=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    values.update(overrides)
    return DodoLlamaConfig(**values)


def randomize_adapters(model: DodoLlamaForCausalLM, scale: float = 0.3) -> DodoLlamaForCausalLM:
    """Fresh LoRA B is zero (φ = θ = base); give both adapters distinct non-zero weights."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, scale)
    return model


def tiny_model(**overrides) -> DodoLlamaForCausalLM:
    torch.manual_seed(0)
    return randomize_adapters(DodoLlamaForCausalLM(tiny_config(**overrides))).eval()


@pytest.fixture
def model():
    return tiny_model()


def ids(batch: int, length: int, low: int = 3) -> torch.LongTensor:
    return torch.randint(low, VOCAB, (batch, length))


def left_pad(tokens: torch.LongTensor, width: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    pad = width - tokens.shape[1]
    return (
        torch.cat([tokens.new_zeros(1, pad), tokens], 1),
        torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(tokens)], 1),
    )


def right_pad(tokens: torch.LongTensor, width: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    pad = width - tokens.shape[1]
    return (
        torch.cat([tokens, tokens.new_zeros(1, pad)], 1),
        torch.cat([torch.ones_like(tokens), torch.zeros(1, pad, dtype=torch.long)], 1),
    )


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


# --------------------------------------------------------------------------------------------------------------------
# Configuration and registration
# --------------------------------------------------------------------------------------------------------------------


def test_defaults_are_the_papers_and_registration():
    config = DodoLlamaConfig()
    assert isinstance(config, LlamaConfig) and config.model_type == "dodo_llama"
    assert (config.nugget_layer, config.nugget_ratio, config.lora_r, config.lora_alpha, config.soft_prompt_length) == (
        3,
        0.1,
        32,
        32.0,
        1,
    )
    assert config.lora_target_modules == ["q_proj", "v_proj", "o_proj"] and config.adapter_names == [
        "encoder",
        "decoder",
    ]
    assert config.nugget_count_rounding == "dodo" and config.score_in_forward and config.force_last_nugget
    assert not config.legacy_decoder_mask_order and config.recent_window is None
    assert config.lora_target_regex == r".*layers\.(\d+)\.self_attn\.(q_proj|v_proj|o_proj)"  # the authors' own pattern
    assert type(AutoConfig.for_model("dodo_llama")) is DodoLlamaConfig
    small = tiny_config()
    assert type(AutoModelForCausalLM.from_config(small)) is DodoLlamaForCausalLM
    assert type(AutoModel.from_config(small)) is DodoLlamaForCausalLM
    assert {"DodoLlamaConfig", "DodoLlamaForCausalLM", "DodoNuggets"} <= set(longreach.__all__)


def test_config_round_trip_and_counts(tmp_path):
    config = tiny_config(lora_layers=[2, 1], recent_window=16, nugget_threshold=0.5)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is DodoLlamaConfig and loaded.lora_layers == [1, 2] and loaded.recent_window == 16
    assert loaded.effective_compression_stride == 16 and loaded.nugget_threshold == 0.5
    dodo = DodoLlamaConfig(nugget_ratio=0.1)
    assert [dodo.num_nuggets_for_length(n) for n in (1, 10, 11, 23, 37, 101)] == [1, 1, 2, 3, 4, 11]
    ceil = DodoLlamaConfig(nugget_ratio=0.1, nugget_count_rounding="ceil")
    assert [ceil.num_nuggets_for_length(n) for n in (1, 10, 11, 30, 101)] == [1, 1, 2, 3, 11]


def test_the_configs_nugget_count_is_the_models_at_exact_products():
    """From an audit: with 'ceil' rounding the config rounded 100 * 0.07 = 7.000000000000001 up to 8 nuggets, while the
    model (which allows for the float error) keeps 7."""
    model = tiny_model(nugget_ratio=0.07, nugget_count_rounding="ceil")
    assert model.config.num_nuggets_for_length(100) == 7
    with torch.no_grad():
        assert int(model.compress(ids(1, 100)).num_nuggets[0]) == 7
    counts = [model.config.num_nuggets_for_length(n) for n in range(1, 1001)]
    assert counts == model._num_nuggets(torch.arange(1, 1001)).tolist()


@pytest.mark.parametrize("ratio", [0.07, 0.1, 0.2, 1 / 3])
def test_without_float64_the_ceil_nugget_count_is_the_float64_one(monkeypatch, ratio):
    """On a device without float64 (Apple's ``mps``; forced here on the CPU, where every float64 result raises) the
    'ceil' nugget count is taken from the same float64 numbers as Python floats, and compress() runs."""
    from device_helpers import without_float64

    from longreach.modeling import modeling_dodo

    model = tiny_model(nugget_ratio=ratio, nugget_count_rounding="ceil")
    lengths = torch.arange(0, 1001)
    expected = model._num_nuggets(lengths)
    context = ids(2, 30)
    with torch.no_grad():
        nuggets = model.compress(context)
        with without_float64(monkeypatch, modeling_dodo):
            counts = model._num_nuggets(lengths)
            nuggets_without = model.compress(context)
    assert counts.dtype == torch.long and torch.equal(counts, expected)
    assert torch.equal(nuggets_without.num_nuggets, nuggets.num_nuggets)
    assert torch.equal(nuggets_without.indices, nuggets.indices)


@pytest.mark.parametrize(
    "field, value",
    [
        ("nugget_layer", 9),
        ("nugget_ratio", 0.0),
        ("nugget_count_rounding", "floor"),
        ("scorer_features", "x"),
        ("soft_prompt_length", -1),
        ("lora_target_modules", ["gate_proj"]),
        ("lora_layers", [7]),
        ("lora_layers", []),  # (PEFT's own error named a regex; the adapters need a layer)
        ("encoder_adapter_name", "a b"),
        ("recent_window", -2),
        ("compression_stride", 0),
        ("nugget_encoding", "auto"),
    ],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: value})


def test_reencoding_needs_adapter_free_scores_and_compressor_mode():
    with pytest.raises(ValueError, match="scorer_features"):
        tiny_config(nugget_encoding="reencode", scorer_features="encoder_hidden", lora_layers=[2])
    with pytest.raises(ValueError, match="recent_window"):
        tiny_config(nugget_encoding="reencode", recent_window=4)


def test_encoder_hidden_features_need_adapter_free_early_layers():
    with pytest.raises(ValueError, match="lora_layers"):
        tiny_config(scorer_features="encoder_hidden")
    config = tiny_config(scorer_features="encoder_hidden", lora_layers=[2])
    assert config.lora_target_regex == r".*layers\.(2)\.self_attn\.(q_proj|v_proj|o_proj)"


# --------------------------------------------------------------------------------------------------------------------
# Adapters, initialisation, freezing, saving
# --------------------------------------------------------------------------------------------------------------------


def test_one_state_dict_holds_base_adapters_scorer_and_soft_prompt(tmp_path, model):
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert (
        "model.layers.0.self_attn.q_proj.base_layer.weight" in keys and "model.layers.0.self_attn.k_proj.weight" in keys
    )
    for adapter in ("encoder", "decoder"):
        assert f"model.layers.2.self_attn.o_proj.lora_B.{adapter}.weight" in keys
    assert {
        "nugget_scorer.0.weight",
        "nugget_scorer.0.bias",
        "nugget_scorer.2.weight",
        "nugget_scorer.2.bias",
        "soft_prompt.weight",
        "lm_head.weight",
    } <= keys
    assert not any("k_proj.lora" in key or "mlp" in key and "lora" in key for key in keys)
    reloaded = DodoLlamaForCausalLM.from_pretrained(tmp_path).eval()
    context, prompt = ids(1, 12), ids(1, 4)
    with torch.no_grad():
        assert (
            max_diff(
                reloaded(prompt, context_input_ids=context).logits, model(prompt, context_input_ids=context).logits
            )
            == 0
        )


def test_fresh_adapters_are_the_identity_and_switching_changes_outputs():
    torch.manual_seed(0)
    fresh = DodoLlamaForCausalLM(tiny_config()).eval()
    lora_b = [p for n, p in fresh.named_parameters() if ".lora_B." in n]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)  # gotcha 2: transformers' init must not touch B
    assert all(torch.count_nonzero(p) > 0 for n, p in fresh.named_parameters() if ".lora_A." in n)
    tokens = ids(1, 6)
    outputs = {}
    randomize_adapters(fresh)
    with torch.no_grad():
        for name in ("encoder", "decoder", None):
            fresh.set_active_adapter(name)
            outputs[name] = fresh.lm_head(fresh.model(tokens).last_hidden_state)
    assert (
        max_diff(outputs["encoder"], outputs["decoder"]) > 1e-3 and max_diff(outputs[None], outputs["decoder"]) > 1e-3
    )
    fresh.set_active_adapter(None)
    with torch.no_grad():  # disabling is reversible
        assert max_diff(fresh.lm_head(fresh.model(tokens).last_hidden_state), outputs[None]) == 0
    with pytest.raises(ValueError, match="adapter_name"):
        fresh.set_active_adapter("theta")


def trainable_names(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def test_base_is_frozen_at_init_after_switching_and_after_from_pretrained(tmp_path, model):
    expected = {
        name
        for name, _ in model.named_parameters()
        if ".lora_" in name or name.startswith(("nugget_scorer.", "soft_prompt."))
    }
    assert trainable_names(model) == expected and len(expected) == 3 * 3 * 2 * 2 + 4 + 1
    for name in ("encoder", None, "decoder", "encoder"):  # gotcha 3: switching must not freeze the inactive adapter
        model.set_active_adapter(name)
        assert trainable_names(model) == expected
    model.save_pretrained(tmp_path)
    for loaded in (DodoLlamaForCausalLM.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert trainable_names(loaded) == expected  # gotcha 4


def test_from_base_model_loads_a_plain_llama(tmp_path):
    torch.manual_seed(0)
    llama_config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,  # the mapping must rename the wrapped projections' biases too
    )
    llama = LlamaForCausalLM(llama_config).eval()
    with torch.no_grad():
        for name, param in llama.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    llama.save_pretrained(tmp_path / "llama")
    dodo = DodoLlamaForCausalLM.from_base_model(tmp_path / "llama", {"nugget_layer": 2, "lora_r": 4}).eval()
    assert dodo.config.model_type == "dodo_llama" and dodo.config.lora_r == 4
    tokens = ids(2, 7)
    with torch.no_grad():  # gotcha 1: base_layer weights loaded; fresh θ is the identity, so plain decoding = the base
        assert max_diff(dodo(tokens).logits, llama(tokens).logits) < 1e-5
    assert trainable_names(dodo) and all(
        ".lora_" in n or n.startswith(("nugget_", "soft_")) for n in trainable_names(dodo)
    )
    dodo.save_pretrained(tmp_path / "dodo")  # saved with our names (no reverse renaming), reloads as is
    reloaded = DodoLlamaForCausalLM.from_pretrained(tmp_path / "dodo").eval()
    with torch.no_grad():
        assert max_diff(reloaded(tokens).logits, llama(tokens).logits) < 1e-5
    with pytest.raises(ValueError, match="from_base_model"):
        DodoLlamaForCausalLM.from_pretrained(tmp_path / "llama")


def test_from_base_model_takes_config_overrides_as_from_pretrained_does(tmp_path):
    """`LlamaForCausalLM.from_pretrained(path, use_cache=False)` sets the config attribute; `from_base_model` passed
    such arguments to `from_pretrained` next to its own config object, which hands them to `__init__` ("TypeError:
    DodoLlamaForCausalLM.__init__() got an unexpected keyword argument 'use_cache'")."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama", use_cache=False, output_hidden_states=True)
    dodo = DodoLlamaForCausalLM.from_base_model(
        tmp_path / "llama", {"nugget_layer": 2, "lora_r": 4}, use_cache=False, output_hidden_states=True,
        nugget_ratio=0.5, dtype=torch.bfloat16)
    assert (llama.config.use_cache, llama.config.output_hidden_states) == (False, True)
    assert (dodo.config.use_cache, dodo.config.output_hidden_states, dodo.config.nugget_ratio) == (False, True, 0.5)
    assert (dodo.config.lora_r, dodo.dtype) == (4, torch.bfloat16)  # `dodo_config` and `from_pretrained`'s own
    with pytest.raises(ValueError, match=r"\['lora_r'\] given both in `dodo_config` and as keyword arguments"):
        DodoLlamaForCausalLM.from_base_model(tmp_path / "llama", {"lora_r": 4}, lora_r=8)
    with pytest.raises(TypeError, match="not_a_setting"):  # as in transformers: neither an option nor an attribute
        DodoLlamaForCausalLM.from_base_model(tmp_path / "llama", not_a_setting=1)


# --------------------------------------------------------------------------------------------------------------------
# Compression
# --------------------------------------------------------------------------------------------------------------------


def test_compress_output_and_counts(model):
    context = ids(2, 23)
    mask = torch.ones_like(context)
    mask[1, 12:] = 0
    nuggets = model.compress(context, mask, output_features=True)
    assert isinstance(nuggets, DodoNuggets)
    # dodo rounding: int(23*0.2 + 0.99) = 5, int(12*0.2 + 0.99) = 3
    assert nuggets.mask.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert nuggets.indices[0, -1] == 22 and nuggets.indices[1, 2] == 11  # the last real token is always a nugget
    assert (nuggets.indices[0].diff() > 0).all() and (nuggets.indices[1, :3].diff() > 0).all()
    assert len(nuggets.key_values) == 3 and nuggets.key_values[0][0].shape == (2, 2, 5, 8)
    assert (
        nuggets.scores.shape == (2, 5) and nuggets.all_scores.shape == (2, 23) and nuggets.features.shape == (2, 23, 32)
    )
    assert torch.equal(nuggets.scores, nuggets.all_scores.gather(1, nuggets.indices))
    assert torch.equal(nuggets.positions, nuggets.indices)  # right padding: positions are the columns
    # the non-forced nuggets are the top scores of the real tokens
    real_scores = nuggets.all_scores[0, :22]
    assert set(nuggets.indices[0, :4].tolist()) == set(real_scores.topk(4).indices.tolist())

    ceil = tiny_model(nugget_count_rounding="ceil")
    assert ceil.compress(ids(1, 10)).mask.shape[1] == 2  # ceil(10 * 0.2) = 2 (dodo: int(2.99) = 2 as well)
    assert tiny_model().compress(ids(1, 11)).mask.shape[1] == 3  # int(2.2 + 0.99) = 3; ceil gives 3 too
    assert tiny_model(nugget_ratio=0.1).compress(ids(1, 21)).mask.shape[1] == 3  # int(3.09) = 3 = ceil(2.1)


def test_compress_left_padding_equals_unpadded(model):
    context = ids(1, 14)
    padded, mask = left_pad(context, 20)
    plain, left = model.compress(context), model.compress(padded, mask)
    assert torch.equal(left.indices - 6, plain.indices) and torch.equal(left.positions, plain.positions)
    assert left.indices[0, -1] == 19  # forced last token is the last real one, not column n_b - 1
    for (k1, v1), (k2, v2) in zip(plain.key_values, left.key_values):
        assert max_diff(k1, k2) < 1e-5 and max_diff(v1, v2) < 1e-5
    assert max_diff(plain.scores, left.scores) < 1e-5


def test_selection_ties_prefer_earlier_tokens(model):
    with torch.no_grad():  # a constant scorer: every token ties
        model.nugget_scorer[2].weight.zero_()
        model.nugget_scorer[2].bias.fill_(0.5)
    nuggets = model.compress(ids(1, 20))  # k = int(4 + 0.99) = 4: the forced last token and the first three
    assert nuggets.indices.tolist() == [[0, 1, 2, 19]]


def test_encoder_hidden_features_are_the_phi_pass_after_iota_layers():
    """``ind_scorer=False``: the scorer reads the raw residual stream after ι layers of the φ pass (no final norm)."""
    model = tiny_model(scorer_features="encoder_hidden", lora_layers=[2])
    context = ids(2, 13)
    with torch.no_grad():
        features = model.compress(context, output_features=True).features
        model.set_active_adapter("encoder")
        hidden = model.model(context, output_hidden_states=True).hidden_states[2]
    assert max_diff(features, hidden) < 1e-6


def test_token_positions_for_right_left_and_no_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert token_positions(mask).tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert token_positions(mask, torch.tensor([3, 0, 1]))[:, -1].tolist() == [7, 2, 5]


# --------------------------------------------------------------------------------------------------------------------
# Decoding with nuggets
# --------------------------------------------------------------------------------------------------------------------


def test_forward_logits_cover_input_ids_only_and_match_a_cached_continuation(model):
    context, tokens = ids(2, 15), ids(2, 7)
    with torch.no_grad():
        nuggets = model.compress(context)
        full = model(tokens, nuggets=nuggets)
        assert full.logits.shape == (2, 7, VOCAB)
        first = model(tokens[:, :4], nuggets=nuggets, use_cache=True)
        cache = first.past_key_values
        assert isinstance(cache, DodoCache) and cache.seen_tokens == 4
        assert cache.get_seq_length() == 4  # the tokens, as generate()'s bookkeeping counts (assisted decoding crops)
        assert cache.layers[0].get_seq_length() == nuggets.mask.shape[1] + 2 + 4  # nuggets + soft prompt + tokens
        rest = model(tokens[:, 4:], attention_mask=torch.ones(2, 7), past_key_values=cache, nuggets=nuggets)
    assert max_diff(torch.cat([first.logits, rest.logits], 1), full.logits) < 1e-5


def test_soft_prompt_and_score_term_change_the_decoder(model):
    context, tokens = ids(1, 15), ids(1, 6)
    with torch.no_grad():
        nuggets = model.compress(context)
        reference = model(tokens, nuggets=nuggets).logits
        model.soft_prompt.weight.add_(1.0)
        assert max_diff(model(tokens, nuggets=nuggets).logits, reference) > 1e-4
        model.soft_prompt.weight.sub_(1.0)
        shifted = DodoNuggets(**{**nuggets, "scores": nuggets.scores + 2.0})
        assert max_diff(model(tokens, nuggets=shifted).logits, reference) > 1e-4
        model.config.score_in_forward = False  # straight-through: the scores vanish from the forward pass
        zero = DodoNuggets(**{**nuggets, "scores": torch.zeros_like(nuggets.scores)})
        model.config.score_in_forward = True
        with_zero_scores = model(tokens, nuggets=zero).logits
        model.config.score_in_forward = False
        assert max_diff(model(tokens, nuggets=nuggets).logits, with_zero_scores) < 1e-6
        model.config.score_in_forward = True


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batches_equal_single_rows(model, side):
    """Padded contexts and prompts: forward equals each row alone on either side; `generate()` too on the left, where
    a decoder-only model's prompts are padded (on the right, as for Llama, the first new token is read at a pad and
    transformers warns), and with right-padded contexts."""
    pad = right_pad if side == "right" else left_pad
    contexts = [ids(1, 18), ids(1, 11)]
    prompts = [ids(1, 6), ids(1, 3)]
    context_ids, context_mask = map(torch.cat, zip(*(pad(c, 18) for c in contexts)))
    prompt_ids, prompt_mask = map(torch.cat, zip(*(pad(p, 6) for p in prompts)))
    with torch.no_grad():
        nuggets = model.compress(context_ids, context_mask)
        logits = model(prompt_ids, attention_mask=prompt_mask, nuggets=nuggets).logits
        left_prompt_ids, left_prompt_mask = map(torch.cat, zip(*(left_pad(p, 6) for p in prompts)))
        batch_generated = model.generate(
            left_prompt_ids, attention_mask=left_prompt_mask, nuggets=nuggets, max_new_tokens=5, do_sample=False
        )
        for row, (context, prompt) in enumerate(zip(contexts, prompts)):
            single = model.compress(context)
            row_logits = model(prompt, nuggets=single).logits[0]
            real = prompt_mask[row].bool()
            assert max_diff(logits[row][real], row_logits) < 1e-5
            generated = model.generate(prompt, nuggets=single, max_new_tokens=5, do_sample=False)
            assert torch.equal(batch_generated[row, 6:], generated[0, prompt.shape[1] :])


@pytest.mark.parametrize("side", ["right", "left"])
def test_reencoded_nuggets_in_padded_batches_equal_single_rows(side):
    """`nugget_encoding="reencode"` (the authors' auto=True, which runs on a batch of one): padding is excluded from
    what the re-encoded nuggets see, so a padded row gives the nuggets of the row alone. Selection is the same as with
    the encoder pass (adapter-free scores); the keys/values are not (θ context, φ nuggets)."""
    model = tiny_model(nugget_encoding="reencode")
    pad = right_pad if side == "right" else left_pad
    contexts = [ids(1, 18), ids(1, 11)]
    context_ids, context_mask = map(torch.cat, zip(*(pad(c, 18) for c in contexts)))
    with torch.no_grad():
        nuggets = model.compress(context_ids, context_mask)
        for row, context in enumerate(contexts):
            single = model.compress(context)
            slots = int(single.mask.sum())
            assert torch.equal(nuggets.positions[row, :slots], single.positions[0])
            for (k1, v1), (k2, v2) in zip(nuggets.key_values, single.key_values):
                assert max_diff(k1[row, :, :slots], k2[0]) < 1e-5 and max_diff(v1[row, :, :slots], v2[0]) < 1e-5
        model.config.nugget_encoding = "encoder_pass"
        encoder_pass = model.compress(context_ids, context_mask)
    assert torch.equal(encoder_pass.indices, nuggets.indices) and max_diff(encoder_pass.scores, nuggets.scores) == 0
    assert max_diff(encoder_pass.key_values[-1][0], nuggets.key_values[-1][0]) > 1e-2


def test_legacy_mask_order_only_changes_rows_with_padded_nugget_slots():
    model = tiny_model()
    legacy = tiny_model(legacy_decoder_mask_order=True)
    context_ids, context_mask = map(torch.cat, zip(right_pad(ids(1, 18), 18), right_pad(ids(1, 9), 18)))
    tokens = ids(2, 5)
    with torch.no_grad():
        fixed = model(tokens, nuggets=model.compress(context_ids, context_mask)).logits
        bug = legacy(tokens, nuggets=legacy.compress(context_ids, context_mask)).logits
    assert max_diff(fixed[0], bug[0]) == 0 and max_diff(fixed[1], bug[1]) > 1e-4


def test_eager_and_sdpa_agree(model, tmp_path):
    model.save_pretrained(tmp_path)
    eager = DodoLlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    sdpa = DodoLlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    context_ids, context_mask = map(torch.cat, zip(right_pad(ids(1, 16), 16), left_pad(ids(1, 9), 16)))
    tokens = ids(2, 5)
    with torch.no_grad():
        a, b = eager.compress(context_ids, context_mask), sdpa.compress(context_ids, context_mask)
        assert torch.equal(a.indices, b.indices) and max_diff(a.scores, b.scores) < 1e-5
        assert max_diff(eager(tokens, nuggets=a).logits, sdpa(tokens, nuggets=b).logits) < 1e-5


def test_bfloat16_and_tied_embeddings(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    reloaded = DodoLlamaForCausalLM.from_pretrained(tmp_path).eval()
    context, prompt = ids(2, 15), ids(2, 4)
    with torch.no_grad():
        reference = model(prompt, context_input_ids=context).logits
        assert max_diff(reloaded(prompt, context_input_ids=context).logits, reference) == 0
        half = reloaded.to(torch.bfloat16)
        nuggets = half.compress(context)
        assert nuggets.key_values[0][0].dtype == torch.bfloat16
        logits = half(prompt, nuggets=nuggets).logits
        assert torch.isfinite(logits).all() and max_diff(logits, reference) < 0.1 * reference.abs().max()
        assert half.generate(prompt, nuggets=nuggets, max_new_tokens=3, num_beams=2).shape == (2, 7)


def test_bfloat16_base_with_float32_trainable_weights(tmp_path, model):
    """PEFT's layout (`get_peft_model` keeps LoRA weights float32 on a bfloat16 base), which `from_pretrained` gives:
    adapters, scorer and soft prompt in float32. The scorer got the bfloat16 features ("mat1 and mat2 must have the
    same dtype")."""
    model.save_pretrained(tmp_path)
    mixed = DodoLlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert mixed.dtype == torch.bfloat16 and mixed.nugget_scorer[0].weight.dtype == torch.float32
    context, prompt = ids(2, 30), ids(2, 6)
    loss = mixed.train()(prompt, context_input_ids=context, labels=prompt).loss
    loss.backward()
    grads = [param.grad for param in mixed.parameters() if param.grad is not None]  # (not φ past the scorer's layer)
    assert torch.isfinite(loss) and all(grad.dtype == torch.float32 and torch.isfinite(grad).all() for grad in grads)
    assert mixed.nugget_scorer[0].weight.grad.abs().sum() > 0
    with torch.no_grad():
        nuggets = mixed.eval().compress(context)
        reference = model.compress(context)
        assert torch.equal(nuggets.indices, reference.indices) and nuggets.scores.dtype == torch.bfloat16
        logits = mixed(prompt, nuggets=nuggets).logits
        expected = model(prompt, nuggets=reference).logits
        assert max_diff(logits, expected) < 0.05 * expected.abs().max()
        assert mixed.generate(prompt, context_input_ids=context, max_new_tokens=3, num_beams=2).shape == (2, 9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loading_keeps_trainable_weights_float32_as_peft_does(tmp_path, model, dtype):
    """As PEFT's `autocast_adapter_dtype=True`: loaded in 16 bits, the base follows `dtype` and the adapters, scorer and
    soft prompt are float32 (read from a float32 checkpoint without rounding), so that small updates are not lost.
    They were in `dtype` too: one AdamW step at lr 1e-5 left most bfloat16 weights unchanged."""
    from safetensors import safe_open

    model.save_pretrained(tmp_path / "float32")
    mixed = DodoLlamaForCausalLM.from_pretrained(tmp_path / "float32", dtype=dtype)
    reference = dict(model.named_parameters())
    for name, param in mixed.named_parameters():
        assert param.dtype == (torch.float32 if param.requires_grad else dtype), name
        if param.requires_grad:
            assert torch.equal(param, reference[name]), name
    context, prompt = ids(2, 30), ids(2, 6)

    def changed_by_one_step(dodo) -> tuple[int, int]:
        """(weights changed by one AdamW step, weights with a non-zero gradient)."""
        trained = [param for param in dodo.parameters() if param.requires_grad]
        before = [param.detach().clone() for param in trained]
        optimizer = torch.optim.AdamW(trained, lr=1e-5, weight_decay=0.0)
        dodo.train()(prompt, context_input_ids=context, labels=prompt).loss.backward()
        optimizer.step()
        pairs = [(param, old) for param, old in zip(trained, before) if param.grad is not None]
        return (sum(int(((param != old) & (param.grad != 0)).sum()) for param, old in pairs),
                sum(int((param.grad != 0).sum()) for param, _ in pairs))

    changed, with_gradient = changed_by_one_step(mixed)
    assert with_gradient > 1000 and changed == with_gradient
    if dtype == torch.bfloat16:  # what the all-bfloat16 model (PEFT's opt-out) does with the same step
        half = DodoLlamaForCausalLM.from_pretrained(tmp_path / "float32", dtype=dtype, autocast_adapter_dtype=False)
        assert {param.dtype for param in half.parameters()} == {dtype}
        changed, with_gradient = changed_by_one_step(half)
        assert changed < with_gradient / 2

    # saved as PEFT saves adapters: in their own dtype (float32), the base in `dtype`; reloaded the same
    mixed.eval().save_pretrained(tmp_path / "mixed")
    saved = dict(mixed.state_dict())
    with safe_open(tmp_path / "mixed" / "model.safetensors", "pt") as file:
        assert {key: file.get_tensor(key).dtype for key in file.keys()} == {k: t.dtype for k, t in saved.items()}
    reloaded = DodoLlamaForCausalLM.from_pretrained(tmp_path / "mixed").eval()
    assert all(torch.equal(tensor, saved[key]) and tensor.dtype == saved[key].dtype
               for key, tensor in reloaded.state_dict().items())
    with torch.no_grad():
        nuggets = reloaded.compress(context)
        assert nuggets.key_values[0][0].dtype == dtype and nuggets.scores.dtype == dtype
        assert torch.equal(reloaded(prompt, nuggets=nuggets).logits, mixed(prompt, context_input_ids=context).logits)
        assert reloaded.generate(prompt, nuggets=nuggets, max_new_tokens=3).shape == (2, 9)

    # a Dodo built around a Llama checkpoint gets fresh float32 ones; `.to(dtype)` casts them with the rest (as it casts
    # a PEFT model's adapters)
    built = DodoLlamaForCausalLM.from_base_model(tmp_path / "float32", dtype=dtype)
    assert {(param.requires_grad, param.dtype) for param in built.parameters()} == {(True, torch.float32),
                                                                                    (False, dtype)}
    assert {param.dtype for param in built.to(dtype).parameters()} == {dtype}
    with pytest.raises(ValueError, match=re.escape("`autocast_adapter_dtype` must be True (float32 adapters, scorer "
                                                   "and soft prompt on a float16 or bfloat16 model, as PEFT keeps "
                                                   "adapters) or False, got 'no'.")):
        DodoLlamaForCausalLM(tiny_config(), autocast_adapter_dtype="no")


# --------------------------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------------------------


def test_greedy_generation_is_the_argmax_loop_and_starts_with_the_prompt(model):
    context, prompt = ids(1, 20), ids(1, 4)
    with torch.no_grad():
        nuggets = model.compress(context)
        generated = model.generate(prompt, nuggets=nuggets, max_new_tokens=6, do_sample=False)
        sequence = prompt
        for _ in range(6):
            next_token = model(sequence, nuggets=nuggets).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], 1)
        one_call = model.generate(input_ids=prompt, context_input_ids=context, max_new_tokens=6, do_sample=False)
        no_cache = model.generate(prompt, nuggets=nuggets, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(generated[:, :4], prompt) and torch.equal(generated, sequence)
    assert torch.equal(one_call, generated) and torch.equal(no_cache, generated)


def test_beam_search_and_sampling(model):
    contexts, prompts = ids(2, 17), ids(2, 4)
    with torch.no_grad():
        nuggets = model.compress(contexts)
        beams = model.generate(prompts, nuggets=nuggets, max_new_tokens=5, num_beams=3, do_sample=False)
        for row in range(2):  # beam search of a batch equals beam search of each row
            single = model.generate(
                prompts[row : row + 1],
                nuggets=model.compress(contexts[row : row + 1]),
                max_new_tokens=5,
                num_beams=3,
                do_sample=False,
            )
            assert torch.equal(beams[row], single[0])
        beam_out = model.generate(
            prompts,
            nuggets=nuggets,
            max_new_tokens=5,
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        # the best beam's score is its log-probability per generated token, recomputed here with a plain forward pass
        best = model(beam_out.sequences[::2], nuggets=nuggets).logits
        log_probs = best[:, 3:-1].log_softmax(-1).gather(2, beam_out.sequences[::2, 4:, None]).sum((1, 2)) / 5
        assert max_diff(log_probs, beam_out.sequences_scores[::2]) < 1e-4
        torch.manual_seed(1)
        sampled = model.generate(
            input_ids=prompts,
            context_input_ids=contexts,
            do_sample=True,
            top_k=10,
            max_new_tokens=5,
            num_return_sequences=3,
        )
    assert sampled.shape == (6, 9) and torch.equal(sampled[::3, :4], prompts)


# --------------------------------------------------------------------------------------------------------------------
# Autoregressive mode (paper §2.2): self-consistency
# --------------------------------------------------------------------------------------------------------------------


def peft_llama_with_theta(model: DodoLlamaForCausalLM) -> torch.nn.Module:
    """Stock transformers Llama + PEFT θ adapter, with our weights."""
    config = model.config
    llama = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.to_dict().items() if k in LlamaConfig().to_dict()}))
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, target_modules=config.lora_target_regex)
    inject_adapter_in_model(lora, llama.model, adapter_name="decoder")
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k or ".decoder." in k}
    missing, unexpected = llama.load_state_dict(
        {k: v for k, v in state.items() if not k.startswith(("nugget_", "soft_"))}
    )
    assert not missing and not unexpected
    return llama.eval()


def test_autoregressive_window_longer_than_the_text_is_plain_llama_with_theta(model):
    stock = peft_llama_with_theta(model)
    windowed = tiny_model(recent_window=64)
    text = ids(2, 20)
    with torch.no_grad():
        output = windowed(text)
        assert output.past_key_values.autoregressive and output.past_key_values.num_nugget_slots == 0
        assert max_diff(output.logits, stock(text).logits) < 1e-5
        generated = windowed.generate(text, max_new_tokens=8, do_sample=False)
        assert torch.equal(generated, stock.generate(text, max_new_tokens=8, do_sample=False))


def test_autoregressive_window_boundary_at_a_compressor_call_is_compressor_mode():
    window, stride = 6, 15
    streaming, compressor = tiny_model(recent_window=window, compression_stride=stride), tiny_model()
    text = ids(1, stride + window + 4)
    with torch.no_grad():
        streamed = streaming(text)
        cache = streamed.past_key_values
        nuggets = compressor.compress(text[:, :stride])
        assert cache.num_nugget_slots == nuggets.mask.shape[1] == 3 and cache.compressed_tokens == stride
        reference = compressor(text[:, stride:], nuggets=nuggets).logits
        assert max_diff(streamed.logits[:, stride + window :], reference[:, window:]) < 1e-5
        # greedy continuations equal while no second compression happens
        ar_generated = streaming.generate(text, max_new_tokens=5, do_sample=False)
        compressor_generated = compressor.generate(text[:, stride:], nuggets=nuggets, max_new_tokens=5, do_sample=False)
    assert torch.equal(ar_generated[:, -5:], compressor_generated[:, -5:])


def test_autoregressive_streaming_equals_one_call_and_threshold_modes():
    streaming = tiny_model(recent_window=4, compression_stride=6)
    text = ids(1, 27)
    with torch.no_grad():
        one_call = streaming(text)
        cache, pieces = None, []
        for start in range(0, 27, 5):  # uneven pieces crossing several compressions
            end = min(start + 5, 27)
            out = streaming(text[:, start:end], attention_mask=torch.ones(1, end), past_key_values=cache)
            cache = out.past_key_values
            pieces.append(out.logits)
        assert max_diff(torch.cat(pieces, 1), one_call.logits) < 1e-5
        assert cache.compressed_tokens == 18 and cache.pending_ids.shape[1] == 9  # three chunks of 6 compressed
        assert cache.num_nugget_slots == 3 * 2  # int(6 * 0.2 + 0.99) = 2 per chunk
        keep_all = tiny_model(recent_window=4, compression_stride=6, nugget_threshold=-1e9)(text).past_key_values
        keep_none = tiny_model(recent_window=4, compression_stride=6, nugget_threshold=1e9)(text)
        assert keep_all.num_nugget_slots == 18 and keep_none.past_key_values.num_nugget_slots == 0
        assert keep_none.logits.shape == (1, 27, VOCAB)
        beams = streaming.generate(text[:, :10].repeat(2, 1), max_new_tokens=14, num_beams=2, do_sample=False)
    assert beams.shape == (2, 24)
    threshold = tiny_model().estimate_nugget_threshold(ids(2, 40))
    assert isinstance(threshold, float) and math.isfinite(threshold)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_autoregressive_tokens_after_a_compression_that_kept_no_nugget_stay_causal(attention):
    """From an audit: when a compression keeps no nugget (threshold mode), the cache holds only the recent tokens but
    counts every token seen; transformers then placed the queries after all of them, so each recent token saw the
    later ones (in one call; with eager attention also when re-encoding the recent tokens, token by token too). They
    must be the θ Llama over the recent tokens, at positions after the compressed ones."""
    model = tiny_model(recent_window=5, compression_stride=2, nugget_threshold=1e9)  # no token is ever kept
    model.set_attn_implementation(attention)
    stock = peft_llama_with_theta(model)
    text = ids(1, 9)
    with torch.no_grad():
        one_call = model(text)
        assert one_call.past_key_values.compressed_tokens == 2 and one_call.past_key_values.num_nugget_slots == 0
        cache, pieces = None, []
        for end in range(1, 10):
            out = model(text[:, end - 1 : end], attention_mask=torch.ones(1, end), past_key_values=cache)
            cache, pieces = out.past_key_values, pieces + [out.logits]
        reference = stock(text[:, 2:], position_ids=torch.arange(2, 9)[None]).logits  # tokens 0, 1 compressed
    assert max_diff(one_call.logits[:, 7:], reference[:, 5:]) < 1e-5
    assert max_diff(torch.cat(pieces, 1)[:, 7:], reference[:, 5:]) < 1e-5


def test_autoregressive_threshold_rows_without_nuggets_in_a_batch_equal_rows_alone():
    """From an audit: with a threshold, a compression may keep no token of one row while another row keeps some. That
    row then got the soft prompt and positions counted from 0 (as after nuggets), not what it computes alone (no soft
    prompt, positions after its compressed tokens): right padding must keep each row's result."""
    window, stride = 2, 3
    texts = ids(2, 12)
    with torch.no_grad():  # the best score of each first chunk (before any nugget, the scorer sees the chunk alone)
        best = tiny_model().compress(texts[:, :stride]).all_scores.max(dim=1).values
    row = int(best.argmin())  # the shorter row: a threshold between the two keeps nothing of its first chunk
    short, long = texts[row : row + 1, :9], texts[1 - row : 2 - row]
    model = tiny_model(recent_window=window, compression_stride=stride, nugget_threshold=best.mean().item())
    batch_ids = torch.cat([torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], dim=1), long])
    batch_mask = torch.ones_like(batch_ids)
    batch_mask[0, 9:] = 0
    with torch.no_grad():
        first = model(batch_ids[:, : window + stride + 1], attention_mask=batch_mask[:, : window + stride + 1])
        assert first.past_key_values.nugget_mask.sum(dim=1).tolist()[0] == 0  # the short row kept nothing
        assert first.past_key_values.nugget_mask.sum(dim=1).tolist()[1] > 0
        batched = model(batch_ids, attention_mask=batch_mask).logits
        assert max_diff(batched[0, :9], model(short).logits[0]) < 1e-5
        assert max_diff(batched[1], model(long).logits[0]) < 1e-5


# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


def test_scorer_learns_only_through_the_attention_logits():
    """Eq. 17: ∂L/∂s_j equals the gradient of an additive bias on attention column j, summed over layers, heads and
    queries. With straight-through scores the forward pass ignores s; the gradient is that bias gradient."""
    model = tiny_model(score_in_forward=False)
    context, tokens = ids(1, 20), ids(1, 6)
    nuggets = model.compress(context)
    bias = torch.zeros_like(nuggets.scores, requires_grad=True)
    model.config.score_in_forward = True  # + bias (all zeros): the forward pass is unchanged
    loss_bias = model(tokens, nuggets=DodoNuggets(**{**nuggets, "scores": bias}), labels=tokens).loss
    (bias_grad,) = torch.autograd.grad(loss_bias, bias)
    model.config.score_in_forward = False
    scores = nuggets.scores.detach().requires_grad_(True)
    loss = model(tokens, nuggets=DodoNuggets(**{**nuggets, "scores": scores}), labels=tokens).loss
    assert abs(loss.item() - loss_bias.item()) < 1e-6
    (score_grad,) = torch.autograd.grad(loss, scores, retain_graph=True)
    assert bias_grad.abs().sum() > 0 and max_diff(score_grad, bias_grad) < 1e-7
    # and the scorer's parameters get exactly the chain rule through those scores (nothing else reaches them)
    model.zero_grad()
    nuggets = model.compress(context)
    model(tokens, nuggets=nuggets, labels=tokens).loss.backward()
    features = model.compress(context, output_features=True).features.detach()
    expected = torch.autograd.grad(
        model.nugget_scorer(features).squeeze(-1).gather(1, nuggets.indices),
        model.nugget_scorer[0].weight,
        grad_outputs=score_grad,
    )[0]
    assert max_diff(model.nugget_scorer[0].weight.grad, expected) < 1e-6


def test_joint_compress_then_decode_step_trains_both_adapters_scorer_and_soft_prompt():
    model = tiny_model().train()
    batch = DodoDataCollator()(
        [
            {"context_input_ids": ids(1, 20)[0].tolist(), "input_ids": ids(1, 8)[0].tolist()},
            {"context_input_ids": ids(1, 14)[0].tolist(), "input_ids": ids(1, 5)[0].tolist(), "prompt_length": 2},
        ]
    )
    loss = model(**batch).loss
    loss.backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    for role in ("encoder", "decoder"):
        assert sum(g.abs().sum() for n, g in grads.items() if f".lora_B.{role}." in n and g is not None) > 0
    assert grads["nugget_scorer.0.weight"].abs().sum() > 0 and grads["soft_prompt.weight"].abs().sum() > 0
    assert all(g is None for n, g in grads.items() if ".lora_" not in n and not n.startswith(("nugget_", "soft_")))


@pytest.mark.parametrize(
    "settings", [{}, {"nugget_encoding": "reencode"}, {"recent_window": 4, "compression_stride": 6}],
    ids=["compressor", "reencode", "autoregressive"],
)
def test_passes_joined_for_fsdp_change_no_value_and_no_gradient(settings, monkeypatch):
    """Under FSDP the compression passes' unused outputs are joined to the nuggets (`_ZeroGradientTie`; the sharded
    training itself: test_distributed.py). Joined, as if the layers were FSDP units, the loss is the same to the bit
    and so is every gradient; the parameters that only the unused outputs depend on (φ's q and o in the last layer)
    get zeros where they got none."""
    import longreach.modeling.modeling_dodo as modeling_dodo

    model = tiny_model(**settings).train()
    if "recent_window" in settings:
        batch = {"input_ids": ids(2, 24)}
        batch["labels"] = batch["input_ids"]
    else:
        batch = DodoDataCollator()([{"context_input_ids": ids(1, 20)[0].tolist(), "input_ids": ids(1, 8)[0].tolist()},
                                    {"context_input_ids": ids(1, 14)[0].tolist(), "input_ids": ids(1, 5)[0].tolist()}])

    def loss_and_gradients(sharded: bool):
        monkeypatch.setattr(modeling_dodo, "_layers_are_sharded", lambda layers: sharded)
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {name: param.grad for name, param in model.named_parameters()}

    loss, gradients = loss_and_gradients(False)
    joined_loss, joined_gradients = loss_and_gradients(True)
    assert torch.equal(loss, joined_loss)
    zeros_only = set()
    for name, gradient in gradients.items():
        joined = joined_gradients[name]
        if gradient is None and joined is not None:
            assert not joined.any(), name
            zeros_only.add(name)
        else:
            assert (gradient is None and joined is None) or torch.equal(gradient, joined), name
    if "recent_window" not in settings:  # φ's q and o of the last layer (its k and v reach the decoder pass)
        assert {name.split(".lora_")[0] for name in zeros_only} == {"model.layers.2.self_attn.q_proj",
                                                                    "model.layers.2.self_attn.o_proj"}
    assert zeros_only  # the join did reach the unused outputs


def test_collator_builds_autoencoding_and_continuation_examples():
    batch = DodoDataCollator(pad_token_id=0)(
        [
            {"context_input_ids": [1, 5, 6, 7]},  # autoencoding: target = context
            {"context_input_ids": [1, 8], "input_ids": [9, 10, 11], "prompt_length": 1},  # continuation
        ]
    )
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7], [9, 10, 11, 0]]
    assert batch["labels"].tolist() == [[1, 5, 6, 7], [-100, 10, 11, -100]]
    assert batch["context_attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    with pytest.raises(ValueError, match="context_input_ids"):
        DodoDataCollator()([{"input_ids": [1, 2]}])


def test_trainer_updates_only_adapters_scorer_and_soft_prompt(tmp_path):
    from datasets import Dataset

    model = tiny_model().train()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    rows = [
        {"context_input_ids": ids(1, 16 + i)[0].tolist(), "input_ids": ids(1, 6)[0].tolist(), "prompt_length": 2}
        for i in range(4)
    ]
    rows += [{"context_input_ids": ids(1, 12)[0].tolist(), "input_ids": None, "prompt_length": 0} for _ in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=DodoDataCollator())
    result = trainer.train()
    assert math.isfinite(result.training_loss)
    changed = {name for name, param in model.named_parameters() if not torch.equal(param.detach(), before[name])}
    assert changed and all(".lora_" in n or n.startswith(("nugget_scorer.", "soft_prompt.")) for n in changed)
    assert any(".lora_B.encoder." in n for n in changed) and any(".lora_B.decoder." in n for n in changed)
    assert "nugget_scorer.0.weight" in changed and "soft_prompt.weight" in changed
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = DodoLlamaForCausalLM.from_pretrained(tmp_path / "saved")
    assert trainable_names(reloaded) == trainable_names(model)


# --------------------------------------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------------------------------------


def checkpointing_batch(mode: str) -> dict[str, torch.Tensor]:
    """A compressor-mode batch (two contexts of different lengths: padded nugget slots; a prompt without loss) or an
    autoregressive-mode text (a right-padded row, as the collator pads; several compressions and θ recomputations)."""
    torch.manual_seed(1)
    if mode in ("compressor", "reencode"):
        return DodoDataCollator()(
            [
                {"context_input_ids": ids(1, 20)[0].tolist(), "input_ids": ids(1, 8)[0].tolist()},
                {"context_input_ids": ids(1, 14)[0].tolist(), "input_ids": ids(1, 5)[0].tolist(), "prompt_length": 2},
            ]
        )
    text, mask = ids(2, 27), torch.ones(2, 27, dtype=torch.long)
    mask[1, -3:] = 0
    return {"input_ids": text, "attention_mask": mask, "labels": text.masked_fill(mask == 0, -100)}


#: A base weight used by the φ, scorer and θ passes; trained in some tests (the scorer pass then needs autograd).
BASE_WEIGHT = "model.layers.0.mlp.down_proj.weight"


def checkpointing_model(
    mode: str, attention: str, enable=None, train_base_weight: bool = False
) -> DodoLlamaForCausalLM:
    overrides = {
        "compressor": {"lora_dropout": 0.1},
        "reencode": {"lora_dropout": 0.1, "nugget_encoding": "reencode"},
        "autoregressive": {"recent_window": 4, "compression_stride": 6},
    }[mode]
    model = tiny_model(**overrides).train()
    model.set_attn_implementation(attention)
    model.get_parameter(BASE_WEIGHT).requires_grad_(train_base_weight)
    if enable is not None:
        enable(model)
    return model


def loss_and_gradients(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    torch.manual_seed(0)  # the LoRA dropout masks
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters() if param.requires_grad}


CHECKPOINTING = {
    "default": lambda model: model.activation_checkpointing_enable(),  # transformers 5.23: use_reentrant=False
    "reentrant": lambda model: model.gradient_checkpointing_enable(  # the deprecated name, the other variant
        gradient_checkpointing_kwargs={"use_reentrant": True}
    ),
}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["compressor", "reencode", "autoregressive"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(mode, attention):
    """φ's keys/values leave its checkpointed layers through the cache and the nuggets enter θ's through it; every
    trainable tensor (both adapters, scorer, soft prompt; in compressor mode also a base weight, which makes the
    adapter-free scorer pass checkpointed too) gets the gradient of the run without checkpointing."""
    batch = checkpointing_batch(mode)
    train_base_weight = mode == "compressor"
    reference_loss, reference = loss_and_gradients(checkpointing_model(mode, attention, None, train_base_weight), batch)
    for role in ("encoder", "decoder"):
        assert any(g is not None and g.abs().sum() > 0 for n, g in reference.items() if f".lora_B.{role}." in n)
    assert reference["nugget_scorer.0.weight"].abs().sum() > 0 and reference["soft_prompt.weight"].abs().sum() > 0
    assert (BASE_WEIGHT in reference) == train_base_weight
    for variant, enable in CHECKPOINTING.items():
        model = checkpointing_model(mode, attention, enable, train_base_weight)
        assert model.is_activation_checkpointing
        loss, gradients = loss_and_gradients(model, batch)
        assert loss == reference_loss, variant
        for name, expected in reference.items():
            got = gradients[name]
            if expected is None:  # φ's q/o LoRA of the last layer: nothing reads that layer's φ output
                # the reentrant variant backpropagates a zero gradient through the unused output
                assert got is None or (variant == "reentrant" and not got.any()), (variant, name)
                continue
            relative = max_diff(got, expected) / expected.abs().max().item()
            assert relative <= 1e-6, (variant, name, relative)


def count_calls(modules: list[torch.nn.Module]) -> list[int]:
    """Live counts of each module's calls (module hooks run again when a checkpointed layer is replayed)."""
    calls = [0] * len(modules)
    for index, module in enumerate(modules):
        module.register_forward_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    return calls


def test_checkpointed_layers_are_replayed_in_the_backward_pass():
    """Counts each decoder layer's attention calls: the compressor step runs every layer in the φ and θ passes and the
    first ι = 2 in the scorer pass; checkpointed layers replay their φ and θ calls during backward, others nothing (the
    scorer pass of a frozen base runs without autograd: nothing to replay)."""
    batch = checkpointing_batch("compressor")
    expected_forward = [3, 3, 2]
    for enable, replayed in (
        (None, [0, 0, 0]),
        (lambda model: model.activation_checkpointing_enable(), [2, 2, 2]),
        (lambda model: model.activation_checkpointing_enable(every_n_layers=2), [2, 0, 2]),
    ):
        model = checkpointing_model("compressor", "sdpa", enable)
        calls = count_calls([layer.self_attn for layer in model.model.layers])
        loss = model(**batch).loss
        assert calls == expected_forward
        loss.backward()
        assert [total - forward for total, forward in zip(calls, expected_forward)] == replayed
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing
    assert not any(layer._can_checkpoint_with_cache for layer in model.model.layers)


def test_scorer_pass_uses_autograd_only_when_a_base_weight_it_reads_trains():
    context = ids(1, 20)
    for train_base_weight in (False, True):
        enable = CHECKPOINTING["default"]  # which makes the embeddings require gradients
        model = checkpointing_model("compressor", "sdpa", enable, train_base_weight)
        assert model.compress(context, output_features=True).features.requires_grad == train_base_weight


def test_activation_checkpointing_leaves_inference_and_the_cache_unchanged():
    plain, checkpointed = tiny_model().train(), tiny_model().train()
    checkpointed.activation_checkpointing_enable()
    context, tokens = ids(2, 20), ids(2, 6)
    # training step: the decoder's cache ends the same (nuggets, then the new keys/values, appended once)
    caches = [m(tokens, context_input_ids=context, labels=tokens).past_key_values for m in (plain, checkpointed)]
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 6
    assert caches[0].layers[0].get_seq_length() == caches[1].layers[0].get_seq_length() == caches[0].num_nugget_slots + 2 + 6
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # no gradient (generate() on a model left in train mode) and eval mode: identical outputs, no replay machinery
    for train in (True, False):
        plain.train(train), checkpointed.train(train)
        with torch.no_grad():
            logits = [m(tokens, context_input_ids=context).logits for m in (plain, checkpointed)]
            generated = [m.generate(tokens, context_input_ids=context, max_new_tokens=5) for m in (plain, checkpointed)]
        assert torch.equal(logits[0], logits[1]) and torch.equal(generated[0], generated[1])


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing:FutureWarning")  # the deprecated names, on purpose
def test_trainer_with_activation_checkpointing_takes_the_same_steps(tmp_path):
    from datasets import Dataset

    torch.manual_seed(2)
    rows = [
        {"context_input_ids": ids(1, 16 + i)[0].tolist(), "input_ids": ids(1, 6)[0].tolist(), "prompt_length": 2}
        for i in range(4)
    ]
    parameters = []
    for index, options in enumerate(
        (
            {},
            {"activation_checkpointing": True},
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
        )
    ):
        model = tiny_model().train()
        args = TrainingArguments(
            output_dir=str(tmp_path / f"run{index}"),
            per_device_train_batch_size=2,
            max_steps=2,
            learning_rate=1e-2,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            remove_unused_columns=False,
            seed=0,
            **options,
        )
        Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=DodoDataCollator()).train()
        assert model.is_activation_checkpointing == bool(options)
        parameters.append({name: param.detach().clone() for name, param in model.named_parameters()})
    for checkpointed in parameters[1:]:
        for name, expected in parameters[0].items():
            assert max_diff(checkpointed[name], expected) <= 1e-6 * max(expected.abs().max().item(), 1e-12), name


# --------------------------------------------------------------------------------------------------------------------
# Hub-ready saving
# --------------------------------------------------------------------------------------------------------------------


def test_saved_folder_loads_without_longreach(tmp_path, model, isolated_hf_env):
    folder = tmp_path / "dodo-tiny"
    model.save_pretrained(folder)
    config = (folder / "config.json").read_text()
    assert '"AutoModelForCausalLM": "modeling_dodo.DodoLlamaForCausalLM"' in config and '"AutoModel"' in config
    context, prompt = ids(1, 20), ids(1, 5)
    with torch.no_grad():
        logits = model(prompt, context_input_ids=context).logits
        generated = model.generate(input_ids=prompt, context_input_ids=context, max_new_tokens=6, num_beams=2)
    code = f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        context, prompt = torch.tensor({context.tolist()}), torch.tensor({prompt.tolist()})
        with torch.no_grad():
            nuggets = model.compress(context)
            logits = model(prompt, nuggets=nuggets).logits
            generated = model.generate(input_ids=prompt, context_input_ids=context, max_new_tokens=6, num_beams=2)
        frozen = all(not p.requires_grad for n, p in model.named_parameters() if "base_layer" in n)
        print(json.dumps({{"cls": type(model).__name__, "module": type(model).__module__, "logits": logits.tolist(),
                          "generated": generated.tolist(), "frozen": frozen}}))
    """
    result = run_without_longreach(code, tmp_path)
    assert result["cls"] == "DodoLlamaForCausalLM" and "longreach" not in result["module"]
    assert torch.equal(torch.tensor(result["logits"]), logits)
    assert result["generated"] == generated.tolist() and result["frozen"]


def test_two_folders_loaded_without_longreach_share_nuggets_an_assistant_and_a_config(tmp_path, model,
                                                                                       isolated_hf_env):
    """Without longreach, transformers loads each folder's code as a module of its own: the nuggets, model and config
    of one folder were refused by another folder's identical model ("must be the DodoNuggets ..., got DodoNuggets"),
    and a config from AutoConfig got no Llama key mapping when loading a base Llama checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for name in ("main", "draft"):
        model.save_pretrained(tmp_path / name)
    llama_fields = {key: getattr(model.config, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "bos_token_id", "eos_token_id", "pad_token_id")}
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**llama_fields)).save_pretrained(tmp_path / "base")
    context, prompt = ids(1, 30), ids(1, 6)
    with torch.no_grad():
        expected_logits = model(prompt, context_input_ids=context).logits
        expected = model.generate(prompt, context_input_ids=context, max_new_tokens=6)
    code = f"""
        import json, torch
        from transformers import AutoConfig, AutoModelForCausalLM
        main = AutoModelForCausalLM.from_pretrained({str(tmp_path / "main")!r}, trust_remote_code=True).eval()
        draft = AutoModelForCausalLM.from_pretrained({str(tmp_path / "draft")!r}, trust_remote_code=True).eval()
        context, prompt = torch.tensor({context.tolist()}), torch.tensor({prompt.tolist()})
        with torch.no_grad():
            logits = draft(prompt, nuggets=main.compress(context)).logits
            assisted = main.generate(prompt, context_input_ids=context, max_new_tokens=6, assistant_model=draft)
        config = AutoConfig.from_pretrained({str(tmp_path / "main")!r}, trust_remote_code=True)
        base = AutoModelForCausalLM.from_pretrained({str(tmp_path / "base")!r}, config=config, trust_remote_code=True)
        print(json.dumps({{"logits": logits.tolist(), "assisted": assisted.tolist(), "base": type(base).__name__,
                          "modules": sorted({{type(main).__module__, type(draft).__module__}})}}))
    """
    result = run_without_longreach(code, tmp_path)
    assert len(result["modules"]) == 2  # two copies of the code, as the bug needs
    assert torch.allclose(torch.tensor(result["logits"]), expected_logits, atol=1e-6)
    assert result["assisted"] == expected.tolist() and result["base"] == "DodoLlamaForCausalLM"


# --------------------------------------------------------------------------------------------------------------------
# Summarization inputs (pipeline protocol)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def tokenizer():
    words = ["[INST]", "[/INST]", "Please", "summarize", "the", "above", "document", "in", "one", "sentence."]
    words += [f"w{i}" for i in range(VOCAB - 4 - len(words))]
    vocab = {token: index for index, token in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def test_prepare_summarization_inputs_compresses_the_document_and_prompts_with_d3(model, tokenizer):
    documents = [" ".join(f"w{i}" for i in range(30)), "w1 w2 w3 w4 w5 w6"]
    inputs, dropped = model.prepare_summarization_inputs(tokenizer, documents, max_input_length=20)
    assert dropped == [12, 0]  # BOS + [INST] + 18 document tokens fit
    prompt = tokenizer.decode(inputs["input_ids"][0])
    assert prompt == "Please summarize the above document in one sentence. [/INST]"
    assert inputs["context_input_ids"][0, :2].tolist() == [
        tokenizer.bos_token_id,
        tokenizer.convert_tokens_to_ids("[INST]"),
    ]
    assert inputs["context_attention_mask"].sum(1).tolist() == [20, 8]
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, inputs["input_ids"].shape[1] + 4)
    _, none_dropped = model.prepare_summarization_inputs(tokenizer, documents)
    assert none_dropped == [0, 0]
    with pytest.raises(ValueError, match="max_input_length"):
        model.prepare_summarization_inputs(tokenizer, documents, max_input_length=2)


def test_summarization_pipeline_runs_dodo(model, tokenizer):
    summarizer = pipeline("long-summarization", model=model, tokenizer=tokenizer, max_new_tokens=3, do_sample=False)
    result = summarizer(["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"])
    assert isinstance(result[0]["summary_text"], str)


# --------------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------------


def test_bad_input_raises_clear_value_errors(model):
    context, tokens = ids(2, 12), ids(2, 4)
    nuggets = model.compress(context)
    empty_mask = torch.ones_like(context)
    empty_mask[1] = 0
    with pytest.raises(ValueError, match="Empty context"):
        model.compress(context, empty_mask)
    with pytest.raises(ValueError, match="input_ids"):
        model.compress(context[:, :0])
    with pytest.raises(ValueError, match="input_ids"):
        model.compress(context.float())
    with pytest.raises(ValueError, match="too short for any nugget"):
        tiny_model(nugget_ratio=0.005).compress(ids(1, 1))
    other = tiny_model(nugget_layer=1)
    with pytest.raises(ValueError, match="another configuration"):
        other(tokens, nuggets=nuggets)
    with pytest.raises(ValueError, match="another configuration"):
        other.generate(tokens, nuggets=nuggets, max_new_tokens=2)
    with pytest.raises(ValueError, match="contexts but"):
        model(tokens[:1], nuggets=nuggets)
    with pytest.raises(ValueError, match="not both"):
        model(tokens, nuggets=nuggets, context_input_ids=context)
    with pytest.raises(ValueError, match="nuggets"):
        model(tokens, nuggets={"mask": nuggets.mask})
    with pytest.raises(ValueError, match="attention_mask"):
        model(tokens, nuggets=nuggets, attention_mask=torch.ones(2, 9))
    with pytest.raises(ValueError, match="labels"):
        model(tokens, nuggets=nuggets, labels=tokens[:, :2])
    with pytest.raises(ValueError, match="DodoCache"):
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.update(torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8), 0)
        model(tokens, past_key_values=cache)
    with pytest.raises(ValueError, match="exactly one"):
        model(nuggets=nuggets)
    with pytest.raises(ValueError, match="Flash Attention"):
        DodoLlamaForCausalLM(tiny_config(_attn_implementation="flash_attention_2"))


# --------------------------------------------------------------------------------------------------------------------
# The scorer's features read from the φ pass (LoRA on layers >= ι only)
# --------------------------------------------------------------------------------------------------------------------


def padded_contexts() -> tuple[torch.LongTensor, torch.LongTensor]:
    """Three contexts: one whole row, one right-padded, one left-padded."""
    torch.manual_seed(2)
    rows = [(ids(1, 13), torch.ones(1, 13, dtype=torch.long)), right_pad(ids(1, 9), 13), left_pad(ids(1, 7), 13)]
    return torch.cat([row[0] for row in rows]), torch.cat([row[1] for row in rows])


def count_scorer_passes(model, monkeypatch) -> list[int]:
    calls, scorer_features = [0], model._scorer_features

    def counted(*args, **kwargs):
        calls[0] += 1
        return scorer_features(*args, **kwargs)

    monkeypatch.setattr(model, "_scorer_features", counted)
    return calls


@pytest.mark.parametrize(
    "features, nugget_layer, lora_layers",
    [("encoder_hidden", 2, [2]), ("base_final_norm", 2, [2]), ("base_final_norm", 0, None)],  # ι = 0: the embeddings
)
def test_scorer_reads_the_phi_pass_where_its_first_layers_are_adapter_free(
    features, nugget_layer, lora_layers, monkeypatch
):
    """LoRA on layers >= ι only: the φ pass's residual stream after ι layers is the adapter-free one the scorer reads,
    so compress takes it from there instead of running the scorer's own pass, and selects the same nuggets."""
    model = tiny_model(scorer_features=features, nugget_layer=nugget_layer, lora_layers=lora_layers)
    context, mask = padded_contexts()
    passes = count_scorer_passes(model, monkeypatch)
    with torch.no_grad():
        shared = model.compress(context, mask, output_features=True)
        assert passes == [0]
        monkeypatch.setattr(model, "_scorer_reads_phi_pass", lambda previous: False)  # the scorer's own pass
        separate = model.compress(context, mask, output_features=True)
        assert passes == [1]
    real = mask.bool()
    assert max_diff(shared.features[real], separate.features[real]) < 1e-6
    assert max_diff(shared.all_scores[real], separate.all_scores[real]) < 1e-6
    assert torch.equal(shared.indices, separate.indices) and torch.equal(shared.mask, separate.mask)
    for (key, value), (other_key, other_value) in zip(shared.key_values, separate.key_values):
        assert torch.equal(key, other_key) and torch.equal(value, other_value)  # the φ pass itself is unchanged


def test_scorer_runs_its_own_pass_where_the_phi_pass_cannot_serve(monkeypatch):
    """The paper's setting (LoRA on every layer: φ's early layers are not adapter-free) runs the scorer's pass; in
    autoregressive mode the first compression reads the φ pass and the later ones, whose φ pass also attends to older
    nuggets, run the scorer's pass."""
    model = tiny_model()
    passes = count_scorer_passes(model, monkeypatch)
    with torch.no_grad():
        model.compress(ids(2, 13))
    assert passes == [1]

    model = tiny_model(scorer_features="encoder_hidden", lora_layers=[2], recent_window=4, compression_stride=6)
    passes = count_scorer_passes(model, monkeypatch)
    reads = []
    decide = model._scorer_reads_phi_pass
    monkeypatch.setattr(model, "_scorer_reads_phi_pass", lambda previous: reads.append(decide(previous)) or reads[-1])
    text = ids(1, 27)
    with torch.no_grad():
        model(text, labels=text)
    assert reads[0] and not all(reads) and passes == [reads.count(False)]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("checkpointing", [None, "default", "reentrant"])
@pytest.mark.parametrize("train_base_weight", [False, True])
def test_features_read_from_the_phi_pass_train_like_the_scorer_pass(checkpointing, train_base_weight, monkeypatch):
    """Same loss and gradients (adapters, scorer, soft prompt, and a base weight of the first layers when it trains)
    whether the scorer reads the φ pass or runs its own pass, with and without activation checkpointing."""
    batch = checkpointing_batch("compressor")

    def model_for(shared: bool):
        model = tiny_model(scorer_features="encoder_hidden", lora_layers=[2], lora_dropout=0.1).train()
        model.get_parameter(BASE_WEIGHT).requires_grad_(train_base_weight)
        if checkpointing is not None:
            CHECKPOINTING[checkpointing](model)
        if not shared:
            monkeypatch.setattr(model, "_scorer_reads_phi_pass", lambda previous: False)
        return model

    reference_loss, reference = loss_and_gradients(model_for(shared=False), batch)
    loss, gradients = loss_and_gradients(model_for(shared=True), batch)
    assert (BASE_WEIGHT in reference) == train_base_weight
    assert reference["nugget_scorer.0.weight"].abs().sum() > 0
    if train_base_weight:
        assert reference[BASE_WEIGHT].abs().sum() > 0
    assert abs(loss.item() - reference_loss.item()) <= 1e-6
    for name, expected in reference.items():
        got = gradients[name]
        if expected is None or not expected.any():
            assert got is None or not got.any(), name
            continue
        assert max_diff(got, expected) / expected.abs().max().item() <= 1e-5, name


def test_features_read_from_the_phi_pass_use_autograd_only_when_a_base_weight_they_depend_on_trains():
    """As the scorer's own pass (above): with a frozen base the features carry no graph, even where activation
    checkpointing makes the embeddings require gradients."""
    for train_base_weight in (False, True):
        model = tiny_model(scorer_features="encoder_hidden", lora_layers=[2]).train()
        model.get_parameter(BASE_WEIGHT).requires_grad_(train_base_weight)
        CHECKPOINTING["default"](model)
        assert model.compress(ids(1, 20), output_features=True).features.requires_grad == train_base_weight


def test_config_output_hidden_states_keeps_logits_and_loss_on_the_tokens():
    """As LlamaModel: the config's output_hidden_states (from_pretrained(..., output_hidden_states=True)) applies when the
    call does not say, and the logits still cover `input_ids` only (not the soft prompt)."""
    model = tiny_model()
    generator = torch.Generator().manual_seed(1)
    context = torch.randint(3, VOCAB, (2, 30), generator=generator)
    prompt = torch.randint(3, VOCAB, (2, 6), generator=generator)
    with torch.no_grad():
        expected = model(prompt, context_input_ids=context, labels=prompt)
        model.config.output_hidden_states = True
        flagged = model(prompt, context_input_ids=context, labels=prompt)
    assert flagged.logits.shape == expected.logits.shape == (2, 6, VOCAB)
    assert torch.allclose(flagged.loss, expected.loss) and flagged.hidden_states[0].shape[:2] == (2, 6)
    assert expected.hidden_states is None


def test_data_collator_takes_tensors_and_numpy_features():
    import numpy as np

    collator = DodoDataCollator(pad_token_id=0)
    as_lists = collator([{"context_input_ids": [1, 5, 6], "input_ids": [7, 8]}, {"context_input_ids": [0]}])
    for convert in (torch.tensor, np.array):
        batch = collator([{"context_input_ids": convert([1, 5, 6]), "input_ids": convert([7, 8])},
                          {"context_input_ids": convert([0])}])  # a one-token context of token 0 is not empty
        assert all(torch.equal(batch[key], as_lists[key]) for key in as_lists)


def test_data_collator_keeps_a_features_labels_pads_to_a_multiple_and_masks_prompts():
    collator = DodoDataCollator(pad_token_id=0, pad_to_multiple_of=8)
    batch = collator([
        {"context_input_ids": [1, 5, 6], "input_ids": [20, 21, 22, 23], "labels": [-100, -100, 22, 23]},
        {"context_input_ids": [1, 7], "input_ids": [30, 31, 32], "labels": [-100, 31, 32]},
    ])
    assert batch["labels"].tolist() == [[-100, -100, 22, 23] + [-100] * 4, [-100, 31, 32] + [-100] * 5]
    assert all(batch[key].shape[1] == 8 for key in batch)
    # the prompt never counts, whatever pads the labels
    padded_with_zero = DodoDataCollator(label_pad_token_id=0)([
        {"context_input_ids": [1, 5], "input_ids": [9, 10, 11], "prompt_length": 1},
        {"context_input_ids": [1, 8], "input_ids": [12, 13, 14, 15]},
    ])
    assert padded_with_zero["labels"].tolist() == [[-100, 10, 11, 0], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="must align"):
        collator([{"context_input_ids": [1, 5], "input_ids": [9, 10], "labels": [9]}])
    with pytest.raises(ValueError, match="to every feature or to none"):
        collator([{"context_input_ids": [1], "input_ids": [9], "labels": [9]}, {"context_input_ids": [1]}])
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        DodoDataCollator(pad_to_multiple_of=0)


@pytest.mark.parametrize("feature, message", [
    ({"context_input_ids": [1, 5], "input_ids": [9, 10, 11], "prompt_length": -2},
     "`prompt_length` must be an integer from 0 to 2"),
    ({"context_input_ids": [1, 5], "input_ids": [9, 10, 11], "prompt_length": 3}, "at least one must be in the loss"),
    ({"context_input_ids": [1, 5], "input_ids": [9, 10, 11], "prompt_length": None}, "`prompt_length` must be"),
    ({"context_input_ids": [1, 5], "input_ids": [9.7, 10, 11]}, "`input_ids` must be a flat list of integer"),
    ({"context_input_ids": [[1, 5], [2]], "input_ids": [9]}, "`context_input_ids` must be a flat list of integer"),
    ([1, 5], "must be a dict of token lists"),
])
def test_data_collator_refuses_bad_features(feature, message):
    """Such features were counted from the end (a negative prompt length), left no token in the loss, had their ids
    truncated to integers (8.7 became 8) or failed deep."""
    with pytest.raises(ValueError, match=message):
        DodoDataCollator()([{"context_input_ids": [1, 2], "input_ids": [3, 4]}, feature])
    with pytest.raises(ValueError, match="`pad_token_id` must be an integer token id"):
        DodoDataCollator(pad_token_id=None)


def test_trainer_label_smoothing_shifts_the_labels_as_for_llama(tmp_path, model):
    """The Trainer's label smoother shifts labels only for the models in transformers' causal-LM table: Dodo is in it
    (it trained every position towards its own token)."""
    features = [{"context_input_ids": [1] + ids(1, 12)[0].tolist(), "input_ids": ids(1, 6)[0].tolist()}
                for _ in range(2)]
    batch = DodoDataCollator()(features)
    trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), use_cpu=True, report_to="none",
                                                          label_smoothing_factor=0.1, remove_unused_columns=False))
    with torch.no_grad():
        got = trainer.compute_loss(model, dict(batch)).item()
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    log_probs, real = logits.log_softmax(-1), labels != -100
    nll = -log_probs.gather(-1, labels.clamp(min=0)[..., None])[..., 0][real]
    expected = 0.9 * nll.mean() + 0.1 * (-log_probs.mean(-1))[real].mean()
    assert abs(got - expected.item()) < 1e-5


# --------------------------------------------------------------------------------------------------------------------
# generate()'s signature, later turns, assistants, PEFT from outside, offloading
# --------------------------------------------------------------------------------------------------------------------


def test_generate_takes_inputs_and_a_positional_generation_config_as_llama_does(model):
    from transformers import GenerationConfig

    context, prompt = ids(1, 20), ids(1, 4)
    with torch.no_grad():
        nuggets = model.compress(context)
        expected = model.generate(input_ids=prompt, nuggets=nuggets, max_new_tokens=5, do_sample=False)
        assert torch.equal(model.generate(inputs=prompt, nuggets=nuggets, max_new_tokens=5, do_sample=False), expected)
        config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, config, nuggets=nuggets), expected)
        assert torch.equal(model.generate(prompt, config, context_input_ids=context), expected)
        with pytest.raises(ValueError, match="Pass the prompt once"):
            model.generate(prompt, input_ids=prompt, nuggets=nuggets, max_new_tokens=2)


def test_a_later_turn_refuses_nuggets_other_than_those_in_its_cache(model):
    """Continuing from a returned cache: its nuggets are the ones attended to, so other nuggets are refused (they were
    ignored); the same nuggets, or none, continue the turn."""
    contexts, prompt = ids(2, 20), ids(1, 4)
    with torch.no_grad():
        first, other = model.compress(contexts[:1]), model.compress(contexts[1:])
        turn = model.generate(prompt, nuggets=first, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        follow_up = torch.cat([turn.sequences, ids(1, 2)], dim=1)
        options = dict(max_new_tokens=3, do_sample=False)
        fresh = model.generate(follow_up, nuggets=first, **options)
        assert torch.equal(model.generate(follow_up, nuggets=first, cache=copy.deepcopy(turn.past_key_values),
                                          **options), fresh)
        with pytest.raises(ValueError, match=r"`nuggets` differ from the nuggets already in the cache \(`cache`, or `past_key_values`\)"):
            model.generate(follow_up, nuggets=other, cache=copy.deepcopy(turn.past_key_values), **options)
        with pytest.raises(ValueError, match="`nuggets` differ"):
            seen = turn.past_key_values.seen_tokens  # (the last generated token is not in the cache yet)
            model(follow_up[:, seen:], nuggets=other, past_key_values=copy.deepcopy(turn.past_key_values),
                  attention_mask=torch.ones_like(follow_up))


def test_an_assistant_that_cannot_read_nuggets_is_refused_clearly(model):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="`assistant_model` must be a DodoLlamaForCausalLM"):
        model.generate(ids(1, 4), context_input_ids=ids(1, 20), assistant_model=llama, max_new_tokens=3)


@pytest.mark.parametrize("change", ["get_peft_model on q_proj", "get_peft_model on gate_proj", "merge_and_unload"])
def test_peft_adapters_added_from_outside_are_refused(change):
    """PEFT adapters added to a Dodo model were left inactive (on φ/θ's layers), trained beside Dodo's own parameters
    and saved without them, and `merge_and_unload` dropped φ: each is now a clear error at the next call."""
    from peft import get_peft_model

    model = tiny_model()
    target = "gate_proj" if "gate_proj" in change else "q_proj"
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=[target], task_type="CAUSAL_LM"))
    if change == "merge_and_unload":
        wrapped = wrapped.merge_and_unload()
    with pytest.raises(ValueError, match="LoRA layers were changed from outside"):
        wrapped(input_ids=ids(1, 5), context_input_ids=ids(1, 20))
    with pytest.raises(ValueError, match="LoRA layers were changed from outside"):
        wrapped(input_ids=ids(1, 5))


@pytest.mark.parametrize("method", ["prompt tuning", "p-tuning"])
def test_peft_prompt_tuning_generates_what_its_forward_predicts(method):
    """PEFT's prompt tuning and p-tuning add no layer: they prepend virtual tokens (embeddings) to the decoder's input,
    as on Llama. Their generate() crashed at the second step (the cache had read more columns than `input_ids` holds,
    and the new token was sliced off); it now continues the greedy argmax of the forward, padded rows included."""
    from peft import PromptEncoderConfig, PromptTuningConfig, get_peft_model

    config = (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3) if method == "prompt tuning" else
              PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=8))
    tuned = get_peft_model(tiny_model(), config).eval()
    with torch.no_grad():
        for parameter in tuned.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter))
    short, short_mask = left_pad(ids(1, 4), 6)
    prompt, mask = torch.cat([short, ids(1, 6)]), torch.cat([short_mask, torch.ones(1, 6, dtype=torch.long)])
    context = ids(2, 20)
    expected, expected_mask = prompt, mask
    with torch.no_grad():
        for _ in range(4):
            logits = tuned(input_ids=expected, attention_mask=expected_mask, context_input_ids=context).logits
            expected = torch.cat([expected, logits[:, -1:].argmax(-1)], 1)
            expected_mask = torch.cat([expected_mask, torch.ones(2, 1, dtype=torch.long)], 1)
        generated = tuned.generate(input_ids=prompt, attention_mask=mask, context_input_ids=context, max_new_tokens=4,
                                   do_sample=False)
    assert torch.equal(generated, expected)


def test_peft_prefix_tuning_is_refused_with_what_works_instead():
    """PEFT's prefix tuning passes its virtual tokens as a DynamicCache, which cannot hold the nuggets before them: the
    error spoke of a cache the user never passed; it now names prefix tuning and the PEFT methods that work."""
    from peft import PrefixTuningConfig, get_peft_model

    tuned = get_peft_model(tiny_model(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    prompt, context = ids(2, 6), ids(2, 20)
    message = "prefix tuning is not supported on Dodo; PEFT's prompt tuning and p-tuning are"
    with pytest.raises(ValueError, match=message):
        tuned(input_ids=prompt, context_input_ids=context, labels=prompt)
    with pytest.raises(ValueError, match=message):
        tuned.generate(input_ids=prompt, context_input_ids=context, max_new_tokens=2)


def test_offloaded_soft_prompt_is_loaded_by_its_hook(tmp_path, model):
    """Under accelerate's disk offload, the soft prompt is read by calling its module (its hook loads the weight)."""
    model.save_pretrained(tmp_path / "dodo")
    context, prompt = ids(1, 20), ids(1, 4)
    with torch.no_grad():
        expected = model.generate(prompt, context_input_ids=context, max_new_tokens=4, do_sample=False)
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "dodo", device_map={"model": "cpu", "lm_head": "cpu", "nugget_scorer": "cpu", "soft_prompt": "disk"},
        offload_folder=str(tmp_path / "offload"))
    assert offloaded.soft_prompt.weight.device.type == "meta"
    with torch.no_grad():
        generated = offloaded.generate(prompt, context_input_ids=context, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, expected)


def test_export_peft_adapters_of_an_offloaded_model_writes_the_weights(tmp_path, model):
    """A model loaded with a device_map that offloads holds meta tensors; `save_pretrained` reads them back from the
    offload hooks, and so must `export_peft_adapters` (it raised "Cannot copy out of meta tensor; no data!")."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path / "dodo")
    model.export_peft_adapters(tmp_path / "expected")
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "dodo", offload_folder=str(tmp_path / "offload"),
        device_map={"model": "disk", "lm_head": "cpu", "nugget_scorer": "disk", "soft_prompt": "disk"})
    assert offloaded.model.layers[0].self_attn.q_proj.lora_A["encoder"].weight.device.type == "meta"
    offloaded.export_peft_adapters(tmp_path / "exported")
    for name in ("encoder/adapter_model.safetensors", "decoder/adapter_model.safetensors", "soft_prompt.safetensors"):
        expected, exported = load_file(tmp_path / "expected" / name), load_file(tmp_path / "exported" / name)
        assert expected.keys() == exported.keys() and all(torch.equal(expected[k], exported[k]) for k in expected)
    expected, exported = (torch.load(tmp_path / folder / "scorer.pt") for folder in ("expected", "exported"))
    assert expected.keys() == exported.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(torch.equal(expected[k], exported[k]) for k in expected)


def test_collator_keeps_the_masks_of_features_padded_already():
    """Features padded by the tokenizer (`padding="max_length"`) keep their masks, as `tokenizer.pad` and
    `DataCollatorForSeq2Seq` keep them: their padding is neither attended to nor a training target."""
    features = [
        {"context_input_ids": [1, 5, 6, 0, 0], "context_attention_mask": [1, 1, 1, 0, 0],
         "input_ids": [7, 8, 0], "attention_mask": [1, 1, 0]},
        {"context_input_ids": [1, 9, 9, 9, 9], "input_ids": [7, 8, 9, 4]},  # no masks: every token is real
    ]
    batch = DodoDataCollator(pad_token_id=0)(features)
    assert batch["context_attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[7, 8, -100, -100], [7, 8, 9, 4]]  # the pad id 0 is no target
    autoencoding = DodoDataCollator(pad_token_id=0)([{"context_input_ids": [1, 5, 0], "context_attention_mask": [1, 1, 0]}])
    assert autoencoding["attention_mask"].tolist() == [[1, 1, 0]] and autoencoding["labels"].tolist() == [[1, 5, -100]]
    for bad, message in [
        ({"context_input_ids": [1, 5], "context_attention_mask": [1, 1, 1]}, "`context_attention_mask` must hold one 0"),
        ({"context_input_ids": [1, 5], "input_ids": [3], "attention_mask": [2]}, "`attention_mask` must hold one 0 or 1"),
        ({"context_input_ids": [1, 5], "context_attention_mask": [0, 0]}, "with at least one 1"),
        ({"context_input_ids": [1, 5], "attention_mask": [1, 1]}, "has an `attention_mask` but no `input_ids`"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            DodoDataCollator()([bad])


def test_cache_crop_never_removes_the_soft_prompt_or_the_nugget_slots(model):
    from longreach import DodoCache

    with torch.no_grad():
        cache = DodoCache(model.config)
        model(ids(1, 4), nuggets=model.compress(ids(1, 15)), past_key_values=cache)
    columns = cache.layers[0].get_seq_length()
    cache.crop(-6)  # more than the 4 tokens it holds
    assert cache.seen_tokens == 0 and cache.layers[0].get_seq_length() == columns - 4
    assert cache.decoder_mask.shape[1] == model.config.soft_prompt_length
    DodoCache(model.config).crop(-1)  # an empty cache: nothing to remove


def test_estimate_nugget_threshold_and_summarization_inputs_check_their_arguments(model, tokenizer):
    context = ids(2, 40)
    for ratio in (1.5, 0, -0.5, "0.1", True):
        with pytest.raises(ValueError, match=re.escape(f"`ratio` must be a number in (0, 1] (the share of tokens kept "
                                                       f"as nuggets), got {ratio!r}.")):
            model.estimate_nugget_threshold(context, ratio=ratio)
    assert isinstance(model.estimate_nugget_threshold(context, ratio=1), float)
    for length in (10.5, "10", True):
        with pytest.raises(ValueError, match=re.escape(f"`max_input_length` must be an integer or None, got {length!r}")):
            model.prepare_summarization_inputs(tokenizer, ["w1 w2 w3"], max_input_length=length)


def test_nuggets_of_another_dtype_or_with_inconsistent_fields_are_refused(model):
    import copy

    prompt = ids(2, 4)
    with torch.no_grad():
        nuggets = model.compress(ids(2, 30))
        with pytest.raises(ValueError, match=re.escape("`nuggets.key_values` are torch.float32 but the model computes "
                                                       "in torch.bfloat16")):
            copy.deepcopy(model).to(torch.bfloat16)(prompt, nuggets=nuggets)
        with pytest.raises(ValueError, match=re.escape("`nuggets.scores` must be a [batch, K]")):
            model(prompt, nuggets=DodoNuggets(**{**nuggets, "scores": None}))
        with pytest.raises(ValueError, match=re.escape("`nuggets.mask` must be a [batch, K]")):
            model(prompt, nuggets=DodoNuggets(**{**nuggets, "mask": nuggets.mask[:, :2]}))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_dynamic_int8_quantization_of_the_linears_outside_the_lora_matrices():
    """The README's recipe: every linear but the LoRA matrices (PEFT reads `lora_A.weight.dtype`, which a quantized
    module's `weight` method has not) quantized by `quantize_dynamic`; forward and generate() run, close to float."""
    model = tiny_model().eval()
    input_ids, context = torch.randint(3, 100, (2, 8)), torch.randint(3, 100, (2, 30))
    with torch.no_grad():
        expected = model(input_ids=input_ids, context_input_ids=context).logits
    with pytest.raises(AttributeError, match="'function' object has no attribute 'dtype'"), torch.no_grad():
        everything = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
        everything(input_ids=input_ids, context_input_ids=context)
    linears = {name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and ".lora_" not in name}
    quantized = torch.ao.quantization.quantize_dynamic(model, linears, dtype=torch.qint8)
    assert any(type(module).__name__ == "Linear" and "quantized" in type(module).__module__
               for module in quantized.modules())
    with torch.no_grad():
        logits = quantized(input_ids=input_ids, context_input_ids=context).logits
        generated = quantized.generate(input_ids=input_ids, context_input_ids=context, max_new_tokens=3,
                                       min_new_tokens=3)
    assert generated.shape == (2, 11)
    torch.testing.assert_close(logits, expected, atol=0.5, rtol=0)  # int8 weights: close, not equal
