"""T5-compatible building blocks shared by LOCOST and VCC-T5.

Why our own and not ``transformers.models.t5``: T5's internals changed by hundreds of lines inside transformers 5.x
(signatures, return tuples, mask helpers, ``cache_position``), while a checkpoint on the Hub must keep loading for
years. These blocks use T5's parameter names (``SelfAttention.q``, ``EncDecAttention.o``, ``DenseReluDense.wi_0``,
``layer_norm``, ``relative_attention_bias``...) and T5's math, and only the stable public API of transformers
(``Cache`` classes, the attention-function interface, ``GradientCheckpointingLayer``). A test proves them equal to
``transformers.T5ForConditionalGeneration`` on the same weights.

T5 in one paragraph (Raffel et al. 2020; v1.1 variant with gated-GELU): pre-norm residual blocks with RMSNorm
(no mean, no bias); attention without the 1/sqrt(d) scaling, with a learned *relative position bias* bucketed by
distance and owned by the first block of each stack; the decoder adds causal self-attention and cross-attention;
token embeddings are shared and, when tied, the LM head rescales the decoder output by d_model**-0.5.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from .input_checks import (
    cache_field,
    cache_of,
    check_binary_mask,
    check_hidden_states,
    check_mask,
    check_token_ids,
    cut_to_length,
    embedding_shape,
    pad_right,
    summarization_documents,
    take_cache_argument,
    unwrap_layer,
)

logger = logging.get_logger(__name__)

# ---------------------------------------------------------------------------------------------------------------------
# Norm and feed-forward
# ---------------------------------------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """T5's RMSNorm (see `T5LayerNorm`) whose backward keeps the input and 1/rms, not the normalised input too.

    With n = x·r, r = 1/sqrt(mean(x²) + eps) and y = w·n: ∂w = Σ ∂y·n and ∂x = r·(g − n·mean(g·n)), g = ∂y·w.
    ``forward`` returns ``(y, 1/rms)`` and ``setup_context`` keeps 1/rms (the split ``torch.func`` transforms need).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(hidden_states, weight, eps):
        inverse_rms = _inverse_rms(hidden_states, eps)
        return weight * _normalized(hidden_states, inverse_rms, weight), inverse_rms

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden_states, weight, _ = inputs
        inverse_rms = output[1]
        ctx.mark_non_differentiable(inverse_rms)
        ctx.set_materialize_grads(False)  # (no zeros made for the gradient of 1/rms, which is never used)
        ctx.save_for_backward(hidden_states, inverse_rms, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output, _):
        if grad_output is None:  # (grads are not materialized: the output got no gradient)
            return None, None, None
        hidden_states, inverse_rms, weight = ctx.saved_tensors
        grad_input, grad_weight = _rms_norm_backward(grad_output, hidden_states, inverse_rms, weight,
                                                     *ctx.needs_input_grad[:2])
        return grad_input, None if grad_weight is None else grad_weight.to(weight.dtype), None


def _rms_norm_backward(grad_output, hidden_states, inverse_rms, weight, needs_input: bool, needs_weight: bool):
    """``(∂x, ∂w)`` of the RMSNorm y = w·x·r (see `_RMSNormFunction`), None where not needed; ∂w is summed over all
    positions, in the dtype of the products (the caller casts it)."""
    normalized = hidden_states.to(torch.float32) * inverse_rms
    grad_input = grad_weight = None
    if needs_weight:
        products = grad_output * normalized.to(_normalized_dtype(hidden_states, weight))
        grad_weight = products.reshape(-1, products.shape[-1]).sum(0)
    if needs_input:
        grad_normalized = (grad_output * weight).to(torch.float32)
        mean = (grad_normalized * normalized).mean(-1, keepdim=True)
        grad_input = (inverse_rms * (grad_normalized - normalized * mean)).to(hidden_states.dtype)
    return grad_input, grad_weight


