"""VCC-T5 (longreach/modeling/modeling_vcc_t5.py): configuration, equality with T5 when compression is off, padding,
VIP handling, generation, training, tokenization helpers and Hub-ready saving. Fixture parity: test_convert_vcc_t5.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSeq2SeqLM,
    PreTrainedTokenizerFast,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
)

import longreach  # noqa: F401  (registers the Auto classes)
from longreach import VCCT5Config, VCCT5DataCollator, VCCT5ForConditionalGeneration, VCCT5Model, prepare_vip_inputs
from remote_code_helpers import run_without_longreach

T5_SIZES = dict(vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4,
                decoder_start_token_id=0, dropout_rate=0.0)
VCC_SIZES = dict(num_vanilla_layers=1, segment_length=32, num_vip_slots=8, block_size=4, num_refined_blocks=3)


def tiny_model(**overrides) -> VCCT5ForConditionalGeneration:
    return VCCT5ForConditionalGeneration(VCCT5Config(**{**T5_SIZES, **VCC_SIZES, **overrides})).eval()


def batch(length=150, lengths=(150, 100, 37)):
    """Right-padded rows of different lengths; VIPs: a 5-token query at the start (+ position 50 in row 1)."""
    input_ids = torch.randint(2, 200, (len(lengths), length))
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        attention_mask[row, :n] = 1
    input_ids = input_ids * attention_mask
    vip_mask = torch.zeros_like(input_ids)
    vip_mask[:, :5] = 1
    if len(lengths) > 1 and lengths[1] > 50:
        vip_mask[1, 50] = 1
    return input_ids, attention_mask, vip_mask


# ---------------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------------


def test_presets_and_auto_registration(tmp_path):
    expected = {"base": (12, 4, 768), "large": (24, 6, 1024), "3b": (24, 6, 1024)}
    for name, (layers, vanilla, d_model) in expected.items():
        config = VCCT5Config.from_preset(name)
        assert (config.num_layers, config.num_vanilla_layers, config.num_vcc_layers, config.d_model) == (
            layers, vanilla, layers - vanilla, d_model)
        assert (config.segment_length, config.block_size, config.num_refined_blocks) == (512, 16, 90)
    assert VCCT5Config.from_preset("3b").d_ff == 16384 and VCCT5Config.from_preset("3b").num_heads == 32
    with pytest.raises(ValueError, match="preset"):
        VCCT5Config.from_preset("xl")

    config = VCCT5Config(**T5_SIZES, **VCC_SIZES)
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert type(reloaded) is VCCT5Config and reloaded.to_diff_dict() == config.to_diff_dict()
    assert isinstance(AutoModel.from_config(config), VCCT5Model)
    assert isinstance(AutoModelForSeq2SeqLM.from_config(config), VCCT5ForConditionalGeneration)


def test_config_reads_the_original_field_names(fixtures_dir):
    original = json.loads((fixtures_dir / "vcc" / "hf_ckpt" / "config.json").read_text())
    config = VCCT5Config(**original)
    assert (config.num_vanilla_layers, config.segment_length, config.num_vip_slots, config.block_size,
            config.num_refined_blocks, config.exploration_probability, config.scale_correction) == (1, 128, 16, 8, 8, 0.1, True)
    assert not hasattr(config, "encoder_layers") and not hasattr(config, "num_important_tokens")

    vcc_first = dict(original, encoder_layers=original["encoder_layers"][::-1])
    with pytest.raises(ValueError, match="vanilla layers followed by VCC layers"):
        VCCT5Config(**vcc_first)
    with pytest.raises(ValueError, match="selector_type"):
        VCCT5Config(**dict(original, selector_type="random"))
    with pytest.raises(ValueError, match="encoder_layers"):
        VCCT5Config(**dict(original, num_layers=6))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_vanilla_layers": 4}, "num_vanilla_layers"),
        ({"segment_length": 32, "block_size": 16, "num_vip_slots": 8}, "segment_length"),  # gcd 16 does not divide 8
        ({"exploration_probability": 1.5}, "exploration_probability"),
        ({"block_size": 0}, "block_size"),
        ({"num_vip_slots": 0}, "num_vip_slots"),
        ({"segment_length": 0}, "segment_length"),
        ({"cross_attention_logn_length": 1}, "cross_attention_logn_length"),
    ],
)
def test_config_rejects_settings_that_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        VCCT5Config(**{**T5_SIZES, **VCC_SIZES, **overrides})


def test_logn_scaling_of_the_cross_attention_only_beyond_its_length():
    """`cross_attention_logn_length` (shared with LOCOST's decoder): rows of at most N unmasked tokens give the same
    bits as without it, longer rows are scaled."""
    torch.manual_seed(0)
    plain = tiny_model()
    scaled = tiny_model(cross_attention_logn_length=100)
    scaled.load_state_dict(plain.state_dict())
    input_ids, attention_mask, vip_mask = batch()  # rows of 150, 100 and 37 tokens
    decoder_input_ids = torch.randint(2, 200, (3, 4))
    with torch.no_grad():
        a, b = (m(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, decoder_input_ids=decoder_input_ids).logits
                for m in (plain, scaled))
    assert torch.equal(a[1:], b[1:])
    assert not torch.allclose(a[0], b[0], atol=1e-4)


def test_padded_length_and_compression_sizes():
    config = VCCT5Config(**T5_SIZES, **VCC_SIZES)  # S 32, NI 8, k 4, h 3
    assert config.padded_length(150) == 160  # multiple of 32 with (160 - 8) % 4 == 0
    assert config.padded_length(5) == 32  # at least NI + h*k = 20 tokens, then a whole segment
    assert config.compression_sizes(160) == {"num_blocks": 38, "compressed_length": 3 * 4 + 35 + 8}
    paper = VCCT5Config.from_preset("base", num_vip_slots=48)
    assert paper.compression_sizes(16384) == {"num_blocks": 1021, "compressed_length": 2419}  # spec §3 example
    assert paper.padded_length(16000) == 16384
    with pytest.raises(ValueError, match="more than the 6 blocks"):  # more refined blocks than blocks
        VCCT5Config(**T5_SIZES, **{**VCC_SIZES, "num_refined_blocks": 7}).compression_sizes(32)
    with pytest.raises(ValueError, match="multiple of `segment_length`"):
        config.compression_sizes(150)
    with pytest.raises(ValueError, match="multiple of `block_size`"):
        VCCT5Config(**T5_SIZES, **{**VCC_SIZES, "num_vanilla_layers": 0}).compression_sizes(150)


# ---------------------------------------------------------------------------------------------------------------------
# Compression off = T5
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("feed_forward_proj, tie", [("relu", True), ("gated-gelu", False)])
def test_compression_off_equals_transformers_t5(feed_forward_proj, tie):
    t5_sizes = {**T5_SIZES, "feed_forward_proj": feed_forward_proj}
    reference = T5ForConditionalGeneration(T5Config(**t5_sizes, tie_word_embeddings=tie)).eval()
    model = VCCT5ForConditionalGeneration(
        VCCT5Config(**t5_sizes, tie_word_embeddings=tie, num_vanilla_layers=3, segment_length=None)
    ).eval()
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and not unexpected
    input_ids, attention_mask, _ = batch(length=37, lengths=(37, 20, 5))
    decoder_input_ids = torch.randint(2, 200, (3, 6))
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                             output_hidden_states=True)
        got = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                    output_hidden_states=True)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=0)
        real = attention_mask[..., None].bool()
        assert len(got.encoder_hidden_states) == len(expected.encoder_hidden_states) == 4
        for ours, theirs in zip(got.encoder_hidden_states, expected.encoder_hidden_states):
            torch.testing.assert_close(ours * real, theirs * real, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.encoder_last_hidden_state * real, expected.encoder_last_hidden_state * real,
                                   atol=1e-5, rtol=0)
        assert torch.all(got.encoder_last_hidden_state[~real.expand_as(got.encoder_last_hidden_state)] == 0)
        for kwargs in ({}, {"num_beams": 3}):
            assert torch.equal(
                model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, **kwargs),
                reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, **kwargs),
            )


@pytest.mark.parametrize("own_head", [False, True])
def test_t5_folders_saved_by_transformers_v5_load_as_t5_loads_them(tmp_path, own_head):
    """transformers v5's T5 saves `tie_word_embeddings: true` and the rescaling in `scale_decoder_outputs`: a T5 made
    with `tie_word_embeddings=False` is saved tied, unscaled, with `shared.weight` alone (its head was random in VCC-T5,
    read as untied); one whose checkpoint holds its own `lm_head.weight` keeps it. VCC-T5 loads both as T5 does."""
    from safetensors.torch import load_file, save_file

    t5_sizes = {**T5_SIZES, "feed_forward_proj": "gated-gelu"}
    T5ForConditionalGeneration(T5Config(**t5_sizes, tie_word_embeddings=False)).save_pretrained(tmp_path)
    if own_head:
        weights = load_file(tmp_path / "model.safetensors")
        save_file({**weights, "lm_head.weight": torch.randn_like(weights["shared.weight"])},
                  tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    model = VCCT5ForConditionalGeneration.from_pretrained(tmp_path, num_vanilla_layers=3, segment_length=None).eval()
    assert model.config.scale_decoder_outputs is False
    input_ids, attention_mask, _ = batch(length=37, lengths=(37, 20, 5))
    decoder_input_ids = torch.randint(2, 200, (3, 6))
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        got = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Encoder: internal padding, VIP handling, bad input
# ---------------------------------------------------------------------------------------------------------------------


def test_internal_padding_crops_back_zeroes_padding_and_is_invariant():
    model = tiny_model()
    input_ids, attention_mask, vip_mask = batch()
    with torch.no_grad():
        out = model.encoder(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, output_compression_info=True)
        assert out.last_hidden_state.shape == (3, 150, 32)
        assert out.compression_info.padded_length == 160 and out.compression_info.vip_sort_order.shape == (3, 160)
        assert torch.all(out.last_hidden_state[attention_mask == 0] == 0)
        for row, n in enumerate((150, 100, 37)):  # each row alone (padded internally to 160, 128 and 64)
            alone = model.encoder(input_ids[row : row + 1, :n], vip_mask=vip_mask[row : row + 1, :n])
            torch.testing.assert_close(alone.last_hidden_state[0], out.last_hidden_state[row, :n], atol=1e-5, rtol=0)
        short = model.encoder(input_ids[:1, :3], vip_mask=vip_mask[:1, :3], output_compression_info=True)
        assert short.compression_info.padded_length == 32 and torch.isfinite(short.last_hidden_state).all()


def test_left_padded_rows_equal_rows_alone():
    """The original assumes right padding; we realign other rows internally, so the padding side does not matter."""
    model = tiny_model()
    input_ids, attention_mask, vip_mask = batch()
    lengths = (150, 100, 37)
    left_ids, left_mask, left_vip = (torch.zeros_like(t) for t in (input_ids, attention_mask, vip_mask))
    for row, n in enumerate(lengths):  # the same rows, padded on the left
        left_ids[row, 150 - n:], left_mask[row, 150 - n:], left_vip[row, 150 - n:] = (
            input_ids[row, :n], attention_mask[row, :n], vip_mask[row, :n])
    decoder_input_ids = torch.randint(2, 99, (3, 4))
    with torch.no_grad():
        right = model(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, decoder_input_ids=decoder_input_ids)
        left = model(left_ids, attention_mask=left_mask, vip_mask=left_vip, decoder_input_ids=decoder_input_ids)
        for row, n in enumerate(lengths):
            torch.testing.assert_close(left.encoder_last_hidden_state[row, 150 - n:],
                                       right.encoder_last_hidden_state[row, :n], atol=1e-5, rtol=0)
        assert torch.all(left.encoder_last_hidden_state[left_mask == 0] == 0)
        torch.testing.assert_close(left.logits, right.logits, atol=1e-4, rtol=0)
        generated_left = model.generate(left_ids, attention_mask=left_mask, vip_mask=left_vip, max_new_tokens=5)
        generated_right = model.generate(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, max_new_tokens=5)
    assert torch.equal(generated_left, generated_right)


def test_default_vip_mask_and_rows_without_vip():
    model = tiny_model()
    input_ids, attention_mask, vip_mask = batch()
    first_slots = torch.zeros_like(vip_mask)
    first_slots[:, : model.config.num_vip_slots] = 1
    with torch.no_grad():
        explicit = model.encoder(input_ids, attention_mask=attention_mask, vip_mask=first_slots).last_hidden_state
        default = model.encoder(input_ids, attention_mask=attention_mask).last_hidden_state
        assert torch.equal(default, explicit)
        no_vip = vip_mask.clone()
        no_vip[1] = 0
        mixed = model.encoder(input_ids, attention_mask=attention_mask, vip_mask=no_vip).last_hidden_state
        with_vip = model.encoder(input_ids, attention_mask=attention_mask, vip_mask=vip_mask).last_hidden_state
        torch.testing.assert_close(mixed[1], explicit[1], atol=1e-6, rtol=0)  # the fallback row
        torch.testing.assert_close(mixed[0], with_vip[0], atol=1e-6, rtol=0)  # other rows unchanged
        on_padding = vip_mask.clone()
        on_padding[2, 100] = 1  # beyond row 2's 37 real tokens: ignored
        padded_vip = model.encoder(input_ids, attention_mask=attention_mask, vip_mask=on_padding).last_hidden_state
        torch.testing.assert_close(padded_vip, with_vip, atol=1e-6, rtol=0)


def test_vip_tokens_steer_the_selection():
    model = tiny_model()
    input_ids, attention_mask, vip_mask = batch(length=150, lengths=(150,))
    other = torch.zeros_like(vip_mask)
    other[:, 120:126] = 1
    with torch.no_grad():
        first = model.encoder(input_ids, vip_mask=vip_mask, output_compression_info=True)
        second = model.encoder(input_ids, vip_mask=other, output_compression_info=True)
    assert first.compression_info.vip_sort_order[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert second.compression_info.vip_sort_order[0, :6].tolist() == list(range(120, 126))
    assert any(not torch.equal(a, b) for a, b in zip(first.compression_info.fine_block_indices,
                                                     second.compression_info.fine_block_indices))
    assert not torch.allclose(first.last_hidden_state, second.last_hidden_state)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda ids, mask, vip: (ids, mask, vip[:, :-1]), "vip_mask"),
        (lambda ids, mask, vip: (ids, mask, vip[0]), "vip_mask"),
        (lambda ids, mask, vip: (ids, mask, vip * 2), "vip_mask"),
        (lambda ids, mask, vip: (ids, mask[:, :-3], vip), "attention_mask"),
        (lambda ids, mask, vip: (ids.float(), mask, vip), "input_ids"),
    ],
)
def test_bad_input_raises_value_error(change, message):
    model = tiny_model()
    input_ids, attention_mask, vip_mask = change(*batch())
    with pytest.raises(ValueError, match=message):
        model(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, decoder_input_ids=torch.zeros(3, 1).long())


def test_return_dict_false_gives_tuples():
    model = tiny_model()
    input_ids, attention_mask, vip_mask = batch()
    labels = torch.randint(2, 200, (3, 4))
    with torch.no_grad():
        as_dict = model(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, labels=labels)
        as_tuple = model(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, labels=labels, return_dict=False)
        encoder_tuple = model.encoder(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, return_dict=False)
        from_tuple = model(attention_mask=attention_mask, encoder_outputs=encoder_tuple, labels=labels)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], as_dict.loss) and torch.equal(as_tuple[1], as_dict.logits)
    assert isinstance(encoder_tuple, tuple) and torch.equal(encoder_tuple[0], as_dict.encoder_last_hidden_state)
    assert torch.equal(from_tuple.logits, as_dict.logits)


def test_peft_prompt_tuning_with_a_vip_mask_says_how_to_align_it():
    """PEFT's prompt tuning prepends its virtual tokens to the embeddings and the attention mask, not to `vip_mask`:
    the error named `input_ids`, whose shape the user's mask had. It now says what to prepend, and that mask works."""
    from peft import PromptTuningConfig, get_peft_model

    tuned = get_peft_model(tiny_model(), PromptTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=4)).eval()
    input_ids, attention_mask, vip_mask = batch()
    labels = torch.randint(2, 200, (3, 4))
    with pytest.raises(ValueError, match=r"`inputs_embeds`, got .* \(3, 150\)\. PEFT's prompt tuning .* prepend 4 "):
        tuned(input_ids=input_ids, attention_mask=attention_mask, vip_mask=vip_mask, labels=labels)
    with pytest.raises(ValueError, match="prepend 4 columns to `vip_mask`"):
        tuned.generate(input_ids=input_ids, attention_mask=attention_mask, vip_mask=vip_mask, max_new_tokens=2)
    aligned = torch.cat([torch.ones(3, 4, dtype=torch.long), vip_mask], dim=1)  # the virtual tokens as VIPs
    with torch.no_grad():
        loss = tuned(input_ids=input_ids, attention_mask=attention_mask, vip_mask=aligned, labels=labels).loss
        generated = tuned.generate(input_ids=input_ids, attention_mask=attention_mask, vip_mask=aligned,
                                   max_new_tokens=2)
    assert torch.isfinite(loss) and generated.shape == (3, 3)


