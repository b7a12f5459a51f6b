"""``torch.func`` on LOCOST and VCC-T5, as on transformers' T5: ``functional_call`` + ``grad`` (a loss as a function
of a parameter dict), ``vmap`` over a batch of inputs and per-sample gradients (``vmap(grad(...))``).

Every model is fresh before its ``functional_call``: a dict that replaces ``shared.weight`` replaces the embedding the
encoder and decoder share for good (a known limitation), which would spoil a later ``loss.backward()``.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, vmap

from longreach.modeling.input_checks import check_token_ids

VOCAB = 99


def test_the_token_range_check_is_skipped_under_vmap_and_kept_outside():
    ids = torch.tensor([[3, 4], [5, 6]])
    # under vmap the ids are batched: their values cannot be read (the check used to fail inside vmap)
    sums = vmap(lambda row: (check_token_ids("input_ids", row[None], vocab_size=VOCAB), row.sum())[1])(ids)
    assert sums.tolist() == [7, 11]
    # under grad alone the values are readable, and checked
    with pytest.raises(ValueError, match=r"`input_ids` holds the token id 100"):
        grad(lambda x: (check_token_ids("input_ids", torch.tensor([[100]]), vocab_size=VOCAB), x.sum())[1])(
            torch.ones(2))