def _inverse_rms(hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
    """1/sqrt(mean(x²) + eps) over the last dim, in float32 (as T5)."""
    return torch.rsqrt(hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)


def _normalized_dtype(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if weight.dtype in (torch.float16, torch.bfloat16):
        return weight.dtype
    return torch.promote_types(hidden_states.dtype, torch.float32)


def _normalized(hidden_states: torch.Tensor, inverse_rms: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x·r in float32 (or wider), cast to the weight's dtype when that is half precision (as T5)."""
    return (hidden_states * inverse_rms).to(_normalized_dtype(hidden_states, weight))


class T5LayerNorm(nn.Module):
    """RMSNorm: ``y = weight * x / sqrt(mean(x**2) + eps)``; variance in float32, no mean subtraction, no bias.

    When autograd records, it runs as one function that keeps x and 1/rms for the backward pass (one tensor of x's
    size per norm less than the same formula as separate ops)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)[0]
        return self.weight * _normalized(hidden_states, _inverse_rms(hidden_states, self.variance_epsilon), self.weight)


class _BoolMaskDropout(torch.autograd.Function):
    """``x · mask / (1 − p)`` keeping the mask as bool for the backward pass. torch's CPU dropout computes the same
    values from the same random draws (bit for bit) but keeps the mask as a float tensor, 4 bytes per element.
    ``forward`` returns ``(output, mask)``; ``setup_context`` keeps the mask."""

    generate_vmap_rule = True

    @staticmethod
    def forward(hidden_states, p):
        mask = torch.empty_like(hidden_states, dtype=torch.bool).bernoulli_(1 - p)
        return hidden_states * mask.to(hidden_states.dtype).div_(1 - p), mask

    @staticmethod
    def setup_context(ctx, inputs, output):
        mask = output[1]
        ctx.mark_non_differentiable(mask)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(mask)
        ctx.p = inputs[1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output, _):
        if grad_output is None:  # (grads are not materialized: the output got no gradient)
            return None, None
        (mask,) = ctx.saved_tensors
        return grad_output * mask.to(grad_output.dtype).div_(1 - ctx.p), None


class Dropout(nn.Dropout):
    """``nn.Dropout``; in CPU training it keeps a bool mask for the backward pass instead of torch's float one (the
    same outputs and gradients, bit for bit; on accelerators torch's fused dropout already keeps a bool mask)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if (self.training and 0 < self.p < 1 and not self.inplace and hidden_states.device.type == "cpu"
                and torch.is_grad_enabled() and hidden_states.requires_grad):
            return _BoolMaskDropout.apply(hidden_states, self.p)[0]
        return super().forward(hidden_states)


def check_t5_config(config) -> None:
    """The T5 fields LOCOST's and VCC-T5's configs share, refused at construction (not as a crash or NaNs in the
    model); their configs call this from their own checks."""
    for name in ("relative_attention_num_buckets", "relative_attention_max_distance"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise ValueError(f"`{name}` must be an integer >= 2, got {value!r}.")
    if config.relative_attention_max_distance <= config.relative_attention_num_buckets // 2:
        raise ValueError(
            "`relative_attention_max_distance` must exceed half of `relative_attention_num_buckets` (the exact "
            f"buckets), got {config.relative_attention_max_distance} and {config.relative_attention_num_buckets}."
        )
    for name in ("layer_norm_epsilon", "initializer_factor"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"`{name}` must be a positive number, got {value!r}.")
    rate = config.dropout_rate
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ValueError(f"`dropout_rate` must be a number in [0, 1), got {rate!r}.")
    for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):  # (a string loaded, then crashed deep)
        value = getattr(config, name, None)
        ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
        if any(token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0)
               for token in ids):
            either = " or a list of them" if name == "eos_token_id" else ""
            raise ValueError(f"`{name}` must be a token id (an integer >= 0){either} or None, got {value!r}.")
    check_logn_length(getattr(config, "cross_attention_logn_length", None))
    ffn_activation(config)


def check_logn_length(logn_length) -> None:
    """`cross_attention_logn_length` is None or an integer >= 2: checked by the configs and, since the decoder reads it
    at every call, there too (a value assigned after loading gave NaN logits for 1 and a "math domain error" below)."""
    if logn_length is not None and (isinstance(logn_length, bool) or not isinstance(logn_length, int)
                                    or logn_length < 2):
        raise ValueError(
            "`cross_attention_logn_length` must be None or an integer >= 2 (the number of encoder tokens the model "
            f"was trained on), got {logn_length!r}."
        )


def ffn_activation(config) -> tuple[bool, str]:
    """``(is_gated, activation name)`` from T5's ``feed_forward_proj`` ("relu", "gated-gelu", "gated-silu", ...)."""
    proj = config.feed_forward_proj
    parts = proj.split("-") if isinstance(proj, str) else []
    act = "gelu_new" if proj == "gated-gelu" else parts[-1] if parts else None
    if not 1 <= len(parts) <= 2 or (len(parts) == 2 and parts[0] != "gated") or act not in ACT2FN:
        raise ValueError(
            "`feed_forward_proj` must be an activation name, optionally after 'gated-' (e.g. 'relu', 'gated-gelu'), "
            f"got {proj!r}."
        )
    is_gated = len(parts) == 2
    if act == "gelu_new":
        # T5's tanh GELU as one fused op (torch's gelu(approximate="tanh"), equal up to float rounding): autograd keeps
        # its input only, where transformers' NewGELUActivation, written as five ops, keeps five [*, d_ff] tensors.
        act = "gelu_pytorch_tanh"
    return is_gated, act


def _to_weight_dtype(hidden_states: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    # `wo` may be kept in float32 (``_keep_in_fp32_modules``) while the rest runs in half precision. A quantized
    # linear's `weight` may be a method (torch.ao dynamic quantization) or an integer tensor: input left as it is.
    weight = linear.weight
    if isinstance(weight, torch.Tensor) and hidden_states.dtype != weight.dtype and weight.dtype.is_floating_point:
        return hidden_states.to(weight.dtype)
    return hidden_states


class T5DenseActDense(nn.Module):
    """``wo(dropout(act(wi x)))`` (T5 v1.0)."""

    def __init__(self, config, activation: str):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        _set_t5_init_std(self.wi, config.d_model**-0.5)
        _set_t5_init_std(self.wo, config.d_ff**-0.5)
        self.dropout = Dropout(config.dropout_rate)
        self.act = ACT2FN[activation]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.act(self.wi(hidden_states)))
        return self.wo(_to_weight_dtype(hidden_states, self.wo))


class _GatedTanhGELU(torch.autograd.Function):
    """``gelu_tanh(gate) * value`` keeping gate and value for the backward pass, where the activation is recomputed
    (autograd would keep the activation's output too: one [*, d_ff] tensor more per feed-forward)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(gate, value):
        return nn.functional.gelu(gate, approximate="tanh") * value

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        gate, value = ctx.saved_tensors
        grad_gate = grad_value = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.gelu_backward(grad_output * value, gate, approximate="tanh")
        if ctx.needs_input_grad[1]:
            grad_value = grad_output * nn.functional.gelu(gate, approximate="tanh")
        return grad_gate, grad_value


class T5DenseGatedActDense(nn.Module):
    """``wo(dropout(act(wi_0 x) * wi_1 x))`` (T5 v1.1, gated-GELU with the tanh GELU)."""

    def __init__(self, config, activation: str):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        _set_t5_init_std(self.wi_0, config.d_model**-0.5)
        _set_t5_init_std(self.wi_1, config.d_model**-0.5)
        _set_t5_init_std(self.wo, config.d_ff**-0.5)
        self.dropout = Dropout(config.dropout_rate)
        self.act = ACT2FN[activation]
        self._tanh_gelu = activation == "gelu_pytorch_tanh"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._tanh_gelu and torch.is_grad_enabled():
            hidden_states = _GatedTanhGELU.apply(self.wi_0(hidden_states), self.wi_1(hidden_states))
        else:
            hidden_states = self.act(self.wi_0(hidden_states)) * self.wi_1(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return self.wo(_to_weight_dtype(hidden_states, self.wo))


#: `_GatedFeedForwardFunction` computes the gated product over this many elements at a time ([rows, d_ff]) on CPU,
FEED_FORWARD_STEP_ELEMENTS = 2**22
#: and on an accelerator, where each step's dozen launches cost host time the GPU waits for: at 16K tokens and
#: d_ff 2048, steps of 2**22 elements (eight per layer) made a quarter of the operators LOCOST's training step
#: dispatches (counted on CPU with the accelerator's code paths: 15,912, against 12,384 with 2**24, two steps with
#: [rows, d_ff] temporaries of 32 MiB in bfloat16). On an H100 the step times of the two were mixed
#: (benchmarks/results/cuda.md, third session).
ACCELERATOR_FEED_FORWARD_STEP_ELEMENTS = 2**24


def _feed_forward_step_rows(d_ff: int, device: torch.device) -> int:
    """Positions per step of `_GatedFeedForwardFunction`."""
    elements = FEED_FORWARD_STEP_ELEMENTS if device.type == "cpu" else ACCELERATOR_FEED_FORWARD_STEP_ELEMENTS
    return max(1, elements // d_ff)


#: torch's matrix product with a float32 result from bfloat16/float16 operands (``torch.mm(..., out_dtype=)``, CUDA).
_MM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def _add_weight_gradient(accumulator: torch.Tensor, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> None:
    """``accumulator += grad_rowsᵀ · input_rows`` with a float32 ``accumulator``, as one matrix product would sum it.

    On CUDA, bfloat16/float16 operands go to the tensor cores with a float32 result (the products of two such
    numbers are exact in float32, and the sums are float32 either way). Converting them to float32 first ran these
    products as float32 matmuls: a quarter of the GPU time of a LOCOST training step at 16K tokens in bfloat16 on an
    H200 (`benchmarks/results/cuda.md`). Elsewhere (the CPU has no such product) the operands are converted, which
    costs nothing in float32.
    """
    if (_MM_HAS_OUT_DTYPE and grad_rows.device.type == "cuda"
            and grad_rows.dtype in (torch.bfloat16, torch.float16) and input_rows.dtype == grad_rows.dtype):
        accumulator.add_(torch.mm(grad_rows.T, input_rows, out_dtype=torch.float32))
    else:
        accumulator.addmm_(grad_rows.T.float(), input_rows.float())


class _GatedFeedForwardFunction(torch.autograd.Function):
    """T5's gated tanh-GELU feed-forward sublayer without its residual, ``wo(dropout(gelu_tanh(wi_0 n) ⊙ wi_1 n))``
    with ``n = RMSNorm(x)``, for training: the modules' ops (on CPU the same bool dropout mask from the same random
    draw as `Dropout`), the gated product and ``wo`` computed a few positions at a time
    (``_feed_forward_step_rows``; so equal to the modules' output up to the matmul's float rounding).

    It keeps x, 1/rms and the two [*, d_ff] projections (and the dropout mask as bool) for the backward pass, which
    recomputes n and the gated product (elementwise work, no matmul) step by step too, accumulating the weight
    gradients. Through the modules, autograd keeps n and the product as well, and the forward and backward passes
    allocate two or three [*, d_ff] tensors at once: at 16K tokens and d_ff 2048 that is 176 MiB more kept and up to
    384 MiB more at once, where a checkpointed LOCOST training step peaked (in the FFN's recomputation and backward
    pass of the last encoder block).

    ``forward`` returns the output and what the backward pass needs (1/rms, the projections, the mask if any), which
    ``setup_context`` keeps (the split ``torch.func`` transforms need); buffers are made from the inputs and the
    gradient (batched tensors under ``torch.func.vmap``).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(hidden_states, norm_weight, eps, wi_0, wi_1, wo, dropout_p):
        inverse_rms = _inverse_rms(hidden_states, eps)
        normed = norm_weight * _normalized(hidden_states, inverse_rms, norm_weight)
        gate, value = nn.functional.linear(normed, wi_0), nn.functional.linear(normed, wi_1)
        del normed
        mask = None
        if dropout_p > 0:
            mask = torch.empty_like(gate, dtype=torch.bool).bernoulli_(1 - dropout_p)
        d_ff = gate.shape[-1]
        output = gate.new_empty(*gate.shape[:-1], wo.shape[0])
        flat_gate, flat_value = gate.reshape(-1, d_ff), value.reshape(-1, d_ff)
        flat_output = output.view(-1, wo.shape[0])
        rows = _feed_forward_step_rows(d_ff, gate.device)
        for step in (slice(start, start + rows) for start in range(0, flat_gate.shape[0], rows)):
            product = nn.functional.gelu(flat_gate[step], approximate="tanh") * flat_value[step]
            if mask is not None:
                product = product * mask.reshape(-1, d_ff)[step].to(product.dtype).div_(1 - dropout_p)
            flat_output[step] = nn.functional.linear(product, wo)
        # the mask only when there is one: no None among the outputs and saved values
        return (output, inverse_rms, gate, value) + (() if mask is None else (mask,))

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden_states, norm_weight, _, wi_0, wi_1, wo, dropout_p = inputs
        kept = output[1:]
        ctx.mark_non_differentiable(*kept)
        ctx.set_materialize_grads(False)  # (no zeros made for the kept tensors' gradients, which are never used)
        ctx.save_for_backward(hidden_states, kept[0], norm_weight, wi_0, wi_1, wo, *kept[1:])
        ctx.dropout_p = dropout_p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output, *_):
        if grad_output is None:  # (grads are not materialized: the output got no gradient)
            return None, None, None, None, None, None, None
        hidden_states, inverse_rms, norm_weight, wi_0, wi_1, wo, gate, value, *masks = ctx.saved_tensors
        mask = masks[0] if masks else None
        needs_x, needs_norm, _, needs_wi_0, needs_wi_1, needs_wo, _ = ctx.needs_input_grad
        width, d_ff = hidden_states.shape[-1], gate.shape[-1]
        x, grad_out = hidden_states.reshape(-1, width), grad_output.reshape(-1, width)
        inverse_rms, gate, value = inverse_rms.reshape(-1, 1), gate.reshape(-1, d_ff), value.reshape(-1, d_ff)
        mask = None if mask is None else mask.reshape(-1, d_ff)
        # weight gradients summed over the steps in float32 (one matmul over all rows would also accumulate so)
        wanted = (("wi_0", wi_0, needs_wi_0), ("wi_1", wi_1, needs_wi_1), ("wo", wo, needs_wo),
                  ("norm", norm_weight, needs_norm))
        accumulators = {name: grad_output.new_zeros(weight.shape, dtype=torch.float32)
                        for name, weight, needed in wanted if needed}
        grad_x = grad_output.new_empty(x.shape) if needs_x else None
        rows = _feed_forward_step_rows(d_ff, x.device)
        for start in range(0, x.shape[0], rows):
            step = slice(start, start + rows)
            activation = nn.functional.gelu(gate[step], approximate="tanh")
            grad_product = grad_out[step] @ wo  # ∂(dropped product)
            if mask is not None:
                dropout_scale = mask[step].to(grad_product.dtype).div_(1 - ctx.dropout_p)
                grad_product.mul_(dropout_scale)
            if needs_wo:
                product = activation * value[step]
                if mask is not None:
                    product.mul_(dropout_scale)
                _add_weight_gradient(accumulators["wo"], grad_out[step], product)
                del product
            grad_value = grad_product * activation
            del activation
            grad_gate = torch.ops.aten.gelu_backward(grad_product.mul_(value[step]), gate[step], approximate="tanh")
            del grad_product
            if needs_wi_0 or needs_wi_1:
                normed = norm_weight * _normalized(x[step], inverse_rms[step], norm_weight)  # the linears' input
                if needs_wi_0:
                    _add_weight_gradient(accumulators["wi_0"], grad_gate, normed)
                if needs_wi_1:
                    _add_weight_gradient(accumulators["wi_1"], grad_value, normed)
                del normed
            grad_normed = torch.addmm(grad_gate @ wi_0, grad_value, wi_1)  # ∂(RMSNorm output)
            del grad_gate, grad_value
            grad_x_step, grad_norm_step = _rms_norm_backward(grad_normed, x[step], inverse_rms[step], norm_weight,
                                                             needs_x, needs_norm)
            if needs_norm:
                accumulators["norm"] += grad_norm_step
            if needs_x:
                grad_x[step] = grad_x_step
        weights = {"wi_0": wi_0, "wi_1": wi_1, "wo": wo, "norm": norm_weight}
        grads = {name: accumulator.to(weights[name].dtype) for name, accumulator in accumulators.items()}
        return (None if grad_x is None else grad_x.reshape(hidden_states.shape), grads.get("norm"), None,
                grads.get("wi_0"), grads.get("wi_1"), grads.get("wo"), None)