# ---------------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------------


def test_generate_carries_vip_mask_with_and_without_cache():
    model = tiny_model()
    input_ids, attention_mask, vip_mask = batch()
    with torch.no_grad():
        greedy = model.generate(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, max_new_tokens=6)
        # The same greedy search by hand, re-running the whole model (no cache) with this vip_mask at every step.
        manual = torch.zeros(3, 1, dtype=torch.long)
        for _ in range(6):
            logits = model(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, decoder_input_ids=manual,
                           use_cache=False).logits
            manual = torch.cat([manual, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(greedy, manual)
        for kwargs in ({}, {"num_beams": 3}, {"num_beams": 2, "num_return_sequences": 2}):
            cached = model.generate(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, max_new_tokens=6,
                                    use_cache=True, **kwargs)
            uncached = model.generate(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, max_new_tokens=6,
                                      use_cache=False, **kwargs)
            assert torch.equal(cached, uncached)
        samples = []
        for _ in range(2):
            torch.manual_seed(3)
            samples.append(model.generate(input_ids, attention_mask=attention_mask, vip_mask=vip_mask,
                                          max_new_tokens=6, do_sample=True, top_k=20))
        assert samples[0].shape == (3, 7) and torch.equal(samples[0], samples[1])


@pytest.mark.parametrize("assistant_kind", ["t5", "vcc"])
def test_assisted_decoding_with_a_vip_mask_and_a_t5_or_vcc_assistant(assistant_kind):
    """A small T5 of the same vocabulary drafts for VCC-T5 as for T5; it reads the whole input itself and is not given
    the `vip_mask` (its generate() refused it: "The following `model_kwargs` are not used by the model: ['vip_mask']").
    A VCC-T5 assistant's encoder still gets it. Assisted greedy decoding equals greedy decoding."""
    model = tiny_model()
    torch.manual_seed(1)
    if assistant_kind == "t5":
        assistant = T5ForConditionalGeneration(T5Config(vocab_size=200, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                        num_heads=2, decoder_start_token_id=0)).eval()
    else:
        assistant = tiny_model(num_layers=2, num_decoder_layers=1, d_model=16, d_ff=32, num_heads=2)
    input_ids, _, vip_mask = batch(lengths=(100,))
    vip_mask[0, 40:60] = 1
    seen = []
    assistant.get_encoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("vip_mask")), with_kwargs=True)
    with torch.no_grad():
        expected = model.generate(input_ids, vip_mask=vip_mask, max_new_tokens=6, min_new_tokens=6)
        assisted = model.generate(input_ids, vip_mask=vip_mask, max_new_tokens=6, min_new_tokens=6,
                                  assistant_model=assistant)
    assert torch.equal(assisted, expected)
    assert len(seen) == 1  # the assistant encodes the input once
    if assistant_kind == "vcc":
        assert torch.equal(seen[0], vip_mask)


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------


