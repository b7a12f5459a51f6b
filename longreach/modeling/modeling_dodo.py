"""Dodo: a Llama that compresses its context into nuggets (Qin et al., "Dodo: Dynamic Contextual Compression for
Decoder-only LMs", ACL 2024), with the numerics of the authors' code.

Compressor mode (paper §2.3, Fig. 3). For a context ``w_1..n`` and a decoder input ``y``:

    K_l, V_l  = Llama_φ(w)                          per-layer keys/values (RoPE at positions 0..n-1)   # Eq. 1, φ
    f         = RMSNorm_final(Llama_base[:ι](w))    adapters off, first ι layers                          # Eq. 6, §3
    s         = W2 · ReLU(W1 f + b1) + b2           scorer ϕ, raw logits                                  # Eq. 15
    idx       = TopK(s, k),  k = rounding(n · ratio), the last real token always kept                    # Eq. 14, fn. 4
    z_l       = (K_l[idx], V_l[idx])                nuggets: the φ cache entries of the selected tokens   # Eq. 5
    logits    = Llama_θ([z ; soft prompt ; y])      positions k + 0, 1, ...; every attention logit towards
                                                    nugget j gets + s_j (or s_j - stopgrad(s_j))         # Eq. 13, 17-18

The score term is folded into the additive 4-D attention mask handed to transformers' ``LlamaModel`` (eager and sdpa
both honour float masks), and the nuggets enter as the first ``K`` entries of the decoder's KV cache (a
``DodoCache``). Both LoRA adapters live inside the model (``peft.functional``), so one ``model.safetensors`` holds the
base weights, φ, θ, the scorer and the soft prompt.

Autoregressive mode (paper §2.2, Eq. 8-10; no released code): with ``config.recent_window = τ``, a call without nuggets
streams its tokens. The last τ..τ+stride tokens stay uncompressed (θ keys/values); whenever τ + stride tokens are
pending, the oldest ``stride`` are compressed into new nuggets (φ pass over ``[previous nuggets ; chunk]``, scorer on
the chunk, top-k by ratio or threshold Λ) and the θ states of the remaining τ tokens are recomputed over
``[all nuggets ; soft prompt ; recent tokens]``. Feeding a text in one call or token by token gives the same logits.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import math
import numbers
import os
import threading
import weakref
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial, wraps
from pathlib import Path

import torch
from peft import LoraConfig
from peft.functional import inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.llama.modeling_llama import LlamaModel, LlamaPreTrainedModel
from transformers.utils import ModelOutput, logging

from ..configuration.config_overrides import check_config_fields
from ..configuration.configuration_dodo import DodoLlamaConfig
from .input_checks import (
    cache_field,
    check_binary_mask,
    check_mask,
    check_hidden_states,
    check_rows_not_empty,
    check_token_ids,
    describe,
    pad_right,
    question_per_document,
    reject_head_masks,
    summarization_documents,
    supports_float64,
    take_cache_argument,
    values_readable,
)
from .remote_code import HubReadyMixin

logger = logging.get_logger(__name__)
#: The name of ``LlamaModel.forward``'s key/value cache argument: ``cache`` from transformers 5.24 on (which deprecates
#: the old name), ``past_key_values`` before.
LLAMA_CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
#: `from_pretrained` options that are also config attributes (``dtype``), or that it applies to a config object
#: itself: `from_base_model` leaves them to it.
_FROM_PRETRAINED_OPTIONS = frozenset({"dtype", "torch_dtype", "attn_implementation", "experts_implementation",
                                      "quantization_config", "generation_config"})

#: The paper's summarization prompt (Appendix D.3): ``[INST]\n$DOCUMENT\nPlease summarize the above document in one
#: sentence.\n[/INST]``. The part before the document is compressed with it; the rest is the decoder prompt.
SUMMARIZATION_CONTEXT_PREFIX = "[INST]\n"
SUMMARIZATION_PROMPT = "\nPlease summarize the above document in one sentence.\n[/INST]"
#: The paper's question-answering prompt (Appendix D.2, SQuAD): ``[INST]\n$DOCUMENT\nBased on the provided document,
#: answer the following question:\n$QUESTION\n[/INST]``; the context is compressed as for summarization.
QUESTION_PROMPT = "\nBased on the provided document, answer the following question:\n{question}\n[/INST]"


# ---------------------------------------------------------------------------------------------------------------------
# Outputs and cache
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class DodoNuggets(ModelOutput):
    """What [`DodoLlamaForCausalLM.compress`] returns: the context as nuggets.

    Args:
        key_values (`tuple` of `(key, value)` per layer, each `[batch, num_key_value_heads, K, head_dim]`):
            The φ-pass cache entries of the selected tokens; keys carry RoPE at the tokens' own positions.
        mask (`torch.BoolTensor` of shape `[batch, K]`):
            Which slots hold a nugget. Rows with fewer nuggets than the batch maximum end with padding slots.
        scores (`torch.FloatTensor` of shape `[batch, K]`):
            Raw scorer logits of the selected tokens (differentiable; padding slots too). They are added to the
            decoder's attention logits towards each nugget.
        indices (`torch.LongTensor` of shape `[batch, K]`):
            Column of each nugget in the context `input_ids`, ascending among the real slots.
        positions (`torch.LongTensor` of shape `[batch, K]`):
            RoPE position of each nugget (its index among the real tokens of its row).
        all_scores (`torch.FloatTensor` of shape `[batch, n]`):
            Scorer logits of every context token (meaningless at padding).
        features (`torch.FloatTensor` of shape `[batch, n, hidden_size]`, *optional*):
            Scorer input features, returned with `output_features=True`.
        config_fingerprint (`str`):
            Identifies the configuration that produced the nuggets; a model with another one refuses them.
    """

    key_values: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    mask: torch.BoolTensor | None = None
    scores: torch.FloatTensor | None = None
    indices: torch.LongTensor | None = None
    positions: torch.LongTensor | None = None
    all_scores: torch.FloatTensor | None = None
    features: torch.FloatTensor | None = None
    config_fingerprint: str | None = None

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def num_nuggets(self) -> torch.LongTensor:
        """Real nuggets per row, ``[batch]``."""
        return self.mask.sum(dim=1)

    def repeat_interleave(self, repeats: int) -> "DodoNuggets":
        """Each row repeated ``repeats`` times (for beam search and ``num_return_sequences``)."""
        if repeats == 1:
            return self

        def rep(tensor):
            return None if tensor is None else tensor.repeat_interleave(repeats, dim=0)

        return DodoNuggets(
            key_values=tuple((rep(k), rep(v)) for k, v in self.key_values),
            mask=rep(self.mask),
            scores=rep(self.scores),
            indices=rep(self.indices),
            positions=rep(self.positions),
            all_scores=rep(self.all_scores),
            features=rep(self.features),
            config_fingerprint=self.config_fingerprint,
        )


def _is_a(value, cls: type) -> bool:
    """``isinstance``, or an instance of the class of that name from another copy of its file: where longreach is not
    installed, transformers loads each checkpoint folder's code as a module of its own, so the nuggets, the config or
    the model of one folder are not instances of another folder's classes (same code, same fingerprint)."""
    module = cls.__module__.rsplit(".", 1)[-1]
    return isinstance(value, cls) or any(
        klass.__name__ == cls.__name__ and klass.__module__.rsplit(".", 1)[-1] == module
        for klass in type(value).__mro__
    )


class DodoCache(DynamicCache):
    """The decoder's KV cache: per layer ``[K nugget slots ; soft prompt ; tokens]``, plus what generate() cannot know.

    Its length is not the number of tokens seen: ``seen_tokens`` counts the token columns the
    model has processed, ``nugget_mask``/``nugget_scores`` describe the first K slots, ``decoder_mask`` the columns
    after them. In autoregressive mode it also keeps the ids of the uncompressed tokens, which the next compression
    needs. Every per-row tensor follows beam reordering.
    """

    _row_tensors = (
        "nugget_mask",
        "nugget_scores",
        "decoder_mask",
        "pending_ids",
        "pending_mask",
        "compressed_real_tokens",
    )

    def __init__(self, config: DodoLlamaConfig):
        super().__init__(config=config)
        self._set_empty_state()

    def restart(self) -> None:
        """Empty the cache as new (its layers and its state), keeping the object: a cache the caller made and passed to
        `forward` before any call could fill it (one that failed midway may have left keys, values and state)."""
        self.reset_layers()
        self._set_empty_state()

    def _set_empty_state(self) -> None:
        self.nugget_mask: torch.Tensor | None = None
        self.nugget_scores: torch.Tensor | None = None
        self.decoder_mask: torch.Tensor | None = None
        self.soft_prompt_length = 0
        self.seen_tokens = 0
        self.started = False
        # autoregressive mode
        self.autoregressive = False
        self.pending_ids: torch.Tensor | None = None
        self.pending_mask: torch.Tensor | None = None
        self.compressed_tokens = 0
        self.compressed_real_tokens: torch.Tensor | None = None
        self.left_padded = False  # some row starts with padding (refused at the first compression)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The number of *token* columns processed (``seen_tokens``), as transformers' generation utilities read it
        (e.g. assisted decoding computes how many columns to ``crop`` from it): the nugget slots and the soft prompt
        before them are not tokens of the sequence. The layers' own lengths still count every column."""
        return self.seen_tokens

    @property
    def num_nugget_slots(self) -> int:
        return 0 if self.nugget_mask is None else self.nugget_mask.shape[1]

    def nuggets_per_row(self, batch_size: int, device) -> torch.Tensor:
        if self.nugget_mask is None:
            return torch.zeros(batch_size, dtype=torch.long, device=device)
        return self.nugget_mask.sum(dim=1)

    def set_nuggets(self, key_values, mask: torch.Tensor, scores: torch.Tensor) -> None:
        """Empty the cache and put ``key_values`` in its first slots."""
        self.reset_layers()
        for layer_idx, (key, value) in enumerate(key_values):
            self.update(key, value, layer_idx)
        self.nugget_mask, self.nugget_scores = mask, scores
        self.decoder_mask, self.soft_prompt_length = None, 0

    def reset_layers(self) -> None:
        for layer in self.layers:
            layer.reset()

    def nugget_key_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        k = self.num_nugget_slots
        return [(layer.keys[:, :, :k], layer.values[:, :, :k]) for layer in self.layers]

    def _map_rows(self, fn) -> None:
        for name in self._row_tensors:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_rows(lambda tensor: tensor[indices])

    def crop(self, max_length: int) -> None:
        """Drop the last token columns (assisted decoding rolls back rejected candidates). As for a
        ``DynamicCache``, ``max_length >= 0`` is the number of *tokens* to keep (the nugget slots and the soft
        prompt always stay) and a negative value the number of tokens to remove (at most the tokens it holds). Not in
        autoregressive mode, where tokens already compressed cannot be taken back."""
        if self.autoregressive:
            raise ValueError("A DodoCache in autoregressive mode cannot drop tokens (they may be compressed already).")
        tokens_to_remove = max(self.seen_tokens - max_length, 0) if max_length >= 0 else -max_length
        tokens_to_remove = min(tokens_to_remove, self.seen_tokens)  # never into the soft prompt or the nugget slots
        if tokens_to_remove:
            super().crop(-tokens_to_remove)
            self.decoder_mask = self.decoder_mask[:, :-tokens_to_remove]
            self.seen_tokens -= tokens_to_remove


# ---------------------------------------------------------------------------------------------------------------------
# Small tensor helpers
# ---------------------------------------------------------------------------------------------------------------------


def token_positions(mask: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.LongTensor:
    """RoPE position of every column: real tokens count the real tokens before them (right and left padding alike);
    padding columns get ``column - leading padding`` (clamped at 0), so right padding keeps ``arange`` as the authors'
    code does."""
    mask = mask.bool()
    length = mask.shape[1]
    columns = torch.arange(length, device=mask.device)
    leading = torch.where(
        mask.any(dim=1), mask.int().argmax(dim=1), torch.full_like(mask[:, 0], length, dtype=torch.long)
    )
    positions = torch.where(mask, mask.long().cumsum(dim=1) - 1, (columns[None, :] - leading[:, None]).clamp(min=0))
    offset = offset[:, None] if isinstance(offset, torch.Tensor) else offset
    return positions + offset


def last_real_column(mask: torch.Tensor) -> torch.LongTensor:
    """Index of each row's last real token (the forced nugget; correct for right and left padding)."""
    return mask.shape[1] - 1 - mask.flip(dims=[1]).int().argmax(dim=1)


#: Dodo settings the model's modules are made from at construction (its LoRA layers and its soft prompt). Assigned to
#: `model.config` afterwards, another value would not reach them (only the code that reads the config: `lora_layers`
#: decides where the scorer reads its features), and a saved config.json would describe other weights.
BUILT_SETTINGS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_layers",
    "encoder_adapter_name",
    "decoder_adapter_name",
    "soft_prompt_length",
)


def _comparable_setting(name: str, value, num_hidden_layers: int):
    """A built setting as the model uses it: LoRA layers and target modules as sorted sets (`None`: every layer). Any
    other value (`lora_target_modules=None`) is kept as it is, so that it compares unequal and is named."""
    if name == "lora_layers" and value is None:
        return list(range(num_hidden_layers))
    if name in ("lora_layers", "lora_target_modules") and isinstance(value, (list, tuple)):
        return sorted(set(value))
    return value