def _plain(module: nn.Module, kind: type) -> bool:
    """``module`` is exactly ``kind`` with no hooks (not a PEFT/quantized subclass or wrapper, not hooked by
    accelerate or a user): a fused function may then stand for its forward."""
    return (type(module) is kind and not module._forward_hooks and not module._forward_pre_hooks
            and not module._backward_hooks and not module._backward_pre_hooks)


class T5LayerFF(nn.Module):
    """Pre-norm residual feed-forward sublayer: ``x + dropout(FF(RMSNorm(x)))``.

    In training, the gated tanh-GELU sublayer of plain modules runs as `_GatedFeedForwardFunction` (same values,
    less memory); anything else (PEFT LoRA on its linears, hooks, autocast, mixed dtypes, dropout on an accelerator,
    ``torch.compile``) runs through the modules.
    """

    def __init__(self, config):
        super().__init__()
        is_gated, activation = ffn_activation(config)
        dense_class = T5DenseGatedActDense if is_gated else T5DenseActDense
        self.DenseReluDense = dense_class(config, activation)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def _fused_dropout_p(self, hidden_states: torch.Tensor) -> float | None:
        """The inner dropout probability to pass to `_GatedFeedForwardFunction`, or None where it does not apply.

        Not inside ``torch.compile``: the compiler picks what to keep for the backward pass itself, and with symbolic
        sizes (the first batch of a new length, or a block compiled a second time) torch 2.11's dynamo fails an
        assertion on the function, whose forward graph hands a symbolic size to the backward pass (seen on a GPU,
        reproduced on CPU; torch 2.13 traces it)."""
        dense = self.DenseReluDense
        if not (torch.is_grad_enabled() and isinstance(dense, T5DenseGatedActDense) and dense._tanh_gelu):
            return None
        if torch.compiler.is_compiling():
            return None
        linears = (dense.wi_0, dense.wi_1, dense.wo)
        parameters = [self.layer_norm.weight] + [linear.weight for linear in linears]
        if not (all(_plain(linear, nn.Linear) and linear.bias is None for linear in linears)
                and _plain(self.layer_norm, T5LayerNorm) and _plain(dense, T5DenseGatedActDense)
                and _plain(dense.dropout, Dropout) and _plain(dense.act, type(dense.act))):
            return None
        if any(p.dtype != hidden_states.dtype or p.device != hidden_states.device for p in parameters):
            return None
        if not (hidden_states.requires_grad or any(p.requires_grad for p in parameters)):
            return None
        if hidden_states.device.type != "meta" and torch.is_autocast_enabled(hidden_states.device.type):
            return None  # (the meta device, shapes only, has no autocast state to ask for)
        p = dense.dropout.p if dense.dropout.training else 0.0
        if p > 0 and (hidden_states.device.type != "cpu" or p >= 1 or dense.dropout.inplace):
            return None  # the bool-mask dropout is `Dropout`'s CPU path; elsewhere torch's own dropout runs
        return p

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dropout_p = self._fused_dropout_p(hidden_states)
        if dropout_p is not None:
            dense = self.DenseReluDense
            output = _GatedFeedForwardFunction.apply(hidden_states, self.layer_norm.weight,
                                                     self.layer_norm.variance_epsilon, dense.wi_0.weight,
                                                     dense.wi_1.weight, dense.wo.weight, dropout_p)[0]
        else:
            output = self.DenseReluDense(self.layer_norm(hidden_states))
        return hidden_states + self.dropout(output)


