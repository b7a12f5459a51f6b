"""LOCOST: a T5 encoder-decoder whose encoder is a stack of gated bidirectional state-space (S4D) blocks.

Le Bronnec et al., "LOCOST: State-Space Models for Long Document Abstractive Summarization" (EACL 2024), with the
numerics of the authors' code (github.com/flbbb/locost-summarization). Encoder block i (paper §3, eq. 4; code names):

    u = RMSNorm(x)
    x = x + dropout( out_proj( q_proj(u) ⊙ BiSSMConv(mask ⊙ k_proj(u)) ) )      # gated bidirectional SSM
    x = x + dropout( FF(RMSNorm(x)) )                                            # T5 gated-GELU feed-forward

There is no attention and no positional embedding in the encoder: positions come from the convolution, whose cost is
O(L log L). Padded positions are zeroed before every convolution, so real positions never see padding (and the model
is invariant to the padding side). The decoder, the tied LM head and the loss are T5 v1.1 (``t5_blocks``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.modeling_utils import PreTrainedModel

from ..configuration.configuration_locost import LocostConfig
from .input_checks import (
    check_hidden_states,
    check_mask,
    check_rows_not_empty,
    check_token_ids,
    embedding_shape,
    reject_head_masks,
    take_cache_argument,
)
from .remote_code import HubReadyMixin
from .ssm import BidirectionalS4DConvolution
from .t5_blocks import (
    Dropout,
    T5DecoderStack,
    T5LayerFF,
    T5LayerNorm,
    T5Seq2SeqLMMixin,
    as_encoder_output,
    init_t5_module,
    returns_dict,
)


class LocostGatedSSM(nn.Module):
    """``out_proj( q ⊙ BiSSMConv(mask ⊙ k) )`` with linear projections (with biases) q, k of the normed input.

    The mask multiplies k only (k_proj has a bias, so padded positions would otherwise inject it), the gate q has no
    activation, and the convolution includes the D skip term. Padded positions still get outputs (from real tokens).
    """

    def __init__(self, config: LocostConfig):
        super().__init__()
        self.gating = config.gating
        if config.gating:
            self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.conv = BidirectionalS4DConvolution(
            config.d_model,
            config.d_state,
            bidirectional=config.bidirectional,
            dt_min=config.ssm_dt_min,
            dt_max=config.ssm_dt_max,
            kernel_chunk_size=config.ssm_kernel_chunk_size,
            authors_fft_size=config.ssm_authors_fft_size,
            kernel_cache_lengths=config.ssm_kernel_cache_lengths,
            kernel_cache_bytes=config.ssm_kernel_cache_bytes,
        )
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        for linear in (self.k_proj, self.out_proj, getattr(self, "q_proj", None)):
            if linear is not None:
                linear._torch_default_init = True  # see LocostPreTrainedModel._init_weights

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        k = self.k_proj(hidden_states) * attention_mask[:, :, None].to(hidden_states.dtype)
        y = self.conv(k)
        if self.gating:
            y = self.q_proj(hidden_states) * y
        return self.out_proj(y)


class LocostLayerSSM(nn.Module):
    """Pre-norm residual SSM sublayer (``layer.0`` of an encoder block)."""

    def __init__(self, config: LocostConfig):
        super().__init__()
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.ssm = LocostGatedSSM(config)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.dropout(self.ssm(self.layer_norm(hidden_states), attention_mask))


class LocostEncoderBlock(GradientCheckpointingLayer):
    """``layer.0`` gated bidirectional SSM, ``layer.1`` T5 feed-forward."""

    def __init__(self, config: LocostConfig):
        super().__init__()
        self.layer = nn.ModuleList([LocostLayerSSM(config), T5LayerFF(config)])

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                piece_length: int | None = None) -> torch.Tensor:
        """With ``piece_length``: ``forward_in_pieces_`` (no autograd, in place), run through this call so that hooks
        on the block see it (FSDP gathers the block's weights only around its ``forward``)."""
        if piece_length is not None:
            return self.forward_in_pieces_(hidden_states, attention_mask, piece_length)
        return self.layer[1](self.layer[0](hidden_states, attention_mask))

    @torch.no_grad()
    def forward_in_pieces_(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                           piece_length: int) -> torch.Tensor:
        """``forward`` for long inputs without autograd, updating ``hidden_states`` in place, and returning it.

        Norms, projections, gate and feed-forward run over ``piece_length`` positions at a time, the convolution over
        groups of channels of about the same number of elements; one extra [B, L, H] buffer holds k, then the
        convolution's output. Dtypes are those of ``forward``: where a sublayer's output is wider than
        ``hidden_states`` (a float16 model's float32 ``wo``, float32 ``inputs_embeds`` in a bfloat16 model), the
        residual stream is widened (a new tensor, returned) instead of the output rounded into it.
        """
        ssm_layer, ff_layer = self.layer
        ssm = ssm_layer.ssm
        batch, length, width = hidden_states.shape
        pieces = [slice(start, start + piece_length) for start in range(0, length, piece_length)]
        k = None
        for piece in pieces:
            normed = ssm_layer.layer_norm(hidden_states[:, piece])
            value = ssm.k_proj(normed) * attention_mask[:, piece, None].to(normed.dtype)
            if k is None:
                k = value.new_empty(batch, length, width)  # the dtype that `LocostGatedSSM.forward` convolves in
            k[:, piece] = value
        ssm.conv(k, channel_group=max(1, piece_length * width // (batch * length)))  # (hooks: see its forward)
        for piece in pieces:
            y = k[:, piece]
            if ssm.gating:
                y = ssm.q_proj(ssm_layer.layer_norm(hidden_states[:, piece])) * y
            update = ssm_layer.dropout(ssm.out_proj(y))
            hidden_states = _widened_for(hidden_states, update)
            hidden_states[:, piece] += update
        del k
        for piece in pieces:
            value = ff_layer(hidden_states[:, piece])
            hidden_states = _widened_for(hidden_states, value)
            hidden_states[:, piece] = value
        return hidden_states


def _widened_for(hidden_states: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``hidden_states``, or a copy in the wider dtype that ``hidden_states + value`` has (as the one-piece path)."""
    dtype = torch.promote_types(hidden_states.dtype, value.dtype)  # (dynamo cannot trace torch.result_type)
    return hidden_states if dtype == hidden_states.dtype else hidden_states.to(dtype)


#: `LocostConfig` fields that set how the encoder computes, not its weights -> where the encoder keeps them (``conv.``:
#: in each block's SSM convolution). An edit of `model.config` after loading applies from the next call.
ENCODER_RUNTIME_SETTINGS = {
    "encoder_chunk_length": "chunk_length",
    "encoder_accelerator_chunk_length": "accelerator_chunk_length",
    "ssm_kernel_chunk_size": "conv.kernel_chunk_size",
    "ssm_kernel_cache_lengths": "conv.kernel_cache_lengths",
    "ssm_kernel_cache_bytes": "conv.kernel_cache_bytes",
    "ssm_authors_fft_size": "conv.authors_fft_size",
}


class LocostEncoder(nn.Module):
    """embedding -> dropout -> SSM blocks -> RMSNorm -> dropout. The attention mask is applied in every block."""

    main_input_name = "input_ids"

    def __init__(self, config: LocostConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList([LocostEncoderBlock(config) for _ in range(config.num_layers)])
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)
        self.chunk_length = config.encoder_chunk_length
        self.accelerator_chunk_length = config.encoder_accelerator_chunk_length
        self._applied_settings = {name: getattr(config, name) for name in ENCODER_RUNTIME_SETTINGS}

    def apply_config(self) -> None:
        """Apply the `ENCODER_RUNTIME_SETTINGS` of `self.config` that changed since the last call (checked first with
        `LocostConfig.validate_locost`): assigned to `model.config` after loading, they were ignored, and the saved
        config then described another computation (`ssm_authors_fft_size` is another function).

        Under ``torch.compile`` the comparison is traced (dynamo guards on the settings, so an edit recompiles), and a
        change is applied outside the graph (`_apply_changed_settings`): a graph break, which ``fullgraph=True``
        refuses, instead of the compiled code keeping the old settings; inside a strict ``torch.export`` a change
        is refused with what to do (call this method first)."""
        current = {name: getattr(self.config, name) for name in ENCODER_RUNTIME_SETTINGS}
        changed = {name: value for name, value in current.items() if value != self._applied_settings[name]}
        if changed and torch.compiler.is_exporting() and torch.compiler.is_dynamo_compiling():
            # (a strict torch.export cannot leave its graph to apply them: dynamo's error named only the method)
            raise RuntimeError(f"LOCOST encoder settings changed on `model.config` since the last call ({changed}) "
                               "cannot be applied inside a strict torch.export; apply them first with "
                               "`model.get_encoder().apply_config()` (or one call of the model), then export.")
        if changed:
            self._apply_changed_settings(changed)

    @torch.compiler.disable
    def _apply_changed_settings(self, changed: dict) -> None:
        self.config.validate_locost()
        for name, value in changed.items():
            target = ENCODER_RUNTIME_SETTINGS[name]
            if target.startswith("conv."):
                for block in self.block:
                    conv = block.layer[0].ssm.conv
                    setattr(conv, target.removeprefix("conv."), value)
                    conv.clear_kernel_cache()  # spectra of the previous settings
            else:
                setattr(self, target, value)
            self._applied_settings[name] = value

    def piece_length(self, device: torch.device) -> int | None:
        """Positions per piece of the long-input path for inputs on ``device`` (None: one piece): the CPU's
        ``encoder_chunk_length`` or the accelerators' ``encoder_accelerator_chunk_length``."""
        return self.chunk_length if device.type == "cpu" else self.accelerator_chunk_length

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        """``hidden_states`` (with ``output_hidden_states``) follows T5: the embedding output, the output of every
        block but the last, then the final-norm output. The encoder has no attention, so ``attentions`` is None."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds` to the LOCOST encoder.")
        self.apply_config()
        check_token_ids("input_ids", input_ids, vocab_size=embedding_shape(self.embed_tokens)[0])
        callers_embeddings = inputs_embeds is not None
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        else:
            check_hidden_states("inputs_embeds", inputs_embeds, embedding_shape(self.embed_tokens)[1])
        check_mask("attention_mask", attention_mask, "input_ids", inputs_embeds)
        check_rows_not_empty("attention_mask", attention_mask)
        if attention_mask is None:
            attention_mask = torch.ones(inputs_embeds.shape[:2], device=inputs_embeds.device)

        hidden_states = self.dropout(inputs_embeds)
        all_hidden = [] if output_hidden_states else None
        length = hidden_states.shape[1]
        # (not under torch.export: the length may be symbolic, and the comparison would fix its range)
        piece_length = None if torch.compiler.is_exporting() else self.piece_length(hidden_states.device)
        if piece_length is not None and length > piece_length and not torch.is_grad_enabled():
            # long input: pieces written in place (see LocostConfig.encoder_chunk_length)
            if callers_embeddings and hidden_states is inputs_embeds:
                hidden_states = hidden_states.clone()  # never write into the caller's tensor
            for block in self.block:
                if all_hidden is not None:
                    all_hidden.append(hidden_states.clone())
                hidden_states = block(hidden_states, attention_mask, piece_length=piece_length)
            output = None
            for start in range(0, length, piece_length):
                piece = slice(start, start + piece_length)
                value = self.dropout(self.final_layer_norm(hidden_states[:, piece]))
                if output is None:  # the norm's dtype, as in one piece (half precision for a half-precision norm)
                    same = value.dtype == hidden_states.dtype
                    output = hidden_states if same else value.new_empty(hidden_states.shape)
                output[:, piece] = value
            hidden_states = output
        else:
            for block in self.block:
                if all_hidden is not None:
                    all_hidden.append(hidden_states)
                hidden_states = block(hidden_states, attention_mask)
            hidden_states = self.dropout(self.final_layer_norm(hidden_states))
        if all_hidden is not None:
            all_hidden.append(hidden_states)
        output = BaseModelOutput(
            last_hidden_state=hidden_states, hidden_states=tuple(all_hidden) if all_hidden is not None else None
        )
        return output if return_dict is not False else output.to_tuple()


class LocostPreTrainedModel(HubReadyMixin, PreTrainedModel):
    config: LocostConfig
    config_class = LocostConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LocostEncoderBlock", "T5Block"]
    # The SSM parameters are complex numbers stored as real pairs: keep them float32 when loading in half precision.
    _keep_in_fp32_modules_strict = ["ssm.conv"]
    # As T5: the feed-forward output projections stay float32 when loading in float16, where their products can
    # overflow ("wo" is searched in parameter names: only the `DenseReluDense.wo` weights have it)
    _keep_in_fp32_modules = ["wo"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # forward and a decoding step with a static cache compile without graph breaks (tests/test_model_contract.py)
    _can_compile_fullgraph = True
    _hub_pipeline_auto_class = "AutoModelForSeq2SeqLM"
    _hub_auto_classes = {"AutoModel": "LocostModel", "AutoModelForSeq2SeqLM": "LocostForConditionalGeneration"}

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """S4D-Lin for the SSM and PyTorch defaults for its projections (as the authors), T5's initialisation for
        everything else (N(0, initializer_factor²) for the embedding and an untied head)."""
        if isinstance(module, BidirectionalS4DConvolution):
            module.reset_parameters()
        elif isinstance(module, nn.Linear) and getattr(module, "_torch_default_init", False):
            module.reset_parameters()  # transformers guards torch.nn.init here: loaded tensors are kept
        else:
            init_t5_module(module, self.config, init)


class _LocostSeq2Seq(T5Seq2SeqLMMixin, LocostPreTrainedModel):
    """Shared embedding, SSM encoder and T5 decoder; the two public classes below add their outputs."""

    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: LocostConfig):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = LocostEncoder(config, self.shared)
        self.decoder = T5DecoderStack(config, self.shared)

    def _encode(self, input_ids, attention_mask, inputs_embeds, encoder_outputs, output_hidden_states):
        check_token_ids("input_ids", input_ids)
        check_mask("attention_mask", attention_mask, "input_ids", input_ids if input_ids is not None else inputs_embeds)
        if encoder_outputs is None:
            if input_ids is None and inputs_embeds is None:
                raise ValueError("Pass `input_ids`, `inputs_embeds` or precomputed `encoder_outputs`; got none.")
            return self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_hidden_states=output_hidden_states,
            )
        return as_encoder_output(encoder_outputs)


class LocostModel(_LocostSeq2Seq):
    """LOCOST without the LM head: returns the decoder's last hidden state (like ``T5Model``)."""

    def __init__(self, config: LocostConfig):
        super().__init__(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        past_key_values = take_cache_argument(past_key_values, kwargs)
        reject_head_masks(kwargs)
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states)
        output_attentions = bool(output_attentions if output_attentions is not None else self.config.output_attentions)
        check_token_ids("decoder_input_ids", decoder_input_ids)
        encoder_outputs = self._encode(input_ids, attention_mask, inputs_embeds, encoder_outputs, output_hidden_states)
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
        )
        return output if returns_dict(return_dict, self.config) else output.to_tuple()


class LocostForConditionalGeneration(_LocostSeq2Seq, GenerationMixin):
    """LOCOST with the (tied) LM head: summarization, ``generate()``, training with ``labels``.

    Example:

    ```python
    >>> import torch, longreach
    >>> from longreach import LocostConfig, LocostForConditionalGeneration
    >>> model = LocostForConditionalGeneration(LocostConfig(d_model=64, d_state=16, d_kv=16, d_ff=128, num_layers=2,
    ...                                                     num_heads=4, vocab_size=128))
    >>> ids = torch.randint(2, 128, (1, 5000))                     # a long document
    >>> summary_ids = model.generate(ids, max_new_tokens=20, num_beams=2)
    ```
    """

    _tied_weights_keys = {**_LocostSeq2Seq._tied_weights_keys, "lm_head.weight": "shared.weight"}

    def __init__(self, config: LocostConfig):
        super().__init__(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
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
        return_dict: bool | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, length)`): the document; any length, right or left padded.
        attention_mask (`torch.Tensor` of shape `(batch, length)`): 1 for real tokens, 0 for padding. Zeros between
            real tokens are taken too: no real token sees the masked ones, but the gap still counts as distance for
            the convolution (as it does for T5's relative position bias), so it is not the same as deleting them.
        labels (`torch.LongTensor` of shape `(batch, target_length)`): target ids, -100 where ignored; the decoder
            inputs are derived from them (shift right) when `decoder_input_ids` is not given.
        """
        past_key_values = take_cache_argument(past_key_values, kwargs)
        reject_head_masks(kwargs)
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states)
        output_attentions = bool(output_attentions if output_attentions is not None else self.config.output_attentions)
        if use_cache is None:  # as T5: the config's, with labels too (training under checkpointing turns it off)
            use_cache = self.config.use_cache
        check_token_ids("decoder_input_ids", decoder_input_ids)
        encoder_outputs = self._encode(input_ids, attention_mask, inputs_embeds, encoder_outputs, output_hidden_states)
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
        )
        return output if returns_dict(return_dict, self.config) else output.to_tuple()