def test_seq2seq_trainer_step_with_the_vip_collator(tmp_path, tokenizer):
    from datasets import Dataset

    model = tiny_model(dropout_rate=0.1)
    contexts = ["The committee met on Tuesday to discuss the budget. " * n for n in (9, 3, 6, 1)]
    rows = [prepare_vip_inputs(tokenizer, "Who met?", context) for context in contexts]  # one row each: ragged
    dataset = Dataset.from_dict({
        "input_ids": [row["input_ids"][0].tolist() for row in rows],
        "attention_mask": [row["attention_mask"][0].tolist() for row in rows],
        "vip_mask": [row["vip_mask"][0].tolist() for row in rows],
        "labels": [tokenizer("the committee").input_ids, tokenizer("budget").input_ids] * 2,
    })
    collator = VCCT5DataCollator(tokenizer, model=model, label_pad_token_id=-100)
    collated = collator([dataset[0], dataset[1]])
    assert collated["vip_mask"].shape == collated["input_ids"].shape
    assert torch.equal(collated["vip_mask"][1, : len(dataset[1]["vip_mask"])], torch.tensor(dataset[1]["vip_mask"]))
    assert collated["vip_mask"][1, len(dataset[1]["vip_mask"]) :].sum() == 0
    # a mask must mark its own feature's tokens with 0/1, and be given to every feature or to none
    short = {**dataset[1], "vip_mask": dataset[1]["vip_mask"][:-2]}
    with pytest.raises(ValueError, match="`vip_mask` of feature 1 has .* values but its `input_ids` has"):
        collator([dataset[0], short])
    halves = {**dataset[1], "vip_mask": [0.5] * len(dataset[1]["vip_mask"])}
    with pytest.raises(ValueError, match="`vip_mask` of feature 1 must hold 0 and 1 only"):
        collator([dataset[0], halves])
    without = {key: value for key, value in dataset[1].items() if key != "vip_mask"}
    with pytest.raises(ValueError, match="to every feature or to none"):
        collator([dataset[0], without])
    none_given = [{**dataset[index], "vip_mask": None} for index in (0, 1)]  # a column of Nones: no mask
    plain = [{key: value for key, value in dataset[index].items() if key != "vip_mask"} for index in (0, 1)]
    collated_none, collated_plain = collator(none_given), collator(plain)
    assert "vip_mask" not in collated_none and set(collated_none) == set(collated_plain)
    assert all(torch.equal(collated_none[key], collated_plain[key]) for key in collated_plain)

    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2,
                                    learning_rate=1e-2, use_cpu=True, report_to="none", save_strategy="no",
                                    logging_steps=1, disable_tqdm=True)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [name for name, parameter in model.named_parameters() if not torch.equal(parameter, before[name])]
    assert "encoder.block.2.layer.0.SelfAttention.q.weight" in changed  # a VCC layer learned
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in changed