# ---------------------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------------------


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of ``relative_position = key_position - query_position``.

    Half the buckets are exact small distances, the rest log-spaced up to ``max_distance`` (then clamped). When
    ``bidirectional``, half of all buckets are used for each sign; otherwise only non-positive distances (looking
    back) are distinguished, as in the causal decoder.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = torch.abs(relative_position)
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_bucket = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    log_bucket = torch.clamp(log_bucket, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, log_bucket)


# ---------------------------------------------------------------------------------------------------------------------
# Softmax with the same bits on every CPU
# ---------------------------------------------------------------------------------------------------------------------
# ATen's float32 CPU softmax over the last dimension computes, per row, m = max(x), e = exp(x - m) (SLEEF's expf_u10),
# s = sum(e) and e * (1 / s). The sum runs in vector lanes, 8 with AVX2 and 16 with AVX-512, then across the lanes,
# so its last bits depend on the machine, and attention outputs move by ~1e-6 relative between two CPUs (VCC-T5's
# references, made on AVX-512, by 1.1e-5 at values ~20 on an AVX2 machine). `reproducible_softmax` computes what the
# AVX-512 kernel computes with ordinary tensor ops: on AVX-512 it equals `torch.softmax` bit for bit, and any other
# CPU gets those same bits. The fused multiply-adds of expf_u10 are float64 products (exact for float32 operands) and
# sums rounded to float32, which equals a fused multiply-add except in double-rounding cases (about 2^-29 of them).

def _float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


# SLEEF expf_u10: 2^q · p(s) with q = rint(x / ln 2), s = x - q ln 2 (ln 2 split in two floats); the float32 constants
_INVERSE_LN2 = _float32(1.442695040888963407359924681001892137426645954152985934135449406931)
_LN2_UPPER, _LN2_LOWER = _float32(0.693145751953125), _float32(1.428606765330187045e-06)
_EXP_POLYNOMIAL = [_float32(c) for c in (0.000198527617612853646278381, 0.00139304355252534151077271,
                                         0.00833336077630519866943359, 0.0416664853692054748535156,
                                         0.166666671633720397949219, 0.5)]
_AVX512_LANES = 16


def _fused_multiply_add(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """round_float32(a·b + c), with a·b exact in float64."""
    return (a.double() * b + c).float()


def _sleef_expf(x: torch.Tensor) -> torch.Tensor:
    """SLEEF's expf_u10 (ATen's vectorized float32 exp) for x ≤ 0, lane for lane."""
    q = torch.round(x * _INVERSE_LN2)  # float32 product, rounded half to even (vrint)
    s = _fused_multiply_add(q, -_LN2_UPPER, x)
    s = _fused_multiply_add(q, -_LN2_LOWER, s)
    p = torch.full_like(s, _EXP_POLYNOMIAL[0])
    for coefficient in _EXP_POLYNOMIAL[1:]:
        p = _fused_multiply_add(p, s, coefficient)
    p = 1.0 + _fused_multiply_add(s * s, p, s)
    half = torch.floor(q / 2)
    scaled = p * torch.pow(2.0, half) * torch.pow(2.0, q - half)  # p·2^q in two exact steps, as SLEEF's ldexp
    return torch.where(x < -104, torch.zeros_like(scaled), scaled)  # also exp(-inf) = 0


def _avx512_row_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in ATen's vec::reduce_all order with 16 lanes: left to right below 16 elements;
    otherwise lane-wise over chunks of 16, the tail added to the first lanes, then the lanes pairwise (i + i^8, i^4,
    i^2, i^1)."""
    size = values.shape[-1]
    if size < _AVX512_LANES:
        total = values[..., 0]
        for index in range(1, size):
            total = total + values[..., index]
        return total
    lanes = values[..., :_AVX512_LANES]
    end = size - size % _AVX512_LANES
    for start in range(_AVX512_LANES, end, _AVX512_LANES):
        lanes = lanes + values[..., start:start + _AVX512_LANES]
    if end < size:
        tail = size - end
        lanes = torch.cat([lanes[..., :tail] + values[..., end:], lanes[..., tail:]], dim=-1)
    for stride in (8, 4, 2, 1):
        lanes = lanes + lanes[..., torch.arange(_AVX512_LANES, device=lanes.device) ^ stride]
    return lanes[..., 0]


class _ReproducibleSoftmax(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(scores: torch.Tensor) -> torch.Tensor:
        exponentials = _sleef_expf(scores - scores.amax(dim=-1, keepdim=True))
        return exponentials * (1 / _avx512_row_sum(exponentials)).unsqueeze(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        (probabilities,) = ctx.saved_tensors  # softmax's backward: p ⊙ (g − Σ g ⊙ p)
        return probabilities * (grad_output - (grad_output * probabilities).sum(dim=-1, keepdim=True))


def reproducible_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension; float32 on CPU: the same bits on every CPU (see above), else `torch.softmax`."""
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.shape[-1] == 0:
        return torch.softmax(scores, dim=-1)
    return _ReproducibleSoftmax.apply(scores)


def last_dim_softmax(scores: torch.Tensor, config) -> torch.Tensor:
    """`reproducible_softmax` where the model's config asks for it (`reproducible_softmax: true`), else torch's."""
    if getattr(config, "reproducible_softmax", False):
        return reproducible_softmax(scores)
    return torch.softmax(scores, dim=-1)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float = 1.0,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scaling + bias) v, softmax in float32 (`reproducible_softmax` where the config asks for it).
    ``attention_mask`` is an additive float bias."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = last_dim_softmax(scores.float(), module.config).type_as(scores)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


def _one_float32_query_on_cuda(query: torch.Tensor) -> bool:
    """A decoding step (one query per head) in float32 on CUDA, where sdpa's only kernel for float32 (memory-efficient
    attention) is slow with one query: one decoding step's cross-attention over 16K encoder states took 1.95 ms through
    sdpa and 0.06 ms as two matrix products and a softmax, on an H200 (`benchmarks/benchmark_decode_attention.py`,
    `benchmarks/results/cuda.md`). Such steps run the eager function, which computes the same in float32."""
    return query.shape[-2] == 1 and query.dtype == torch.float32 and query.device.type == "cuda"


