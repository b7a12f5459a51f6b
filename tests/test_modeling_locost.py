"""LOCOST: configuration, model behaviour, generation, training, dtypes, long inputs, Hub-ready saving, errors."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, Seq2SeqTrainer, Seq2SeqTrainingArguments

import longreach
from longreach import LocostConfig, LocostForConditionalGeneration, LocostModel
from longreach.modeling import ssm
from longreach.modeling.ssm import BidirectionalS4DConvolution
from remote_code_helpers import run_without_longreach
from tokenizer_helpers import word_level_tokenizer


def tiny_config(**overrides) -> LocostConfig:
    values = dict(vocab_size=99, d_model=32, d_state=8, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3,
                  num_heads=4, dropout_rate=0.0)
    values.update(overrides)
    return LocostConfig(**values)


@pytest.fixture
def model():
    return LocostForConditionalGeneration(tiny_config()).eval()


def padded_batch(length: int = 37):
    input_ids = torch.randint(2, 99, (3, length))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 20:] = 0
    attention_mask[2, 5:] = 0
    input_ids = input_ids * attention_mask  # pad id 0
    return input_ids, attention_mask


# --------------------------------------------------------------------------------------------------------------------
# Configuration and registration
# --------------------------------------------------------------------------------------------------------------------


def test_defaults_are_the_released_model():
    config = LocostConfig()
    assert (config.d_model, config.d_state, config.d_ff, config.num_layers, config.num_decoder_layers) == (768, 512, 2048, 12, 12)
    assert (config.num_heads, config.vocab_size, config.num_ssm_heads) == (12, 32100, 1)
    assert config.num_hidden_layers == config.num_decoder_layers  # generate() sizes the decoder cache from it
    assert config.tie_word_embeddings and config.use_cache and config.is_encoder_decoder
    assert (config.pad_token_id, config.eos_token_id, config.decoder_start_token_id) == (0, 1, 0)


def test_released_size_parameter_count():
    """The released model has 234,724,224 unique parameters (spec §2); build it on the meta device."""
    with torch.device("meta"):
        model = LocostForConditionalGeneration(LocostConfig())
    unique = {id(p): p.numel() for p in model.parameters()}
    assert sum(unique.values()) == 234_724_224


def test_auto_classes_registered():
    config = tiny_config()
    assert isinstance(AutoConfig.for_model("locost", d_model=32, d_state=8), LocostConfig)
    assert type(AutoModel.from_config(config)) is LocostModel
    assert type(AutoModelForSeq2SeqLM.from_config(config)) is LocostForConditionalGeneration


def test_config_round_trip(tmp_path):
    config = tiny_config(gating=False, bidirectional=False)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, LocostConfig)
    without_path = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert without_path(loaded) == without_path(config)


# --------------------------------------------------------------------------------------------------------------------
# The SSM convolution
# --------------------------------------------------------------------------------------------------------------------


def direct_bidirectional_conv(conv: BidirectionalS4DConvolution, x: torch.Tensor) -> torch.Tensor:
    """y[t] = Σ_{s≤t} K0[t−s] x[s] + Σ_{s≥t} K1[s−t] x[s] + D x[t], in float64, straight from the definitions."""
    dtA, C_hat = (t.to(torch.complex128) for t in conv.discretized())
    length = x.shape[1]
    lags = torch.arange(length, dtype=torch.float64)
    K = 2 * torch.einsum("chn,hnl->chl", C_hat, torch.exp(dtA[..., None] * lags)).real  # [2, H, L]
    x = x.double()
    y = x * conv.D.double()
    for t in range(length):
        for s in range(length):
            if s <= t:
                y[:, t] += K[0, :, t - s] * x[:, s]
            if s >= t:
                y[:, t] += K[1, :, s - t] * x[:, s]
    return y


@pytest.mark.parametrize("length", [1, 2, 7, 16, 33])
def test_fft_convolution_equals_direct_sum(length):
    conv = BidirectionalS4DConvolution(channels=6, d_state=8, kernel_chunk_size=5)
    x = torch.randn(2, length, 6)
    torch.testing.assert_close(conv(x).double(), direct_bidirectional_conv(conv, x), atol=1e-5, rtol=1e-5)


def test_kernel_chunking_does_not_change_the_kernel():
    conv = BidirectionalS4DConvolution(channels=4, d_state=16, kernel_chunk_size=1000)
    reference = conv.kernel(300)
    for chunk in (1, 7, 64, 299, 300):
        conv.kernel_chunk_size = chunk
        torch.testing.assert_close(conv.kernel(300), reference, atol=1e-6, rtol=1e-5)


def test_kernel_memory_is_chunked(monkeypatch):
    """The exponentials are taken over O(h·N/2·chunk) values (h: a block of channels), never O(H·N/2·L)."""
    channels, modes, length, chunk = 40, 32, 4096, 64
    conv = BidirectionalS4DConvolution(channels=channels, d_state=2 * modes, kernel_chunk_size=chunk)
    sizes = []
    real_exp = torch.exp

    def recording_exp(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real_exp(tensor, *args, **kwargs)

    monkeypatch.setattr(torch, "exp", recording_exp)
    conv.kernel(length)
    block = ssm.KERNEL_CHANNEL_BLOCK
    assert block < channels and max(sizes) <= block * modes * max(chunk, math.ceil(length / chunk))
    assert max(sizes) < channels * modes * length // 64


@pytest.mark.parametrize("block", [1, 3, 16, 1000])
def test_kernel_channel_blocks_do_not_change_the_kernel(monkeypatch, block):
    conv = BidirectionalS4DConvolution(channels=20, d_state=16)
    reference = conv.kernel(129)
    monkeypatch.setattr(ssm, "KERNEL_CHANNEL_BLOCK", block)
    torch.testing.assert_close(conv.kernel(129), reference, atol=0, rtol=0)


def test_unidirectional_and_ungated_variants_run():
    for overrides in ({"bidirectional": False}, {"gating": False}):
        model = LocostForConditionalGeneration(tiny_config(**overrides)).eval()
        names = set(model.state_dict())
        assert ("encoder.block.0.layer.0.ssm.q_proj.weight" in names) == model.config.gating
        assert model.encoder.block[0].layer[0].ssm.conv.C.shape[0] == (2 if model.config.bidirectional else 1)
        input_ids, attention_mask = padded_batch()
        out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids[:, :4])
        assert torch.isfinite(out.logits).all()


def test_causal_ssm_ignores_the_future():
    model = LocostForConditionalGeneration(tiny_config(bidirectional=False)).eval()
    input_ids = torch.randint(2, 99, (1, 30))
    changed = input_ids.clone()
    changed[0, 20:] = torch.randint(2, 99, (10,))
    with torch.no_grad():
        a = model.get_encoder()(input_ids).last_hidden_state
        b = model.get_encoder()(changed).last_hidden_state
    torch.testing.assert_close(a[:, :20], b[:, :20], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# Padding and batching
# --------------------------------------------------------------------------------------------------------------------


def test_row_alone_equals_row_in_right_padded_batch(model):
    input_ids, attention_mask = padded_batch()
    decoder_input_ids = torch.randint(2, 99, (3, 5))
    with torch.no_grad():
        batch = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
        for row, length in ((1, 20), (2, 5)):
            alone = model(input_ids[row:row + 1, :length], decoder_input_ids=decoder_input_ids[row:row + 1])
            # The contract: real encoder positions agree to 1e-5 (only the FFT size differs).
            torch.testing.assert_close(batch.encoder_last_hidden_state[row, :length], alone.encoder_last_hidden_state[0], atol=1e-5, rtol=0)
            # The random decoder amplifies those ~1e-6 encoder differences (and batch-size-dependent matmul rounding,
            # which alone gives ~1e-6 on these logits) by up to ~100x, so logits are compared at 1e-4 of their scale.
            scale = alone.logits.abs().max().item()
            torch.testing.assert_close(batch.logits[row], alone.logits[0], atol=1e-4 * scale, rtol=0)


def test_left_padding_gives_the_same_encoding(model):
    input_ids = torch.randint(2, 99, (1, 20))
    left_padded = torch.cat([torch.zeros(1, 9, dtype=torch.long), input_ids], dim=1)
    mask = torch.cat([torch.zeros(1, 9, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = model.get_encoder()(input_ids).last_hidden_state
        padded = model.get_encoder()(left_padded, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(padded[:, 9:], alone, atol=1e-5, rtol=0)


def test_hidden_states_follow_t5_convention(model):
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        out = model.get_encoder()(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_layers + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    assert torch.equal(out.hidden_states[0], model.shared(input_ids))


# --------------------------------------------------------------------------------------------------------------------
# Log-length scaling of the cross-attention (config.cross_attention_logn_length)
# --------------------------------------------------------------------------------------------------------------------


def logn_pair(length: int):
    """The tiny model with and without `cross_attention_logn_length=length`, same weights."""
    torch.manual_seed(0)
    plain = LocostForConditionalGeneration(tiny_config()).eval()
    scaled = LocostForConditionalGeneration(tiny_config(cross_attention_logn_length=length)).eval()
    scaled.load_state_dict(plain.state_dict())
    return plain, scaled


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_logn_scaling_leaves_inputs_up_to_its_length_unchanged(implementation):
    """Up to N encoder tokens the factor is 1: the same bits (so training on inputs of at most N tokens is unchanged);
    a batch row with fewer unmasked tokens is not scaled even when the padded batch is longer than N."""
    plain, scaled = logn_pair(20)
    for m in (plain, scaled):
        m.config._attn_implementation = implementation
    input_ids, attention_mask = padded_batch(37)  # rows of 37, 20 and 5 real tokens
    decoder_input_ids = torch.randint(2, 99, (3, 6))
    with torch.no_grad():
        a = plain(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        b = scaled(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    assert torch.equal(a[1:], b[1:])
    assert not torch.allclose(a[0], b[0], atol=1e-4)  # 37 > 20 tokens: scaled


def test_logn_scaling_multiplies_the_cross_attention_logits_by_log_n_over_log_N():
    """softmax(f·s) is softmax(s)^f renormalised: the first decoder block's cross-attention weights of the scaled
    model, from the unscaled model's, with f = ln 37 / ln 20 for the row of 37 tokens and 1 for the others."""
    plain, scaled = logn_pair(20)
    for m in (plain, scaled):
        m.config._attn_implementation = "eager"
    input_ids, attention_mask = padded_batch(37)
    decoder_input_ids = torch.randint(2, 99, (3, 4))
    with torch.no_grad():
        a = plain(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
        b = scaled(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
    weights, scaled_weights = a.cross_attentions[0].double(), b.cross_attentions[0].double()
    factor = torch.tensor([math.log(37) / math.log(20), 1.0, 1.0], dtype=torch.float64).view(3, 1, 1, 1)
    expected = weights.pow(factor)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(scaled_weights, expected, atol=1e-5, rtol=0)
    assert (scaled_weights[0].max(-1).values >= weights[0].max(-1).values - 1e-6).all()  # sharper, never flatter


def test_logn_scaling_is_per_row_and_kept_by_generate_and_the_cache():
    """A long row in a padded batch equals the row alone; the scale is applied at every decoding step, with or
    without the cache; sdpa and eager agree."""
    _, scaled = logn_pair(8)
    input_ids, attention_mask = padded_batch(37)  # rows of 37, 20 and 5 tokens; N = 8
    decoder_input_ids = torch.randint(2, 99, (3, 5))
    with torch.no_grad():
        batch = scaled(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        alone = scaled(input_ids[1:2, :20], decoder_input_ids=decoder_input_ids[1:2]).logits
        scale = alone.abs().max().item()
        torch.testing.assert_close(batch[1], alone[0], atol=1e-4 * scale, rtol=0)
        cached = scaled.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, num_beams=2)
        uncached = scaled.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, num_beams=2,
                                   use_cache=False)
        assert torch.equal(cached, uncached)
        scaled.config._attn_implementation = "eager"
        eager = scaled(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(eager, batch, atol=1e-5, rtol=1e-5)


def test_logn_scale_is_exactly_one_up_to_its_length():
    """n <= N gives exactly 1 (in float32, ln N / ln N is not always 1: N = 7, 47, 49, 402... would give 1 + 1 ulp)."""
    from longreach.modeling.t5_blocks import logn_attention_scale

    for length in range(2, 2000):
        mask = torch.zeros(3, length + 1)
        for row, n in enumerate((1, length, length + 1)):
            mask[row, :n] = 1
        scale = logn_attention_scale(mask, length + 1, length, "cpu").flatten()
        assert scale[0] == 1.0 and scale[1] == 1.0 and scale[2] > 1.0, length
    assert logn_attention_scale(None, 50, 7, "cpu").item() == pytest.approx(math.log(50) / math.log(7))


def test_logn_length_round_trips_and_bad_values_are_refused(tmp_path):
    config = tiny_config(cross_attention_logn_length=128)
    config.save_pretrained(tmp_path)
    assert LocostConfig.from_pretrained(tmp_path).cross_attention_logn_length == 128
    assert tiny_config().cross_attention_logn_length is None
    for value in (1, 0, 12.5, True, "128"):
        with pytest.raises(ValueError, match=r"`cross_attention_logn_length` must be None or an integer >= 2.*got"):
            tiny_config(cross_attention_logn_length=value)


# --------------------------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generate_kwargs", [{}, {"num_beams": 3}, {"num_beams": 2, "num_return_sequences": 2}])
def test_generate_with_cache_equals_without(model, generate_kwargs):
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        cached = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, **generate_kwargs)
        uncached = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, use_cache=False, **generate_kwargs)
    assert torch.equal(cached, uncached)


