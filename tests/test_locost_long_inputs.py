"""LOCOST's long-input encoder path (config.encoder_chunk_length): pieces along the sequence and channel groups for
the convolution, in place, without autograd; it must compute the same function as the one-piece path."""

from __future__ import annotations

import pytest
import torch

from longreach import LocostConfig
from longreach.modeling.modeling_locost import LocostEncoder, LocostEncoderBlock

TINY = dict(d_model=16, d_state=8, d_kv=4, d_ff=24, num_layers=2, num_heads=4, vocab_size=50)


def tiny_encoder(**overrides) -> LocostEncoder:
    torch.manual_seed(0)
    config = LocostConfig(**TINY, **overrides)
    return LocostEncoder(config, torch.nn.Embedding(config.vocab_size, config.d_model)).eval()


@pytest.mark.parametrize("overrides", [{}, {"bidirectional": False, "gating": False}, {"ssm_authors_fft_size": True},
                                       {"ssm_kernel_cache_bytes": 0}])
def test_chunked_path_equals_the_one_piece_path(monkeypatch, overrides):
    encoder = tiny_encoder(encoder_chunk_length=None, **overrides)
    input_ids = torch.randint(2, 50, (2, 29))
    attention_mask = torch.ones(2, 29, dtype=torch.long)
    attention_mask[0, 20:] = 0  # right padding
    attention_mask[1, :3] = 0  # left padding
    with torch.no_grad():
        reference = encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)

    pieces_calls = []
    forward_in_pieces = LocostEncoderBlock.forward_in_pieces_

    def spy(self, hidden_states, mask, piece_length):
        pieces_calls.append(piece_length)
        return forward_in_pieces(self, hidden_states, mask, piece_length)

    monkeypatch.setattr(LocostEncoderBlock, "forward_in_pieces_", spy)
    encoder.chunk_length = 6  # 5 pieces; convolution in groups of 6·16 // (2·29) = 1 channel
    embeds = encoder.embed_tokens(input_ids).detach()
    embeds_before = embeds.clone()
    with torch.no_grad():
        chunked = encoder(inputs_embeds=embeds, attention_mask=attention_mask, output_hidden_states=True)
    assert pieces_calls == [6, 6]
    torch.testing.assert_close(chunked.last_hidden_state, reference.last_hidden_state, atol=1e-4, rtol=0)
    assert len(chunked.hidden_states) == len(reference.hidden_states) == 3
    for got, expected in zip(chunked.hidden_states, reference.hidden_states):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert torch.equal(embeds, embeds_before)  # the caller's tensor is not written


def test_chunked_path_only_without_autograd_and_above_the_threshold(monkeypatch):
    encoder = tiny_encoder(encoder_chunk_length=8)
    calls = []
    monkeypatch.setattr(LocostEncoderBlock, "forward_in_pieces_", lambda *args: calls.append(args[-1]) or args[1])
    encoder(input_ids=torch.randint(2, 50, (1, 9)))  # autograd on: one piece
    with torch.no_grad():
        encoder(input_ids=torch.randint(2, 50, (1, 8)))  # not longer than the threshold
    assert calls == []
    with torch.no_grad():
        encoder(input_ids=torch.randint(2, 50, (1, 9)))
    assert calls == [8, 8]


def test_encoder_chunk_length_is_validated():
    with pytest.raises(ValueError, match="encoder_chunk_length.*got 0"):
        LocostConfig(**TINY, encoder_chunk_length=0)
    with pytest.raises(ValueError, match="encoder_accelerator_chunk_length.*got -1"):
        LocostConfig(**TINY, encoder_accelerator_chunk_length=-1)


def test_accelerators_use_their_own_piece_length():
    # each piece and channel group costs launches that a GPU waits for: pieces of 2048 made a 16K-token encode 4.3x
    # slower on an H200 than one piece (benchmarks/results/cuda.md)
    encoder = tiny_encoder(encoder_chunk_length=8, encoder_accelerator_chunk_length=None)
    assert encoder.piece_length(torch.device("cpu")) == 8
    assert encoder.piece_length(torch.device("cuda")) is None
    encoder.accelerator_chunk_length = 64
    assert encoder.piece_length(torch.device("cuda", 1)) == 64
    assert encoder.piece_length(torch.device("mps")) == 64
    assert LocostConfig(**TINY).encoder_accelerator_chunk_length == 32768