@pytest.mark.parametrize("length", [32, 33])  # 32 is a valid length already (no internal padding), 33 is padded
def test_trainer_neftune_noise_on_inputs_at_a_valid_length(tmp_path, length):
    """`neftune_noise_alpha` hooks the input embeddings, and its noise divides by the output's length: the encoder
    also embedded an empty padding for inputs already at a valid length, and the step failed ("from is out of bounds
    for float"), where T5 trains."""
    from datasets import Dataset

    assert tiny_model().config.padded_length(32) == 32
    torch.manual_seed(0)
    rows = [{"input_ids": torch.randint(2, 200, (length,)).tolist(), "attention_mask": [1] * length,
             "vip_mask": [1] * 5 + [0] * (length - 5), "labels": torch.randint(2, 200, (4,)).tolist()}
            for _ in range(2)]
    losses = {}
    for alpha in (None, 5.0):
        torch.manual_seed(0)
        model = tiny_model(exploration_probability=0.0)
        args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=1,
                                        use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                                        neftune_noise_alpha=alpha, remove_unused_columns=False)
        trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows))
        losses[alpha] = trainer.train().training_loss
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses.values())
    assert losses[5.0] != losses[None]  # the noise reached the inputs


def _loss_and_gradients(model, inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True], ids=["default", "use_reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant):
    """Under `use_reentrant=True` too (examples/finetune_dodo.py documents it; PEFT's k-bit preparation uses it): the
    encoder's calls of a block for its selection logits and the bias table are not checkpointed."""
    model = tiny_model(exploration_probability=0.0).train()
    if reentrant:  # its first pass runs without autograd, where sdpa picks other CPU kernels (~1e-5)
        model.set_attn_implementation("eager")
    input_ids, attention_mask, vip_mask = batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, vip_mask=vip_mask,
                  labels=torch.randint(2, 200, (3, 5)))
    loss, gradients = _loss_and_gradients(model, inputs)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    assert all(block.gradient_checkpointing for block in model.encoder.block)
    checkpointed_loss, checkpointed = _loss_and_gradients(model, inputs)
    assert torch.equal(loss, checkpointed_loss) and gradients.keys() == checkpointed.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(checkpointed[name], gradient, atol=1e-6, rtol=1e-5, msg=name)