def _config_fingerprint(config: DodoLlamaConfig) -> str:
    fields = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "nugget_layer",
        "scorer_features",
        "lora_r",
        "lora_target_modules",
        "lora_layers",
        "encoder_adapter_name",
        "decoder_adapter_name",
        "soft_prompt_length",
        "rope_parameters",
    )
    payload = json.dumps({name: getattr(config, name, None) for name in fields}, sort_keys=True, default=str)
    return hashlib.sha1(payload.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------------
# Adapter switching and activation checkpointing
# ---------------------------------------------------------------------------------------------------------------------


def _active_adapter(lora_layers: list[BaseTunerLayer]) -> tuple[str, ...] | None:
    """The adapter(s) these LoRA layers run with (all Dodo's layers share one state), ``None`` if disabled."""
    if not lora_layers or lora_layers[0].disable_adapters:
        return None
    return tuple(lora_layers[0].active_adapters)


def _activate_adapter(lora_layers: list[BaseTunerLayer], adapter: str | tuple[str, ...] | None) -> None:
    """Run ``lora_layers`` with ``adapter`` (``None``: adapters disabled), leaving every ``requires_grad`` as it was.

    PEFT's ``set_adapter`` / ``enable_adapters`` also change ``requires_grad`` (they freeze the inactive adapter,
    which silently zeroes φ's gradient in a joint step), so the flags are restored."""
    flags = [(param, param.requires_grad) for layer in lora_layers for param in layer.parameters()]
    for layer in lora_layers:
        if adapter is None:
            layer.enable_adapters(False)  # "adapters disabled", done layer by layer inside the class
        else:
            layer.set_adapter(list(adapter) if isinstance(adapter, tuple) else adapter)
            layer.enable_adapters(True)
    for param, flag in flags:
        param.requires_grad_(flag)


# (model, nuggets) of the generate() call running in this thread (or asyncio task): the nuggets its assistant of another
# configuration drafts from (see `generate`); threads sharing the model each have their own.
_ASSISTANT_NUGGETS: ContextVar[tuple | None] = ContextVar("dodo_assistant_nuggets", default=None)

# `GenerationMixin.generate`'s positional parameters after `inputs` and `generation_config` (logits_processor,
# stopping_criteria, ..., streamer): Dodo's generate() takes them in that order too, as T5 and Llama do.
_GENERATE_POSITIONAL = tuple(
    name for name, parameter in list(inspect.signature(GenerationMixin.generate).parameters.items())[3:]
    if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
)

# One lock per model (created on first use; a deep copy gets its own): see `_one_call_at_a_time`.
_CALL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CALL_LOCKS_GUARD = threading.Lock()


def _call_lock(model: nn.Module) -> threading.RLock:
    lock = _CALL_LOCKS.get(model)
    if lock is None:
        with _CALL_LOCKS_GUARD:
            lock = _CALL_LOCKS.setdefault(model, threading.RLock())
    return lock


def _one_call_at_a_time(method):
    """Run ``method`` holding the model's lock. A Dodo call switches the LoRA layers between φ and θ (state of the
    layers, shared by every thread that uses the model) and may hook a decoder layer for the duration of a pass, so
    threads sharing one model (a server's worker threads) take turns, call by call: each call gives what it gives
    alone. Reentrant: a call's own inner calls (`forward` compressing its context) never wait. Not inside
    ``torch.compile``, which cannot trace a lock (``fullgraph=True`` failed: "Unsupported context manager"): a compiled
    call runs without it."""

    @wraps(method)
    def locked(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return method(self, *args, **kwargs)
        with _call_lock(self):
            return method(self, *args, **kwargs)

    return locked


@contextmanager
def _adapter_activated(lora_layers: list[BaseTunerLayer], adapter: tuple[str, ...] | None):
    previous = _active_adapter(lora_layers)
    if previous != adapter:
        _activate_adapter(lora_layers, adapter)
    try:
        yield
    finally:  # also when a non-reentrant checkpoint stops its recomputation early (by raising)
        if previous != adapter:
            _activate_adapter(lora_layers, previous)


class _LayerKeyValues:
    """What a checkpointed decoder layer sees as its KV cache: ``update`` returns ``[cached prefix ; new]`` as a
    ``DynamicCache`` does, but stores nothing; it keeps the new keys/values for the caller, which appends them to the
    real cache once. Replaying the layer in the backward pass therefore writes nothing twice."""

    def __init__(self, prefix_keys: torch.Tensor | None, prefix_values: torch.Tensor | None):
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        self.new_keys = self.new_values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.new_keys, self.new_values = key_states, value_states
        if self.prefix_keys is None:
            return key_states, value_states
        return (
            torch.cat([self.prefix_keys, key_states], dim=-2),
            torch.cat([self.prefix_values, value_states], dim=-2),
        )


class _ZeroGradientTie(torch.autograd.Function):
    """``tensor`` unchanged, with ``output`` joined to its graph: the backward pass gives ``output`` a gradient of
    zeros. For a pass whose keys and values are used but whose output is not (a compression pass), so that the last
    layer's output still receives a gradient: FSDP gathers a sharded layer's weights for its backward pass when a
    gradient reaches that layer's output, and without one the weights the decoder pass's backward already freed were
    missing ("setStorage: ... storage of size 0"). The other gradients do not change; the parameters that only the
    unused output depends on (φ's q and o in the last layer) get zeros instead of no gradient, which moves them under
    AdamW's weight decay (they change no output). DeepSpeed ZeRO-3 needs no join: it trains Dodo as it is
    (tests/test_distributed.py, with DeepSpeed 0.19.8)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        ctx.output_shape, ctx.output_dtype = output.shape, output.dtype
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_zeros(ctx.output_shape, dtype=ctx.output_dtype)


def _layers_are_sharded(layers: nn.ModuleList) -> bool:
    """Whether FSDP made the decoder layers (or modules inside them, under a wrapper) units of their own
    (``fully_shard`` or FSDP1's wrapper)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(module, (FSDPModule, FullyShardedDataParallel)) for module in layers.modules())


def _rows_left_padded(mask: torch.Tensor) -> bool:
    """Whether some row of a batch of several starts with padding (what generate() makes of prompts of different
    lengths); a mask whose values cannot be read here (under tracing) counts as not padded."""
    return mask.shape[0] > 1 and values_readable(mask) and not bool(mask[:, 0].all())


def _left_padding_refused(reaches: str, remedies: str) -> ValueError:
    """The autoregressive mode's refusal of a left-padded batch that reaches a compression (``reaches``: which call,
    and where), with what to do instead."""
    return ValueError(
        f"Dodo's autoregressive mode (`config.recent_window`) compresses all rows of a batch at the same columns, and "
        f"{reaches}: rows padded on the left would not give the results they give alone. {remedies}"
    )


def _assisted_decoding_refused(which: str, window: int) -> ValueError:
    return ValueError(
        "Assisted decoding (`assistant_model`, `prompt_lookup_num_tokens` or `assistant_early_exit`) is not supported "
        f"with {which} in Dodo's autoregressive mode (`config.recent_window`={window}): rejected draft tokens cannot "
        "be taken back from a cache that compresses its oldest tokens as it goes. Generate without an assistant, or "
        "give the context as `context_input_ids` (compressor mode)."
    )


def _checkpoint_decoder_layer(layer: nn.Module, checkpoint_function, layer_forward: partial, *args):
    """A Dodo decoder layer's ``_gradient_checkpointing_func`` (installed by ``DodoLlamaModel``).

    transformers' ``GradientCheckpointingLayer`` calls it in training as ``func(partial(forward, layer, **kwargs),
    hidden_states)``; the cache stays in ``kwargs`` because the layers set ``_can_checkpoint_with_cache`` (otherwise it
    would be dropped, and with it the nuggets, which enter the θ pass as the cache's first entries, and the φ keys and
    values, which leave the φ pass through the cache). Three things make the backward replay compute what the forward
    computed:

    - the adapter the layer ran with (φ, θ or none: one training step switches between them) is activated again;
    - the layer writes into a `_LayerKeyValues` over the cache's current entries; its new keys/values leave the
      checkpointed region as outputs and are appended to the real cache here, once;
    - every tensor that needs a gradient is an explicit input (the hidden states, the additive mask that carries the
      nugget scores, the cached nuggets) or output (the new keys/values): ``use_reentrant=True`` runs the forward under
      ``no_grad`` and returns gradients for the inputs only.
    """
    if not torch.is_grad_enabled():  # e.g. generate() on a model left in train mode: nothing to save memory for
        return layer_forward(*args)
    # transformers >= 5.24 hands the layers the cache as `cache`, earlier 5.x as `past_key_values`
    cache_keyword = next((name for name in ("cache", "past_key_values") if name in layer_forward.keywords),
                         LLAMA_CACHE_ARGUMENT)
    cache = layer_forward.keywords.get(cache_keyword)
    attention_mask = layer_forward.keywords.get("attention_mask")
    layer_idx = layer.self_attn.layer_idx
    lora_layers = [module for module in layer.modules() if isinstance(module, BaseTunerLayer)]
    adapter = _active_adapter(lora_layers)
    prefix_keys = prefix_values = None
    if cache is not None and layer_idx < len(cache.layers) and cache.layers[layer_idx].get_seq_length() > 0:
        prefix_keys, prefix_values = cache.layers[layer_idx].keys, cache.layers[layer_idx].values

    def run(attention_mask, prefix_keys, prefix_values, *args):
        key_values = None if cache is None else _LayerKeyValues(prefix_keys, prefix_values)
        with _adapter_activated(lora_layers, adapter):
            hidden_states = layer_forward(*args, attention_mask=attention_mask, **{cache_keyword: key_values})
        return hidden_states if key_values is None else (hidden_states, key_values.new_keys, key_values.new_values)

    outputs = checkpoint_function(run, attention_mask, prefix_keys, prefix_values, *args)
    if cache is None:
        return outputs
    hidden_states, keys, values = outputs
    cache.update(keys, values, layer_idx)
    return hidden_states


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


class DodoLlamaPreTrainedModel(HubReadyMixin, LlamaPreTrainedModel):
    config: DodoLlamaConfig
    config_class = DodoLlamaConfig
    base_model_prefix = "model"
    # Activation checkpointing keeps the KV cache (nuggets enter the θ pass through it, φ keys/values leave the φ pass
    # through it) and replays each layer with the adapter it ran with: see `_checkpoint_decoder_layer`.
    supports_gradient_checkpointing = True
    # The score term lives in an additive float mask: kernels that ignore such masks would silently drop it.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_sdpa = True
    _can_compile_fullgraph = False
    _hub_auto_classes = {"AutoModel": "DodoLlamaForCausalLM", "AutoModelForCausalLM": "DodoLlamaForCausalLM"}
    _hub_pipeline_auto_class = "AutoModelForCausalLM"


class DodoLlamaModel(LlamaModel):
    """transformers' ``LlamaModel`` whose weight initialisation knows the LoRA layers injected into it.

    transformers initialises the modules of a nested ``PreTrainedModel`` with that model's own ``_init_weights``, and
    its generic ``nn.Linear`` rule would make ``lora_B`` non-zero. LoRA linears are tagged
    at injection; here ``lora_B`` is zeroed and ``lora_A`` gets PEFT's Kaiming-uniform initialisation, so a fresh
    adapter starts as the identity change (also for LoRA keys missing from a checkpoint).
    """

    config_class = DodoLlamaConfig

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        role = getattr(module, "_dodo_lora_role", None)
        if role == "B":
            init.zeros_(module.weight)
        elif role == "A":
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        else:
            super()._init_weights(module)

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func=checkpoint, every_n_layers: int = 1
    ) -> None:
        """transformers' switch, then each decoder layer checkpoints through `_checkpoint_decoder_layer`, which keeps
        the KV cache (``_can_checkpoint_with_cache``) and makes its replay write-free and adapter-aware."""
        super()._set_gradient_checkpointing(enable, gradient_checkpointing_func, every_n_layers)
        for layer in self.layers:
            layer._can_checkpoint_with_cache = enable
            if enable:
                layer._gradient_checkpointing_func = partial(
                    _checkpoint_decoder_layer, layer, gradient_checkpointing_func
                )

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._refuse_wrapped_checkpointing()
        return super().forward(*args, **kwargs)

    def _refuse_wrapped_checkpointing(self) -> None:
        """torch's ``checkpoint_wrapper`` (what FSDP's ``activation_checkpointing`` and accelerate's put around each
        layer) replays a layer in the backward pass with the cache it wrote to, which then holds its keys and values
        twice (seen: "The size of tensor a (24) must match the size of tensor b (14)"). Dodo's own checkpointing keeps
        the replay write-free (`_checkpoint_decoder_layer`)."""
        wrapped = next((index for index, layer in enumerate(self.layers)
                        if any(type(module).__name__ == "CheckpointWrapper" for module in layer.modules())), None)
        if wrapped is not None:
            # transformers 5.24 calls it activation checkpointing (`gradient_checkpointing*`: deprecated aliases)
            name = "activation" if hasattr(self, "activation_checkpointing_enable") else "gradient"
            raise ValueError(
                f"Decoder layer {wrapped} is wrapped by torch's CheckpointWrapper (the FSDP config's or accelerate's "
                "`activation_checkpointing`), whose replay would write the layer's keys and values into Dodo's cache "
                "a second time. Turn it off and use the model's own activation checkpointing instead: "
                f"`model.{name}_checkpointing_enable()` or `TrainingArguments({name}_checkpointing=True)`."
            )


class DodoLlamaForCausalLM(DodoLlamaPreTrainedModel, GenerationMixin):
    """Dodo on Llama: ``compress()`` a context into nuggets, then decode with θ conditioned on them.

    Example:

    ```python
    >>> import torch, longreach
    >>> from longreach import DodoLlamaConfig, DodoLlamaForCausalLM
    >>> model = DodoLlamaForCausalLM(DodoLlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
    ...     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, lora_r=8)).eval()
    >>> context, prompt = torch.randint(3, 128, (1, 300)), torch.randint(3, 128, (1, 5))
    >>> nuggets = model.compress(context)                    # 30 nuggets instead of 300 tokens
    >>> logits = model(prompt, nuggets=nuggets).logits        # [1, 5, 128]
    >>> out = model.generate(prompt, nuggets=nuggets, max_new_tokens=8)
    >>> out = model.generate(input_ids=prompt, context_input_ids=context, max_new_tokens=8, num_beams=2)
    ```

    Model state: the base Llama (frozen), LoRA φ (``config.encoder_adapter_name``) and θ
    (``config.decoder_adapter_name``) on ``config.lora_target_modules``, the scorer ``nugget_scorer``
    (``Linear(d, d) -> ReLU -> Linear(d, 1)``) and ``soft_prompt`` (``[soft_prompt_length, d]``). In a float16 or
    bfloat16 model the last three stay float32, as PEFT's adapters do; ``autocast_adapter_dtype=False`` (also a
    ``from_pretrained`` keyword, as in PEFT) keeps them in the model's dtype.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DodoLlamaConfig, autocast_adapter_dtype: bool = True):
        if not isinstance(autocast_adapter_dtype, bool):
            raise ValueError(
                "`autocast_adapter_dtype` must be True (float32 adapters, scorer and soft prompt on a float16 or "
                f"bfloat16 model, as PEFT keeps adapters) or False, got {autocast_adapter_dtype!r}."
            )
        super().__init__(config)
        self.model = DodoLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.nugget_scorer = nn.Sequential(
            nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(), nn.Linear(config.hidden_size, 1)
        )
        self.soft_prompt = (
            nn.Embedding(config.soft_prompt_length, config.hidden_size) if config.soft_prompt_length > 0 else None
        )
        lora_config = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=config.lora_target_regex,
            bias="none",
        )
        for name in config.adapter_names:
            inject_adapter_in_model(lora_config, self.model, adapter_name=name)
            if hasattr(
                self.model, "peft_config"
            ):  # the LoRA settings live in our config; no PEFT-integration side paths
                del self.model.peft_config
        for layer in self._lora_layers():
            for name in layer.lora_A:
                layer.lora_A[name]._dodo_lora_role = "A"
                layer.lora_B[name]._dodo_lora_role = "B"
        self._dodo_active_adapter = ()  # sentinel: nothing selected yet
        self._dodo_built_settings = {name: copy.deepcopy(getattr(config, name)) for name in BUILT_SETTINGS}
        if autocast_adapter_dtype:
            self._upcast_trainable_weights()
        self.post_init()
        self.freeze_base_model()

    # -----------------------------------------------------------------------------------------------------------------
    # Adapters and freezing
    # -----------------------------------------------------------------------------------------------------------------

    def _lora_layers(self) -> list[BaseTunerLayer]:
        layers = self.__dict__.get("_dodo_lora_layer_list")
        if layers is None:
            layers = [module for module in self.model.modules() if isinstance(module, BaseTunerLayer)]
            self.__dict__["_dodo_lora_layer_list"] = layers
        return layers

    def _check_own_adapters(self) -> None:
        """Dodo switches its LoRA layers between φ and θ itself, at every call. Adapters added to it with PEFT
        (``get_peft_model``, ``add_adapter``) would then be left inactive, or trained beside Dodo's own parameters and
        saved without them, and ``merge_and_unload`` of such a wrapper removes φ and θ: refuse all three."""
        own = set(self.config.adapter_names)
        found = [module for module in self.modules() if isinstance(module, BaseTunerLayer)]
        foreign = sorted({
            adapter for module in found for attribute in getattr(module, "adapter_layer_names", ())
            for adapter in (getattr(module, attribute, None) or {}) if adapter not in own
        })
        expected = self._lora_layers()
        if not foreign and len(found) == len(expected) and all(a is b for a, b in zip(found, expected)):
            return
        what = (f"adapters {foreign} were added to it" if foreign
                else f"{len(expected)} LoRA layers holding {sorted(own)} were expected, {len(found)} are there "
                     "(were they merged or unloaded?)")
        raise ValueError(
            f"This DodoLlamaForCausalLM's LoRA layers were changed from outside: {what}. Dodo runs its own adapters "
            f"{sorted(own)} (φ compresses, θ decodes) and switches between them at every call, so PEFT adapters added "
            "to it (`get_peft_model`, `add_adapter`) are not supported, and `merge_and_unload` would remove φ and θ. "
            "To fine-tune Dodo, train its own adapters, scorer and soft prompt (examples/finetune_dodo.py); to use θ on "
            "a plain Llama, see `export_peft_adapters`."
        )

    def _check_config(self) -> None:
        """`model.config` as this model can run it. Dodo's settings are read at every call, so one assigned after
        loading counts: it must be valid (`DodoLlamaConfig.validate_dodo`, which `save_pretrained` runs too, only then),
        and those the modules were built from (`BUILT_SETTINGS`) must be unchanged."""
        layers = self.config.num_hidden_layers
        for name, built in self._dodo_built_settings.items():
            value = getattr(self.config, name)
            if _comparable_setting(name, value, layers) != _comparable_setting(name, built, layers):
                raise ValueError(
                    f"`config.{name}` was changed to {value!r} after the model was built with {built!r}: the LoRA "
                    "layers and the soft prompt are made from it at construction, so the change would not apply to "
                    "them (and `save_pretrained` would write a config that does not describe the weights). Set it "
                    "back, or build a model with it (`DodoLlamaForCausalLM(config)`, or "
                    f"`from_pretrained(path, {name}=...)` where the checkpoint's weights fit it)."
                )
        self.config.validate_dodo()

    def _check_model_state(self) -> None:
        """What every call that starts from scratch checks first: the config (`_check_config`), then the adapters."""
        self._check_config()
        self._check_own_adapters()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` (with the code files, see `HubReadyMixin`), refused before anything is
        written where `model.config` no longer describes the model (`_check_config`)."""
        self._check_config()
        return super().save_pretrained(save_directory, *args, **kwargs)

    @_one_call_at_a_time
    def set_active_adapter(self, adapter_name: str | None) -> None:
        """Run the backbone with adapter ``adapter_name`` (φ or θ name), or with no adapter (``None``).

        The trainable flags PEFT changes when switching are restored (`_activate_adapter`), so switching never changes
        what is trained.
        """
        if adapter_name is not None and adapter_name not in self.config.adapter_names:
            raise ValueError(
                f"`adapter_name` must be one of {self.config.adapter_names} or None, got {adapter_name!r}."
            )
        if self._dodo_active_adapter == adapter_name:
            return
        _activate_adapter(self._lora_layers(), adapter_name)
        self._dodo_active_adapter = adapter_name

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func=checkpoint, every_n_layers: int = 1
    ) -> None:
        # every checkpointed layer lives in the backbone, which installs Dodo's cache- and adapter-aware version
        self.model._set_gradient_checkpointing(enable, gradient_checkpointing_func, every_n_layers)

    @staticmethod
    def _is_trainable_weight(name: str) -> bool:
        """Whether parameter ``name`` is one of Dodo's own trainable weights (adapters, scorer, soft prompt)."""
        return ".lora_A." in name or ".lora_B." in name or name.startswith(("nugget_scorer.", "soft_prompt."))

    def _upcast_trainable_weights(self) -> None:
        """float16 / bfloat16 adapters, scorer and soft prompt to float32, as PEFT's ``get_peft_model`` and
        ``PeftModel.from_pretrained`` do (``autocast_adapter_dtype=True``): in 16 bits most small optimizer updates
        would round away. Run at construction, so that ``from_pretrained(dtype=torch.bfloat16)`` loads these weights
        into float32 (a float32 checkpoint's without rounding). The LoRA layers cast their input to the adapter's dtype
        and the result back; the scorer and the soft prompt do the same in `_compress` and `_decode`. A later
        ``.to(dtype)`` casts them with the rest, as it does a PEFT model's."""
        if is_deepspeed_zero3_enabled():  # ZeRO-3 partitions the weights at construction and sets their dtypes
            return
        for name, param in self.named_parameters():
            if self._is_trainable_weight(name) and param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.to(torch.float32)

    def freeze_base_model(self) -> None:
        """Train only the adapters, the scorer and the soft prompt (the authors' setting).

        Called at construction and after ``from_pretrained``, which otherwise leaves every parameter trainable
        (base weights included). To fine-tune more, set ``requires_grad`` yourself afterwards.
        """
        for name, param in self.named_parameters():
            param.requires_grad_(self._is_trainable_weight(name))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained``, then the base is frozen again (loading leaves everything trainable).

        A plain Llama checkpoint has ``q_proj.weight`` where the LoRA-wrapped model has ``q_proj.base_layer.weight``
        (PEFT's renaming); loading it without a key mapping would leave random attention weights. Use
        [`~DodoLlamaForCausalLM.from_base_model`] for Llama checkpoints; passing a `DodoLlamaConfig` as `config=` adds
        the mapping automatically, and anything else that leaves a ``base_layer`` weight missing raises.
        """
        if kwargs.get("tp_plan") is not None:
            raise ValueError(
                f"`tp_plan={kwargs['tp_plan']!r}`: tensor parallelism is not supported by Dodo (its attention projections "
                "are LoRA wrappers holding two adapters, which transformers' plans cannot shard). Pass tp_plan=None and "
                "train with data parallelism (torchrun/accelerate DDP, FSDP or DeepSpeed ZeRO); see the README."
            )
        config = kwargs.get("config")
        if kwargs.get("key_mapping") is None and _is_a(config, DodoLlamaConfig):
            kwargs["key_mapping"] = cls.base_llama_key_mapping(config)
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        missing_base = sorted(key for key in info.get("missing_keys", []) if "base_layer" in key)
        if missing_base:
            raise ValueError(
                f"{pretrained_model_name_or_path} lacks the LoRA-wrapped base weights {missing_base[:4]}... It looks "
                "like a plain Llama checkpoint: load it with "
                "DodoLlamaForCausalLM.from_base_model(path, dodo_config={...})."
            )
        # A Dodo checkpoint loaded with other LoRA layers, target modules or adapter names: the projections it stores
        # wrapped (`base_layer`) would stay randomly initialised, its trained adapters would give way to fresh ones.
        unused = sorted(key for key in info.get("unexpected_keys", [])
                        if ".base_layer." in key or ".lora_A." in key or ".lora_B." in key)
        if unused:
            settings = {name: getattr(model.config, name) for name in
                        ("lora_layers", "lora_target_modules", "encoder_adapter_name", "decoder_adapter_name")}
            raise ValueError(
                f"A model with {settings} has no place for weights of the checkpoint: {unused[:4]}"
                f"{'...' if len(unused) > 4 else ''} ({len(unused)} in all); the layers they belong to would be left "
                f"randomly initialised or with fresh adapters. Load {pretrained_model_name_or_path} with the settings "
                "of its own config.json (leave these out of `from_pretrained`)."
            )
        # transformers would undo load-time renamings when saving (writing `q_proj.weight` again); a Dodo checkpoint is
        # always written with the model's own names.
        model._weight_conversions = []
        model.freeze_base_model()
        return (model, info) if want_info else model

    @staticmethod
    def base_llama_key_mapping(config: DodoLlamaConfig) -> dict[str, str]:
        """``from_pretrained(key_mapping=...)``: a plain Llama's wrapped projections -> PEFT's ``base_layer`` names."""
        layers = r"\d+" if config.lora_layers is None else "|".join(str(layer) for layer in config.lora_layers)
        modules = "|".join(config.lora_target_modules)
        wrapped = rf"^(model\.layers\.(?:{layers})\.self_attn\.(?:{modules}))"
        # one rule per tensor name: transformers' renaming only substitutes the first group
        return {wrapped + r"\.weight$": r"\1.base_layer.weight", wrapped + r"\.bias$": r"\1.base_layer.bias"}

    @classmethod
    def from_base_model(cls, base_model_name_or_path, dodo_config: dict | None = None, **kwargs):
        """A Dodo model around a Llama checkpoint: base weights loaded, adapters as fresh (identity) LoRA, new scorer
        and soft prompt. ``dodo_config`` holds `DodoLlamaConfig` fields (e.g. ``{"nugget_ratio": 0.05, "lora_r": 16}``);
        other keyword arguments go to ``from_pretrained`` (``dtype``, ``attn_implementation``, ...), where, as in
        ``from_pretrained(path, use_cache=False)``, those naming a config attribute set it."""
        from transformers import AutoConfig

        hub_keys = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
        base_config = AutoConfig.from_pretrained(
            base_model_name_or_path, **{k: kwargs[k] for k in hub_keys if k in kwargs}
        )
        fields = {
            key: value for key, value in base_config.to_dict().items() if key not in ("model_type", "architectures")
        }
        check_config_fields(DodoLlamaConfig, dodo_config or {}, "`dodo_config`")
        fields.update(dodo_config or {})
        config = DodoLlamaConfig(**fields)
        # `from_pretrained` hands keyword arguments to `__init__` when given a config object: the config attributes
        # among them are applied here instead, as transformers does when it reads the config itself
        overrides = {key: kwargs.pop(key) for key in list(kwargs)
                     if key not in _FROM_PRETRAINED_OPTIONS and hasattr(config, key)}
        both = sorted(set(overrides) & set(dodo_config or {}))
        if both:
            raise ValueError(f"{both} given both in `dodo_config` and as keyword arguments; give each once.")
        if overrides:
            config = DodoLlamaConfig(**{**fields, **overrides})
        return cls.from_pretrained(base_model_name_or_path, config=config, **kwargs)

    # -----------------------------------------------------------------------------------------------------------------
    # Input checks
    # -----------------------------------------------------------------------------------------------------------------

    @property
    def config_fingerprint(self) -> str:
        return _config_fingerprint(self.config)

    @staticmethod
    def _check_nuggets_match_cache(nuggets: DodoNuggets, cache: DodoCache) -> None:
        """Nuggets passed with a cache that already holds nuggets must be those (the cache's are the ones attended to):
        the same slots, mask and scores, row for row (a cache from beam search holds each context's rows repeated)."""
        mask, scores = cache.nugget_mask, cache.nugget_scores
        same = (not cache.autoregressive and mask is not None and scores is not None and nuggets.scores is not None
                and mask.shape[1] == nuggets.mask.shape[1] and mask.shape[0] % nuggets.batch_size == 0)
        if same:
            repeat = mask.shape[0] // nuggets.batch_size
            same = (torch.equal(mask, nuggets.mask.repeat_interleave(repeat, dim=0).to(mask.device))
                    and torch.equal(scores, nuggets.scores.repeat_interleave(repeat, dim=0).to(scores.device, scores.dtype)))
        if not same:
            raise ValueError(
                "`nuggets` differ from the nuggets already in the cache (`cache`, or `past_key_values`), which are the "
                "ones the model would attend to: pass the nuggets that cache was started with, or no cache for another "
                "context."
            )

    def _check_nuggets(self, nuggets, batch_size: int | None = None, allow_multiple: bool = False) -> None:
        if not _is_a(nuggets, DodoNuggets):
            raise ValueError(
                f"`nuggets` must be the DodoNuggets returned by `model.compress(...)`, got {type(nuggets).__name__}."
            )
        if nuggets.config_fingerprint != self.config_fingerprint:
            raise ValueError(
                "`nuggets` were produced by a model with another configuration (fingerprint "
                f"{nuggets.config_fingerprint!r}, this model {self.config_fingerprint!r}); compress the context with "
                "this model."
            )
        layers = self.config.num_hidden_layers
        expected = (self.config.num_key_value_heads, self.config.head_dim)
        if len(nuggets.key_values) != layers or any(
            tuple(k.shape[1:2]) + tuple(k.shape[3:]) != expected for k, _ in nuggets.key_values
        ):
            raise ValueError(
                f"`nuggets.key_values` must hold {layers} layers of [batch, {expected[0]}, K, {expected[1]}] tensors, "
                "got "
                f"{len(nuggets.key_values)} layers of {tuple(nuggets.key_values[0][0].shape)}."
            )
        slots = tuple(nuggets.key_values[0][0].shape[:1]) + tuple(nuggets.key_values[0][0].shape[2:3])  # [batch, K]
        if any(tuple(t.shape[:1]) + tuple(t.shape[2:3]) != slots for pair in nuggets.key_values for t in pair):
            raise ValueError(f"`nuggets.key_values` must all hold [batch, heads, K, head_dim] = {slots[0]} rows of "
                             f"{slots[1]} slots, as the first layer's key does.")
        for name in ("mask", "scores"):
            value = getattr(nuggets, name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != slots:
                got = describe(value) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"`nuggets.{name}` must be a [batch, K] = {slots} tensor (one per slot of "
                                 f"`nuggets.key_values`), got {got}.")
        dtypes = sorted({str(t.dtype) for pair in nuggets.key_values for t in pair})
        if dtypes != [str(self.dtype)] and not torch.is_autocast_enabled(self.device.type):
            raise ValueError(f"`nuggets.key_values` are {', '.join(dtypes)} but the model computes in {self.dtype}: "
                             "compress the context with the model as it is now (after `.to(dtype)`).")
        if batch_size is not None and nuggets.batch_size != batch_size:
            if not (allow_multiple and batch_size % nuggets.batch_size == 0):
                raise ValueError(
                    f"`nuggets` hold {nuggets.batch_size} contexts but `input_ids` has {batch_size} rows; pass one "
                    "context per row."
                )
        if nuggets.mask.shape[1] == 0 or (nuggets.num_nuggets == 0).any():
            raise ValueError("`nuggets` has rows without any nugget; every context needs at least one.")

    @staticmethod
    def _full_attention_mask(name, mask, batch_size, length, device) -> torch.Tensor:
        if mask is None:
            return torch.ones(batch_size, length, dtype=torch.bool, device=device)
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch_size, length):
            got = describe(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"`{name}` must have shape [batch, past + new tokens] = {(batch_size, length)}, got {got}."
            )
        return mask.bool()

    # -----------------------------------------------------------------------------------------------------------------
    # Attention masks
    # -----------------------------------------------------------------------------------------------------------------

    def _attention_bias(
        self,
        nugget_mask: torch.Tensor | None,
        nugget_scores: torch.Tensor | None,
        decoder_mask: torch.Tensor,
        query_length: int,
        dtype: torch.dtype,
        soft_prompt_length: int = 0,
        legacy_order: bool = False,
    ) -> torch.Tensor:
        """Additive 4-D mask ``[B, 1, q, K + D]`` over keys ``[K nugget slots ; D decoder columns]``; the queries are
        the last ``q`` decoder columns. Nugget column j holds the score term (``+ s_j``, or ``s_j - stopgrad(s_j)``)
        where it is visible and the dtype minimum where not; decoder columns are causal + padding (0 or minimum)."""
        batch, length = decoder_mask.shape
        minimum = torch.finfo(dtype).min
        device = decoder_mask.device
        past = length - query_length
        query_columns = past + torch.arange(query_length, device=device)
        causal = torch.arange(length, device=device)[None, :] <= query_columns[:, None]  # [q, D]
        slots = 0 if nugget_mask is None else nugget_mask.shape[1]
        nugget_visible, decoder_visible = nugget_mask, decoder_mask
        if legacy_order and slots:
            # a bug of the authors' code: their key padding mask is ordered [soft ; nuggets ; tokens], the keys
            # [nuggets ; soft ; tokens]
            shifted = torch.cat(
                [decoder_mask[:, :soft_prompt_length], nugget_mask, decoder_mask[:, soft_prompt_length:]], dim=1
            )
            nugget_visible, decoder_visible = shifted[:, :slots], shifted[:, slots:]
        allowed = decoder_visible[:, None, :] & causal[None]
        decoder_part = torch.zeros(batch, query_length, length, dtype=dtype, device=device).masked_fill(
            ~allowed, minimum
        )
        if not slots:
            return decoder_part[:, None]
        bias = nugget_scores if self.config.score_in_forward else nugget_scores - nugget_scores.detach()
        # a Python scalar, not torch.tensor(minimum, device=...): that is a blocking host-to-device copy every step
        nugget_part = bias.to(dtype).masked_fill(~nugget_visible, minimum)
        nugget_part = nugget_part[:, None, :].expand(batch, query_length, slots)
        return torch.cat([nugget_part, decoder_part], dim=-1)[:, None]

    def _causal_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Mask for running decoder layers directly (scorer pass): None lets sdpa use its causal kernel."""
        if mask.all() and self.config._attn_implementation == "sdpa":
            return None
        return self._attention_bias(None, None, mask, mask.shape[1], dtype)

    # -----------------------------------------------------------------------------------------------------------------
    # Compression (paper §2.3, Eq. 5-6 and 14-15)
    # -----------------------------------------------------------------------------------------------------------------

    @_one_call_at_a_time
    def compress(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, output_features: bool = False,
        *, argument_names: tuple[str, str] = ("input_ids", "attention_mask"),
    ) -> DodoNuggets:
        """Compress contexts into nuggets (top-k by ``config.nugget_ratio``, last real token forced).

        Args:
            input_ids (`torch.LongTensor` of shape `[batch, n]`): contexts, right- or left-padded (start them with BOS
                as the authors do).
            attention_mask (`torch.Tensor` of shape `[batch, n]`, *optional*): 1 for real tokens.
            output_features (`bool`): also return the scorer input features.
            argument_names: the caller's names for the two tensors, used in error messages (``forward`` and
                ``generate`` pass ``context_input_ids`` / ``context_attention_mask``).
        """
        ids_name, mask_name = argument_names
        self._check_model_state()
        check_token_ids(ids_name, input_ids, vocab_size=self.get_input_embeddings().num_embeddings)
        check_mask(mask_name, attention_mask, ids_name, input_ids)
        check_binary_mask(mask_name, attention_mask)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if (mask.sum(dim=1) == 0).any():
            empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
            raise ValueError(f"Empty context: rows {empty} of `{mask_name}` have no real token to compress.")
        return self._compress(input_ids, mask, token_positions(mask), output_features=output_features)

    def _compress(
        self,
        input_ids: torch.LongTensor,
        mask: torch.Tensor,
        positions: torch.LongTensor,
        previous: DodoCache | None = None,
        use_threshold: bool = False,
        output_features: bool = False,
        allow_empty: bool = False,
    ) -> DodoNuggets:
        batch, length = input_ids.shape
        embeds = self.model.embed_tokens(input_ids)

        # φ pass (paper §2.3): keys/values of every token; in autoregressive mode the chunk also attends to older
        # nuggets.
        # (`nugget_encoding="reencode"`, the authors' auto=True: this pass runs with θ, and only the nuggets get φ.)
        reencode = self.config.nugget_encoding == "reencode"
        self.set_active_adapter(self.config.decoder_adapter_name if reencode else self.config.encoder_adapter_name)
        cache = DynamicCache(config=self.config)
        if previous is not None and previous.num_nugget_slots:
            for layer_idx, (key, value) in enumerate(previous.nugget_key_values()):
                cache.update(key, value, layer_idx)
            attention = self._attention_bias(previous.nugget_mask, previous.nugget_scores, mask, length, embeds.dtype)
        else:
            attention = None if mask.all() else mask.long()
        shared = self._scorer_reads_phi_pass(previous)
        join = self._joins_unused_outputs()
        with self._residual_stream_before(self.config.nugget_layer) if shared else nullcontext() as stream:
            output = self.model(
                inputs_embeds=embeds,
                attention_mask=attention,
                position_ids=positions,
                **{LLAMA_CACHE_ARGUMENT: cache},
                use_cache=False,  # the cache is ours, passed explicitly: `use_cache` would make LlamaModel create one
            ).last_hidden_state
        unused_outputs = [output] if join else []  # only its keys and values are used (see `_joins_unused_outputs`)
        del output
        token_key_values = [(layer.keys[:, :, -length:], layer.values[:, :, -length:]) for layer in cache.layers]

        # scorer ϕ on adapter-free features (Eq. 15; adapters disabled as in paper §3)
        if shared:
            features = stream[0] if self._scorer_pass_is_trained() else stream[0].detach()
            if self.config.scorer_features == "base_final_norm":
                features = self.model.norm(features)
        else:
            features = self._scorer_features(embeds, mask, positions)
        # in the scorer's dtype, which may be wider than the model's (float32 trainable weights on a bfloat16 model, as
        # PEFT keeps adapters), then back in the model's, as PEFT's LoRA outputs and the soft prompt
        # (a dynamically quantized scorer has no floating parameter: it takes the features as they are)
        scorer_dtype = next((p.dtype for p in self.nugget_scorer.parameters() if p.is_floating_point()),
                            features.dtype)
        all_scores = self.nugget_scorer(features.to(scorer_dtype)).squeeze(-1).to(features.dtype)

        indices, nugget_mask = self._select(all_scores, mask, use_threshold, allow_empty)
        if reencode:
            key_values, reencoded = self._reencode_nuggets(cache, embeds, mask, positions, indices)
            unused_outputs += [reencoded] if join else []
            del reencoded
        else:
            gather = indices[:, None, :, None]
            key_values = tuple(
                (
                    key.gather(2, gather.expand(-1, key.shape[1], -1, key.shape[3])),
                    value.gather(2, gather.expand(-1, value.shape[1], -1, value.shape[3])),
                )
                for key, value in token_key_values
            )
        if unused_outputs:
            (*earlier, (last_keys, last_values)) = key_values
            key_values = (*earlier, (self._joined(last_keys, unused_outputs), last_values))
        return DodoNuggets(
            key_values=key_values,
            mask=nugget_mask,
            scores=all_scores.gather(1, indices),
            indices=indices,
            positions=positions.gather(1, indices),
            all_scores=all_scores,
            features=features if output_features else None,
            config_fingerprint=self.config_fingerprint,
        )

    def _reencode_nuggets(
        self,
        context_cache: DynamicCache,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.LongTensor,
        indices: torch.LongTensor,
    ) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], torch.Tensor]:
        """`nugget_encoding="reencode"` (the authors' ``auto=True``, not in the paper): the selected tokens'
        embeddings run again with φ at their own positions; nugget j attends to the θ keys/values of the context tokens
        strictly before it (padding excluded) and to itself only. Its new keys/values, per layer, are the nugget.
        Returned with the pass's (unused) output."""
        batch, count = indices.shape
        length = mask.shape[1]
        nugget_embeds = embeds.gather(1, indices[:, :, None].expand(-1, -1, embeds.shape[-1]))
        columns = torch.arange(length, device=mask.device)
        before = (columns[None, None, :] < indices[:, :, None]) & mask[:, None, :]  # [B, K, n]
        itself = torch.eye(count, dtype=torch.bool, device=mask.device).expand(batch, count, count)
        allowed = torch.cat([before, itself], dim=-1)[:, None]  # [B, 1, K, n + K]
        bias = torch.zeros(allowed.shape, dtype=embeds.dtype, device=embeds.device)
        bias = bias.masked_fill(~allowed, torch.finfo(embeds.dtype).min)
        self.set_active_adapter(self.config.encoder_adapter_name)
        output = self.model(
            inputs_embeds=nugget_embeds,
            attention_mask=bias,
            position_ids=positions.gather(1, indices),
            **{LLAMA_CACHE_ARGUMENT: context_cache},
            use_cache=False,  # as in `_compress`: the cache is ours
        ).last_hidden_state
        return tuple((layer.keys[:, :, -count:], layer.values[:, :, -count:]) for layer in context_cache.layers), output

    def _joins_unused_outputs(self) -> bool:
        """Whether the outputs of passes that only leave keys and values are joined to those (`_joined`): when the
        decoder layers are FSDP units and a gradient will be computed. Elsewhere the backward pass and every gradient
        stay as they were, and those outputs are freed at once."""
        return torch.is_grad_enabled() and _layers_are_sharded(self.model.layers)

    @staticmethod
    def _joined(last_keys: torch.Tensor, unused_outputs: list[torch.Tensor]) -> torch.Tensor:
        """The last layer's keys with the unused outputs joined to them by `_ZeroGradientTie`."""
        for output in unused_outputs:
            if output.requires_grad:
                last_keys = _ZeroGradientTie.apply(last_keys, output)
        return last_keys

    def _redecode_recent(self, cache: DodoCache, recent_ids: torch.LongTensor, recent_mask: torch.Tensor, **kwargs):
        """θ pass over the recent tokens after a compression: only the keys and values it leaves in the cache are used
        (see `_joins_unused_outputs`)."""
        outputs, _ = self._decode(cache, self.model.embed_tokens(recent_ids), recent_mask, **kwargs)
        if self._joins_unused_outputs():
            cache.layers[-1].keys = self._joined(cache.layers[-1].keys, [outputs.last_hidden_state])

    def _scorer_reads_phi_pass(self, previous: DodoCache | None) -> bool:
        """Whether the scorer's features can be read from the φ pass: where its first ι layers carry no adapter
        (`lora_layers` all >= ι) and see only this context (no older nuggets), its residual stream after them *is*
        the adapter-free one the scorer reads (for `encoder_hidden`, what the authors' ``ind_scorer=False`` takes). Then
        the scorer's own pass over ι layers is not run, and a compression costs one pass over the context instead of
        (L + ι) / L of one."""
        if previous is not None and previous.num_nugget_slots:
            return False
        return all(layer >= self.config.nugget_layer for layer in self.config.lora_layer_indices)

    @contextmanager
    def _residual_stream_before(self, layer_index: int):
        """Yield a list that receives the backbone's hidden states as they enter decoder layer ``layer_index`` during a
        forward pass run inside the block (ι < L here: a LoRA layer >= ι exists). A pre-hook reads the tensor the layer
        loop passes on, so under activation checkpointing it is that graph's tensor, not a replay's."""
        captured: list[torch.Tensor] = []
        target = self.model.layers[layer_index]

        def capture(module, args, kwargs):
            if not captured:
                captured.append(args[0] if args else kwargs["hidden_states"])

        handle = target.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            yield captured
        finally:
            handle.remove()

    def _scorer_features(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.LongTensor) -> torch.Tensor:
        """First ι decoder layers with the adapters disabled (paper §3), then (paper setting) the final RMSNorm.

        With the base weights frozen (the authors' setting) nothing here is trained: the pass runs without autograd,
        also when activation checkpointing makes the embeddings require gradients, so no backward pass or checkpoint
        replay is spent on it (the scorer learns through the attention logits only, Eq. 17)."""
        self.set_active_adapter(None)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self._scorer_pass_is_trained()):
            hidden = embeds
            attention = self._causal_bias(mask, embeds.dtype)
            position_embeddings = self.model.rotary_emb(hidden, position_ids=positions)
            for layer in self.model.layers[: self.config.nugget_layer]:
                hidden = layer(
                    hidden, attention_mask=attention, position_ids=positions, position_embeddings=position_embeddings
                )
            if self.config.scorer_features == "base_final_norm":
                hidden = self.model.norm(hidden)
        return hidden

    def _scorer_pass_is_trained(self) -> bool:
        """Whether a base weight of the scorer pass (embeddings, first ι layers without LoRA, final norm) is trained."""
        modules = [self.model.embed_tokens, self.model.norm, *self.model.layers[: self.config.nugget_layer]]
        return any(
            param.requires_grad
            for module in modules
            for name, param in module.named_parameters()
            if "lora_" not in name
        )

    def _num_nuggets(self, real_tokens: torch.LongTensor) -> torch.LongTensor:
        if self.config.nugget_count_rounding == "ceil":
            # in float64, with a tiny tolerance so that e.g. 30 * 0.1 = 3.0000000000000004 does not round up to 4
            if supports_float64(real_tokens.device):
                counts = torch.ceil(real_tokens.double() * self.config.nugget_ratio - 1e-9).long()
            else:  # (mps) the same float64 numbers, as Python floats
                counts = [math.ceil(tokens * self.config.nugget_ratio - 1e-9) for tokens in real_tokens.tolist()]
                counts = torch.tensor(counts, dtype=torch.long, device=real_tokens.device)
        else:  # the authors': float32 product + 0.99, truncated toward zero (the paper says ⌈n / r⌉)
            counts = (real_tokens * self.config.nugget_ratio + 0.99).long()
        return torch.minimum(counts, real_tokens)

    def _select(self, scores: torch.Tensor, mask: torch.Tensor, use_threshold: bool, allow_empty: bool = False):
        """Nugget columns ``[B, K]`` (real slots first, each group ascending) and their validity mask (Eq. 14)."""
        batch, length = scores.shape
        columns = torch.arange(length, device=scores.device)
        if use_threshold:  # Eq. 8: keep exactly the tokens whose score exceeds Λ
            chosen = (scores.detach() > self.config.nugget_threshold) & mask
            counts = chosen.sum(dim=1)
            order_key = torch.where(chosen, columns, columns + length + 1)
            order = order_key.argsort(dim=1, stable=True)
        else:
            counts = self._num_nuggets(mask.sum(dim=1))
            empty_rows = (counts == 0).nonzero().flatten().tolist()
            if empty_rows and not allow_empty:
                raise ValueError(
                    f"Context too short for any nugget: rows {empty_rows} have {mask.sum(dim=1)[empty_rows].tolist()} "
                    f"real tokens, which give 0 nuggets with nugget_ratio={self.config.nugget_ratio} and "
                    f"nugget_count_rounding={self.config.nugget_count_rounding!r}. Use longer contexts, a larger ratio "
                    "or 'ceil' rounding."
                )
            selection = scores.detach().float().masked_fill(~mask, torch.finfo(torch.float32).min)
            if self.config.force_last_nugget:
                selection[torch.arange(batch, device=scores.device), last_real_column(mask)] = torch.finfo(
                    torch.float32
                ).max
            # stable: ties go to the earlier token (the authors' unstable sort resolves them arbitrarily)
            order = selection.argsort(dim=1, descending=True, stable=True)
        slots = int(counts.max().item()) if batch else 0
        top = order[:, :slots]
        valid = torch.arange(slots, device=scores.device)[None, :] < counts[:, None]
        # real slots ascending by position, then the padding slots (next-best tokens), also ascending
        resort = torch.where(valid, top, top + length + 1).argsort(dim=1)
        return top.gather(1, resort), valid

    # -----------------------------------------------------------------------------------------------------------------
    # Decoder (paper Eq. 12-13)
    # -----------------------------------------------------------------------------------------------------------------

    def _decode(
        self,
        cache: DodoCache,
        token_embeds: torch.Tensor,
        token_mask: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        prepend_soft_prompt: bool = False,
        **model_kwargs,
    ):
        """θ pass over new decoder columns (optionally preceded by the soft prompt) on top of ``cache``."""
        self.set_active_adapter(self.config.decoder_adapter_name)
        batch, length = token_embeds.shape[:2]
        soft = 0
        embeds, new_mask = token_embeds, token_mask
        nuggets_per_row = cache.nuggets_per_row(batch, token_embeds.device)
        # decoder positions continue right after the number of nuggets: k_b + 0, 1, ... (the authors' code; the paper
        # does not say)
        offsets = nuggets_per_row
        # In autoregressive mode a threshold may have kept no token of a row while other rows have nuggets: that row
        # runs as it does alone, without the soft prompt and at positions after its compressed tokens.
        without_nuggets = None
        if cache.autoregressive and cache.num_nugget_slots:
            without_nuggets = nuggets_per_row == 0
            offsets = torch.where(without_nuggets, cache.compressed_real_tokens, nuggets_per_row)
        if prepend_soft_prompt and self.soft_prompt is not None and cache.num_nugget_slots:
            soft = self.soft_prompt.num_embeddings
            # called, not read through `.weight`: an offloaded module's weight is loaded by its hook when called
            soft_embeds = self.soft_prompt(torch.arange(soft, device=token_embeds.device))
            soft_embeds = soft_embeds.to(token_embeds.device, token_embeds.dtype)[None].expand(batch, -1, -1)
            embeds = torch.cat([soft_embeds, token_embeds], dim=1)
            soft_mask = token_mask.new_ones(batch, soft)
            if without_nuggets is not None:
                soft_mask = (~without_nuggets)[:, None].expand(batch, soft).to(token_mask.dtype)
            new_mask = torch.cat([soft_mask, token_mask], dim=1)
            cache.soft_prompt_length = soft
        decoder_mask = new_mask if cache.decoder_mask is None else torch.cat([cache.decoder_mask, new_mask], dim=1)
        if position_ids is None:
            positions = token_positions(decoder_mask, offsets)[:, -(length + soft) :]
        else:
            positions = position_ids
            if soft:
                soft_positions = nuggets_per_row[:, None] + torch.arange(soft, device=positions.device)
                positions = torch.cat([soft_positions, positions], dim=1)
        if cache.num_nugget_slots:
            attention = self._attention_bias(
                cache.nugget_mask,
                cache.nugget_scores,
                decoder_mask,
                length + soft,
                embeds.dtype,
                soft_prompt_length=cache.soft_prompt_length,
                legacy_order=self.config.legacy_decoder_mask_order,
            )
        elif cache.compressed_tokens:
            # no nuggets, but tokens were compressed (a threshold kept none of them): the layers hold only the recent
            # tokens, while transformers would place the queries after all `seen_tokens` and let them see later keys
            attention = self._attention_bias(None, None, decoder_mask, length + soft, embeds.dtype)
        else:  # no nuggets: a plain Llama with θ; transformers builds the causal + padding mask
            attention = decoder_mask.long()
        # With a soft prompt, the hidden states returned for the tokens must be the tensors the next layer consumes (so
        # that hooks and `retain_grad()` see gradients): each layer's output is split into (soft, tokens) and put
        # back together, and the token part is what is returned.
        capture_token_states = bool(soft and model_kwargs.get("output_hidden_states"))
        token_states, hooks = [token_embeds], []
        if capture_token_states:
            def split_soft_prompt(module, args, output):
                tokens = output[:, soft:]
                token_states.append(tokens)
                return torch.cat([output[:, :soft], tokens], dim=1)

            hooks = [layer.register_forward_hook(split_soft_prompt) for layer in self.model.layers[:-1]]
        try:
            outputs = self.model(
                inputs_embeds=embeds,
                attention_mask=attention,
                position_ids=positions,
                **{LLAMA_CACHE_ARGUMENT: cache},
                use_cache=False,  # as in `_compress`
                **model_kwargs,
            )
        finally:
            for hook in hooks:
                hook.remove()
        if capture_token_states:
            outputs.hidden_states = (*token_states, outputs.last_hidden_state[:, soft:])
        cache.decoder_mask = decoder_mask
        cache.started = True
        return outputs, soft

    # -----------------------------------------------------------------------------------------------------------------
    # Autoregressive mode (paper §2.2, Eq. 8-10; not in the authors' code)
    # -----------------------------------------------------------------------------------------------------------------

    def _autoregressive_forward(self, cache: DodoCache, input_ids: torch.LongTensor, token_mask: torch.Tensor):
        window, stride = self.config.recent_window, self.config.effective_compression_stride
        batch, length = input_ids.shape
        if not cache.autoregressive:
            # rows padded on the left (read once, on the first call): see the check below
            cache.left_padded = _rows_left_padded(token_mask)
            cache.autoregressive = True
            cache.pending_ids = input_ids.new_zeros(batch, 0)
            cache.pending_mask = token_mask.new_zeros(batch, 0)
            cache.compressed_real_tokens = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
        if cache.left_padded and cache.pending_ids.shape[1] + length > window + stride:
            # Compression happens at the same columns in every row (see `DodoLlamaConfig.recent_window`): a row padded
            # on the left would be compressed at other points of its text than alone, and give another result (before
            # the first compression each row's result is its own). Refused before this call changes the cache.
            raise _left_padding_refused(
                f"this call reaches a compression (after {window + stride} columns)",
                "Pad the batch on the right (`tokenizer.padding_side = 'right'`) for forward(), run rows of different "
                "lengths one at a time (generate() pads on the left), or give the context as `context_input_ids` "
                "(compressor mode).",
            )
        hidden_blocks = []
        start = 0
        while start < length:
            if cache.pending_ids.shape[1] >= window + stride:
                self._compress_oldest(cache, cache.pending_ids.shape[1] - window)
            take = min(length - start, window + stride - cache.pending_ids.shape[1])
            block_ids, block_mask = input_ids[:, start : start + take], token_mask[:, start : start + take]
            # positions of the uncompressed tokens: after the compressed ones before any nugget exists (a plain LM),
            # and k_b + [soft ; recent] afterwards (compressor-mode convention)
            offset = None if cache.num_nugget_slots else cache.compressed_real_tokens
            positions = None
            if offset is not None:
                positions = token_positions(torch.cat([cache.pending_mask, block_mask], dim=1), offset)[:, -take:]
            outputs, _ = self._decode(cache, self.model.embed_tokens(block_ids), block_mask, position_ids=positions)
            cache.pending_ids = torch.cat([cache.pending_ids, block_ids], dim=1)
            cache.pending_mask = torch.cat([cache.pending_mask, block_mask], dim=1)
            cache.seen_tokens += take
            hidden_blocks.append(outputs.last_hidden_state)
            start += take
        return torch.cat(hidden_blocks, dim=1)

    def _compress_oldest(self, cache: DodoCache, count: int) -> None:
        """Move the oldest ``count`` pending tokens into nuggets and recompute θ over the remaining recent tokens."""
        chunk_ids, chunk_mask = cache.pending_ids[:, :count], cache.pending_mask[:, :count]
        positions = token_positions(chunk_mask, cache.compressed_real_tokens)
        new = self._compress(  # a chunk of padding may give a row no nugget: allowed here
            chunk_ids,
            chunk_mask,
            positions,
            previous=cache,
            use_threshold=self.config.nugget_threshold is not None,
            allow_empty=True,
        )
        if cache.num_nugget_slots:
            key_values = [
                (torch.cat([old_k, new_k], dim=2), torch.cat([old_v, new_v], dim=2))
                for (old_k, old_v), (new_k, new_v) in zip(cache.nugget_key_values(), new.key_values)
            ]
            nugget_mask = torch.cat([cache.nugget_mask, new.mask], dim=1)
            nugget_scores = torch.cat([cache.nugget_scores, new.scores], dim=1)
        else:
            key_values, nugget_mask, nugget_scores = list(new.key_values), new.mask, new.scores
        recent_ids, recent_mask = cache.pending_ids[:, count:], cache.pending_mask[:, count:]
        cache.compressed_tokens += count
        cache.compressed_real_tokens = cache.compressed_real_tokens + chunk_mask.sum(dim=1)
        if nugget_mask.shape[1]:
            cache.set_nuggets(key_values, nugget_mask, nugget_scores)
            if recent_ids.shape[1] or self.soft_prompt is not None:
                self._redecode_recent(cache, recent_ids, recent_mask, prepend_soft_prompt=True)
        else:  # nothing selected so far (threshold mode): only the recent tokens remain
            cache.reset_layers()
            cache.decoder_mask = None
            if recent_ids.shape[1]:
                positions = token_positions(recent_mask, cache.compressed_real_tokens)
                self._redecode_recent(cache, recent_ids, recent_mask, position_ids=positions)
        cache.pending_ids, cache.pending_mask = recent_ids, recent_mask

    @torch.no_grad()
    def estimate_nugget_threshold(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, ratio: float | None = None
    ) -> float:
        """Λ such that about ``ratio`` (default ``config.nugget_ratio``) of the real tokens score above it (paper §2.2:
        "we estimate the threshold Λ by running a trained scorer on sampled tokens")."""
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1):
            raise ValueError(f"`ratio` must be a number in (0, 1] (the share of tokens kept as nuggets), got "
                             f"{ratio!r}.")
        nuggets = self.compress(input_ids, attention_mask)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        real_scores = nuggets.all_scores[mask].float()
        ratio = self.config.nugget_ratio if ratio is None else ratio
        return float(torch.quantile(real_scores, 1.0 - ratio).item())

    # -----------------------------------------------------------------------------------------------------------------
    # Forward
    # -----------------------------------------------------------------------------------------------------------------

    @_one_call_at_a_time
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        nuggets: DodoNuggets | None = None,
        context_input_ids: torch.LongTensor | None = None,
        context_attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""
        input_ids (`torch.LongTensor` of shape `[batch, length]`): decoder tokens (prompt / target), right or left
            padded. With a cache, only the new tokens.
        attention_mask (`torch.Tensor` of shape `[batch, past + length]`): 1 for real tokens, covering the tokens
            already in `past_key_values` and the new ones (transformers' convention). Nugget and soft-prompt columns are
            added inside.
        nuggets (`DodoNuggets`): output of `compress()`; the decoder attends to them. Without nuggets (and without
            `config.recent_window`) the model is the plain Llama with θ and no soft prompt.
        context_input_ids / context_attention_mask: a context to compress first (one graph: a joint training step).
        position_ids: positions of the new tokens (default: `k_b + soft + index among the real tokens`); not taken
            in autoregressive mode, which numbers the tokens itself.
        labels (`torch.LongTensor` of shape `[batch, length]`): next-token targets aligned with `input_ids` (shifted
            inside), -100 where ignored.

        Returns logits and `hidden_states` for `input_ids` only (the soft prompt positions are dropped); the hidden
        states are the tensors the layers and the LM head consume, so `retain_grad()` and hooks on them see gradients,
        as do the attentions (which keep the soft-prompt rows and the nugget and soft-prompt columns). Assisted
        decoding (`assistant_model=`, `prompt_lookup_num_tokens=`) works with nuggets: rejected candidates are cropped
        from the cache. In autoregressive mode the tokens are processed in blocks between compressions and no
        `hidden_states` or `attentions` are returned.
        """
        past_key_values = take_cache_argument(past_key_values, kwargs)
        reject_head_masks(kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds` (the decoder tokens).")
        check_token_ids("input_ids", input_ids)
        check_hidden_states("inputs_embeds", inputs_embeds, self.config.hidden_size)
        if labels is not None:
            check_token_ids("labels", labels, vocab_size=self.config.vocab_size, ignore_index=-100)
        reference = input_ids if input_ids is not None else inputs_embeds
        batch, length = reference.shape[:2]
        if context_input_ids is not None:
            check_token_ids("context_input_ids", context_input_ids, vocab_size=self.get_input_embeddings().num_embeddings)
            if nuggets is not None:
                raise ValueError("Pass either `nuggets` or `context_input_ids` (compressed here), not both.")
            nuggets = self.compress(context_input_ids, context_attention_mask,
                                    argument_names=("context_input_ids", "context_attention_mask"))
        elif context_attention_mask is not None:
            raise ValueError("`context_attention_mask` was given without `context_input_ids`; pass both, or neither.")
        use_cache = self.config.use_cache if use_cache is None else use_cache

        cache = past_key_values if _is_a(past_key_values, DodoCache) and past_key_values.started else None
        if cache is None and context_input_ids is None:  # (compress() has just checked)
            self._check_model_state()
        if cache is None and past_key_values is not None and past_key_values.get_seq_length() > 0:
            raise ValueError(
                "The cache (`cache`, or `past_key_values`) must be the DodoCache this model returned; got a "
                f"{type(past_key_values).__name__} holding {past_key_values.get_seq_length()} positions. (PEFT's "
                "prefix tuning passes its virtual tokens as such a cache, which cannot hold the nuggets that come "
                "before them: prefix tuning is not supported on Dodo; PEFT's prompt tuning and p-tuning are.)"
            )
        if past_key_values is not None and not _is_a(past_key_values, DodoCache):
            # Llama fills an empty DynamicCache in place; this one could not hold the nuggets and the decoder mask, and
            # a new cache returned instead would leave the caller's empty (its next call would lose the context)
            raise ValueError(
                "The cache (`cache`, or `past_key_values`) must be a DodoCache (`longreach.DodoCache(model.config)`, "
                f"filled in place) or None; got an empty {type(past_key_values).__name__}, which cannot hold the "
                "nuggets."
            )
        past_tokens = 0 if cache is None else cache.seen_tokens
        if cache is None or length > 1:  # the caller's ids (decoding steps feed back the model's own token, one)
            check_token_ids("input_ids", input_ids, vocab_size=self.get_input_embeddings().num_embeddings)
        token_mask = self._full_attention_mask(
            "attention_mask", attention_mask, batch, past_tokens + length, reference.device
        )
        if cache is None:  # later steps only append the model's own tokens (and a check would sync with the host)
            check_rows_not_empty("attention_mask", attention_mask)  # the caller's values, before `token_mask`'s bools
        new_token_mask = token_mask[:, past_tokens:]

        prepend_soft = False
        if cache is None:
            if _is_a(past_key_values, DodoCache):  # the caller's new cache, filled in place as Llama's is
                cache = past_key_values
                cache.restart()
            else:
                cache = DodoCache(self.config)
            if nuggets is not None:
                self._check_nuggets(nuggets, batch)
                cache.set_nuggets(nuggets.key_values, nuggets.mask, nuggets.scores)
                prepend_soft = True
        elif nuggets is not None:
            self._check_nuggets(nuggets, batch)
            self._check_nuggets_match_cache(nuggets, cache)

        soft = 0
        # As LlamaModel does, the config's flags apply when the call does not say (from_pretrained(...,
        # output_hidden_states=True)); passed on explicitly, so that the inner model does not read the config again.
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        extra = {"output_attentions": bool(output_attentions), "output_hidden_states": bool(output_hidden_states)}
        if cache.autoregressive or (cache.num_nugget_slots == 0 and self.config.recent_window is not None):
            if input_ids is None:
                raise ValueError(
                    "The autoregressive mode (config.recent_window) needs `input_ids`, not `inputs_embeds`."
                )
            if position_ids is not None:  # (they were ignored: the positions move as older tokens are compressed)
                raise ValueError(
                    "`position_ids` are not taken in the autoregressive mode (`config.recent_window`), which numbers "
                    f"the tokens itself; got {describe(position_ids)}. Leave them out."
                )
            hidden = self._autoregressive_forward(cache, input_ids, new_token_mask)
            outputs = None
        else:
            if inputs_embeds is not None and inputs_embeds.dtype != self.model.embed_tokens.weight.dtype:
                # in the model's dtype, as its own embeddings are: the nugget keys and the attention bias are in it
                # (Llama computes in the weights' dtype from its first norm on: the same result)
                inputs_embeds = inputs_embeds.to(self.model.embed_tokens.weight.dtype)
            embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            if position_ids is not None and tuple(position_ids.shape) != (batch, length):
                raise ValueError(f"`position_ids` must have shape {(batch, length)}, got {describe(position_ids)}.")
            if position_ids is not None and length > 1:
                real_pairs = new_token_mask[:, 1:].bool() & new_token_mask[:, :-1].bool()  # padding may hold anything
                backwards = (position_ids[:, 1:] < position_ids[:, :-1]) & real_pairs
                restarts = backwards.any(dim=1).nonzero().flatten().tolist()
                if restarts:  # a padding-free (packed) batch: several sequences in one row
                    raise ValueError(
                        f"`position_ids` restart inside rows {restarts}: padding-free (packed) batches are not "
                        "supported, because every row is one sequence conditioned on its own nuggets and Dodo's "
                        "attention mask spans the whole row. Pad the sequences into separate rows instead."
                    )
            outputs, soft = self._decode(cache, embeds, new_token_mask, position_ids, prepend_soft, **extra)
            cache.seen_tokens += length
            hidden_states = getattr(outputs, "hidden_states", None)
            # the last hidden state (after the final norm) feeds the LM head: with a soft prompt, its token part
            hidden = hidden_states[-1] if soft and hidden_states else outputs.last_hidden_state[:, soft:]

        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, slice_indices, :])
        loss = None
        if labels is not None:
            if tuple(labels.shape) != (batch, length):
                raise ValueError(
                    f"`labels` must have the shape of `input_ids` {(batch, length)}, got {describe(labels)}."
                )
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        result = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **cache_field(cache if use_cache else None),
            hidden_states=getattr(outputs, "hidden_states", None),  # token positions only (see `_decode`)
            attentions=getattr(outputs, "attentions", None),
        )
        return result if return_dict is not False else result.to_tuple()

    # -----------------------------------------------------------------------------------------------------------------
    # Generation
    # -----------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.LongTensor | None = None,
        generation_config: GenerationConfig | None = None,
        *args,
        nuggets: DodoNuggets | None = None,
        context_input_ids: torch.LongTensor | None = None,
        context_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        """``GenerationMixin.generate`` conditioned on nuggets (or on a context compressed here first).

        ``inputs`` (or ``input_ids=``) is the prompt and ``generation_config`` the second positional argument, as for
        any transformers model, followed by ``GenerationMixin.generate``'s other positional arguments
        (``logits_processor``, ``stopping_criteria``, ..., ``streamer``); the nuggets and the context are keyword
        arguments. Greedy, sampling and beam search work; the returned sequences start with the prompt. Without
        nuggets: the plain Llama with θ, or the autoregressive mode when ``config.recent_window`` is set. An
        ``assistant_model`` is a Dodo model; one with another configuration (a smaller Dodo) compresses
        ``context_input_ids`` itself and drafts from its own nuggets.
        """
        if len(args) > len(_GENERATE_POSITIONAL):
            raise TypeError(f"generate() takes at most {2 + len(_GENERATE_POSITIONAL)} positional arguments (inputs, "
                            f"generation_config, {', '.join(_GENERATE_POSITIONAL)}), got {2 + len(args)}.")
        for name, value in zip(_GENERATE_POSITIONAL, args):  # named, as read below (`assistant_model`)
            if name in kwargs:
                raise TypeError(f"generate() got multiple values for argument {name!r}")
            kwargs[name] = value
        input_ids = kwargs.pop("input_ids", None)
        if inputs is not None and input_ids is not None:
            raise ValueError("Pass the prompt once: as `inputs` (the first argument) or as `input_ids`, not both.")
        input_ids = inputs if inputs is not None else input_ids
        # shapes only (no values read): forward() reads the prompt's ids, on the first step or when several tokens
        # continue a cache (a chat's next turn); generate() drops an all-ones mask before forward() could check it
        check_token_ids("input_ids", input_ids)
        check_mask("attention_mask", kwargs.get("attention_mask"), "input_ids", input_ids)
        if generation_config is not None:
            kwargs["generation_config"] = generation_config
        requested = kwargs.get("cache_implementation",
                               getattr(kwargs.get("generation_config") or self.generation_config,
                                       "cache_implementation", None))
        if requested not in (None, "dynamic"):  # the nuggets live in a DodoCache, which grows: it would be ignored
            raise ValueError(f"`cache_implementation`={requested!r} is not supported by Dodo's generate(), which keeps "
                             "the nuggets and the new tokens in its own dynamic cache (DodoCache); expected None or "
                             "'dynamic'.")
        if context_input_ids is not None and kwargs.get("streamer") is not None:
            # transformers' checks of the generation mode (no streamer with beam search) run before compressing the
            # context, as T5's run before its encoder
            options = {name: value for name, value in kwargs.items() if name != "generation_config"}
            config, _ = self._prepare_generation_config(kwargs.get("generation_config"), **options)
            self._validate_generation_mode(config.get_generation_mode(kwargs.get("assistant_model")), config,
                                           {"streamer": kwargs["streamer"]})
        if context_input_ids is not None:
            check_token_ids("context_input_ids", context_input_ids, vocab_size=self.get_input_embeddings().num_embeddings)
            if nuggets is not None:
                raise ValueError("Pass either `nuggets` or `context_input_ids` (compressed here), not both.")
            nuggets = self.compress(context_input_ids, context_attention_mask,
                                    argument_names=("context_input_ids", "context_attention_mask"))
        elif context_attention_mask is not None:
            raise ValueError("`context_attention_mask` was given without `context_input_ids`; pass both, or neither.")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("`inputs_embeds` are not supported by Dodo's generate(); pass `input_ids`.")
        if input_ids is None and nuggets is not None:
            # generate() would start one BOS row; one per context is what is meant.
            bos = (kwargs.get("generation_config") or self.generation_config).bos_token_id
            bos = self.config.bos_token_id if bos is None else bos
            if not isinstance(bos, int):
                raise ValueError("Pass `input_ids` (a prompt per context): without one, generation starts from the BOS "
                                 f"token, and this model's bos_token_id is {bos!r}.")
            input_ids = torch.full((nuggets.mask.shape[0], 1), bos, dtype=torch.long, device=nuggets.mask.device)
        assistant, assistant_nuggets = kwargs.get("assistant_model"), None
        if nuggets is not None:
            self._check_nuggets(nuggets, input_ids.shape[0] if input_ids is not None else None)
            cache = kwargs.get("cache") if kwargs.get("cache") is not None else kwargs.get("past_key_values")
            if _is_a(cache, DodoCache) and cache.started:  # a later turn: its nuggets are those in the cache
                self._check_nuggets_match_cache(nuggets, cache)
            if assistant is not None and not _is_a(assistant, DodoLlamaForCausalLM):
                raise ValueError(
                    "`assistant_model` must be a DodoLlamaForCausalLM when generating from nuggets or a context: the "
                    f"assistant drafts its tokens from the same context, which a {type(assistant).__name__} cannot "
                    "read. Use a smaller Dodo model, `prompt_lookup_num_tokens`, or no assistant."
                )
            if assistant is not None and assistant.config_fingerprint != self.config_fingerprint:
                # another configuration cannot read this model's nuggets: the assistant compresses the context itself
                if context_input_ids is None:
                    raise ValueError(
                        "`assistant_model` has another configuration than this model, so it cannot read `nuggets` "
                        "compressed by this model; pass the context as `context_input_ids` (each model then compresses "
                        "it), or use an assistant with this model's configuration."
                    )
                assistant_nuggets = assistant.compress(
                    context_input_ids.to(assistant.device),
                    None if context_attention_mask is None else context_attention_mask.to(assistant.device),
                    argument_names=("context_input_ids", "context_attention_mask"),
                )
            kwargs["nuggets"] = nuggets
        token = _ASSISTANT_NUGGETS.set((self, assistant_nuggets))
        try:
            return super().generate(input_ids, **kwargs)
        finally:
            _ASSISTANT_NUGGETS.reset(token)

    def _get_candidate_generator(self, generation_config, *args, model_kwargs: dict, **kwargs):
        """transformers' candidate generator (assisted decoding, before its first step); an assistant with another
        configuration drafts from its own nuggets of the context (`generate` compressed it with the assistant), not
        from this model's, which it cannot read. Refused in autoregressive mode, whose cache cannot be cropped."""
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        started = _is_a(cache, DodoCache) and cache.started
        window = self.config.recent_window
        # autoregressive: a started cache says so; a fresh call is, without nuggets, when a recent window is set
        fresh_without_nuggets = model_kwargs.get("nuggets") is None and window is not None
        autoregressive = cache.autoregressive if started else fresh_without_nuggets
        if autoregressive:
            raise _assisted_decoding_refused("this model", window)
        generator = super()._get_candidate_generator(generation_config, *args, model_kwargs=model_kwargs, **kwargs)
        assistant_kwargs = getattr(generator, "assistant_kwargs", None)
        owner, assistant_nuggets = _ASSISTANT_NUGGETS.get() or (None, None)
        if owner is self and assistant_nuggets is not None and isinstance(assistant_kwargs, dict):
            assistant_kwargs["nuggets"] = assistant_nuggets
        assistant = getattr(generator, "assistant_model", None)
        if (_is_a(assistant, DodoLlamaForCausalLM) and isinstance(assistant_kwargs, dict)
                and assistant_kwargs.get("nuggets") is None and assistant.config.recent_window is not None):
            raise _assisted_decoding_refused("`assistant_model`", assistant.config.recent_window)
        return generator

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """generate()'s own cache is a DodoCache (`forward` refuses another kind, which cannot hold the nuggets); a
        cache the caller passed is left as given."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        for name in ("cache", "past_key_values"):  # the argument's name in transformers 5.24+ and before
            made = model_kwargs.get(name)
            if made is not None and not _is_a(made, DodoCache) and not getattr(made, "_is_user_defined", False):
                model_kwargs[name] = DodoCache(self.config)
        self._refuse_left_padding_that_would_compress(generation_config, model_kwargs)

    def _refuse_left_padding_that_would_compress(self, generation_config, model_kwargs: dict) -> None:
        """The autoregressive mode refuses a left-padded batch at its first compression (`_autoregressive_forward`),
        which generate() reached after some of its steps: refused here, before the first step, when ``max_length``
        lets the run reach it (a stop at EOS before it could have let it finish; the result would not depend on it).
        A cache that has read tokens continues a chat: its first call said whether the rows are left-padded, and its
        uncompressed columns count towards the compression."""
        window = self.config.recent_window
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        mask = model_kwargs.get("attention_mask")
        if window is None or model_kwargs.get("nuggets") is not None or mask is None or mask.dim() != 2:
            return
        started = _is_a(cache, DodoCache) and cache.started
        if started:
            if not (cache.autoregressive and cache.left_padded):
                return
        elif not _rows_left_padded(mask):
            return
        read = cache.seen_tokens if started else 0
        pending = cache.pending_ids.shape[1] if started else 0  # uncompressed columns the cache holds
        prompt = mask.shape[1] - read  # this call's prompt; every generated token but the last is read too
        limit = window + self.config.effective_compression_stride
        if pending + generation_config.max_length - 1 - read > limit:
            most = limit + 1 - pending - prompt  # new tokens that keep it under the next compression
            shorter = f"keep `max_new_tokens` at most {most}, " if most >= 1 else ""
            held = f"the cache's {pending} uncompressed columns, " if pending else ""
            raise _left_padding_refused(
                f"this generate() call can reach a compression (after {limit} columns; {held}the prompt's {prompt} and "
                f"up to {generation_config.max_length - mask.shape[1]} new tokens)",
                f"Generate the rows one at a time, {shorter}or give the context as `context_input_ids` (compressor "
                "mode).",
            )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        nuggets: DodoNuggets | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ):
        """Slice by the tokens the cache has *seen* (not by its length, which counts nugget and soft-prompt slots) and
        pass explicit decoder positions ``k_b + soft + index among real tokens``. ``cache`` is
        named here so that ``generate()`` accepts it back (an assistant model's cache, in assisted decoding)."""
        past_key_values = take_cache_argument(past_key_values, {"cache": cache, **kwargs})
        batch = input_ids.shape[0]
        if attention_mask is None:  # generate drops an all-ones mask
            attention_mask = torch.ones_like(input_ids)
        cache = past_key_values if _is_a(past_key_values, DodoCache) and past_key_values.started else None
        seen = cache.seen_tokens if cache is not None else 0
        new_ids = input_ids[:, seen:]
        if new_ids.shape[1] == 0 and kwargs.get("next_sequence_length"):
            # the cache read more columns than `input_ids` holds (PEFT's prompt tuning prepends its virtual tokens as
            # embeddings): the new ids are the last ones, as many as generate() says
            new_ids = input_ids[:, -kwargs["next_sequence_length"]:]
        if cache is not None:  # the nuggets are in the cache since the first step: no per-step checks or copies
            nuggets = None
        if nuggets is not None and nuggets.batch_size != batch:  # beams / num_return_sequences expanded the prompt
            self._check_nuggets(nuggets, batch, allow_multiple=True)
            nuggets = nuggets.repeat_interleave(batch // nuggets.batch_size)

        position_ids = None
        autoregressive = (cache is not None and cache.autoregressive) or (
            cache is None and nuggets is None and self.config.recent_window is not None
        )
        if not autoregressive:
            if cache is not None:
                nuggets_per_row, soft = cache.nuggets_per_row(batch, input_ids.device), cache.soft_prompt_length
            elif nuggets is not None:
                nuggets_per_row, soft = (
                    nuggets.num_nuggets,
                    (self.soft_prompt.weight.shape[0] if self.soft_prompt is not None else 0),
                )
            else:
                nuggets_per_row, soft = torch.zeros(batch, dtype=torch.long, device=input_ids.device), 0
            decoder_mask = torch.cat([attention_mask.new_ones(batch, soft), attention_mask], dim=1)
            position_ids = token_positions(decoder_mask, nuggets_per_row)[:, -new_ids.shape[1] :]

        model_inputs = {
            "input_ids": new_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "nuggets": nuggets,
            "use_cache": use_cache,
        }
        dropped = {
            "position_ids",
            "next_sequence_length",
            "is_first_iteration",
            "labels",
            "inputs_embeds",
            "cache_position",
        }
        for key, value in kwargs.items():
            if key not in model_inputs and key not in dropped:
                model_inputs[key] = value
        return model_inputs

    # -----------------------------------------------------------------------------------------------------------------
    # Summarization pipeline protocol and PEFT export
    # -----------------------------------------------------------------------------------------------------------------

    def prepare_summarization_inputs(
        self, tokenizer, documents: list[str], max_input_length: int | None = None
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """``generate()`` keyword arguments for the paper's summarization prompt (Appendix D.3).

        Each context is ``BOS + "[INST]\\n" + document`` (compressed into nuggets); the decoder prompt
        ``"\\nPlease summarize the above document in one sentence.\\n[/INST]"`` is `input_ids`, so `generate` returns
        the prompt followed by the summary. ``max_input_length`` caps the context tokens; the number of document tokens
        dropped per document is returned (never truncated silently).
        """
        documents = summarization_documents(documents, allow_empty=False)
        return self._prompted_inputs(tokenizer, documents, [SUMMARIZATION_PROMPT] * len(documents), max_input_length)

    def prepare_question_inputs(
        self, tokenizer, question: str | list[str], documents: str | list[str], max_input_length: int | None = None
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """``generate()`` keyword arguments to answer ``question`` (one string for every document, or one per
        document) from each document, with the paper's question-answering prompt (Appendix D.2).

        The context is compressed as in :meth:`prepare_summarization_inputs`; the decoder prompt is
        ``"\\nBased on the provided document, answer the following question:\\n" + question + "\\n[/INST]"``, left
        padded where the questions differ in length. ``max_input_length`` caps the context tokens (the question is in
        the decoder prompt, outside that count); the number of document tokens dropped per document is returned.
        """
        documents = summarization_documents(documents, allow_empty=False)
        prompts = [QUESTION_PROMPT.format(question=text) for text in question_per_document(question, len(documents))]
        return self._prompted_inputs(tokenizer, documents, prompts, max_input_length)

    def _prompted_inputs(
        self, tokenizer, documents: list[str], prompts: list[str], max_input_length: int | None
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Contexts ``BOS + "[INST]\\n" + document`` (right padded, the authors' layout) and one decoder prompt per
        document (left padded, so that every row's generation starts right after its prompt)."""
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        prefix = bos + tokenizer(SUMMARIZATION_CONTEXT_PREFIX, add_special_tokens=False)["input_ids"]
        if max_input_length is not None and (isinstance(max_input_length, bool)
                                             or not isinstance(max_input_length, int)):
            raise ValueError(f"`max_input_length` must be an integer or None, got {max_input_length!r}.")
        if max_input_length is not None and max_input_length <= len(prefix):
            raise ValueError(
                f"`max_input_length` must leave room for the document after the {len(prefix)} prefix tokens, got "
                f"{max_input_length}."
            )
        contexts, dropped = [], []
        for document in documents:  # (non-empty: `summarization_documents`)
            ids = tokenizer(document, add_special_tokens=False)["input_ids"]
            keep = len(ids) if max_input_length is None else min(len(ids), max_input_length - len(prefix))
            dropped.append(len(ids) - keep)
            contexts.append(prefix + ids[:keep])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        context_ids, context_mask = pad_right(contexts, pad)  # right padding, the authors' layout
        prompt_rows = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        flipped_ids, flipped_mask = pad_right([row[::-1] for row in prompt_rows], pad)
        inputs = {
            "input_ids": flipped_ids.flip(1),  # left padded: pad_right of the reversed rows, reversed back
            "attention_mask": flipped_mask.flip(1),
            "context_input_ids": context_ids,
            "context_attention_mask": context_mask,
        }
        return {name: tensor.to(self.device) for name, tensor in inputs.items()}, dropped  # where the model is

    def export_peft_adapters(
        self, save_directory: str | os.PathLike, base_model_name_or_path: str | None = None
    ) -> list[Path]:
        """Write each adapter as a standard PEFT folder (``save_directory/<adapter name>/adapter_config.json`` +
        ``adapter_model.safetensors``) that ``PeftModel.from_pretrained(llama, folder, adapter_name=...)`` loads, plus
        ``scorer.pt`` (the authors' ``load_scorer`` format: a plain state dict) and ``soft_prompt.safetensors``."""
        from safetensors.torch import save_file

        save_directory = Path(save_directory)
        save_directory.mkdir(parents=True, exist_ok=True)
        state_dict = self.state_dict()
        offloaded = [key for key, tensor in state_dict.items() if tensor.device.type == "meta"]
        if offloaded:  # loaded with a device_map that offloads: read from the offload hooks, as save_pretrained does
            from transformers.integrations.accelerate import load_offloaded_parameter

            state_dict.update({key: load_offloaded_parameter(self, key) for key in offloaded})
        written = []
        for name in self.config.adapter_names:
            tensors = {}
            for key, tensor in state_dict.items():
                for part in ("lora_A", "lora_B"):
                    marker = f".{part}.{name}.weight"
                    if key.endswith(marker):
                        tensors["base_model.model." + key[: -len(marker)] + f".{part}.weight"] = (
                            tensor.detach().cpu().contiguous()
                        )
            folder = save_directory / name
            LoraConfig(
                r=self.config.lora_r,
                lora_alpha=self.config.lora_alpha,
                lora_dropout=self.config.lora_dropout,
                target_modules=self.config.lora_target_regex,
                bias="none",
                task_type="CAUSAL_LM",
                base_model_name_or_path=base_model_name_or_path,
            ).save_pretrained(str(folder))
            save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
            written.append(folder)
        scorer = {key.removeprefix("nugget_scorer."): tensor.detach().cpu().clone()
                  for key, tensor in state_dict.items() if key.startswith("nugget_scorer.")}
        torch.save(scorer, save_directory / "scorer.pt")
        written.append(save_directory / "scorer.pt")
        if self.soft_prompt is not None:
            save_file(
                {"soft_prompt.weight": state_dict["soft_prompt.weight"].detach().cpu().contiguous()},
                str(save_directory / "soft_prompt.safetensors"),
            )
            written.append(save_directory / "soft_prompt.safetensors")
        return written


# ---------------------------------------------------------------------------------------------------------------------
# Training data
# ---------------------------------------------------------------------------------------------------------------------


def _token_list(ids, name: str = "input_ids", index: int = 0) -> list[int]:
    """Token ids given as a flat list, a tensor or a numpy array, as a list of ints (``None``: empty)."""
    if ids is None:
        return []
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not all(
            isinstance(token, numbers.Integral) and not isinstance(token, bool) for token in ids):
        raise ValueError(f"Feature {index}: `{name}` must be a flat list of integer token ids, got "
                         f"{str(ids)[:80]!r}.")
    return [int(token) for token in ids]


# Trainer's label smoothing shifts the labels (next-token targets) only for the model names in transformers'
# causal-LM table, which `AutoModelForCausalLM.register` does not fill; done here, at import, so that it also holds
# where this file is loaded as remote code.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(DodoLlamaConfig.model_type, DodoLlamaForCausalLM.__name__)


def _feature_mask(feature, name: str, ids_name: str, ids: list[int], index: int) -> list[int]:
    """A feature's own mask for ``ids`` (0/1, as long, at least one 1), or all ones if it brings none."""
    mask = feature.get(name)
    if mask is None:
        return [1] * len(ids)
    mask = _token_list(mask, name, index)
    if len(mask) != len(ids) or any(value not in (0, 1) for value in mask) or 1 not in mask:
        raise ValueError(f"Feature {index}: `{name}` must hold one 0 or 1 per token of `{ids_name}` ({len(ids)}), "
                         f"with at least one 1; got {str(mask)[:80]}.")
    return mask


class DodoDataCollator:
    """Batches (context, target) pairs for compressor-mode training with ``Trainer`` (paper §2.3, Eq. 12-13).

    Each feature is a dict with ``context_input_ids`` (list of ids, BOS first as the authors do) and, for text
    continuation, ``input_ids`` (the target). Without ``input_ids`` the target is the context itself (autoencoding).
    The loss covers the target tokens, less an optional ``prompt_length`` (the authors' ``skip``) of first ones; a
    feature may instead bring its own ``labels`` (as long as the target, -100 where no loss, the usual layout of
    instruction tuning), which are kept. Both sides are right-padded, to a multiple of ``pad_to_multiple_of`` if set;
    ``labels`` hold ``label_pad_token_id`` at padding and -100 at prompt positions. Features padded already (e.g. by
    ``tokenizer(..., padding="max_length")``) keep their ``context_attention_mask`` / ``attention_mask``: their 0s
    stay padding, never attended to nor trained on.

    With ``Trainer``, ``prompt_length`` is not an argument of the model, so the default
    ``remove_unused_columns=True`` drops it before it reaches the collator: pass
    ``TrainingArguments(remove_unused_columns=False)``, or put the prompt's -100 in ``labels``, which the Trainer keeps.
    """

    def __init__(self, pad_token_id: int = 0, label_pad_token_id: int = -100, pad_to_multiple_of: int | None = None):
        if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                               or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"`pad_to_multiple_of` must be a positive integer or None, got {pad_to_multiple_of!r}.")
        for name, value in (("pad_token_id", pad_token_id), ("label_pad_token_id", label_pad_token_id)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"`{name}` must be an integer token id, got {value!r}.")
        self.pad_token_id = pad_token_id
        self.label_pad_token_id = label_pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("DodoDataCollator got an empty batch.")
        for index, feature in enumerate(features):
            if not isinstance(feature, Mapping):
                raise ValueError(f"Feature {index} must be a dict of token lists, got {type(feature).__name__}.")
        given_labels = [feature.get("labels") is not None for feature in features]
        if any(given_labels) and not all(given_labels):
            raise ValueError("Some features bring `labels` and others do not; give them to every feature or to none.")
        contexts, targets, prompt_lengths, labels = [], [], [], []
        context_masks, target_masks = [], []
        for index, feature in enumerate(features):
            # Lists, tensors or numpy arrays (a `datasets` dataset with a torch/numpy format): never tested for truth.
            context = _token_list(feature.get("context_input_ids"), "context_input_ids", index)
            has_target = feature.get("input_ids") is not None
            target = _token_list(feature["input_ids"], "input_ids", index) if has_target else context
            if not context or not target:
                raise ValueError(f"Feature {index} needs a non-empty `context_input_ids` (and `input_ids` if given).")
            if feature.get("attention_mask") is not None and not has_target:
                raise ValueError(f"Feature {index} has an `attention_mask` but no `input_ids` (its target is then the "
                                 "context, whose mask is `context_attention_mask`).")
            context_masks.append(_feature_mask(feature, "context_attention_mask", "context_input_ids", context, index))
            target_masks.append(_feature_mask(feature, "attention_mask", "input_ids", target, index) if has_target
                                else context_masks[-1])
            if given_labels[0]:
                labels.append(_token_list(feature["labels"], "labels", index))
                if len(labels[-1]) != len(target):
                    raise ValueError(f"Feature {index}: `labels` has {len(labels[-1])} tokens, its target "
                                     f"({'`input_ids`' if feature.get('input_ids') is not None else 'the context'}) "
                                     f"{len(target)}; they must align, -100 where no loss.")
            contexts.append(context)
            targets.append(target)
            prompt_length = feature.get("prompt_length", 0)
            if hasattr(prompt_length, "item"):
                prompt_length = prompt_length.item()
            if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) \
                    or not 0 <= prompt_length < len(target):
                raise ValueError(f"Feature {index}: `prompt_length` must be an integer from 0 to {len(target) - 1} "
                                 f"(its target has {len(target)} tokens, and at least one must be in the loss), "
                                 f"got {prompt_length!r}.")
            prompt_lengths.append(prompt_length)
        context_ids, _ = pad_right(contexts, self.pad_token_id, self.pad_to_multiple_of)
        input_ids, _ = pad_right(targets, self.pad_token_id, self.pad_to_multiple_of)
        context_mask, _ = pad_right(context_masks, 0, self.pad_to_multiple_of)  # the features' own padding stays 0
        attention_mask, _ = pad_right(target_masks, 0, self.pad_to_multiple_of)
        if labels:
            labels, _ = pad_right(labels, -100, self.pad_to_multiple_of)
            labels = labels.masked_fill(attention_mask == 0, self.label_pad_token_id)
        else:
            labels = input_ids.masked_fill(attention_mask == 0, self.label_pad_token_id)
        for row, skip in enumerate(prompt_lengths):
            labels[row, :skip] = -100  # prompt positions never count, whatever pads the labels
        return {
            "context_input_ids": context_ids,
            "context_attention_mask": context_mask,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
        }


__all__ = [
    "DodoCache",
    "DodoDataCollator",
    "DodoLlamaForCausalLM",
    "DodoLlamaModel",
    "DodoNuggets",
    "DodoLlamaPreTrainedModel",
]