def half_model_with_float32_wo() -> LocostEncoder:
    """A float16 encoder as `from_pretrained(dtype=torch.float16)` loads it: the feed-forward `wo` stay float32."""
    encoder = tiny_encoder().half()
    for block in encoder.block:
        block.layer[1].DenseReluDense.wo.float()
    return encoder


@pytest.mark.parametrize("case", ["float16 with float32 wo", "bfloat16 model, float32 embeddings",
                                  "float32 model, bfloat16 embeddings"])
def test_chunked_path_keeps_the_dtypes_of_the_one_piece_path(case):
    # the pieces wrote every sublayer's output into the input's dtype: float32 embeddings in a bfloat16 model failed
    # ("mat1 and mat2 must have the same dtype"), and the float32 residual stream of the others was rounded
    if case == "float16 with float32 wo":
        encoder = half_model_with_float32_wo()
        inputs = {"input_ids": torch.randint(2, 50, (2, 29))}
    else:
        model_dtype, embeds_dtype = (torch.bfloat16, torch.float32) if case.startswith("bfloat16") else \
            (torch.float32, torch.bfloat16)
        encoder = tiny_encoder().to(model_dtype)
        inputs = {"inputs_embeds": torch.randn(2, 29, 16, dtype=embeds_dtype)}
    attention_mask = torch.ones(2, 29, dtype=torch.long)
    attention_mask[1, 11:] = 0
    with torch.no_grad():
        encoder.chunk_length = None
        reference = encoder(**inputs, attention_mask=attention_mask).last_hidden_state
        encoder.chunk_length = 6
        chunked = encoder(**inputs, attention_mask=attention_mask).last_hidden_state
    assert chunked.dtype == reference.dtype
    # float32 outputs differ in rounding only (the convolution runs over channel groups); half ones not at all here
    tolerance = 1e-5 if reference.dtype == torch.float32 else 0
    torch.testing.assert_close(chunked, reference, atol=tolerance, rtol=0)


def test_chunked_float16_does_not_overflow_where_one_piece_does_not():
    # T5 v1.1 keeps `wo` in float32 under float16 because its outputs can pass 65504: the one-piece path keeps them in
    # a float32 residual stream, the pieces rounded them to float16 (inf, then NaN after the next norm)
    encoder = half_model_with_float32_wo()
    with torch.no_grad():
        encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(1e7)  # outputs of about 3e6
        input_ids = torch.randint(2, 50, (1, 20))
        encoder.chunk_length = None
        reference = encoder(input_ids=input_ids).last_hidden_state
        encoder.chunk_length = 6
        chunked = encoder(input_ids=input_ids).last_hidden_state
    assert torch.isfinite(reference).all()
    assert torch.isfinite(chunked).all()
    torch.testing.assert_close(chunked, reference, atol=0, rtol=0)


def test_chunked_path_under_disk_offload_loads_the_convolution_weights(tmp_path):
    # accelerate's offload hooks load a module's weights around its forward only: the convolution was called through
    # a method, its parameters stayed on the meta device ("Tensor on device meta is not on the expected device cpu!")
    from longreach import LocostForConditionalGeneration

    torch.manual_seed(0)
    LocostForConditionalGeneration(LocostConfig(**TINY)).save_pretrained(tmp_path / "locost")
    # the encoder's blocks on disk, the rest on the CPU (older accelerate refuses a whole model on disk)
    device_map = {"shared": "cpu", "encoder.embed_tokens": "cpu", "encoder.block": "disk",
                  "encoder.final_layer_norm": "cpu", "encoder.dropout": "cpu", "decoder": "cpu", "lm_head": "cpu"}
    offloaded = LocostForConditionalGeneration.from_pretrained(
        tmp_path / "locost", device_map=device_map, offload_folder=str(tmp_path / "offload"), encoder_chunk_length=8)
    assert offloaded.encoder.block[0].layer[0].ssm.conv.C.device.type == "meta"
    reference = LocostForConditionalGeneration.from_pretrained(tmp_path / "locost", encoder_chunk_length=None)
    input_ids = torch.randint(2, 50, (2, 29))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 20:] = 0
    with torch.no_grad():
        chunked = offloaded.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        expected = reference.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=0)