def test_selection_is_trained_through_the_state_scores():
    """The top-h choice is not differentiable; the original's straight-through scores σ = 1 + p - stopgrad(p) are 1
    in value but carry the gradient of the selection probabilities p (spec §4.5c)."""
    model = tiny_model(exploration_probability=0.0).train()
    model.set_attn_implementation("eager")  # sdpa picks different CPU kernels with and without autograd (~1e-5)
    input_ids, attention_mask, vip_mask = batch()
    out = model(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, labels=torch.randint(2, 200, (3, 5)),
                output_compression_info=True)
    scores = out.encoder_compression_info.selection_scores
    gradients = torch.autograd.grad(out.loss, scores)
    assert all(gradient.abs().sum() > 0 for gradient in gradients)
    with torch.no_grad():  # σ = 1 in value: the same forward as the eval model
        evaluated = model.eval()(input_ids, attention_mask=attention_mask, vip_mask=vip_mask,
                                 labels=torch.zeros(3, 1).long())
        assert torch.equal(evaluated.encoder_last_hidden_state, out.encoder_last_hidden_state)


def test_exploration_refines_random_blocks_only_in_training():
    model = tiny_model(exploration_probability=1.0)
    input_ids, attention_mask, vip_mask = batch()
    with torch.no_grad():
        evaluation = [model.encoder(input_ids, attention_mask=attention_mask, vip_mask=vip_mask,
                                    output_compression_info=True).compression_info for _ in range(2)]
        model.train()
        training = model.encoder(input_ids, attention_mask=attention_mask, vip_mask=vip_mask,
                                 output_compression_info=True).compression_info
    assert not any(explored.any() for explored in evaluation[0].explored)
    assert all(torch.equal(a, b) for a, b in zip(evaluation[0].fine_block_indices, evaluation[1].fine_block_indices))
    assert all(explored.all() for explored in training.explored)
    assert any(not torch.equal(a, b) for a, b in zip(training.fine_block_indices, evaluation[0].fine_block_indices))