def test_generate_uses_encoder_decoder_cache(model):
    from transformers import EncoderDecoderCache

    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, EncoderDecoderCache)
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1


def test_sampling_is_reproducible_and_valid(model):
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        torch.manual_seed(3)
        first = model.generate(input_ids, attention_mask=attention_mask, do_sample=True, top_k=10, max_new_tokens=6)
        torch.manual_seed(3)
        second = model.generate(input_ids, attention_mask=attention_mask, do_sample=True, top_k=10, max_new_tokens=6)
    assert torch.equal(first, second)
    assert first.shape[0] == 3 and (first[:, 0] == model.config.decoder_start_token_id).all()


def test_greedy_generation_equals_manual_argmax_loop(model):
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        generated = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, eos_token_id=None,
                                   pad_token_id=0)
        encoder_outputs = model.get_encoder()(input_ids, attention_mask=attention_mask)
        decoded = torch.zeros(3, 1, dtype=torch.long)
        for _ in range(6):
            logits = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask, decoder_input_ids=decoded,
                           use_cache=False).logits
            decoded = torch.cat([decoded, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, decoded)


def test_precomputed_encoder_outputs_are_reusable(model):
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids, attention_mask=attention_mask)
        direct = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, num_beams=2)
        first = model.generate(encoder_outputs=copy.deepcopy(encoder_outputs), attention_mask=attention_mask,
                               max_new_tokens=5, num_beams=2)
        again = model.generate(encoder_outputs=copy.deepcopy(encoder_outputs), attention_mask=attention_mask,
                               max_new_tokens=5, num_beams=2)
        tuple_form = model(encoder_outputs=(encoder_outputs.last_hidden_state,), attention_mask=attention_mask,
                           decoder_input_ids=direct[:, :3]).logits
        object_form = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                            decoder_input_ids=direct[:, :3]).logits
    assert torch.equal(direct, first) and torch.equal(first, again)
    assert torch.equal(tuple_form, object_form)


