"""LOCOST and VCC-T5 where transformers' own code reaches into a T5-like model: the encoder accessor
(`get_encoder(modality=...)`, transformers' export helpers), compared with T5 built from the same tiny sizes."""

from __future__ import annotations

import pytest
import torch
from test_modeling_vcc_t5 import tiny_model as tiny_vcc
from transformers import T5Config, T5ForConditionalGeneration
from workflow_helpers import tiny_locost

import longreach  # noqa: F401  (Auto classes)

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