def test_bfloat16_forward_and_backward():
    model = tiny_model().to(torch.bfloat16).train()
    input_ids, attention_mask, vip_mask = batch()
    out = model(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, labels=torch.randint(2, 200, (3, 5)))
    assert out.logits.dtype == torch.bfloat16 and out.encoder_last_hidden_state.dtype == torch.bfloat16
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(model.encoder.block[2].layer[0].SelfAttention.q.weight.grad.float()).all()
    with torch.no_grad():
        generated = model.eval().generate(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, max_new_tokens=3)
    assert generated.shape == (3, 4)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenization helpers (a tokenizer trained locally)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = [
        "The committee met on Tuesday to discuss the budget for the coming year.",
        "Who wrote the report about the river and the bridge?",
        "summarize the meeting notes in three sentences.",
        "A long document follows, with many sentences about trains, rivers, bridges and budgets.",
    ] * 5
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=180, special_tokens=["<pad>", "</s>", "<unk>"]))
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def test_prepare_vip_inputs_follows_the_original_collators(tokenizer):
    query, contexts = "Who wrote the report?", ["The committee met on Tuesday.", "A long document about trains."]
    inputs = prepare_vip_inputs(tokenizer, query, contexts)
    assert set(inputs) == {"input_ids", "attention_mask", "vip_mask"}
    vip_count = len(tokenizer(query).input_ids)  # the query's tokens + its EOS, as the original counts them
    for row, context in enumerate(contexts):
        expected = tokenizer(query + "\n\n\n" + context).input_ids
        assert inputs["input_ids"][row, : len(expected)].tolist() == expected
        assert inputs["attention_mask"][row].sum() == len(expected)
        assert inputs["vip_mask"][row].tolist() == [1] * vip_count + [0] * (inputs["vip_mask"].shape[1] - vip_count)
    truncated = prepare_vip_inputs(tokenizer, [query, "Who?"], contexts, max_length=12)
    assert truncated["input_ids"].shape[1] == 12 and truncated["input_ids"][0, -1] == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="one query per context"):
        prepare_vip_inputs(tokenizer, ["a", "b", "c"], contexts)
    # a max_length that would cut a row to its query (or into it) leaves no context: refused, not silently emptied
    shortest = prepare_vip_inputs(tokenizer, query, contexts, max_length=vip_count + 1)
    assert shortest["input_ids"].shape[1] == vip_count + 1
    for max_length in (vip_count, vip_count - 2):
        with pytest.raises(ValueError, match=re.escape(f"`max_length`={max_length} leaves no room for the context of "
                                                       f"row 0: its query ('Who wrote the report?') takes {vip_count} "
                                                       "tokens")):
            prepare_vip_inputs(tokenizer, [query, "Who?"], contexts, max_length=max_length)

    model = tiny_model()
    with torch.no_grad():
        assert model.generate(**inputs, max_new_tokens=3).shape == (2, 4)