def test_return_dict_false_gives_tuples(model):
    input_ids, attention_mask = padded_batch()
    labels = torch.randint(2, 99, (3, 4))
    with torch.no_grad():
        as_dict = model(input_ids, attention_mask=attention_mask, labels=labels)
        as_tuple = model(input_ids, attention_mask=attention_mask, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple)
    assert torch.equal(as_tuple[0], as_dict.loss) and torch.equal(as_tuple[1], as_dict.logits)


def test_base_model_returns_decoder_states():
    model = LocostModel(tiny_config()).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids[:, :4])
    assert out.last_hidden_state.shape == (3, 4, 32)
    assert out.encoder_last_hidden_state.shape == (3, 37, 32)


# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


def test_loss_from_labels_and_shift_right(model):
    input_ids, attention_mask = padded_batch()
    labels = torch.randint(2, 99, (3, 6))
    labels[1, 4:] = -100
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    assert (decoder_input_ids[:, 0] == 0).all() and (decoder_input_ids >= 0).all()
    assert torch.equal(decoder_input_ids[:, 1:], labels[:, :-1].clamp(min=0))
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, labels=labels)
        logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 99), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


def test_backward_reaches_every_parameter_including_the_ssm():
    model = LocostForConditionalGeneration(tiny_config(dropout_rate=0.1)).train()
    input_ids, attention_mask = padded_batch()
    labels = torch.randint(2, 99, (3, 6))
    model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    no_grad = [name for name, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert no_grad == []
    conv = model.encoder.block[0].layer[0].ssm.conv
    assert all(p.grad.abs().sum() > 0 for p in (conv.C, conv.B, conv.inv_A_real, conv.A_imag, conv.log_dt, conv.D))


def test_dropout_is_active_in_training_only():
    model = LocostForConditionalGeneration(tiny_config(dropout_rate=0.3))
    input_ids, attention_mask = padded_batch()
    decoder_input_ids = torch.randint(2, 99, (3, 4))
    model.train()
    a = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    b = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    assert not torch.equal(a, b)
    model.eval()
    with torch.no_grad():
        c = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        d = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    assert torch.equal(c, d)


def test_gradient_checkpointing_gives_identical_gradients():
    model = LocostForConditionalGeneration(tiny_config()).train()
    input_ids, attention_mask = padded_batch()
    labels = torch.randint(2, 99, (3, 6))

    def gradients():
        model.zero_grad()
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_plain, grads_plain = gradients()
    model.activation_checkpointing_enable()
    assert all(block.gradient_checkpointing for block in model.encoder.block)
    loss_ckpt, grads_ckpt = gradients()
    assert torch.equal(loss_plain, loss_ckpt)
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_the_ssm_in_float32(model, dtype):
    input_ids, attention_mask = padded_batch()
    decoder_input_ids = torch.randint(2, 99, (3, 4))
    with torch.no_grad():
        reference = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        half = copy.deepcopy(model).to(dtype)
        conv = half.encoder.block[0].layer[0].ssm.conv
        assert {p.dtype for p in conv.parameters()} == {torch.float32}
        assert half.shared.weight.dtype == dtype and half.encoder.block[0].layer[0].ssm.k_proj.weight.dtype == dtype
        logits = half(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        generated = half.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    relative = (logits.float() - reference).norm() / reference.norm()
    assert relative < 0.1, f"{dtype} logits deviate by {relative:.3f} (relative) from float32"
    assert generated.shape == (3, 5)


def test_half_precision_training_step():
    model = LocostForConditionalGeneration(tiny_config()).to(torch.bfloat16).train()
    input_ids, attention_mask = padded_batch()
    loss = model(input_ids, attention_mask=attention_mask, labels=torch.randint(2, 99, (3, 5))).loss
    loss.backward()
    conv = model.encoder.block[1].layer[0].ssm.conv
    assert torch.isfinite(loss) and conv.C.grad.dtype == torch.float32 and torch.isfinite(conv.C.grad).all()


def test_loading_in_bfloat16_keeps_the_ssm_in_float32(tmp_path, model):
    model.save_pretrained(tmp_path)
    loaded = LocostForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.encoder.block[0].layer[0].ssm.conv.C.dtype == torch.float32
    assert loaded.shared.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.encoder.block[0].layer[0].ssm.conv.C, model.encoder.block[0].layer[0].ssm.conv.C,
                               atol=0, rtol=0)


def test_seq2seq_trainer_step(tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq

    model = LocostForConditionalGeneration(tiny_config())
    rows = {"input_ids": [list(range(2, 30)), list(range(5, 17))], "labels": [[5, 6, 7, 1], [8, 9, 1]]}
    dataset = Dataset.from_dict(rows)

    collator = DataCollatorForSeq2Seq(word_level_tokenizer(), model=model, label_pad_token_id=-100)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2,
                                    learning_rate=1e-2, use_cpu=True, report_to="none", save_strategy="no")
    before = model.encoder.block[0].layer[0].ssm.conv.C.detach().clone()
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    result = trainer.train()
    assert math.isfinite(result.training_loss)
    assert not torch.equal(before, model.encoder.block[0].layer[0].ssm.conv.C.detach())
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "modeling_locost.py").is_file() and (tmp_path / "saved" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------------------------------
# Hub-ready saving
# --------------------------------------------------------------------------------------------------------------------


def test_saved_folder_is_hub_ready(tmp_path, model):
    model.save_pretrained(tmp_path / "ckpt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "configuration_locost.py",
            "modeling_locost.py", "ssm.py", "ssm_cpu_kernel.py", "t5_blocks.py", "remote_code.py", "input_checks.py"} <= files
    assert not any(name.endswith(".bin") for name in files)
    config = (tmp_path / "ckpt" / "config.json").read_text()
    for entry in ('"AutoConfig": "configuration_locost.LocostConfig"', '"AutoModel": "modeling_locost.LocostModel"',
                  '"AutoModelForSeq2SeqLM": "modeling_locost.LocostForConditionalGeneration"'):
        assert entry in config
    for code_file in (tmp_path / "ckpt").glob("*.py"):
        imports = re.findall(r"^\s*(?:from|import)\s+(\S+)", code_file.read_text(), flags=re.M)
        assert not [name for name in imports if name.startswith("..") or name.split(".")[0] == "longreach"]


def test_hub_folder_loads_in_a_process_without_longreach(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    input_ids, attention_mask = padded_batch()
    decoder_input_ids = torch.randint(2, 99, (3, 5))
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids},
               tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        expected_ids = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, num_beams=2)
    result = run_without_longreach(
        f"""
        import json, torch
        from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM
        folder = {str(folder)!r}
        inputs = torch.load({str(tmp_path / "inputs.pt")!r}, weights_only=True)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        with torch.no_grad():
            logits = model(**inputs).logits
            ids = model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5, num_beams=2)
        torch.save({{"logits": logits, "ids": ids}}, "outputs.pt")
        print(json.dumps({{"model": type(model).__module__, "base": type(base).__name__, "config": type(config).__name__}}))
        """,
        tmp_path,
    )
    assert result["model"].startswith("transformers_modules.")
    assert (result["base"], result["config"]) == ("LocostModel", "LocostConfig")
    outputs = torch.load(tmp_path / "outputs.pt", weights_only=True)
    assert torch.equal(outputs["logits"], expected)
    assert torch.equal(outputs["ids"], expected_ids)


