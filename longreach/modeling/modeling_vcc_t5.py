"""VCC-T5: a T5 whose encoder compresses everything but a few VIP tokens at every layer.

Zeng et al., "VCC: Scaling Transformers to 128K Tokens or More by Prioritizing Important Tokens" (NeurIPS 2023), with
the numerics of the authors' code (github.com/awslabs/vip-token-centric-compression).
Only the encoder changes; embeddings, decoder, LM head, loss and generation are T5 (``t5_blocks``), and VCC adds no
parameters, so every T5 checkpoint loads as is. The encoder (paper §3-4; the authors' `src/t5/models/vcc_t5.py`):

    x = dropout(embed(input_ids))
    vanilla layers   : ordinary T5 layers on independent `segment_length`-token segments (global positions)
    enter compression: zero padding; VIP tokens first (stable sort); the first `num_vip_slots` tokens stay
                       uncompressed ("important" slots I); the rest is cut into n_b blocks of k tokens, stored as block
                       means c and deltas D = c - fine (the paper's tree T(C) with two levels)
    each VCC layer l : scores s = log(mean over VIP slots, heads of softmax_blocks(q(ln0 I) · k(ln0 c) + bias) + 1e-5)
                       -> the top-h blocks are refined (tokens = c - D), the others stay means;
                       X = [refined tokens ; block means ; I]  (r = h·k + n_b - h + NI tokens, positions travel along)
                       a = Attn(ln0 X) with key terms log(σ + 1e-4) + log(dups + 1e-4);  f = FF(ln1(a + X))
                       X = (f + a)·σ + X;  write back: refined blocks get new means and deltas, the others new means
                       (all tokens of an unrefined block receive its mean's update, paper eq. 17/18)
    leave            : fine = (c - D)·mask, put back in the input order -> final RMSNorm -> dropout

σ ("state scores") is a straight-through device of the original: 1 in the forward pass (up to one ulp), but its
gradient is the gradient of the selection probabilities, the only path by which training reaches the selection.

Inputs of any length are padded internally to the smallest length the original accepts and cropped back; padded
positions of the encoder output are exactly 0. The mask constant is the original's finite -1000 (a fully padded
segment then gets uniform, finite attention instead of NaN).
"""

from __future__ import annotations

import inspect
import threading
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers import BatchEncoding, DataCollatorForSeq2Seq
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput, logging

from ..configuration.configuration_vcc_t5 import VCCT5Config
from .input_checks import (
    check_hidden_states,
    check_mask,
    check_rows_not_empty,
    check_token_ids,
    cut_to_length,
    describe,
    embedding_shape,
    pad_right,
    question_per_document,
    reject_head_masks,
    summarization_documents,
    take_cache_argument,
)
from .remote_code import HubReadyMixin
from .t5_blocks import (
    Dropout,
    T5Block,
    T5DecoderStack,
    T5LayerNorm,
    T5Seq2SeqLMMixin,
    as_encoder_output,
    init_t5_module,
    last_dim_softmax,
    relative_position_bucket,
    returns_dict,
)

logger = logging.get_logger(__name__)

#: The original's additive key-mask constant (-1000, not -inf). Finite on purpose: see the module docstring.
MASK_VALUE = -1000.0
#: Tokens per chunk of segments in the vanilla layers (bounds the [segments, heads, S, S] attention tensors).
VANILLA_TOKENS_PER_CHUNK = 8192
#: The original collators' separator between the query (the VIP tokens) and the context.
QUERY_SEPARATOR = "\n\n\n"
#: The original's query for plain summarization (no colon).
SUMMARIZATION_QUERY = "summarize"


# ---------------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class VCCT5CompressionInfo(ModelOutput):
    r"""
    What the VCC layers did (returned with `output_compression_info=True`). Blocks are numbered 0..n_b-1 in the order
    of the compressible part: the input order with the `num_vip_slots` uncompressed tokens taken out. Positions refer
    to the internally padded input of length `padded_length` (>= the input length).

    vip_sort_order (`torch.LongTensor` of shape `(batch, padded_length)`):
        stable descending sort of the VIP mask: entries `[:num_vip_slots]` are the uncompressed slots, entries
        `[num_vip_slots + b*k : num_vip_slots + (b+1)*k]` the tokens of block b.
    coarse_token_positions (`torch.LongTensor` of shape `(batch, n_b)`):
        position of each block mean (round half to even of the mean of its k positions).
    coarse_token_mask (`torch.FloatTensor` of shape `(batch, n_b)`): 1 where a block holds at least one real token.
    selection_scores (`tuple` of `torch.FloatTensor` of shape `(batch, n_b)`, one per VCC layer):
        block scores `log(mean over VIP slots(mean over heads(attention probabilities)) + 1e-5)`, in block order.
        Differentiable: the loss reaches them through the state scores σ.
    fine_block_indices (`tuple` of `torch.LongTensor` of shape `(batch, num_refined_blocks)`, one per VCC layer):
        the refined blocks, best score first (a random set for rows that explored, see `explored`).
    coarse_block_indices (`tuple` of `torch.LongTensor` of shape `(batch, n_b - num_refined_blocks)`):
        the other blocks, in ranking order (ties, e.g. fully padded blocks, in block order).
    explored (`tuple` of `torch.BoolTensor` of shape `(batch,)`): rows that refined random blocks (training only).
    compressed_hidden_states (`tuple` of `torch.FloatTensor` of shape `(batch, r, d_model)`):
        output of each VCC layer on its compressed sequence, laid out as [refined tokens (blocks in
        `fine_block_indices` order, k tokens each), block means (in `coarse_block_indices` order), the
        `num_vip_slots` uncompressed tokens (in `vip_sort_order` order)].
    padded_length (`int`): the internal length the input was padded to.
    """

    vip_sort_order: torch.LongTensor | None = None
    coarse_token_positions: torch.LongTensor | None = None
    coarse_token_mask: torch.FloatTensor | None = None
    selection_scores: tuple[torch.FloatTensor, ...] | None = None
    fine_block_indices: tuple[torch.LongTensor, ...] | None = None
    coarse_block_indices: tuple[torch.LongTensor, ...] | None = None
    explored: tuple[torch.BoolTensor, ...] | None = None
    compressed_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    padded_length: int | None = None


