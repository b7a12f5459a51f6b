"""LOCOST and VCC-T5 where transformers' own code reaches into a T5-like model: the encoder and decoder accessors
(`get_encoder(modality=...)`, transformers' export helpers) and the decoder stack called on its own with T5's stack
arguments (`cache=`, `return_dict=`; transformers' ExecuTorch decoder wrapper), each compared with T5 built from the
same tiny sizes."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import pad as nn_pad
from test_modeling_vcc_t5 import tiny_model as tiny_vcc
from transformers import T5Config, T5ForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from workflow_helpers import tiny_locost

import longreach  # noqa: F401  (Auto classes)
from longreach.modeling.input_checks import cache_of

KINDS = ["locost", "vcc"]


def tiny(kind: str):
    torch.manual_seed(0)
    return tiny_locost() if kind == "locost" else tiny_vcc()


def inputs(model, batch: int = 2, length: int = 40) -> dict:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, -5:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("kind", KINDS)
def test_get_encoder_takes_the_modality_transformers_asks_for(kind):
    """transformers' exporters ask every model for its image/audio encoders (`get_encoder(modality=...)`): ours
    raised a TypeError there, so `decompose_for_generation` failed where T5's works."""
    from transformers.exporters.utils import decompose_for_generation, is_multimodal

    model = tiny(kind)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                             num_heads=4)).eval()
    assert model.get_encoder() is model.encoder
    for modality in ("image", "audio"):
        assert t5.get_encoder(modality=modality) is t5  # transformers' answer for "no such encoder"
        assert model.get_encoder(modality=modality) is model
    assert is_multimodal(model) is False
    stages = decompose_for_generation(model, inputs(model))
    assert sorted(stages) == ["decode", "prefill"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_decoder_called_alone_takes_t5s_stack_arguments(kind):
    """`model.get_decoder()(..., cache=..., return_dict=...)` as T5's decoder stack takes them (the cache's name since
    transformers 5.24): a TypeError before. `use_cache` left out follows the config, as T5's stack."""
    model = tiny(kind)
    batch = inputs(model)
    decoder_input_ids = torch.tensor([[0, 5, 6], [0, 7, 8]])
    with torch.no_grad():
        encoded = model.get_encoder()(**batch).last_hidden_state
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        output = model.get_decoder()(input_ids=decoder_input_ids, encoder_hidden_states=encoded,
                                     encoder_attention_mask=batch["attention_mask"], cache=cache, use_cache=True,
                                     return_dict=False)
        assert isinstance(output, tuple) and cache.get_seq_length() == 3
        expected = model(**batch, decoder_input_ids=decoder_input_ids, output_hidden_states=True)
        torch.testing.assert_close(output[0], expected.decoder_hidden_states[-1], rtol=0, atol=0)
        # the old name still works, and `use_cache` comes from the config when not given
        old_name = EncoderDecoderCache(DynamicCache(), DynamicCache())
        again = model.get_decoder()(input_ids=decoder_input_ids, encoder_hidden_states=encoded,
                                    encoder_attention_mask=batch["attention_mask"], past_key_values=old_name)
        # (the output's field is `cache` from transformers 5.24 on, `past_key_values` before)
        assert cache_of(again) is old_name and old_name.get_seq_length() == 3
        torch.testing.assert_close(again.last_hidden_state, output[0], rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_the_decoder_exports_with_transformers_executorch_wrapper_and_decodes_as_generate(kind):
    """transformers' `Seq2SeqLMDecoderExportableModuleWithStaticCache` calls the decoder with `cache=`; exported with
    `torch.export` (strict), its greedy steps give `generate()`'s tokens."""
    from transformers.integrations.executorch import Seq2SeqLMDecoderExportableModuleWithStaticCache

    model = tiny(kind)
    input_ids = inputs(model, batch=1)["input_ids"]
    wrapper = Seq2SeqLMDecoderExportableModuleWithStaticCache(model, max_static_cache_length=8, batch_size=1).eval()
    with torch.no_grad():
        exported = torch.export.export(
            wrapper, (torch.tensor([[0]]), torch.zeros(1, 10, model.config.d_model), torch.tensor([0])),
            dynamic_shapes={"decoder_input_ids": None, "encoder_hidden_states": {1: torch.export.Dim("length", max=64)},
                            "cache_position": None},
            strict=True,
        ).module()
        encoded = model.get_encoder()(input_ids=input_ids).last_hidden_state
        tokens = [model.config.decoder_start_token_id]
        for step in range(4):
            logits = exported(torch.tensor([[tokens[-1]]]), encoded, torch.tensor([step]))
            tokens.append(int(logits[0, -1].argmax()))
        expected = model.generate(input_ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert tokens == expected[0].tolist()


def test_locost_exports_with_a_dynamic_encoder_length_through_transformers_seq2seq_exporter():
    """transformers' `Seq2SeqLMExportableModule(model).export()` (T5's ExecuTorch recipe: the encoder exported with a
    dynamic length up to 4096, strict) failed for LOCOST with "Constraints violated (encoder_seq_length)": the SSM
    kernel's chunk sizes (`_lag_chunks`, √(2L)), its doublings, the FFT blocks and the long-input pieces fixed the
    length to the example's. Its greedy tokens are `generate()`'s at lengths on both sides of a kernel chunk."""
    from transformers.integrations.executorch import Seq2SeqLMExportableModule

    model = tiny_locost(seed=13)
    exporter = Seq2SeqLMExportableModule(model, batch_size=1, max_cache_length=8).export()
    encoder = exporter.exported_encoder.module()
    for length in (1, 3, 40, 300):
        generator = torch.Generator().manual_seed(length)
        input_ids = torch.randint(3, model.config.vocab_size, (1, length), generator=generator)
        with torch.no_grad():
            expected = model.generate(input_ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
            eager = model.get_encoder()(input_ids=input_ids).last_hidden_state
            torch.testing.assert_close(encoder(input_ids), eager, rtol=1e-5, atol=1e-5)
        assert exporter.generate(input_ids, max_new_tokens=6) == expected[0].tolist()


def test_the_kernel_traced_for_export_is_the_eager_kernel():
    """Under torch.export the S4D kernel is computed with fixed chunks, each power its own exponential, by blocks of
    channels (`_s4d_kernel_for_export`): the same values as `s4d_kernel` to float32 rounding, long inputs included."""
    from longreach.modeling.ssm import BidirectionalS4DConvolution, _s4d_kernel_for_export, s4d_kernel

    conv = BidirectionalS4DConvolution(64, 64).eval()  # two blocks of 32 channels on the CPU
    dtA, z, C_hat = conv._discretized()
    with torch.no_grad():
        for length in (2, 300, 5000):
            expected = s4d_kernel(dtA, z, C_hat, length, 256)
            torch.testing.assert_close(_s4d_kernel_for_export(dtA, C_hat, length, 256), expected, rtol=0, atol=2e-6)


class EncoderOutput(torch.nn.Module):
    """An encoder's ``last_hidden_state`` as the exported program's output."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask=None):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def test_vcc_encoder_exports_non_strict_with_a_length_torch_chooses():
    """`torch.export.export(..., strict=False)` with `Dim.AUTO` on the length: `VCCT5Config.padded_length` refused the
    symbolic length ("`num_tokens` must be a positive integer, got s70"), where the strict export works. Both now give
    a program for the lengths that pad to the example's (VCC-T5's compression sizes depend on it); another length is
    refused by torch's guard."""
    model = tiny_vcc()

    input_ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported = torch.export.export(EncoderOutput(model.get_encoder()).eval(), (input_ids,),
                                       dynamic_shapes={"input_ids": {1: torch.export.Dim.AUTO}}, strict=False).module()
        for length in (40, 57):  # both padded to 64
            other = torch.randint(3, 200, (1, length), generator=torch.Generator().manual_seed(length))
            expected = model.get_encoder()(input_ids=other).last_hidden_state
            torch.testing.assert_close(exported(other), expected, rtol=0, atol=0)
        with pytest.raises(AssertionError, match="Guard failed"):
            exported(torch.randint(3, 200, (1, 70)))


@pytest.mark.parametrize("kind", KINDS)
def test_a_fixed_length_encoder_export_with_padding_decodes_shorter_inputs_as_generate(kind):
    """README's recipe for an encoder exported at one length (VCC-T5's only way: its compression sizes depend on the
    length): pad shorter inputs with `attention_mask`, keep the real positions of the output, decode them with the
    decoder exported with a dynamic encoder length. `generate()`'s tokens on the unpadded input."""
    from transformers.integrations.executorch import Seq2SeqLMDecoderExportableModuleWithStaticCache

    model = tiny_locost(seed=13) if kind == "locost" else tiny_vcc()

    size = 64
    decoder = Seq2SeqLMDecoderExportableModuleWithStaticCache(model, max_static_cache_length=8, batch_size=1).eval()
    with torch.no_grad():
        encoder = torch.export.export(EncoderOutput(model.get_encoder()).eval(), (torch.ones(1, size, dtype=torch.long),
                                      torch.ones(1, size, dtype=torch.long)), strict=True).module()
        decoder = torch.export.export(
            decoder, (torch.tensor([[0]]), torch.zeros(1, 10, model.config.d_model), torch.tensor([0])),
            dynamic_shapes={"decoder_input_ids": None, "cache_position": None,
                            "encoder_hidden_states": {1: torch.export.Dim("length", max=size)}},
            strict=True,
        ).module()
        for length in (64, 23, 7):
            input_ids = torch.randint(3, 99, (1, length), generator=torch.Generator().manual_seed(length))
            padding = (0, size - length)
            encoded = encoder(nn_pad(input_ids, padding), nn_pad(torch.ones_like(input_ids), padding))[:, :length]
            torch.testing.assert_close(encoded, model.get_encoder()(input_ids=input_ids).last_hidden_state,
                                       rtol=1e-5, atol=1e-5)
            tokens = [model.config.decoder_start_token_id]
            for step in range(5):
                tokens.append(int(decoder(torch.tensor([[tokens[-1]]]), encoded, torch.tensor([step]))[0, -1].argmax()))
            expected = model.generate(input_ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
            assert tokens == expected[0].tolist()


def test_an_encoder_setting_edited_before_a_strict_export_is_refused_with_what_to_do():
    """A LOCOST encoder setting assigned to `model.config` and not yet applied (no call since) cannot be applied inside
    a strict torch.export: the error named only `_apply_changed_settings` (dynamo's "Skip inlining"); it now says what
    changed and how to apply it first. Applied first, or with a non-strict export, the program computes with it."""

    input_ids = torch.randint(3, 50, (1, 12), generator=torch.Generator().manual_seed(0))
    model = tiny_locost(seed=13)
    model.config.ssm_authors_fft_size = True  # another function (see LocostConfig.ssm_authors_fft_size)
    with torch.no_grad():
        with pytest.raises(Exception, match=r"ssm_authors_fft_size.*model\.get_encoder\(\)\.apply_config\(\)"):
            torch.export.export(EncoderOutput(model.get_encoder()).eval(), (input_ids,), strict=True)
        exported = torch.export.export(EncoderOutput(model.get_encoder()).eval(), (input_ids,), strict=False).module()
        model.get_encoder().apply_config()
        strict = torch.export.export(EncoderOutput(model.get_encoder()).eval(), (input_ids,), strict=True).module()
        expected = model.get_encoder()(input_ids=input_ids).last_hidden_state
    torch.testing.assert_close(exported(input_ids), expected)
    torch.testing.assert_close(strict(input_ids), expected)