class T5Attention(nn.Module):
    """Multi-head attention with T5's names (q, k, v, o; no biases) and no 1/sqrt(d_kv) scaling.

    The caller passes one additive ``attention_bias`` (relative position bias + masks), broadcastable to
    ``[batch, heads, query_len, key_len]``; it goes through transformers' attention interface (eager or sdpa) as a
    float mask. Only the attention that owns ``relative_attention_bias`` computes position biases
    (:meth:`compute_bias`); T5 computes them once per stack and shares them with every layer.
    """

    def __init__(self, config, has_relative_attention_bias: bool = False, bidirectional: bool = True,
                 layer_idx: int | None = None, is_causal: bool = False):
        super().__init__()
        self.config = config
        self.has_relative_attention_bias = has_relative_attention_bias
        self.bidirectional = bidirectional
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.relative_attention_max_distance = config.relative_attention_max_distance
        self.n_heads = config.num_heads
        self.key_value_proj_dim = config.d_kv
        self.inner_dim = self.n_heads * self.key_value_proj_dim
        self.dropout = config.dropout_rate
        self.scaling = 1.0  # T5 folds the scale into the initialisation of q

        self.q = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, config.d_model, bias=False)
        _set_t5_init_std(self.q, (config.d_model * self.key_value_proj_dim) ** -0.5)
        for projection in (self.k, self.v):
            _set_t5_init_std(projection, config.d_model**-0.5)
        _set_t5_init_std(self.o, self.inner_dim**-0.5)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads)
            _set_t5_init_std(self.relative_attention_bias, config.d_model**-0.5)

    def compute_bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Relative position bias ``[batch or 1, heads, Lq, Lk]`` for integer positions ``[..., Lq]``, ``[..., Lk]``.

        Positions may be per row (``[batch, L]``, as VCC uses after reordering tokens) or shared (``[L]``).
        """
        relative_position = key_positions.unsqueeze(-2) - query_positions.unsqueeze(-1)
        bucket = relative_position_bucket(
            relative_position,
            bidirectional=self.bidirectional,
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )
        values = self.relative_attention_bias(bucket)  # [..., Lq, Lk, heads]
        values = values.movedim(-1, -3)  # [..., heads, Lq, Lk]
        return values if values.dim() == 4 else values.unsqueeze(0)

    def _project(self, linear: nn.Linear, states: torch.Tensor) -> torch.Tensor:
        return linear(states).view(*states.shape[:-1], -1, self.key_value_proj_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_bias: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        output_attentions: bool = False,
        query_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        is_cross_attention = key_value_states is not None
        query = self._project(self.q, hidden_states)
        if query_scale is not None:  # [batch, 1, 1, 1]: the logits q·kᵀ of each example times its scale
            query = query * query_scale.to(query.dtype)

        if isinstance(past_key_values, EncoderDecoderCache):
            cache = past_key_values.cross_attention_cache if is_cross_attention else past_key_values.self_attention_cache
            reuse_cross = is_cross_attention and past_key_values.is_updated.get(self.layer_idx, False)
        else:
            cache, reuse_cross = past_key_values, False

        if reuse_cross:  # encoder keys/values were cached on the first decoding step
            key, value = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
        else:
            source = key_value_states if is_cross_attention else hidden_states
            key, value = self._project(self.k, source), self._project(self.v, source)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
                if is_cross_attention:
                    past_key_values.is_updated[self.layer_idx] = True

        implementation = self.config._attn_implementation
        if output_attentions and implementation != "eager":
            implementation = "eager"  # only eager returns the weights
        elif implementation == "sdpa" and _one_float32_query_on_cuda(query):
            implementation = "eager"
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if attention_bias is not None:
            attention_bias = attention_bias.to(query.dtype)
        dropout = self.dropout if self.training else 0.0
        arguments = (self, query, key, value, attention_bias)
        options = {"dropout": dropout, "scaling": self.scaling, "is_causal": False}  # causality is in the bias
        if (dropout > 0 and not output_attentions and torch.is_grad_enabled()
                and (implementation == "eager" or query.device.type == "cpu")):
            # Selective recomputation (Megatron-LM's "selective activation recomputation"): where the attention keeps
            # [batch, heads, Lq, Lk] tensors for the backward pass (eager always; sdpa on CPU with dropout, which
            # falls back to its math path: scores, dropout mask and dropped weights), keep q, k, v and the bias
            # instead and recompute the rest there, with the same dropout mask (the RNG state is replayed). At 16K
            # encoder tokens that is ~600 MB per decoder layer's cross-attention for 256 target tokens.
            output, weights = torch.utils.checkpoint.checkpoint(
                lambda *tensors: attention(*arguments[:1], *tensors, **options), *arguments[1:], use_reentrant=False
            )
        else:
            output, weights = attention(*arguments, **options)
        output = self.o(output.reshape(*hidden_states.shape[:-1], self.inner_dim).contiguous())
        return output, (weights if output_attentions else None)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config, has_relative_attention_bias: bool = False, is_decoder: bool = False,
                 layer_idx: int | None = None):
        super().__init__()
        self.SelfAttention = T5Attention(
            config, has_relative_attention_bias, bidirectional=not is_decoder, layer_idx=layer_idx, is_causal=is_decoder
        )
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_bias=None, past_key_values=None, output_attentions=False):
        output, weights = self.SelfAttention(
            self.layer_norm(hidden_states), attention_bias, past_key_values=past_key_values,
            output_attentions=output_attentions,
        )
        return hidden_states + self.dropout(output), weights


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config, layer_idx: int | None = None):
        super().__init__()
        self.EncDecAttention = T5Attention(config, has_relative_attention_bias=False, layer_idx=layer_idx)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden_states, key_value_states, attention_bias=None, past_key_values=None,
                output_attentions=False, query_scale=None):
        output, weights = self.EncDecAttention(
            self.layer_norm(hidden_states), attention_bias, key_value_states=key_value_states,
            past_key_values=past_key_values, output_attentions=output_attentions, query_scale=query_scale,
        )
        return hidden_states + self.dropout(output), weights


def _clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    """T5's guard against fp16 overflow in the residual stream (a no-op for other dtypes)."""
    if hidden_states.dtype == torch.float16:
        limit = torch.finfo(torch.float16).max - 1000
        hidden_states = torch.clamp(hidden_states, min=-limit, max=limit)
    return hidden_states


class T5Block(GradientCheckpointingLayer):
    """``layer.0`` self-attention, (decoder only) ``layer.1`` cross-attention, then the feed-forward sublayer."""

    def __init__(self, config, has_relative_attention_bias: bool = False, is_decoder: bool = False,
                 layer_idx: int | None = None):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList(
            [T5LayerSelfAttention(config, has_relative_attention_bias, is_decoder=is_decoder, layer_idx=layer_idx)]
        )
        if is_decoder:
            self.layer.append(T5LayerCrossAttention(config, layer_idx=layer_idx))
        self.layer.append(T5LayerFF(config))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_bias: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_bias: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        output_attentions: bool = False,
        cross_attention_scale: torch.Tensor | None = None,
        relative_positions: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """Returns the new hidden states, the self- and cross-attention weights (or ``None``) and the self-attention
        bias used. ``relative_positions`` (query and key positions; only for the block that owns the stack's relative
        position table): the relative position bias is added to ``attention_bias`` here, inside this block's forward,
        where FSDP has gathered the table, and the sum is returned for the following blocks."""
        if relative_positions is not None:
            bias = self.layer[0].SelfAttention.compute_bias(*relative_positions)
            attention_bias = bias if attention_bias is None else bias + attention_bias
        hidden_states, self_weights = self.layer[0](
            hidden_states, attention_bias, past_key_values=past_key_values, output_attentions=output_attentions
        )
        hidden_states = _clamp_fp16(hidden_states)
        cross_weights = None
        if self.is_decoder and encoder_hidden_states is not None:
            hidden_states, cross_weights = self.layer[1](
                hidden_states, encoder_hidden_states, encoder_attention_bias, past_key_values=past_key_values,
                output_attentions=output_attentions, query_scale=cross_attention_scale,
            )
            hidden_states = _clamp_fp16(hidden_states)
        hidden_states = _clamp_fp16(self.layer[-1](hidden_states))
        return hidden_states, self_weights, cross_weights, attention_bias