@dataclass
class VCCT5EncoderOutput(BaseModelOutput):
    r"""
    `BaseModelOutput` of the VCC encoder (full length, input order) plus, on request, `compression_info`
    ([`VCCT5CompressionInfo`]). `hidden_states` (with `output_hidden_states`) are full-length: the embedding output,
    then the output of every layer (VCC layers decompressed), the last one after the final norm. `attentions` is
    always None.
    """

    compression_info: VCCT5CompressionInfo | None = None


@dataclass
class VCCT5Seq2SeqModelOutput(Seq2SeqModelOutput):
    r"""`Seq2SeqModelOutput` plus the encoder's `encoder_compression_info` ([`VCCT5CompressionInfo`]) on request."""

    encoder_compression_info: VCCT5CompressionInfo | None = None


@dataclass
class VCCT5Seq2SeqLMOutput(Seq2SeqLMOutput):
    r"""`Seq2SeqLMOutput` plus the encoder's `encoder_compression_info` ([`VCCT5CompressionInfo`]) on request."""

    encoder_compression_info: VCCT5CompressionInfo | None = None


# ---------------------------------------------------------------------------------------------------------------------
# The encoder layer: a T5 block that also runs on a compressed sequence
# ---------------------------------------------------------------------------------------------------------------------


class VCCT5EncoderBlock(T5Block):
    """T5's encoder block (same modules, same parameter names) with the VCC residual form of the authors'
    `src/t5/models/vcc_layers.py`.

    Without `state_scores` it is the ordinary T5 block. With them (shape `[batch, r]`), on a compressed sequence:

        a = dropout(Attn(ln0(X)));   f = dropout(FF(ln1(a + X)));   X = (f + a)·σ + X

    which equals the T5 block when σ = 1. The VCC layers apply no dropout to attention probabilities (the encoder
    sets their `SelfAttention.dropout` to 0).

    The encoder also reads a block's weights for two things besides running it, and it asks the block's `forward`
    for them, so that a sharded block (FSDP, DeepSpeed ZeRO-3: one unit per block) gathers its weights for them too:
    `block_means` gives the selection logits of a VCC layer (its own ln0, q and k: VIP slots in `hidden_states` as
    queries, block means as keys), and `relative_buckets` gives block 0's relative-position bias of those buckets
    (the table every encoder layer uses). Forward hooks on a block see these calls too (a pre-hook gets
    `hidden_states=None` for the bias). Gradient checkpointing leaves them out: their outputs are small, and under
    `use_reentrant=True` a keyword tensor input would be backpropagated twice and the bias table, which has no input
    that requires a gradient, would get none.
    """

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and (kwargs.get("block_means") is not None
                                            or kwargs.get("relative_buckets") is not None):
            self.gradient_checkpointing = False  # (module hooks, FSDP's included, still run)
            try:
                return super().__call__(*args, **kwargs)
            finally:
                self.gradient_checkpointing = True
        return super().__call__(*args, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        state_scores: torch.Tensor | None = None,
        *,
        block_means: torch.Tensor | None = None,
        relative_buckets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attention_layer = self.layer[0]
        attention = attention_layer.SelfAttention
        if relative_buckets is not None:  # [heads, *buckets.shape] from the table only block 0 has
            return attention.relative_attention_bias(relative_buckets).t()
        if block_means is not None:  # [B, heads, slots, blocks], in float32 (paper §3.3)
            queries = _split_heads(attention.q(attention_layer.layer_norm(hidden_states)), attention.n_heads).float()
            keys = _split_heads(attention.k(attention_layer.layer_norm(block_means)), attention.n_heads).float()
            return torch.matmul(queries, keys.transpose(-1, -2))
        if state_scores is None:
            return super().forward(hidden_states, attention_bias)[0]
        feed_forward_layer = self.layer[-1]
        attended, _ = attention(attention_layer.layer_norm(hidden_states), attention_bias)
        attended = attention_layer.dropout(attended)
        transformed = feed_forward_layer.DenseReluDense(feed_forward_layer.layer_norm(attended + hidden_states))
        transformed = feed_forward_layer.dropout(transformed)
        return (transformed + attended) * state_scores[..., None].to(hidden_states.dtype) + hidden_states


# ---------------------------------------------------------------------------------------------------------------------
# Compression helpers (paper §3.4; the authors' `src/roberta/models/mra_projection/`). Shapes: B batch, n blocks,
# k block size, d hidden size.
# ---------------------------------------------------------------------------------------------------------------------


def _expand_index(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`index [B, m]` broadcast to `[B, m, *like.shape[2:]]` for gather/scatter along dim 1."""
    trailing = like.shape[2:]
    return index.view(*index.shape, *([1] * len(trailing))).expand(*index.shape, *trailing)


def gather_blocks(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor[b, index[b, j], ...]` for `tensor [B, n, ...]` and `index [B, m]`."""
    return tensor.gather(1, _expand_index(index, tensor))


def scatter_blocks(tensor: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Out-of-place `tensor[b, index[b, j], ...] = values[b, j, ...]`."""
    return tensor.scatter(1, _expand_index(index, values), values)


def coarsen(fine: torch.Tensor, fine_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block means and deltas of `fine [B, n, k, d]` (paper eq. 13 and 15, with two levels).

    `mean = sum(fine·mask) / (count + 1e-4)` (summed in float32; note the +1e-4 of the original) and
    `delta = mean - fine·mask`, so that every token is `mean - delta` (the paper's Δc, parent minus child).
    """
    fine = fine * fine_mask[..., None].to(fine.dtype)
    count = fine_mask.float().sum(-1)
    mean = (fine.float().sum(-2) / (count[..., None] + 1e-4)).to(fine.dtype)
    return mean, mean[:, :, None] - fine


def decompress(
    important: torch.Tensor, means: torch.Tensor, deltas: torch.Tensor, fine_mask: torch.Tensor, order: torch.Tensor
) -> torch.Tensor:
    """Full-length states in the input order (paper eq. 16): `(mean - delta)·mask` for the blocks, the important slots
    unmasked, then the VIP-first permutation undone."""
    batch, _, _, hidden = deltas.shape
    fine = (means[:, :, None] - deltas) * fine_mask[..., None].to(deltas.dtype)
    sorted_states = torch.cat([important, fine.reshape(batch, -1, hidden)], dim=1)
    return sorted_states.gather(1, _expand_index(torch.argsort(order, dim=1), sorted_states))


def _split_heads(states: torch.Tensor, num_heads: int) -> torch.Tensor:
    batch, length, _ = states.shape
    return states.view(batch, length, num_heads, -1).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Encoder
# ---------------------------------------------------------------------------------------------------------------------


class VCCT5Encoder(nn.Module):
    """Embedding -> vanilla T5 layers on segments -> VCC layers -> final RMSNorm -> dropout, full length.

    `encoder.block.{i}` are T5 blocks with T5's parameter names; block 0 owns the one relative-attention-bias table
    that every encoder layer uses (as in T5).
    """

    main_input_name = "input_ids"

    def __init__(self, config: VCCT5Config, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList(
            [VCCT5EncoderBlock(config, has_relative_attention_bias=(i == 0), layer_idx=i) for i in range(config.num_layers)]
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)
        self.attention_dropout = config.dropout_rate
        self._set_vcc_layers(config.num_vanilla_layers)

    def _set_vcc_layers(self, num_vanilla_layers: int) -> None:
        """As the authors' VCC layers, the layers after the first `num_vanilla_layers` apply no dropout to attention
        probabilities; the vanilla ones apply T5's."""
        for index, block in enumerate(self.block):
            block.layer[0].SelfAttention.dropout = 0.0 if index >= num_vanilla_layers else self.attention_dropout
        self._num_vanilla_layers = num_vanilla_layers

    def check_config(self) -> None:
        """`self.config` as this encoder runs it, checked when a call starts: the VCC settings are read at every call,
        so an edit of `model.config` after loading counts. It must be valid (`VCCT5Config.validate_vcc`, which
        `save_pretrained` runs too, only then: an invalid value hung, failed deep inside or was used silently) and keep
        the number of layers the encoder was built with; a new `num_vanilla_layers` takes effect."""
        config = self.config
        if config.num_layers != len(self.block):
            raise ValueError(
                f"`config.num_layers` was changed to {config.num_layers!r} after the encoder was built with "
                f"{len(self.block)} layers; set it back (to run fewer VCC layers, raise `num_vanilla_layers`)."
            )
        config.validate_vcc()
        if config.num_vanilla_layers != self._num_vanilla_layers:
            self._set_vcc_layers(config.num_vanilla_layers)

    def bias_per_distance(self, max_position: int, device: torch.device) -> torch.Tensor:
        """`[heads, 2·max_position + 1]`: the relative position bias of every distance in `[-max_position,
        max_position]`, from block 0's table (asked of its forward: see `VCCT5EncoderBlock`), for `relative_bias`."""
        distances = torch.arange(-max_position, max_position + 1, device=device)
        table = self.block[0].layer[0].SelfAttention  # the bucketing its table was built for (T5's attention keeps it)
        buckets = relative_position_bucket(distances, bidirectional=True,
                                           num_buckets=table.relative_attention_num_buckets,
                                           max_distance=table.relative_attention_max_distance)
        return self.block[0](relative_buckets=buckets)

    @staticmethod
    def relative_bias(query_positions: torch.Tensor, key_positions: torch.Tensor,
                      per_distance: torch.Tensor) -> torch.Tensor:
        """T5's bidirectional relative position bias from the shared table, `[B or 1, heads, Lq, Lk]`, for positions
        `[B, L]` (per row, as after the VIP reordering) or `[L]`, all in `[0, max_position)`, where `per_distance` is
        `bias_per_distance(max_position)`.

        Same values as `T5Attention.compute_bias`, computed through the per-distance table (the bias of every distance
        in `(-max_position, max_position)`, 2·max_position entries, made once per encoder pass) and one gather, instead
        of bucketing all Lq·Lk distances: the VCC layers need a new `[B, heads, r, r]` bias in every layer.
        """
        max_position = (per_distance.shape[-1] - 1) // 2
        index = (key_positions.unsqueeze(-2) - query_positions.unsqueeze(-1)).add_(max_position)  # [B or -, Lq, Lk]
        index = index if index.dim() == 3 else index.unsqueeze(0)
        batch, query_length, key_length = index.shape
        heads = per_distance.shape[0]
        flat_index = index.reshape(batch, 1, query_length * key_length).expand(batch, heads, -1)
        bias = per_distance.unsqueeze(0).expand(batch, -1, -1).gather(2, flat_index)  # contiguous, heads first
        return bias.view(batch, heads, query_length, key_length)

    # -----------------------------------------------------------------------------------------------------------------
    # Inputs
    # -----------------------------------------------------------------------------------------------------------------

    def resolve_vip_mask(self, vip_mask: torch.Tensor | None, attention_mask: torch.Tensor) -> torch.Tensor:
        """The VIP mask actually used, as a `[B, L]` long tensor of 0/1.

        VIPs on padding are dropped. A row without any VIP (and every row when `vip_mask` is None) marks its first
        `num_vip_slots` real tokens as VIPs: they fill exactly the uncompressed slots and all of them vote, i.e. the
        beginning of the input (a task prefix, the query of `prepare_vip_inputs`) steers the selection. The
        original has no default and an undefined selection for such rows.
        """
        first_tokens = (attention_mask > 0) & (attention_mask.cumsum(dim=1) <= self.config.num_vip_slots)
        compiling = torch.compiler.is_compiling()  # no logging and no read-back inside a compiled graph
        if vip_mask is None:
            if not compiling:
                logger.warning_once(
                    "VCC-T5: no `vip_mask` given; the first `num_vip_slots` (%d) tokens of every row are used as VIP "
                    "tokens. Pass `vip_mask` (1 = VIP, e.g. the query; see `prepare_vip_inputs`) to choose them.",
                    self.config.num_vip_slots,
                )
            return first_tokens.long()
        vip = (vip_mask != 0) & (attention_mask > 0)
        empty_rows = ~vip.any(dim=1)
        if compiling:
            vip = torch.where(empty_rows[:, None], first_tokens, vip)  # the same, without asking whether any is empty
        elif bool(empty_rows.any()):
            logger.warning_once(
                "VCC-T5: some rows of `vip_mask` mark no real token; their first `num_vip_slots` tokens are used as "
                "VIP tokens."
            )
            vip = torch.where(empty_rows[:, None], first_tokens, vip)
        return vip.long()

    @staticmethod
    def check_vip_mask(vip_mask: torch.Tensor | None, like: torch.Tensor, like_name: str = "input_ids") -> None:
        if vip_mask is None:
            return
        if (like_name == "inputs_embeds" and isinstance(vip_mask, torch.Tensor) and vip_mask.dim() == 2
                and vip_mask.shape[0] == like.shape[0] and vip_mask.shape[1] < like.shape[1]):
            missing = like.shape[1] - vip_mask.shape[1]
            raise ValueError(
                f"`vip_mask` must have the shape [batch, length] = {tuple(like.shape[:2])} of `inputs_embeds`, got "
                f"{describe(vip_mask)}. PEFT's prompt tuning and p-tuning prepend `num_virtual_tokens` embeddings "
                f"(and attention-mask columns) to the encoder's input, but not to `vip_mask`: with them, prepend "
                f"{missing} columns to `vip_mask` (0s, or 1s to keep the virtual tokens uncompressed as VIPs)."
            )
        check_mask("vip_mask", vip_mask, like_name, like)
        if torch.compiler.is_compiling():  # data-dependent: checked in eager mode only (as `check_token_ids` is)
            return
        if vip_mask.dtype.is_complex or bool(((vip_mask != 0) & (vip_mask != 1)).any()):
            raise ValueError(f"`vip_mask` must hold only 0 and 1 (1 = VIP token), got {describe(vip_mask)} with other values.")

    # -----------------------------------------------------------------------------------------------------------------
    # Forward
    # -----------------------------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        vip_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        output_compression_info: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> VCCT5EncoderOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, length)`): the input; any length, padded on either side.
        attention_mask (`torch.Tensor` of shape `(batch, length)`): 1 for real tokens, 0 for padding.
        vip_mask (`torch.Tensor` of shape `(batch, length)`): 1 for VIP tokens (the original's
            `encoder_input_important_mask`). Default and rows without VIP: see [`VCCT5Encoder.resolve_vip_mask`].
        output_compression_info (`bool`): also return [`VCCT5CompressionInfo`] (for rows that were not right-padded,
            its positions refer to the row with its real tokens moved first).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds` to the VCC-T5 encoder.")
        if not torch.compiler.is_compiling():
            self.check_config()
        check_token_ids("input_ids", input_ids, vocab_size=embedding_shape(self.embed_tokens)[0])
        check_hidden_states("inputs_embeds", inputs_embeds, embedding_shape(self.embed_tokens)[1])
        like = input_ids if input_ids is not None else inputs_embeds
        like_name = "input_ids" if input_ids is not None else "inputs_embeds"
        check_mask("attention_mask", attention_mask, like_name, like)
        check_rows_not_empty("attention_mask", attention_mask)
        self.check_vip_mask(vip_mask, like, like_name)
        batch, length = like.shape[:2]
        device = like.device
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)
        attention_mask = (attention_mask > 0).long()
        vip = self.resolve_vip_mask(vip_mask, attention_mask) if self.config.num_vcc_layers else attention_mask * 0

        # The algorithm (the original's) assumes right padding: positions count from the row start, and internal
        # padding goes at the end. Rows padded elsewhere (left padding) are realigned with their real tokens first, in
        # order, and restored at the end, so that every row computes what it computes alone.
        realign = None
        # (compiled: always, since asking would read a value back; a stable sort leaves right-padded rows as they are)
        if torch.compiler.is_compiling() or bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            realign = torch.sort(attention_mask, dim=1, descending=True, stable=True).indices
            attention_mask, vip = attention_mask.gather(1, realign), vip.gather(1, realign)
            if inputs_embeds is None:
                input_ids = input_ids.gather(1, realign)
            else:
                inputs_embeds = inputs_embeds.gather(1, realign[..., None].expand_as(inputs_embeds))

        # Pad to the smallest length the original accepts (`VCCT5Config.padded_length`); real outputs do not depend
        # on it.
        padded_length = self.config.padded_length(length)
        extra = padded_length - length
        if inputs_embeds is None:
            pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0
            inputs_embeds = self.embed_tokens(input_ids)
            # no call for an empty padding: forward hooks on the embedding see a 0-length output (NEFTune's noise
            # divides by it and failed on inputs already at a valid length)
            padding = self.embed_tokens(input_ids.new_full((batch, extra), pad_id)) if extra else inputs_embeds[:, :0]
        else:
            padding = inputs_embeds.new_zeros(batch, extra, inputs_embeds.shape[-1])
        mask = nn.functional.pad(attention_mask, (0, extra))
        vip = nn.functional.pad(vip, (0, extra))

        # the real positions' embeddings are returned as hidden_states[0] and are the tensor the layers consume
        # (so retain_grad/hooks on it see gradients); the padding is appended to them
        embedded = self.dropout(inputs_embeds)
        hidden_states = torch.cat([embedded, self.dropout(padding)], dim=1)
        all_hidden = [embedded] if output_hidden_states else None
        if self.config.num_vanilla_layers:
            hidden_states = self._vanilla_layers(hidden_states, mask, all_hidden, length)
        info = None
        if self.config.num_vcc_layers:
            hidden_states, info = self._vcc_layers(hidden_states, mask, vip, all_hidden, length, output_compression_info)
        hidden_states = self.dropout(self.final_layer_norm(hidden_states))
        # Crop back and zero padding (the original's output is 0 there; only uncompressed slots could differ).
        hidden_states = hidden_states[:, :length] * attention_mask[..., None].to(hidden_states.dtype)
        if all_hidden is not None:
            all_hidden[-1] = hidden_states
        if realign is not None:  # back to the caller's layout
            restore = torch.argsort(realign, dim=1)[..., None].expand_as(hidden_states)
            hidden_states = hidden_states.gather(1, restore)
            if all_hidden is not None:
                all_hidden = [states.gather(1, restore) for states in all_hidden]
        output = VCCT5EncoderOutput(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            compression_info=info,
        )
        return output if return_dict is not False else output.to_tuple()

    def _vanilla_layers(self, hidden_states, mask, all_hidden, length) -> torch.Tensor:
        """Ordinary T5 layers on independent segments (paper §4). Positions are global, but the relative bias only
        depends on differences, so one `[1, heads, S, S]` bias serves every segment. Segments are independent, so
        they go through all vanilla layers in chunks, which bounds the `[segments, heads, S, S]` attention tensors."""
        batch, padded_length, hidden = hidden_states.shape
        segment = self.config.segment_length if self.config.uses_segments() else padded_length
        segments = hidden_states.reshape(-1, segment, hidden)
        segment_mask = mask.reshape(-1, segment)
        positions = torch.arange(segment, device=hidden_states.device)
        position_bias = self.relative_bias(positions, positions, self.bias_per_distance(segment, positions.device))
        chunk = max(1, VANILLA_TOKENS_PER_CHUNK // segment)
        outputs = []  # per chunk: the output of every vanilla layer
        for start in range(0, segments.shape[0], chunk):
            key_bias = MASK_VALUE * (1.0 - segment_mask[start : start + chunk, None, None, :].float())
            attention_bias = position_bias + key_bias
            states, layer_outputs = segments[start : start + chunk], []
            for block in self.block[: self.config.num_vanilla_layers]:
                states = block(states, attention_bias)
                layer_outputs.append(states)
            outputs.append(layer_outputs if all_hidden is not None else [states])
        per_layer = [torch.cat(chunks, dim=0).reshape(batch, padded_length, hidden) for chunks in zip(*outputs)]
        if all_hidden is not None:
            all_hidden.extend(states[:, :length] for states in per_layer)
        return per_layer[-1]

    def _block_scores(self, block, important, important_positions, important_vip, means, mean_positions, mean_mask,
                      per_distance):
        """Selection scores of VCC layer `block` (paper §3.3): the layer's own ln0, q, k and the shared relative bias
        with the VIP slots as queries and the block means as keys, no scale correction; softmax over blocks, mean over
        heads, VIP-masked mean over the slots (divides by the slot count), `log(· + 1e-5)`. All in float32."""
        logits = block(important, block_means=means)  # through the block's forward (see VCCT5EncoderBlock)
        bias = self.relative_bias(important_positions, mean_positions, per_distance).float() + (
            MASK_VALUE * (1.0 - mean_mask[:, None, None, :])
        )
        probabilities = last_dim_softmax(logits + bias, self.config)
        votes = probabilities.mean(dim=1) * important_vip[:, :, None].float()  # [B, NI, n_b]
        return torch.log(votes.mean(dim=1) + 1e-5)

    def _rank_blocks(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks by descending score (ties in block order); in training, rows explore a random order with
        probability `exploration_probability` (the authors' `explore_prob`; not in the paper)."""
        ranking = torch.argsort(scores, dim=1, descending=True, stable=True)
        explored = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
        if self.training and self.config.exploration_probability > 0:
            explored = torch.rand(scores.shape[0], device=scores.device) < self.config.exploration_probability
            random_order = torch.argsort(torch.rand(scores.shape, device=scores.device), dim=1)
            ranking = torch.where(explored[:, None], random_order, ranking)
        return ranking, explored

    def _vcc_layers(self, hidden_states, mask, vip, all_hidden, length, output_compression_info):
        """Compress (paper §3.1-3.3), run every VCC layer on its compressed sequence and write back (paper §3.4,
        eq. 17/18), decompress to the full length in input order (eq. 16). The tree T(C) is kept as block `means`
        [B, n_b, d] and `deltas` [B, n_b, k, d] (token = mean - delta); the `num_vip_slots` important tokens are kept
        apart, uncompressed."""
        config = self.config
        batch, padded_length, hidden = hidden_states.shape
        slots, k, num_refined = config.num_vip_slots, config.block_size, config.num_refined_blocks
        num_blocks = config.compression_sizes(padded_length)["num_blocks"]
        num_coarse = num_blocks - num_refined

        # Enter compression (paper eq. 6 and 13): zero padding, VIP tokens first, important slots + blocks of k.
        hidden_states = hidden_states * mask[..., None].to(hidden_states.dtype)
        order = torch.sort(vip, dim=1, descending=True, stable=True).indices  # = the sorted tokens' positions
        sorted_states = hidden_states.gather(1, _expand_index(order, hidden_states))
        sorted_mask = mask.gather(1, order).float()
        important, important_mask = sorted_states[:, :slots], sorted_mask[:, :slots]
        important_positions, important_vip = order[:, :slots], vip.gather(1, order[:, :slots])
        fine_mask = sorted_mask[:, slots:].reshape(batch, num_blocks, k)
        fine_positions = order[:, slots:].reshape(batch, num_blocks, k)
        means, deltas = coarsen(sorted_states[:, slots:].reshape(batch, num_blocks, k, hidden), fine_mask)
        mean_mask = (fine_mask.sum(-1) > 0).float()
        mean_positions = torch.round(fine_positions.float().mean(-1)).long()  # round half to even, as torch.round

        device = hidden_states.device  # made there, not copied from the host (a copy would wait for the device)
        duplicates = torch.cat([
            torch.ones(batch, num_refined * k, device=device), torch.full((batch, num_coarse), float(k), device=device),
            torch.ones(batch, slots, device=device),
        ], dim=1)
        log_duplicates = torch.log(duplicates + 1e-4) if config.scale_correction else None
        ones_for_slots = torch.ones(batch, slots, device=device)
        per_distance = self.bias_per_distance(padded_length, device)  # every VCC layer's relative bias comes from it
        info = {name: [] for name in ("selection_scores", "fine_block_indices", "coarse_block_indices", "explored",
                                      "compressed_hidden_states")}

        for block in self.block[config.num_vanilla_layers:]:
            # (b) Which blocks to refine, from this layer's attention of the VIP slots to the block means.
            scores = self._block_scores(block, important, important_positions, important_vip, means, mean_positions,
                                        mean_mask, per_distance)
            ranking, explored = self._rank_blocks(scores)
            refined, coarse = ranking[:, :num_refined], ranking[:, num_refined:]
            # (c) State scores: 1 in value, gradient of the selection probabilities (straight-through).
            probabilities = last_dim_softmax(scores, config).gather(1, ranking)
            refined_probability, coarse_complement = probabilities[:, :num_refined], 1 - probabilities[:, num_refined:]
            refined_scores = 1 + refined_probability - refined_probability.detach()
            coarse_scores = 1 + coarse_complement - coarse_complement.detach()
            # (d) The compressed sequence [refined tokens; block means; important slots], positions travel along.
            refined_mask = gather_blocks(fine_mask, refined)
            refined_tokens = gather_blocks(means, refined)[:, :, None] - gather_blocks(deltas, refined)
            compressed = torch.cat(
                [refined_tokens.reshape(batch, -1, hidden), gather_blocks(means, coarse), important], dim=1
            )
            positions = torch.cat(
                [gather_blocks(fine_positions, refined).reshape(batch, -1), gather_blocks(mean_positions, coarse),
                 important_positions], dim=1,
            )
            key_mask = torch.cat(
                [refined_mask.reshape(batch, -1), gather_blocks(mean_mask, coarse), important_mask], dim=1
            )
            state_scores = torch.cat([refined_scores.repeat_interleave(k, dim=1), coarse_scores, ones_for_slots], dim=1)
            # (e) The unchanged T5 layer with the extra key terms log(σ + 1e-4) [+ log(dups + 1e-4)].
            key_bias = MASK_VALUE * (1.0 - key_mask) + torch.log(state_scores + 1e-4)
            if log_duplicates is not None:
                key_bias = key_bias + log_duplicates
            attention_bias = self.relative_bias(positions, positions, per_distance).add_(key_bias[:, None, None, :])
            compressed = block(compressed, attention_bias, state_scores)
            # (f) + write back (paper eq. 17/18): refined blocks get new means and deltas, the others new means only.
            new_refined = compressed[:, : num_refined * k].reshape(batch, num_refined, k, hidden)
            new_coarse = compressed[:, num_refined * k : num_refined * k + num_coarse]
            important = compressed[:, num_refined * k + num_coarse :]
            refined_means, refined_deltas = coarsen(new_refined, refined_mask)
            means = scatter_blocks(means, ranking, torch.cat([refined_means, new_coarse], dim=1))
            deltas = scatter_blocks(deltas, refined, refined_deltas)

            if all_hidden is not None:
                all_hidden.append(decompress(important, means, deltas, fine_mask, order)[:, :length])
            if output_compression_info:
                for name, value in (("selection_scores", scores), ("fine_block_indices", refined),
                                    ("coarse_block_indices", coarse), ("explored", explored),
                                    ("compressed_hidden_states", compressed)):
                    info[name].append(value)

        hidden_states = decompress(important, means, deltas, fine_mask, order)  # paper eq. 16
        if not output_compression_info:
            return hidden_states, None
        return hidden_states, VCCT5CompressionInfo(
            vip_sort_order=order,
            coarse_token_positions=mean_positions,
            coarse_token_mask=mean_mask,
            padded_length=padded_length,
            **{name: tuple(values) for name, values in info.items()},
        )


# ---------------------------------------------------------------------------------------------------------------------
# Tokenization helpers (the original collators' convention)
# ---------------------------------------------------------------------------------------------------------------------


def _encode_queries_and_contexts(
    tokenizer, queries, contexts, max_length=None, separator=QUERY_SEPARATOR, pad_token_id=None,
    length_name="max_length", query_name="query",
) -> tuple[dict[str, torch.Tensor], list[int]]:
    if isinstance(contexts, str):
        contexts = [contexts]
    contexts = list(contexts)
    queries = [queries] * len(contexts) if isinstance(queries, str) else list(queries)
    if len(queries) != len(contexts) or not contexts:
        raise ValueError(
            f"Pass one query per context (or one query string for all): got {len(queries)} queries for "
            f"{len(contexts)} contexts."
        )
    if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"`{length_name}` must be an integer >= 2 or None, got {max_length!r}.")
    texts = [query + separator + context for query, context in zip(queries, contexts)]
    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
    # The original marks the first len(tokenizer(query).input_ids) positions, i.e. the query's tokens including its
    # EOS: one context token beyond the query (the authors' collators in `src/t5/data/`). We keep that convention.
    vip_counts = [len(ids) for ids in tokenizer(queries, add_special_tokens=True)["input_ids"]]
    if max_length is not None:
        for row, vip_count in enumerate(vip_counts):
            if vip_count >= max_length:  # the cut row would hold the query alone (or part of it): no context at all
                raise ValueError(
                    f"`{length_name}`={max_length} leaves no room for the context of row {row}: its {query_name} "
                    f"({_shorten(queries[row])}) takes {vip_count} tokens (its EOS included); give a `{length_name}` "
                    f"above {vip_count} or a shorter {query_name}."
                )
    rows, dropped = zip(*(cut_to_length(ids, max_length, tokenizer.eos_token_id) for ids in encoded))
    if pad_token_id is None:
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids, attention_mask = pad_right(list(rows), pad_token_id)
    vip_mask = torch.zeros_like(attention_mask)
    for row, vip_count in enumerate(vip_counts):
        vip_mask[row, :vip_count] = attention_mask[row, :vip_count]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "vip_mask": vip_mask}, list(dropped)


def _shorten(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def prepare_vip_inputs(
    tokenizer, queries: str | list[str], contexts: str | list[str], max_length: int | None = None,
    separator: str = QUERY_SEPARATOR,
) -> BatchEncoding:
    """`input_ids`, `attention_mask` and `vip_mask` for VCC-T5, built as the original collators do.

    Each input is `query + separator + context` (separator `"\\n\\n\\n"`), right-padded to the longest row (the model
    pads internally to a valid length). The VIP tokens are the first `len(tokenizer(query).input_ids)` positions:
    the query's tokens, and because that count includes the query's EOS, one more token, as in the original. With
    `max_length`, longer inputs lose the end of their context (the final EOS is kept); a `max_length` that would
    leave a row its query alone raises a `ValueError`.

    Args:
        tokenizer: a T5-style tokenizer (appends EOS).
        queries: the VIP text (a question, `"summarize"`); one string for all contexts or one per context.
        contexts: the document(s).
        max_length: maximum tokens per row, or None (no truncation).
        separator: text between query and context.

    Example:

    ```python
    >>> inputs = prepare_vip_inputs(tokenizer, "Who wrote it?", [long_document])
    >>> answer_ids = model.generate(**inputs, max_new_tokens=32)
    ```
    """
    contexts = [contexts] if isinstance(contexts, str) else list(contexts)
    for row, context in enumerate(contexts):
        if not isinstance(context, str):
            raise ValueError(f"`contexts` must be a string or a list of strings, got {type(context).__name__} "
                             f"{_shorten(str(context))} for context {row}.")
    for row, query in enumerate([queries] if isinstance(queries, str) else list(queries)):
        # an empty query would make the first context token the row's only VIP token (its EOS count marks one)
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"`queries` must be non-empty text, got {query!r} for context {row} (a row without a "
                             f"question: ask {SUMMARIZATION_QUERY!r}, as `prepare_summarization_inputs` does).")
    encoding, _ = _encode_queries_and_contexts(tokenizer, queries, contexts, max_length, separator)
    return BatchEncoding(encoding)


@dataclass
class VCCT5DataCollator(DataCollatorForSeq2Seq):
    """`DataCollatorForSeq2Seq` that also pads `vip_mask` (with 0s, on the tokenizer's padding side) to the padded
    `input_ids` width, so that features of different lengths (e.g. from [`prepare_vip_inputs`] row by row) batch.

    ```python
    >>> collator = VCCT5DataCollator(tokenizer, model=model, label_pad_token_id=-100)
    >>> trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    ```
    """

    def __call__(self, features, return_tensors=None):
        if not features:
            raise ValueError("VCCT5DataCollator got an empty batch.")
        given = ["vip_mask" in feature and feature["vip_mask"] is not None for feature in features]
        if not any(given):  # (a `vip_mask` column of Nones is no mask either)
            return super().__call__([{k: v for k, v in feature.items() if k != "vip_mask"} for feature in features],
                                    return_tensors)
        if not all(given):
            raise ValueError("Some features have a `vip_mask` and others do not; give one to every feature or to none.")
        vip_masks = []
        for row, feature in enumerate(features):
            values = [value.item() if hasattr(value, "item") else value for value in feature["vip_mask"]]
            if len(values) != len(feature["input_ids"]):  # it marks that feature's own tokens, before padding
                raise ValueError(f"`vip_mask` of feature {row} has {len(values)} values but its `input_ids` has "
                                 f"{len(feature['input_ids'])} tokens; they must align.")
            if any(value not in (0, 1) for value in values):
                raise ValueError(f"`vip_mask` of feature {row} must hold 0 and 1 only, got {sorted(set(values))}.")
            vip_masks.append([int(value) for value in values])
        batch = super().__call__([{k: v for k, v in feature.items() if k != "vip_mask"} for feature in features],
                                 return_tensors)
        width = len(batch["input_ids"][0])
        padded = torch.zeros(len(vip_masks), width, dtype=torch.long)
        for row, values in enumerate(vip_masks):
            values = torch.tensor(values, dtype=torch.long)
            if self.tokenizer.padding_side == "left":
                padded[row, width - len(values):] = values
            else:
                padded[row, : len(values)] = values
        batch["vip_mask"] = padded if (return_tensors or self.return_tensors) == "pt" else padded.numpy()
        return batch


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


class VCCT5PreTrainedModel(HubReadyMixin, PreTrainedModel):
    config: VCCT5Config
    config_class = VCCT5Config
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["VCCT5EncoderBlock", "T5Block"]
    # As T5 (t5-base/large checkpoints): the feed-forward output projections stay float32 when loading in float16,
    # where their products overflow ("wo" is searched in parameter names: only the `DenseReluDense.wo` weights have it)
    _keep_in_fp32_modules = ["wo"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # forward and a decoding step with a static cache compile without graph breaks (tests/test_model_contract.py)
    _can_compile_fullgraph = True
    _hub_pipeline_auto_class = "AutoModelForSeq2SeqLM"
    _hub_auto_classes = {"AutoModel": "VCCT5Model", "AutoModelForSeq2SeqLM": "VCCT5ForConditionalGeneration"}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """T5's initialisation; N(0, initializer_factor²) for the embedding and an untied head (as T5)."""
        init_t5_module(module, self.config, init)


class _VCCT5Seq2Seq(T5Seq2SeqLMMixin, VCCT5PreTrainedModel):
    """Shared embedding, VCC encoder and T5 decoder; the public classes below add their outputs."""

    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: VCCT5Config):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = VCCT5Encoder(config, self.shared)
        self.decoder = T5DecoderStack(config, self.shared)

    def _encode(self, input_ids, attention_mask, vip_mask, inputs_embeds, encoder_outputs, output_hidden_states,
                output_compression_info) -> BaseModelOutput:
        if encoder_outputs is not None:
            return as_encoder_output(encoder_outputs, VCCT5EncoderOutput)
        if input_ids is None and inputs_embeds is None:
            raise ValueError("Pass `input_ids`, `inputs_embeds` or precomputed `encoder_outputs`; got none.")
        return self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            vip_mask=vip_mask,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_compression_info=output_compression_info,
            return_dict=True,
        )

    def prepare_summarization_inputs(
        self, tokenizer, documents: str | list[str], max_input_length: int | None = None
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """`generate()` kwargs for plain summarization of `documents` (a list, or one document as a string), the
        original's convention: `"summarize" + "\\n\\n\\n" + document`, with the tokens of `"summarize"` (its EOS
        included, as in the authors' data code) as VIP tokens. Returns the kwargs (`input_ids`, `attention_mask`,
        `vip_mask`) and the number of tokens dropped per document because of `max_input_length` (None: keep
        everything)."""
        documents = summarization_documents(documents)
        encoding, dropped = _encode_queries_and_contexts(
            tokenizer, SUMMARIZATION_QUERY, documents, max_input_length, pad_token_id=self.config.pad_token_id,
            length_name="max_input_length",
        )
        return {name: tensor.to(self.device) for name, tensor in encoding.items()}, dropped

    def prepare_question_inputs(
        self, tokenizer, question: str | list[str], documents: str | list[str], max_input_length: int | None = None
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """`generate()` kwargs to answer `question` (one string for every document, or one per document) from each
        document: `question + "\\n\\n\\n" + document`, the question's tokens (its EOS included) as VIP tokens, as
        the authors' query-based collators build them (see [`prepare_vip_inputs`]). `max_input_length` counts the
        question's tokens too; the number of tokens dropped per document is returned. A question of more tokens than
        `config.num_vip_slots` (its EOS included) gets a warning: its tokens beyond the slots are compressed like the
        document's, as in the authors' code. (The warning's text is the same for every question, so that Python's
        default filter shows it once, not once per question of a corpus.)"""
        documents = summarization_documents(documents, allow_empty=False)
        questions = question_per_document(question, len(documents))
        encoding, dropped = _encode_queries_and_contexts(
            tokenizer, questions, documents, max_input_length, pad_token_id=self.config.pad_token_id,
            length_name="max_input_length", query_name="question",
        )
        slots = self.config.num_vip_slots
        if int(encoding["vip_mask"].sum(dim=1).max()) > slots:  # each row's question tokens, its EOS included
            warnings.warn(
                f"A question is longer than the {slots} tokens this model keeps uncompressed (config.num_vip_slots, "
                "its EOS included): its tokens beyond them are compressed like the document's, as in the authors' "
                "code. Ask shorter questions, or use a model trained with more VIP slots (the authors' question-"
                "answering configurations have 32 to 288).",
                UserWarning,
                stacklevel=2,
            )
        return {name: tensor.to(self.device) for name, tensor in encoding.items()}, dropped


class VCCT5Model(_VCCT5Seq2Seq):
    """VCC-T5 without the LM head: returns the decoder's last hidden state (like `T5Model`)."""

    def __init__(self, config: VCCT5Config):
        super().__init__(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        vip_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        output_compression_info: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> VCCT5Seq2SeqModelOutput:
        r"""Arguments as [`VCCT5ForConditionalGeneration.forward`] without `labels`."""
        past_key_values = take_cache_argument(past_key_values, kwargs)
        reject_head_masks(kwargs)
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states)
        output_attentions = bool(output_attentions if output_attentions is not None else self.config.output_attentions)
        check_token_ids("decoder_input_ids", decoder_input_ids)
        encoder_outputs = self._encode(input_ids, attention_mask, vip_mask, inputs_embeds, encoder_outputs,
                                       output_hidden_states, output_compression_info)
        output = self._model_output(
            encoder_outputs,
            attention_mask,
            decoder_input_ids,
            decoder_attention_mask,
            decoder_inputs_embeds,
            past_key_values,
            use_cache=bool(use_cache if use_cache is not None else self.config.use_cache),
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            output_class=VCCT5Seq2SeqModelOutput,
            encoder_compression_info=getattr(encoder_outputs, "compression_info", None),
        )
        return output if returns_dict(return_dict, self.config) else output.to_tuple()


class VCCT5ForConditionalGeneration(_VCCT5Seq2Seq, GenerationMixin):
    """VCC-T5 with the (tied) LM head: question answering and summarization over very long inputs, `generate()`,
    training with `labels`.

    Example:

    ```python
    >>> import torch, longreach
    >>> from longreach import VCCT5Config, VCCT5ForConditionalGeneration
    >>> config = VCCT5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=4, num_heads=4,
    ...                      num_vanilla_layers=1, segment_length=128, num_vip_slots=16, block_size=8,
    ...                      num_refined_blocks=8)
    >>> model = VCCT5ForConditionalGeneration(config)
    >>> ids = torch.randint(2, 128, (1, 5000))                     # a long input
    >>> vip_mask = torch.zeros_like(ids); vip_mask[:, :6] = 1      # the question at its start
    >>> answer_ids = model.generate(ids, vip_mask=vip_mask, max_new_tokens=20, num_beams=2)
    ```
    """

    _tied_weights_keys = {**_VCCT5Seq2Seq._tied_weights_keys, "lm_head.weight": "shared.weight"}

    def __init__(self, config: VCCT5Config):
        super().__init__(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        vip_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        output_compression_info: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> VCCT5Seq2SeqLMOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, length)`): the input; any length, padded on either side.
        attention_mask (`torch.Tensor` of shape `(batch, length)`): 1 for real tokens, 0 for padding.
        vip_mask (`torch.Tensor` of shape `(batch, length)`): 1 for VIP tokens (the query, a task prefix; the
            original's `encoder_input_important_mask`); pass it to `generate()` too. When omitted, and for rows
            without any VIP, the first `config.num_vip_slots` real tokens are the VIP tokens.
        labels (`torch.LongTensor` of shape `(batch, target_length)`): target ids, -100 where ignored; the decoder
            inputs are derived from them (shift right) when `decoder_input_ids` is not given.
        output_compression_info (`bool`): return the encoder's [`VCCT5CompressionInfo`] (refined blocks per layer,
            selection scores, ...) as `encoder_compression_info`.
        """
        past_key_values = take_cache_argument(past_key_values, kwargs)
        reject_head_masks(kwargs)
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states)
        output_attentions = bool(output_attentions if output_attentions is not None else self.config.output_attentions)
        if use_cache is None:  # as T5: the config's, with labels too (training under checkpointing turns it off)
            use_cache = self.config.use_cache
        check_token_ids("decoder_input_ids", decoder_input_ids)
        encoder_outputs = self._encode(input_ids, attention_mask, vip_mask, inputs_embeds, encoder_outputs,
                                       output_hidden_states, output_compression_info)
        output = self._lm_head_output(
            encoder_outputs,
            attention_mask,
            decoder_input_ids,
            decoder_attention_mask,
            decoder_inputs_embeds,
            past_key_values,
            labels,
            use_cache=bool(use_cache),
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            num_items_in_batch=kwargs.pop("num_items_in_batch", None),
            output_class=VCCT5Seq2SeqLMOutput,
            encoder_compression_info=getattr(encoder_outputs, "compression_info", None),
        )
        return output if returns_dict(return_dict, self.config) else output.to_tuple()

    def generate(self, *args, output_compression_info: bool = False, **kwargs):
        """`GenerationMixin.generate()`; with `output_compression_info=True` and `return_dict_in_generate=True`, the
        output also has the encoder's [`VCCT5CompressionInfo`] as `encoder_compression_info` (the encoder runs once per
        `generate()`, as T5's encoder attentions are returned)."""
        if not output_compression_info:
            return super().generate(*args, **kwargs)
        generation_config = args[1] if len(args) > 1 else kwargs.get("generation_config")
        return_dict = kwargs.get("return_dict_in_generate",
                                 (generation_config or self.generation_config).return_dict_in_generate)
        if not return_dict:
            raise ValueError("generate(output_compression_info=True) returns the compression info only with "
                             f"return_dict_in_generate=True; got return_dict_in_generate={return_dict!r}.")
        encoder_outputs, caller = [], threading.get_ident()

        def record(module, inputs, output):  # this call's encoder only: threads may share the model
            if threading.get_ident() == caller:
                encoder_outputs.append(output)

        hook = self.get_encoder().register_forward_hook(record)
        try:
            output = super().generate(*args, output_compression_info=True, **kwargs)
        finally:
            hook.remove()
        if not encoder_outputs and kwargs.get("encoder_outputs") is not None:  # the caller ran the encoder
            encoder_outputs.append(as_encoder_output(kwargs["encoder_outputs"], VCCT5EncoderOutput))
        output["encoder_compression_info"] = getattr(encoder_outputs[0], "compression_info", None)
        return output

    def _get_candidate_generator(self, *args, **kwargs):
        """transformers' candidate generator (assisted decoding). An assistant that is not a VCC-T5 model (a T5 with
        this vocabulary, LOCOST) runs its own encoder over the whole input: this model's own `generate()` arguments
        (`vip_mask`, `output_compression_info`) are not passed on to it, as its generate() would refuse them."""
        generator = super()._get_candidate_generator(*args, **kwargs)
        assistant = getattr(generator, "assistant_model", None)
        assistant_kwargs = getattr(generator, "assistant_kwargs", None)
        if assistant is not None and isinstance(assistant_kwargs, dict):
            accepted = inspect.signature(assistant.forward).parameters
            for name in ("vip_mask", "output_compression_info"):
                if name not in accepted:
                    assistant_kwargs.pop(name, None)
        return generator