def test_prepare_summarization_inputs_marks_the_summarize_query(tokenizer):
    model = tiny_model()
    documents = ["The committee met on Tuesday to discuss the budget. " * 6, "A long document about trains."]
    kwargs, dropped = model.prepare_summarization_inputs(tokenizer, documents, max_input_length=40)
    assert set(kwargs) == {"input_ids", "attention_mask", "vip_mask"}
    full_length = len(tokenizer("summarize\n\n\n" + documents[0]).input_ids)
    assert dropped == [full_length - 40, 0] and kwargs["input_ids"].shape[1] == 40
    expected = tokenizer("summarize\n\n\n" + documents[1]).input_ids
    assert kwargs["input_ids"][1, : len(expected)].tolist() == expected
    query_tokens = len(tokenizer("summarize").input_ids)
    with pytest.raises(ValueError, match=f"`max_input_length`={query_tokens} leaves no room"):
        model.prepare_summarization_inputs(tokenizer, documents, max_input_length=query_tokens)
    assert kwargs["vip_mask"].sum(dim=1).tolist() == [len(tokenizer("summarize").input_ids)] * 2
    assert model.prepare_summarization_inputs(tokenizer, documents)[1] == [0, 0]
    with torch.no_grad():
        assert model.generate(**kwargs, max_new_tokens=3).shape == (2, 4)