# ---------------------------------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------------------------------


def padding_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``[B, L]`` 1/0 key mask -> additive ``[B, 1, 1, L]`` bias (0 for keep, dtype-min for masked)."""
    if mask is None:
        return None
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def logn_attention_scale(encoder_attention_mask: torch.Tensor | None, encoder_length: int, train_length: int,
                         device) -> torch.Tensor:
    """``[batch, 1, 1, 1]`` factors max(1, ln n / ln N) of the cross-attention logits, n the number of encoder tokens
    each example attends to, N = ``train_length`` (``config.cross_attention_logn_length``).

    Log-length scaling (Chiang & Cholak, "Overcoming a Theoretical Limitation of Self-Attention", ACL 2022; Qwen's
    ``use_logn_attn``): with n keys, a key whose logit exceeds the others' by Δ gets 1 / (1 + (n-1)·e^(-Δ)) of the
    attention, which fades as n grows; with the logits scaled by ln n / ln N the term (n-1)·e^(-Δ·ln n / ln N) is
    about n^(1 - Δ / ln N), which no longer grows with n for a key that stood out among N keys (Δ ≥ ln N). The
    factor is 1 up to N keys (where the model was trained), so training and short inputs are unchanged to the bit."""
    if encoder_attention_mask is None:
        counts = torch.full((1,), float(encoder_length), device=device)
    else:
        counts = encoder_attention_mask.to(device=device, dtype=torch.float32).sum(-1)
    longer = counts > train_length  # exactly 1 otherwise (ln N / ln N need not round to 1 in float32)
    scale = torch.where(longer, torch.log(counts.clamp(min=1.0)) / math.log(train_length), 1.0).clamp(min=1.0)
    return scale.view(-1, 1, 1, 1)


def causal_bias(query_positions: torch.Tensor, key_positions: torch.Tensor, dtype) -> torch.Tensor:
    """``[1, 1, Lq, Lk]`` additive causal mask for absolute positions ``[Lq]`` and ``[Lk]``: keys after the query are
    hidden."""
    blocked = key_positions[None, :] > query_positions[:, None]
    return (blocked.to(dtype) * torch.finfo(dtype).min)[None, None]


# ---------------------------------------------------------------------------------------------------------------------
# Stacks
# ---------------------------------------------------------------------------------------------------------------------


def _collect(enabled: bool) -> list | None:
    return [] if enabled else None


class T5EncoderStack(nn.Module):
    """The plain T5 encoder: embedding -> dropout -> blocks with bidirectional relative bias -> RMSNorm -> dropout.

    LOCOST has its own encoder; this one serves VCC's vanilla layers and proves our blocks equal to T5.
    """

    main_input_name = "input_ids"

    def __init__(self, config, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList(
            [T5Block(config, has_relative_attention_bias=(i == 0), layer_idx=i) for i in range(config.num_layers)]
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=False,
                output_hidden_states=False, return_dict=True, **kwargs) -> BaseModelOutput:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        length = inputs_embeds.shape[1]
        positions = torch.arange(length, device=inputs_embeds.device)
        bias = self.block[0].layer[0].SelfAttention.compute_bias(positions, positions)
        mask_bias = padding_bias(attention_mask, bias.dtype)
        bias = bias if mask_bias is None else bias + mask_bias
        hidden_states = self.dropout(inputs_embeds)
        all_hidden, all_attentions = _collect(output_hidden_states), _collect(output_attentions)
        for block in self.block:
            if all_hidden is not None:
                all_hidden.append(hidden_states)
            hidden_states, weights, _, _ = block(hidden_states, bias, output_attentions=output_attentions)
            if all_attentions is not None:
                all_attentions.append(weights)
        hidden_states = self.dropout(self.final_layer_norm(hidden_states))
        if all_hidden is not None:
            all_hidden.append(hidden_states)
        return BaseModelOutput(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_attentions) if all_attentions is not None else None,
        )


class T5DecoderStack(nn.Module):
    """T5 decoder: causal self-attention with unidirectional relative bias, cross-attention, feed-forward.

    Caching uses the v5 :class:`~transformers.EncoderDecoderCache`: self-attention keys/values grow per step, the
    cross-attention keys/values are computed once from the encoder output and reused. Either cache may be static
    (``generate(cache_implementation="static")``, preallocated for ``torch.compile``): the self-attention then sees
    all ``max_cache_len`` slots, and the causal mask hides the unfilled ones (they lie after every query), as in
    transformers' T5. The filled length of a static cache is a 0-d tensor, so nothing here reads it on the host.
    """

    def __init__(self, config, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList(
            [
                T5Block(config, has_relative_attention_bias=(i == 0), is_decoder=True, layer_idx=i)
                for i in range(config.num_decoder_layers)
            ]
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        *,
        cache: Cache | None = None,
        return_dict: bool | None = None,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """As T5's decoder stack, also when called on its own (``model.get_decoder()``, transformers' ExecuTorch
        export): the cache as ``cache`` (transformers >= 5.24) or ``past_key_values``, ``use_cache`` from the config
        when not given, a tuple with ``return_dict=False``."""
        past_key_values = take_cache_argument(past_key_values, {"cache": cache})
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", False))
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `decoder_input_ids` and `decoder_inputs_embeds`.")
        if use_cache and self.training and torch.is_grad_enabled() and any(
                getattr(block, "gradient_checkpointing", False) for block in self.block):
            # The backward pass replays each block, which would write its keys into a cache a second time (T5 too
            # turns caching off here). A cache the caller passed (prefix tuning) is still read.
            logger.warning_once(
                "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."
            )
            use_cache = False
        if past_key_values is not None and not isinstance(past_key_values, EncoderDecoderCache):
            # the cross-attention keys need a cache of their own (a DynamicCache failed deep inside; T5 writes them
            # into its self-attention cache, silently)
            shown = f"a {type(past_key_values).__name__}"
            if isinstance(past_key_values, Cache) and not past_key_values.get_seq_length():
                shown = f"an empty {type(past_key_values).__name__}"
            raise ValueError(
                "The cache (`cache`, or `past_key_values`) must be an EncoderDecoderCache (self-attention and "
                "cross-attention caches, e.g. `EncoderDecoderCache(DynamicCache(), DynamicCache())`) or None; got "
                f"{shown}."
            )
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())  # layers are added lazily
        # Tokens already cached: an int for a dynamic cache; for a static one a 0-d tensor once it holds any (0 before).
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        first_call = not torch.is_tensor(past_length) and past_length == 0
        if input_ids is not None and (first_call or input_ids.shape[1] > 1):
            # the caller's ids (decoding steps feed back the model's own token, one: not checked again)
            check_token_ids("decoder_input_ids", input_ids, vocab_size=embedding_shape(self.embed_tokens)[0])
        if first_call:
            check_binary_mask("decoder_attention_mask", attention_mask if torch.is_tensor(attention_mask) else None)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        batch, query_length = inputs_embeds.shape[:2]
        static = past_key_values is not None and getattr(past_key_values, "is_compileable", False)
        # Keys the self-attention sees: the cached and the new ones, or every slot of a static cache.
        key_length = query_length if past_key_values is None else past_key_values.get_mask_sizes(query_length, 0)[0]
        device, dtype = inputs_embeds.device, inputs_embeds.dtype

        # Causal mask and optional padding, computed once; block 0 adds the relative position bias from its table in
        # its own forward (under FSDP the table is gathered only there) and returns the sum for the other blocks. The
        # masks take the table's dtype, as the bias they are added to.
        query_positions = torch.arange(query_length, device=device) + past_length
        key_positions = torch.arange(key_length, device=device)
        relative_positions = (query_positions, key_positions)
        table_dtype = self.block[0].layer[0].SelfAttention.relative_attention_bias.weight.dtype
        bias = causal_bias(query_positions, key_positions, table_dtype)
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"`decoder_attention_mask` must be a 2D [batch, decoder positions] mask of 1s and 0s (this decoder "
                    f"builds its causal mask itself), got shape {tuple(attention_mask.shape)}."
                )
            if attention_mask.shape[0] != inputs_embeds.shape[0]:  # (it was broadcast over the rows)
                raise ValueError(f"`decoder_attention_mask` has {attention_mask.shape[0]} rows but the decoder inputs "
                                 f"have {inputs_embeds.shape[0]}; pass one mask row per decoder row.")
            if static and attention_mask.shape[-1] <= key_length:
                # It covers the cached and the new positions, the slots after them are hidden by the causal mask.
                # (That it covers exactly those is not checked: the filled length would have to be read back.)
                attention_mask = nn.functional.pad(attention_mask, (0, key_length - attention_mask.shape[-1]), value=1)
            if attention_mask.shape[-1] != key_length:
                expected = f"at most the static cache's {key_length} slots" if static else f"{key_length}"
                raise ValueError(
                    f"`decoder_attention_mask` must cover the cached and the new decoder positions ({expected}), got "
                    f"shape {tuple(attention_mask.shape)}."
                )
            bias = bias + padding_bias(attention_mask, table_dtype)
        encoder_bias = padding_bias(encoder_attention_mask, dtype) if encoder_hidden_states is not None else None
        cross_attention_scale = None
        logn_length = getattr(self.config, "cross_attention_logn_length", None)
        check_logn_length(logn_length)
        if logn_length is not None and encoder_hidden_states is not None:
            cross_attention_scale = logn_attention_scale(
                encoder_attention_mask, encoder_hidden_states.shape[1], logn_length, device
            )

        hidden_states = self.dropout(inputs_embeds)
        all_hidden = _collect(output_hidden_states)
        all_self, all_cross = _collect(output_attentions), _collect(output_attentions)
        for block in self.block:
            if all_hidden is not None:
                all_hidden.append(hidden_states)
            hidden_states, self_weights, cross_weights, bias = block(
                hidden_states,
                bias,
                encoder_hidden_states,
                encoder_bias,
                past_key_values=past_key_values,
                output_attentions=output_attentions,
                cross_attention_scale=cross_attention_scale,
                relative_positions=relative_positions if block is self.block[0] else None,
            )
            if all_self is not None:
                all_self.append(self_weights)
                all_cross.append(cross_weights)
        hidden_states = self.dropout(self.final_layer_norm(hidden_states))
        if all_hidden is not None:
            all_hidden.append(hidden_states)
        output = BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            **cache_field(past_key_values if use_cache else None),
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_self) if all_self is not None else None,
            cross_attentions=tuple(all_cross) if all_cross is not None else None,
        )
        return output if return_dict is not False else output.to_tuple()


# ---------------------------------------------------------------------------------------------------------------------
# Initialisation and the seq2seq LM head shared by LOCOST and VCC-T5
# ---------------------------------------------------------------------------------------------------------------------


def _set_t5_init_std(module: nn.Module, std: float) -> None:
    """Record T5's initialisation std (before ``initializer_factor``) on a Linear/Embedding of these blocks.

    transformers v5 calls ``_init_weights`` only on modules that own parameters directly (the Linear layers, not the
    ``T5Attention`` / feed-forward modules around them), so each layer carries its own std.
    """
    module._t5_init_std = std


def init_t5_module(module: nn.Module, config, init) -> bool:
    """T5's (Mesh-TensorFlow) initialisation for the modules of this file. Returns True if ``module`` was handled.

    transformers v5 calls ``_init_weights`` on the modules that own parameters (the Linear/Embedding layers and the
    norms), each of which carries its std (see :func:`_set_t5_init_std`). ``init`` is ``transformers.initialization``
    (its functions skip tensors already loaded from a checkpoint).
    """
    factor = config.initializer_factor
    if getattr(module, "_t5_init_std", None) is not None:  # q, k, v, o, wi*, wo, relative_attention_bias
        init.normal_(module.weight, mean=0.0, std=factor * module._t5_init_std)
    elif isinstance(module, T5LayerNorm):
        init.constant_(module.weight, factor)
    elif isinstance(module, (nn.Embedding, nn.Linear)):  # the shared embedding and an untied LM head
        init.normal_(module.weight, mean=0.0, std=factor)
    else:
        return False
    return True


class T5Seq2SeqLMMixin:
    """Everything LOCOST and VCC-T5 share above their encoders: the shared embedding, the T5 decoder, the LM head
    (tied: rescaled by ``d_model**-0.5``), the loss, and the helpers ``generate`` and ``DataCollatorForSeq2Seq`` use.

    The host class defines ``self.shared``, ``self.encoder``, ``self.decoder`` (:class:`T5DecoderStack`) and
    ``self.lm_head``, and lists this mixin *before* ``PreTrainedModel`` in its bases (its methods override the
    generic ones, e.g. ``get_input_embeddings``).
    """

    def get_encoder(self, modality: str | None = None):
        """The text encoder; ``modality`` ("image", "video", "audio": transformers' exporters ask every model) has
        none here, and transformers' own lookup answers for it (the model itself, as for T5)."""
        if modality is None:
            return self.encoder
        return super().get_encoder(modality=modality)

    def get_decoder(self):
        return self.decoder

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        # ``shared`` is the encoder's and the decoder's ``embed_tokens`` too: one module under three names (T5 ties
        # three modules' weights instead), so that FSDP2 shards it once. Whatever replaces it replaces it in both
        # stacks: PEFT's wrappers (LoRA on ``target_modules=["shared"]``, ``modules_to_save``, ``merge_and_unload``
        # putting the plain embedding back), ``resize_token_embeddings``. Otherwise the stacks would read the old one.
        if name == "shared" and isinstance(value, nn.Module):
            for stack in ("encoder", "decoder"):
                if self._modules.get(stack) is not None:  # (not yet while ``__init__`` builds them)
                    self._modules[stack].embed_tokens = value

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, new_embeddings):
        self.shared = new_embeddings  # and the stacks' embed_tokens (see __setattr__)

    def _shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs from labels: prepend ``decoder_start_token_id``, drop the last label, -100 -> pad."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None or pad is None:
            raise ValueError("`config.decoder_start_token_id` and `config.pad_token_id` must be set to shift labels.")
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        shifted[..., 0] = start
        return shifted.masked_fill(shifted == -100, pad)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self._shift_right(labels)

    def prepare_summarization_inputs(
        self, tokenizer, documents: str | list[str], max_input_length: int | None = None
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Tokenize ``documents`` (a list, or one document as a string) for ``generate()`` (the summarization
        pipeline calls this).

        Returns the ``generate`` keyword arguments (right-padded ``input_ids``, ``attention_mask``) and, per
        document, how many tokens were dropped to respect ``max_input_length`` (``None``: keep everything; the
        encoder handles any length). Truncation keeps the tokenizer's final special token (``</s>``).
        """
        documents = summarization_documents(documents)
        encoded = tokenizer(documents, add_special_tokens=True)["input_ids"]
        rows, dropped = zip(*(cut_to_length(ids, max_input_length, tokenizer.eos_token_id) for ids in encoded))
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        input_ids, attention_mask = pad_right(list(rows), pad)
        return {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}, list(dropped)

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """``generate()`` calls this for a prepared 4D decoder mask when the cache is static (transformers'
        ``create_masks_for_generate``, keyword arguments only); this decoder builds its causal mask and relative
        position bias from the positions itself, so the 2D padding mask (or None) passes through unchanged."""
        return attention_mask

    def _decode(
        self,
        encoder_outputs: BaseModelOutput,
        attention_mask: torch.Tensor | None,
        decoder_input_ids: torch.Tensor | None,
        decoder_attention_mask: torch.Tensor | None,
        decoder_inputs_embeds: torch.Tensor | None,
        past_key_values: Cache | None,
        use_cache: bool,
        output_attentions: bool,
        output_hidden_states: bool,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """The T5 decoder over ``encoder_outputs`` (cross-attention masked by the encoder's ``attention_mask``)."""
        decoder_inputs = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
        check_hidden_states("encoder_outputs", encoder_outputs.last_hidden_state, self.config.d_model)
        check_mask("attention_mask", attention_mask, "encoder_outputs", encoder_outputs.last_hidden_state)
        check_hidden_states("decoder_inputs_embeds", decoder_inputs_embeds, self.config.d_model)
        rows = encoder_outputs.last_hidden_state.shape[0]
        if decoder_inputs is not None and decoder_inputs.dim() >= 1 and decoder_inputs.shape[0] != rows:
            name = "decoder_input_ids" if decoder_input_ids is not None else "decoder_inputs_embeds"
            raise ValueError(f"`{name}` has {decoder_inputs.shape[0]} rows but the encoder input has {rows}; pass one "
                             "decoder row per document.")
        return self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            inputs_embeds=decoder_inputs_embeds,
            past_key_values=past_key_values,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )

    def _model_output(
        self,
        encoder_outputs: BaseModelOutput,
        attention_mask: torch.Tensor | None,
        decoder_input_ids: torch.Tensor | None,
        decoder_attention_mask: torch.Tensor | None,
        decoder_inputs_embeds: torch.Tensor | None,
        past_key_values: Cache | None,
        use_cache: bool,
        output_attentions: bool,
        output_hidden_states: bool,
        output_class: type[Seq2SeqModelOutput] = Seq2SeqModelOutput,
        **extra_outputs,
    ) -> Seq2SeqModelOutput:
        """Decoder states without the LM head (the ``...Model`` classes, like ``T5Model``)."""
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                f"Pass `decoder_input_ids` or `decoder_inputs_embeds` to `{type(self).__name__}`; got neither."
            )
        decoder_outputs = self._decode(
            encoder_outputs, attention_mask, decoder_input_ids, decoder_attention_mask, decoder_inputs_embeds,
            past_key_values, use_cache, output_attentions, output_hidden_states,
        )
        return output_class(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **cache_field(cache_of(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            **extra_outputs,
        )

    def _lm_head_output(
        self,
        encoder_outputs: BaseModelOutput,
        attention_mask: torch.Tensor | None,
        decoder_input_ids: torch.Tensor | None,
        decoder_attention_mask: torch.Tensor | None,
        decoder_inputs_embeds: torch.Tensor | None,
        past_key_values: Cache | None,
        labels: torch.Tensor | None,
        use_cache: bool,
        output_attentions: bool,
        output_hidden_states: bool,
        output_class: type[Seq2SeqLMOutput] = Seq2SeqLMOutput,
        num_items_in_batch: int | torch.Tensor | None = None,
        **extra_outputs,
    ) -> Seq2SeqLMOutput:
        """Run the decoder over ``encoder_outputs`` and project to the vocabulary (plus the loss with ``labels``)."""
        if labels is not None:
            vocab_size = unwrap_layer(self.get_output_embeddings(), "out_features").out_features
            check_token_ids("labels", labels, vocab_size=vocab_size, ignore_index=-100)
            rows = encoder_outputs.last_hidden_state.shape[0]
            if labels.dim() != 2 or labels.shape[0] != rows:
                raise ValueError(f"`labels` must be [batch, length] with one row per encoder input ({rows}), got shape "
                                 f"{tuple(labels.shape)}.")
            decoder_inputs = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
            if decoder_inputs is not None and tuple(labels.shape[:2]) != tuple(decoder_inputs.shape[:2]):
                expected = tuple(decoder_inputs.shape[:2])
                raise ValueError(f"`labels` must have the [batch, length] shape {expected} of the decoder inputs, got "
                                 f"{tuple(labels.shape)}.")
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self._shift_right(labels)
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "Pass `decoder_input_ids` (or `decoder_inputs_embeds`) or `labels` (from which the decoder inputs are "
                "derived by shifting right); got neither."
            )
        decoder_outputs = self._decode(
            encoder_outputs, attention_mask, decoder_input_ids, decoder_attention_mask, decoder_inputs_embeds,
            past_key_values, use_cache, output_attentions, output_hidden_states,
        )
        sequence_output = decoder_outputs.last_hidden_state
        scale = getattr(self.config, "scale_decoder_outputs", None)  # (transformers v5 T5's field; ours have it too)
        if self.config.tie_word_embeddings if scale is None else scale:
            sequence_output = sequence_output * self.config.d_model**-0.5  # T5: rescale before the tied head
        logits = self.lm_head(sequence_output)

        loss = None
        if labels is not None:
            # mean over the target tokens; given `num_items_in_batch` (Trainer, with gradient accumulation or several
            # processes: the target tokens of the whole global batch), the sum divided by it, as transformers' losses do
            loss = nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), labels.to(logits.device).reshape(-1), ignore_index=-100,
                reduction="mean" if num_items_in_batch is None else "sum",
            )
            if num_items_in_batch is not None:
                loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device, dtype=loss.dtype)
        return output_class(
            loss=loss,
            logits=logits,
            **cache_field(cache_of(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            **extra_outputs,
        )


def returns_dict(return_dict: bool | None, config) -> bool:
    """transformers' convention: ``return_dict=False`` (the argument, else the config) returns a plain tuple."""
    return return_dict if return_dict is not None else config.return_dict


def as_encoder_output(encoder_outputs, output_class: type[BaseModelOutput] = BaseModelOutput) -> BaseModelOutput:
    """Precomputed ``encoder_outputs`` given as a tuple (an encoder's ``return_dict=False`` output): the last hidden
    state first, then the tuples of per-layer hidden states and attentions if present; other entries are ignored."""
    if isinstance(encoder_outputs, BaseModelOutput):
        return encoder_outputs
    per_layer = [item for item in encoder_outputs[1:] if isinstance(item, tuple)]
    return output_class(
        last_hidden_state=encoder_outputs[0],
        hidden_states=per_layer[0] if per_layer else None,
        attentions=per_layer[1] if len(per_layer) > 1 else None,
    )
