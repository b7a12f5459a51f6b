"""Dodo configuration (Qin, Rosset, Chau, Rao, Van Durme, "Dodo: Dynamic Contextual Compression for Decoder-only
LMs", ACL 2024).

Notation (the paper's): ι = ``nugget_layer``, r = 1 / ``nugget_ratio``, φ (phi) = the
*encoder* (compressor) LoRA adapter, θ (theta) = the *decoder* (language model) LoRA adapter, ϕ (varphi) = the scorer,
τ = ``recent_window``, Λ = ``nugget_threshold``.
"""

from __future__ import annotations

import math
import re

import torch
from transformers import LlamaConfig

from .config_overrides import FieldTypesCheckedOnAssignment, check_field_types, pop_field_overrides

NUGGET_COUNT_ROUNDINGS = ("dodo", "ceil")
SCORER_FEATURES = ("base_final_norm", "encoder_hidden")
NUGGET_ENCODINGS = ("encoder_pass", "reencode")


class DodoLlamaConfig(FieldTypesCheckedOnAssignment, LlamaConfig):
    r"""
    Configuration of a [`DodoLlamaForCausalLM`]: a Llama whose context is compressed into "nuggets" (the per-layer
    key/value states of a learned subset of its tokens), with two LoRA adapters (φ compresses, θ decodes) and a small
    scorer. All [`~transformers.LlamaConfig`] fields describe the base model; the fields below are Dodo's. Names used by
    the authors' code (``hparams.yaml`` of a Dodo checkpoint) are given in brackets.

    Args:
        nugget_layer (`int`, defaults to 3) [`nugget_layer`]:
            ι: the scorer reads the hidden states after the first ι decoder layers (paper §2.1, Eq. 6).
        nugget_ratio (`float`, defaults to 0.1) [`ratio`]:
            Nuggets per context token (0.1 is the paper's compression r = 10).
        nugget_count_rounding (`str`, defaults to `"dodo"`):
            How many nuggets a context of n real tokens gets. `"dodo"`: ``min(n, int(float32(n * ratio) + 0.99))``,
            what the authors' code computes (and what its checkpoints were trained with); it can be 0 for tiny contexts,
            which is refused. `"ceil"`: ``min(n, ceil(n * ratio))``, the paper's k = ⌈n / r⌉ (at least 1).
        force_last_nugget (`bool`, defaults to `True`):
            Always select the context's last real token (paper footnote 4: it is the only token that has seen the whole
            context). Works for right and left padding. Applies to top-k selection; threshold selection (Λ) does not
            force anything.
        scorer_features (`str`, defaults to `"base_final_norm"`) [`ind_scorer`]:
            Input of the scorer. `"base_final_norm"` (``ind_scorer=True``, the paper): the final RMSNorm applied to the
            output of the first ι layers run *with the adapters disabled*. `"encoder_hidden"` (``ind_scorer=False``):
            the raw residual stream after ι layers of the φ pass (LoRA then sits on layers >= ι only: `lora_layers`).
        nugget_encoding (`str`, defaults to `"encoder_pass"`) [`auto`]:
            How the nuggets' keys/values are computed. `"encoder_pass"` (``auto=False``, the paper, Eq. 5-7): one φ pass
            over the context; the nuggets are the selected tokens' entries of its KV cache. `"reencode"` (``auto=True``,
            the authors' experimental encoder, not in the paper): the context is run with θ, then the selected tokens
            alone are run again with φ, each attending to the θ keys/values of the context tokens strictly before it and
            to itself; their new keys/values are the nuggets. Needs `scorer_features="base_final_norm"` and no
            autoregressive mode. (The original only runs it on a batch of one, without padding; here padding is masked.)
        score_in_forward (`bool`, defaults to `True`):
            How the nugget scores s enter the decoder's attention logits (every layer and head, nugget columns only).
            `True`: ``+ s`` in the forward pass, what the authors' code computes and what converted checkpoints need.
            `False`: the paper's straight-through ``+ (s - stopgrad(s))`` (Eq. 18): zero in the forward pass, same
            gradient for the scorer.
        soft_prompt_length (`int`, defaults to 1) [`soft`]:
            Number of trainable vectors inserted between the nuggets and the decoder's tokens. 0 disables them.
        lora_r (`int`, defaults to 32) [`lora`], lora_alpha (`float`, defaults to 32), lora_dropout (`float`, defaults
        to 0.1):
            LoRA rank, scale numerator (scale = alpha / r; the authors hard-code 32) and dropout of both adapters.
        lora_target_modules (`list[str]`, defaults to `["q_proj", "v_proj", "o_proj"]`):
            Attention projections (names inside ``self_attn``) that get LoRA. The authors use q, v and o.
        lora_layers (`list[int]`, *optional*):
            Decoder layers that get LoRA; `None` means all. ``ind_scorer=False`` checkpoints use layers >= ι. With
            every layer >= ι (either `scorer_features`), the φ pass's first ι layers are adapter-free and the scorer
            reads its input from them: a compression then costs one pass over the context instead of (L + ι) / L.
        encoder_adapter_name (`str`, defaults to `"encoder"`), decoder_adapter_name (`str`, defaults to `"decoder"`):
            Names of the φ and θ adapters (the PEFT adapter names of the authors' checkpoints). Setting both to the same
            name gives a model with one adapter used for both roles (what the authors' ``freeze_decoder=True`` computes,
            because of a bug in their code).
        recent_window (`int`, *optional*):
            τ of the autoregressive mode (paper §2.2, Eq. 9-10). `None` disables the mode: a forward pass or
            `generate()` without nuggets is then the plain Llama with θ. When set, a call without nuggets streams its
            tokens: the last τ..τ+stride tokens stay uncompressed and older tokens are compressed into nuggets in
            chunks of `compression_stride` tokens (see [`DodoLlamaForCausalLM`]). The window counts columns: all rows
            of a batch are compressed at the same steps, so a left-padded row's chunks would hold fewer real tokens
            than the same row run alone. A left-padded batch is refused (`ValueError`) once a call would compress
            (by `generate()` before its first step, when its length can reach a compression); right padding keeps each
            row's result.
        compression_stride (`int`, *optional*):
            Tokens compressed at once in autoregressive mode; the uncompressed window then oscillates between τ and
            τ + stride tokens. Defaults to τ.
        nugget_threshold (`float`, *optional*):
            Λ of Eq. 8: in autoregressive mode, keep exactly the tokens whose score exceeds Λ. `None`: keep the top
            ``nugget_ratio`` of each compressed chunk (same rounding and forced last token as compressor mode).
            [`DodoLlamaForCausalLM.estimate_nugget_threshold`] estimates Λ from sample text.
        legacy_decoder_mask_order (`bool`, defaults to `False`):
            Reproduce the authors' decoder attention-mask bug: the padding mask of the keys
            ``[nuggets; soft prompt; tokens]`` is built in the order ``[soft prompt; nuggets; tokens]``. It only changes
            rows with fewer nuggets than the batch maximum (batched inputs): a padded nugget slot becomes visible and
            the soft prompt is hidden. Off by default (the intended computation).

    Example:

    ```python
    >>> import longreach
    >>> from longreach import DodoLlamaConfig, DodoLlamaForCausalLM
    >>> config = DodoLlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    ...                          num_attention_heads=4, num_key_value_heads=2, lora_r=8)
    >>> model = DodoLlamaForCausalLM(config)
    ```
    """

    model_type = "dodo_llama"
    # No tensor-parallel plan: Llama's shards q/k/v/o_proj, which here are PEFT LoRA wrappers holding two adapters (a
    # plan naming them would shard the wrapper, not its weights). `from_pretrained(tp_plan=...)` raises; use data
    # parallelism (DDP, FSDP, DeepSpeed ZeRO), see the README's fine-tuning guide. No pipeline plan either: a forward
    # runs the layers twice (compress with φ, then decode with θ), which Llama's layer-by-layer plan does not describe.
    base_model_tp_plan = None
    base_model_pp_plan = None

    nugget_layer: int = 3
    nugget_ratio: float = 0.1
    nugget_count_rounding: str = "dodo"
    force_last_nugget: bool = True
    scorer_features: str = "base_final_norm"
    nugget_encoding: str = "encoder_pass"
    score_in_forward: bool = True
    soft_prompt_length: int = 1
    lora_r: int = 32
    lora_alpha: float = 32.0
    lora_dropout: float = 0.1
    lora_target_modules: list[str] | None = None
    lora_layers: list[int] | None = None
    encoder_adapter_name: str = "encoder"
    decoder_adapter_name: str = "decoder"
    recent_window: int | None = None
    compression_stride: int | None = None
    nugget_threshold: float | None = None
    legacy_decoder_mask_order: bool = False

    def __post_init__(self, **kwargs):
        if self.lora_target_modules is None:
            self.lora_target_modules = ["q_proj", "v_proj", "o_proj"]
        else:
            self.lora_target_modules = list(self.lora_target_modules)
        if self.lora_layers is not None:
            self.lora_layers = sorted({int(layer) for layer in self.lora_layers})
        super().__post_init__(**kwargs)
        self.validate_llama()
        self.validate_dodo()

    def validate(self) -> None:
        """`save_pretrained`'s check before writing config.json: the parent's validators, then this model's, so that a
        setting assigned after construction that the model cannot run is refused before it is saved, not on load."""
        self.validate_llama()
        self.validate_dodo()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # field overrides are validated with the stored values (see `pop_field_overrides`); a stored legacy
        # `rope_scaling`, which __post_init__ applies after the fields, gives way to a `rope_parameters` override
        config_dict = dict(config_dict)
        if "rope_parameters" in kwargs:
            config_dict.pop("rope_scaling", None)
        config_dict = pop_field_overrides(cls, config_dict, kwargs)
        return super().from_dict(config_dict, **kwargs)

    def validate_llama(self) -> None:
        """LlamaConfig's own checks (head sizes, rope parameters, ...), which its strict dataclass runs at construction
        but a subclass's does not: run here, as a ValueError naming what is wrong."""
        from huggingface_hub.errors import StrictDataclassError

        try:
            LlamaConfig.validate(self)  # LlamaConfig's validators only (`validate` below adds Dodo's)
        except (StrictDataclassError, KeyError, TypeError) as error:
            lines = [line.strip() for line in str(error).strip().strip('"').splitlines() if line.strip()]
            raise ValueError(f"Invalid Llama settings in {type(self).__name__}: {' '.join(lines[1:] or lines)}") from error

    # ------------------------------------------------------------------------------------------------------------------
    # Derived values
    # ------------------------------------------------------------------------------------------------------------------

    @property
    def adapter_names(self) -> list[str]:
        """Distinct adapter names, φ first."""
        names = [self.encoder_adapter_name]
        if self.decoder_adapter_name != self.encoder_adapter_name:
            names.append(self.decoder_adapter_name)
        return names

    @property
    def lora_layer_indices(self) -> list[int]:
        return list(range(self.num_hidden_layers)) if self.lora_layers is None else list(self.lora_layers)

    @property
    def lora_target_regex(self) -> str:
        """``re.fullmatch`` pattern of the LoRA-wrapped modules, backbone-relative (``layers.3.self_attn.v_proj``).

        With all layers it is the authors' own pattern (``.*layers\\.(\\d+)\\.self_attn\\.(q_proj|v_proj|o_proj)``)."""
        modules = "|".join(self.lora_target_modules)
        layers = r"\d+" if self.lora_layers is None else "|".join(str(layer) for layer in self.lora_layers)
        return rf".*layers\.({layers})\.self_attn\.({modules})"

    @property
    def effective_compression_stride(self) -> int | None:
        if self.recent_window is None:
            return None
        return self.compression_stride if self.compression_stride is not None else max(self.recent_window, 1)

    def num_nuggets_for_length(self, num_tokens: int) -> int:
        """Nuggets kept for a context of ``num_tokens`` real tokens (see `nugget_count_rounding`)."""
        if self.nugget_count_rounding == "ceil":
            # the model's tolerance: 100 * 0.07 = 7.000000000000001 gives 7 nuggets, not 8
            return min(num_tokens, math.ceil(num_tokens * self.nugget_ratio - 1e-9))
        # float32 product, then truncation toward zero, exactly as the authors' tensor arithmetic
        product = torch.tensor([num_tokens], dtype=torch.int64) * self.nugget_ratio + 0.99
        return min(num_tokens, int(product.long().item()))

    # ------------------------------------------------------------------------------------------------------------------
    # Validation
    # ------------------------------------------------------------------------------------------------------------------

    def validate_dodo(self) -> None:
        """Refuse settings the model cannot run, naming the field, the value and what is expected."""
        check_field_types(self, DodoLlamaConfig)  # each Dodo field has its annotated type (Llama's: LlamaConfig's)
        if not isinstance(self.nugget_layer, int) or not 0 <= self.nugget_layer <= self.num_hidden_layers:
            raise ValueError(
                f"`nugget_layer` (ι) must be an integer in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.nugget_layer!r}."
            )
        if not isinstance(self.nugget_ratio, (int, float)) or not 0 < self.nugget_ratio <= 1:
            raise ValueError(f"`nugget_ratio` must be in (0, 1] (nuggets per token), got {self.nugget_ratio!r}.")
        if self.nugget_count_rounding not in NUGGET_COUNT_ROUNDINGS:
            raise ValueError(
                f"`nugget_count_rounding` must be one of {NUGGET_COUNT_ROUNDINGS}, got {self.nugget_count_rounding!r}."
            )
        if self.scorer_features not in SCORER_FEATURES:
            raise ValueError(f"`scorer_features` must be one of {SCORER_FEATURES}, got {self.scorer_features!r}.")
        if self.nugget_encoding not in NUGGET_ENCODINGS:
            raise ValueError(f"`nugget_encoding` must be one of {NUGGET_ENCODINGS}, got {self.nugget_encoding!r}.")
        if self.nugget_encoding == "reencode" and self.scorer_features != "base_final_norm":
            raise ValueError(
                "`nugget_encoding='reencode'` scores the tokens on adapter-free features (the original asserts "
                f"ind_scorer): `scorer_features` must be 'base_final_norm', got {self.scorer_features!r}."
            )
        if self.nugget_encoding == "reencode" and self.recent_window is not None:
            raise ValueError(
                "`nugget_encoding='reencode'` is a compressor-mode encoder: `recent_window` (autoregressive mode) must "
                f"be None with it, got {self.recent_window!r}."
            )
        if not isinstance(self.soft_prompt_length, int) or self.soft_prompt_length < 0:
            raise ValueError(f"`soft_prompt_length` must be a non-negative integer, got {self.soft_prompt_length!r}.")
        if not isinstance(self.lora_r, int) or self.lora_r < 1:
            raise ValueError(f"`lora_r` must be a positive integer, got {self.lora_r!r}.")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"`lora_dropout` must be in [0, 1), got {self.lora_dropout!r}.")
        allowed = {"q_proj", "k_proj", "v_proj", "o_proj"}
        if not self.lora_target_modules or not set(self.lora_target_modules) <= allowed:
            raise ValueError(
                f"`lora_target_modules` must be a non-empty subset of {sorted(allowed)}, "
                f"got {self.lora_target_modules!r}."
            )
        if self.lora_layers is not None and len(self.lora_layers) == 0:
            raise ValueError(
                "`lora_layers` must be None (every layer) or a non-empty list of decoder layers, got []: "
                "Dodo's φ and θ adapters need at least one LoRA layer."
            )
        bad_layers = [layer for layer in self.lora_layer_indices if not 0 <= layer < self.num_hidden_layers]
        if bad_layers:
            raise ValueError(
                f"`lora_layers` must index decoder layers 0..{self.num_hidden_layers - 1}, got {self.lora_layers!r}."
            )
        if self.scorer_features == "encoder_hidden" and any(
            layer < self.nugget_layer for layer in self.lora_layer_indices
        ):
            raise ValueError(
                "`scorer_features='encoder_hidden'` reads the φ pass after ι layers, which must be adapter-free: "
                f"`lora_layers` must all be >= nugget_layer={self.nugget_layer}, got {self.lora_layers!r}."
            )
        for name in ("encoder_adapter_name", "decoder_adapter_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
                raise ValueError(f"`{name}` must be a Python identifier (a PEFT adapter name), got {value!r}.")
        if self.recent_window is not None and (not isinstance(self.recent_window, int) or self.recent_window < 0):
            raise ValueError(f"`recent_window` (τ) must be None or a non-negative integer, got {self.recent_window!r}.")
        if self.compression_stride is not None and (
            not isinstance(self.compression_stride, int) or self.compression_stride < 1
        ):
            raise ValueError(
                f"`compression_stride` must be None or a positive integer, got {self.compression_stride!r}."
            )