# --------------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------------


def test_mismatched_mask_shape_is_refused(model):
    with pytest.raises(ValueError, match=r"attention_mask.*\(2, 10\).*\(2, 9\)"):
        model(torch.ones(2, 10, dtype=torch.long), attention_mask=torch.ones(2, 9), decoder_input_ids=torch.zeros(2, 1, dtype=torch.long))


def test_float_ids_are_refused(model):
    with pytest.raises(ValueError, match="input_ids.*integer token ids.*float32"):
        model(torch.ones(2, 10), decoder_input_ids=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="decoder_input_ids.*integer"):
        model(torch.ones(2, 10, dtype=torch.long), decoder_input_ids=torch.zeros(2, 1))


def test_missing_decoder_inputs_and_labels_is_refused(model):
    with pytest.raises(ValueError, match="decoder_input_ids.*labels"):
        model(torch.ones(2, 10, dtype=torch.long))


def test_empty_sequence_is_refused(model):
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.ones(2, 0, dtype=torch.long), decoder_input_ids=torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.parametrize("field,value", [("d_state", 7), ("d_state", 0), ("num_ssm_heads", 8), ("d_model", 0)])
def test_unrunnable_config_is_refused(field, value):
    with pytest.raises(ValueError, match=f"`{field}`.*{value}"):
        tiny_config(**{field: value})


def test_a_training_step_and_generation_inputs_run_on_the_meta_device():
    """On the meta device (shapes, no data: tracing a model's operators or shapes, `benchmarks/count_ops.py`) the
    input checks skip their reads of values, and a training step runs with the shapes of a real one."""
    model = LocostForConditionalGeneration(tiny_config(dropout_rate=0.1)).train().to("meta")
    input_ids, attention_mask = padded_batch()
    labels = torch.randint(2, 99, (3, 6))
    output = model(input_ids=input_ids.to("meta"), attention_mask=attention_mask.to("meta"), labels=labels.to("meta"))
    assert output.logits.shape == (3, 6, 99) and output.logits.device.type == "meta"
    output.loss.backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters() if p.requires_grad)
    # the value checks still run on real tensors
    with pytest.raises(ValueError, match="input_ids"):
        LocostForConditionalGeneration(tiny_config())(input_ids=torch.tensor([[5, 120]]), labels=labels[:1])