# ---------------------------------------------------------------------------------------------------------------------
# Saving, Auto classes, remote code
# ---------------------------------------------------------------------------------------------------------------------


def test_saved_folder_loads_with_auto_classes_and_without_longreach(tmp_path, isolated_hf_env):
    model = tiny_model()
    input_ids, attention_mask, vip_mask = batch()
    decoder_input_ids = torch.randint(2, 200, (3, 4))
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, vip_mask=vip_mask,
                       decoder_input_ids=decoder_input_ids).logits
    folder = tmp_path / "vcc"
    model.save_pretrained(folder)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    assert type(reloaded) is VCCT5ForConditionalGeneration
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids, attention_mask=attention_mask, vip_mask=vip_mask,
                                    decoder_input_ids=decoder_input_ids).logits, logits)
    assert type(AutoModel.from_pretrained(folder)) is VCCT5Model
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask, "vip_mask": vip_mask,
                "decoder_input_ids": decoder_input_ids}, tmp_path / "inputs.pt")
    result = run_without_longreach(
        f"""
        import json, torch
        from transformers import AutoModelForSeq2SeqLM
        model = AutoModelForSeq2SeqLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        with torch.no_grad():
            logits = model(**inputs).logits
            generated = model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                       vip_mask=inputs["vip_mask"], max_new_tokens=4)
        torch.save(logits, {str(tmp_path / "remote_logits.pt")!r})
        print(json.dumps({{"class": type(model).__name__, "module": type(model).__module__,
                          "generated": generated.tolist()}}))
        """,
        tmp_path,
    )
    assert result["class"] == "VCCT5ForConditionalGeneration" and "longreach" not in result["module"]
    assert torch.equal(torch.load(tmp_path / "remote_logits.pt"), logits)
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, vip_mask=vip_mask, max_new_tokens=4)
    assert result["generated"] == expected.tolist()


def test_generate_returns_the_encoders_compression_info():
    """`generate(output_compression_info=True, return_dict_in_generate=True)` returns the encoder's compression info (it
    was dropped); without `return_dict_in_generate` there is nowhere to put it, and that is said."""
    model = tiny_model()
    input_ids, attention_mask, vip_mask = batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, vip_mask=vip_mask)
    with torch.no_grad():
        expected = model.encoder(**inputs, output_compression_info=True).compression_info
        for num_beams in (1, 2):
            out = model.generate(**inputs, max_new_tokens=3, num_beams=num_beams, output_compression_info=True,
                                 return_dict_in_generate=True)
            info = out.encoder_compression_info
            assert info.padded_length == expected.padded_length
            assert torch.equal(info.vip_sort_order, expected.vip_sort_order)
            for got, want in zip(info.fine_block_indices, expected.fine_block_indices, strict=True):
                assert torch.equal(got, want)
            assert torch.equal(out.sequences, model.generate(**inputs, max_new_tokens=3, num_beams=num_beams))
        encoder_outputs = model.encoder(**inputs, output_compression_info=True)
        out = model.generate(encoder_outputs=encoder_outputs, attention_mask=attention_mask, max_new_tokens=3,
                             output_compression_info=True, return_dict_in_generate=True)
        assert out.encoder_compression_info is encoder_outputs.compression_info
        with pytest.raises(ValueError, match="return_dict_in_generate"):
            model.generate(**inputs, max_new_tokens=3, output_compression_info=True)
