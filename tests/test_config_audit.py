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
