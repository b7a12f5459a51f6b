"""VCC-T5 configuration (Zeng et al., "VCC: Scaling Transformers to 128K Tokens or More by Prioritizing Important
Tokens", NeurIPS 2023; code: github.com/awslabs/vip-token-centric-compression)."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedConfig

from .config_overrides import FieldTypesCheckedOnAssignment, check_field_types, pop_field_overrides

#: The original code's class paths in its ``encoder_layers`` list (one entry per encoder layer).
ORIGINAL_VANILLA_LAYER = "src.t5.models.layers.T5Block"
ORIGINAL_VCC_LAYER = "src.t5.models.vcc_layers.VccT5Block"

#: Original VCC field name -> our field name. The original stores these as extra attributes of a stock ``T5Config``
#: (``model_type: "t5"``); ``encoder_layers`` is handled separately (it becomes ``num_vanilla_layers``).
ORIGINAL_FIELD_NAMES = {
    "short_segment_size": "segment_length",
    "num_important_tokens": "num_vip_slots",
    "block_size": "block_size",
    "num_fine_blocks": "num_refined_blocks",
    "scale_correction": "scale_correction",
    "explore_prob": "exploration_probability",
}

#: Original fields that only have one supported value (the port hard-wires it): field -> accepted values.
ORIGINAL_FIXED_FIELDS = {
    "selector_type": ("attention_based_selector",),
    "coarser_type": ("mean",),
    "include_positions_in_mixed_states": (True,),
    "cache_version": (0,),
    "skip_standard_layers": (False,),
}

#: Original fields without numerical effect (a CUDA kernel for the bias backward, activation checkpointing flags).
ORIGINAL_IGNORED_FIELDS = ("custom_relative_attention", "checkpoint_attention", "checkpoint_ffn")

_T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12, feed_forward_proj="relu")
_T5_LARGE = dict(vocab_size=32128, d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_heads=16, feed_forward_proj="relu")
_T5_3B = dict(vocab_size=32128, d_model=1024, d_kv=128, d_ff=16384, num_layers=24, num_heads=32, feed_forward_proj="relu")
_VCC_SHARED = dict(segment_length=512, block_size=16, num_refined_blocks=90, num_vip_slots=16, scale_correction=True,
                   exploration_probability=0.1)

#: The paper's settings (§4, Table 8; the authors' ``cfgs/t5``): t5-base = 4 vanilla + 8 VCC layers, t5-large and
#: t5-3b = 6 vanilla + 18 VCC layers; 512-token segments, blocks of 16, 90 refined blocks per layer. The number of VIP
#: slots is the plain-summarization value (16); the authors used 32-288 for QA tasks (their ``cfgs/t5``).
VCC_T5_PRESETS: dict[str, dict] = {
    "base": {**_T5_BASE, **_VCC_SHARED, "num_vanilla_layers": 4},
    "large": {**_T5_LARGE, **_VCC_SHARED, "num_vanilla_layers": 6},
    "3b": {**_T5_3B, **_VCC_SHARED, "num_vanilla_layers": 6},
}
#: Only the VCC part of each preset (to put on top of an existing T5 configuration).
VCC_FIELDS = ("num_vanilla_layers", "segment_length", "num_vip_slots", "block_size", "num_refined_blocks",
              "scale_correction", "exploration_probability")


class VCCT5Config(FieldTypesCheckedOnAssignment, PreTrainedConfig):
    r"""
    Configuration of a [`VCCT5ForConditionalGeneration`]: a T5 whose encoder runs its first `num_vanilla_layers`
    layers on independent `segment_length`-token segments and every later layer on a compressed sequence in which only
    `num_vip_slots` VIP tokens (a question, a task prefix) and `num_refined_blocks` blocks of `block_size` tokens stay
    at full resolution; every other block is represented by its mean. VCC adds no parameters: the parameter names
    and shapes are T5's, so T5 checkpoints load unchanged. The defaults are the paper's t5-base setting; see
    [`~VCCT5Config.from_preset`] for base / large / 3b.

    T5 fields (same meaning as in `transformers.T5Config`):

    Args:
        vocab_size (`int`, defaults to 32128): rows of the shared token embedding.
        d_model (`int`, defaults to 768): hidden size.
        d_kv (`int`, defaults to 64): size of one attention head.
        d_ff (`int`, defaults to 3072): inner size of the feed-forward sublayers.
        num_layers (`int`, defaults to 12): number of encoder layers (vanilla + VCC).
        num_decoder_layers (`int`, *optional*): number of decoder layers; defaults to `num_layers`.
        num_heads (`int`, defaults to 12): attention heads.
        relative_attention_num_buckets (`int`, defaults to 32), relative_attention_max_distance (`int`, defaults to
            128): T5's bucketed relative position bias. One table serves all encoder layers (vanilla and VCC).
        dropout_rate (`float`, defaults to 0.1), layer_norm_epsilon (`float`, defaults to 1e-6),
        initializer_factor (`float`, defaults to 1.0), feed_forward_proj (`str`, defaults to `"relu"`): as T5.
        pad_token_id (`int`, defaults to 0), eos_token_id (`int`, defaults to 1), decoder_start_token_id (`int`,
            defaults to 0): T5's special ids.
        tie_word_embeddings (`bool`, defaults to `True`): tie the LM head to the shared embedding and rescale the
            decoder output by `d_model**-0.5` (T5 v1.0: t5-base/large/3b). `False` for T5 v1.1-style checkpoints.
        scale_decoder_outputs (`bool`, *optional*): as transformers v5's T5, whose configs say
            `tie_word_embeddings: true` and keep the rescaling here; `None` (the default): rescale when tied at
            construction (later untying, as PEFT's `merge_and_unload` does for a trained head, keeps it). A T5
            folder saved by transformers v5 loads as T5 loads it: head tied unless the checkpoint holds its own
            `lm_head.weight`, rescaled as this says.
        use_cache (`bool`, defaults to `True`): cache decoder keys/values during generation.

    VCC fields (the original's name in brackets):

        num_vanilla_layers (`int`, defaults to 4) [`encoder_layers`: the number of leading
            `"src.t5.models.layers.T5Block"` entries; the rest are `"...VccT5Block"`]:
            leading encoder layers that run as ordinary T5 layers on independent segments. The remaining
            `num_layers - num_vanilla_layers` layers are VCC layers. Paper: 4 of 12 (base), 6 of 24 (large, 3b).
        segment_length (`int` or `None`, defaults to 512) [`short_segment_size`]:
            segment length of the vanilla layers (no attention across segments). `None`: the vanilla layers attend
            over the whole input. With `num_vanilla_layers == num_layers` and `segment_length=None` compression is
            off and the model computes exactly `T5ForConditionalGeneration`.
        num_vip_slots (`int`, defaults to 16) [`num_important_tokens`]:
            uncompressed slots per sequence. VIP tokens (`vip_mask == 1`) fill them first, in input order; free slots
            take the earliest non-VIP tokens (uncompressed, but they do not vote in block selection); VIPs beyond
            the slots are compressed like other tokens. Only VIPs in the slots vote.
        block_size (`int`, defaults to 16) [`block_size`, the paper's k]:
            tokens per block of the compressible part.
        num_refined_blocks (`int`, defaults to 90) [`num_fine_blocks`, the paper's h]:
            blocks kept at token resolution in each VCC layer, chosen by the attention of the VIP slots. Inputs are
            padded internally to hold at least this many blocks (then every block is refined).
        scale_correction (`bool`, defaults to `True`) [`scale_correction`]:
            add `log(block_size + 1e-4)` to the attention logits of block means, so that a mean counts as the
            `block_size` tokens it stands for (the paper's diagonal D).
        exploration_probability (`float`, defaults to 0.1) [`explore_prob`]:
            training only: probability, per sequence and VCC layer, of refining a uniformly random set of blocks
            instead of the top-scoring ones.
        reproducible_softmax (`bool`, defaults to `True`):
            on CPU in float32, compute the softmax of eager attention and of block selection in one fixed order, so
            that outputs are the same bits on every CPU (torch's own softmax sums in an order set by the CPU's vector
            width; the original's references were made on an AVX-512 CPU, and with torch's softmax an AVX2 CPU moved
            them by 1.1e-5). It costs 40-55 times `torch.softmax`'s time (measured on one thread: 11 ms against
            0.3 ms for [2, 4, 134, 134] scores): set it to `False` for fast eager attention on CPU. `sdpa` attention
            (the default) does not use it; block selection does (small: VIP slots x blocks).
        cross_attention_logn_length (`int`, *optional*):
            The number N of encoder tokens of the training inputs: where an example has n > N unmasked encoder tokens,
            the decoder's cross-attention logits are multiplied by ln n / ln N (log-length scaling, Chiang & Cholak
            2022; Qwen's `use_logn_attn`), so that a model trained on short inputs attends as sharply on long ones. Up
            to N tokens nothing changes. `None` (the default, and the original) never scales. See
            [`LocostConfig`] for a measured case.

    Fixed in the port (the only values the original supports or uses): `selector_type="attention_based_selector"`,
    `coarser_type="mean"`, `include_positions_in_mixed_states=True`. `custom_relative_attention`,
    `checkpoint_attention` and `checkpoint_ffn` have no numerical effect (use gradient checkpointing instead).
    A configuration written by the original code (`model_type: "t5"` plus the fields above under their original
    names) is translated on load.

    Sizes: for a padded length `L`, `n_b = (L - num_vip_slots) / block_size` blocks and a compressed sequence of
    `r = num_refined_blocks * block_size + (n_b - num_refined_blocks) + num_vip_slots` tokens
    ([`~VCCT5Config.padded_length`], [`~VCCT5Config.compression_sizes`]).

    Example:

    ```python
    >>> import longreach
    >>> from longreach import VCCT5Config, VCCT5ForConditionalGeneration
    >>> config = VCCT5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=4, num_heads=4,
    ...                      num_vanilla_layers=1, segment_length=128, num_vip_slots=16, block_size=8,
    ...                      num_refined_blocks=8)
    >>> model = VCCT5ForConditionalGeneration(config)
    >>> base = VCCT5Config.from_preset("base")        # t5-base dimensions + the paper's VCC setting
    ```
    """

    model_type = "vcc_t5"
    # what Trainer.predict drops from the outputs: the cache (named `cache` in transformers v5 outputs)
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        "num_hidden_layers": "num_decoder_layers",  # generate() sizes the decoder cache from this
        "head_dim": "d_kv",
    }

    vocab_size: int = 32128
    d_model: int = 768
    d_kv: int = 64
    d_ff: int = 3072
    num_layers: int = 12
    num_decoder_layers: int | None = None
    num_heads: int = 12
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    initializer_factor: float = 1.0
    feed_forward_proj: str = "relu"
    num_vanilla_layers: int = 4
    segment_length: int | None = 512
    num_vip_slots: int = 16
    block_size: int = 16
    num_refined_blocks: int = 90
    scale_correction: bool = True
    exploration_probability: float = 0.1
    reproducible_softmax: bool = True
    cross_attention_logn_length: int | None = None
    is_encoder_decoder: bool = True
    use_cache: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    decoder_start_token_id: int | None = 0
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool | None = None

    def __post_init__(self, **kwargs):
        self._translate_original_fields(kwargs)
        for derived in ("dense_act_fn", "is_gated_act", "model_type"):  # T5Config's derived fields; the class's type
            kwargs.pop(derived, None)
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        super().__post_init__(**kwargs)
        if self.scale_decoder_outputs is None:  # fixed now, as T5's: a head untied later (PEFT's merge_and_unload of
            self.scale_decoder_outputs = bool(self.tie_word_embeddings)  # a trained `lm_head` unties it) keeps it
        self.validate_vcc()

    def validate(self) -> None:
        """`save_pretrained`'s check before writing config.json: the parent's validators, then this model's, so that a
        setting assigned after construction that the model cannot run is refused before it is saved, not on load."""
        super().validate()
        self.validate_vcc()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # field overrides are validated with the stored values (see `pop_field_overrides`); stored values that
        # __post_init__ applies after the fields (the original code's names) give way to them, and so does a stored
        # `scale_decoder_outputs` to `tie_word_embeddings`, which alone means both tying and rescaling
        shadowed = {"num_vanilla_layers": ["encoder_layers"], "tie_word_embeddings": ["scale_decoder_outputs"]}
        for original, name in ORIGINAL_FIELD_NAMES.items():
            if original != name:
                shadowed.setdefault(name, []).append(original)
        config_dict = dict(config_dict)
        for name in set(kwargs) & set(shadowed):
            for stored in shadowed[name]:
                config_dict.pop(stored, None)
        config_dict = pop_field_overrides(cls, config_dict, kwargs)
        # overrides under the original code's names, which the constructor takes too (they were left unused)
        originals = {*ORIGINAL_FIELD_NAMES, "encoder_layers", *ORIGINAL_FIXED_FIELDS, *ORIGINAL_IGNORED_FIELDS}
        for original in set(kwargs) & originals:
            config_dict[original] = kwargs.pop(original)
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "VCCT5Config":
        """The paper's setting `"base"`, `"large"` or `"3b"` (T5 dimensions + VCC fields), with `overrides`."""
        if name not in VCC_T5_PRESETS:
            raise ValueError(f"Unknown VCC-T5 preset {name!r}; choose one of {sorted(VCC_T5_PRESETS)}.")
        return cls(**{**VCC_T5_PRESETS[name], **overrides})

    # -----------------------------------------------------------------------------------------------------------------
    # The original's field names
    # -----------------------------------------------------------------------------------------------------------------

    def _translate_original_fields(self, kwargs: dict) -> None:
        """Apply VCC fields given under the original code's names (they arrive as unknown kwargs)."""
        for name, value in pop_original_vcc_fields(kwargs, self.num_layers).items():
            setattr(self, name, value)

    # -----------------------------------------------------------------------------------------------------------------
    # Validation and sizes
    # -----------------------------------------------------------------------------------------------------------------

    @property
    def num_vcc_layers(self) -> int:
        return self.num_layers - self.num_vanilla_layers

    def validate_vcc(self) -> None:
        """Refuse settings the model cannot run, naming the field, the value and what is expected."""
        from ..modeling.t5_blocks import check_t5_config

        check_t5_config(self)  # the T5 fields both T5-style configs share
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
                     "num_vip_slots", "block_size", "num_refined_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if (not isinstance(self.num_vanilla_layers, int) or isinstance(self.num_vanilla_layers, bool)
                or not 0 <= self.num_vanilla_layers <= self.num_layers):
            raise ValueError(
                f"`num_vanilla_layers` must be an integer between 0 and `num_layers` ({self.num_layers}), got "
                f"{self.num_vanilla_layers!r}."
            )
        if self.segment_length is not None and (
            not isinstance(self.segment_length, int) or isinstance(self.segment_length, bool) or self.segment_length < 1
        ):
            raise ValueError(f"`segment_length` must be a positive integer or None, got {self.segment_length!r}.")
        check_field_types(self, VCCT5Config)  # the fields not checked above have their annotated types too
        if not 0.0 <= self.exploration_probability <= 1.0:
            raise ValueError(
                f"`exploration_probability` must lie in [0, 1], got {self.exploration_probability!r}."
            )
        if self.uses_segments() and self.num_vcc_layers > 0:
            # A padded length L must satisfy L % segment_length == 0 and (L - num_vip_slots) % block_size == 0:
            # solvable exactly when gcd(segment_length, block_size) divides num_vip_slots.
            step = math.gcd(self.segment_length, self.block_size)
            if self.num_vip_slots % step:
                raise ValueError(
                    f"`segment_length` ({self.segment_length}) and `block_size` ({self.block_size}) do not fit "
                    f"`num_vip_slots` ({self.num_vip_slots}): no sequence length is a multiple of the segment length "
                    f"and leaves a multiple of the block size after the VIP slots. Make `num_vip_slots` a multiple of "
                    f"{step} (gcd of the two), as every published setting is."
                )

    def uses_segments(self) -> bool:
        """Whether the vanilla layers run on segments (there are vanilla layers and `segment_length` is set)."""
        return self.num_vanilla_layers > 0 and self.segment_length is not None

    def padded_length(self, num_tokens: int) -> int:
        """The smallest length >= `num_tokens` that the original accepts: a multiple of `segment_length` (when
        vanilla layers use segments), `num_vip_slots` plus a multiple of `block_size`, with at least
        `num_refined_blocks` blocks (when there are VCC layers). The model pads inputs to it internally."""
        if not isinstance(num_tokens, (int, torch.SymInt)) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"`num_tokens` must be a positive integer, got {num_tokens!r}.")
        segment = self.segment_length if self.uses_segments() else 1
        length = -(-num_tokens // segment) * segment
        if self.num_vcc_layers == 0:
            return length
        minimum = self.num_vip_slots + self.num_refined_blocks * self.block_size
        length = max(length, -(-minimum // segment) * segment)
        for _ in range(self.block_size):  # at most block_size steps where validate_vcc passes
            if (length - self.num_vip_slots) % self.block_size == 0:
                return length
            length += segment
        self.validate_vcc()  # settings assigned after construction: name the ones that no length fits
        raise ValueError(f"No length >= {num_tokens} fits this configuration's `segment_length`, `block_size` and "
                         "`num_vip_slots`.")

    def compression_sizes(self, padded_length: int) -> dict[str, int]:
        """`{"num_blocks": n_b, "compressed_length": r}` for a padded length, checking the original's constraints
        (a ValueError names the one that fails)."""
        if self.uses_segments() and padded_length % self.segment_length:
            raise ValueError(
                f"The padded length {padded_length} is not a multiple of `segment_length` ({self.segment_length})."
            )
        if self.num_vcc_layers == 0:
            return {"num_blocks": 0, "compressed_length": padded_length}
        compressible = padded_length - self.num_vip_slots
        if compressible < self.block_size or compressible % self.block_size:
            raise ValueError(
                f"The padded length {padded_length} minus `num_vip_slots` ({self.num_vip_slots}) must be a positive "
                f"multiple of `block_size` ({self.block_size}), got {compressible}."
            )
        num_blocks = compressible // self.block_size
        if self.num_refined_blocks > num_blocks:
            raise ValueError(
                f"`num_refined_blocks` ({self.num_refined_blocks}) is more than the {num_blocks} blocks of a length-"
                f"{padded_length} input; use `padded_length()` to get a valid length."
            )
        compressed = self.num_refined_blocks * self.block_size + num_blocks - self.num_refined_blocks + self.num_vip_slots
        return {"num_blocks": num_blocks, "compressed_length": compressed}


def pop_original_vcc_fields(fields: dict, num_layers: int | None = None) -> dict:
    """Remove the original code's VCC fields from `fields` and return them under our names (see
    `ORIGINAL_FIELD_NAMES`); fixed fields are checked, fields without numerical effect dropped."""
    ours = {}
    for original, name in ORIGINAL_FIELD_NAMES.items():
        if original in fields:
            ours[name] = fields.pop(original)
    if "encoder_layers" in fields:
        encoder_layers = fields.pop("encoder_layers")
        ours["num_vanilla_layers"] = num_vanilla_layers_from_original(encoder_layers)
        if num_layers is not None and len(encoder_layers) != num_layers:
            raise ValueError(
                f"The original config lists {len(encoder_layers)} `encoder_layers` but `num_layers` is {num_layers}."
            )
    for name, accepted in ORIGINAL_FIXED_FIELDS.items():
        if name in fields:
            value = fields.pop(name)
            if value not in accepted:
                raise ValueError(
                    f"The original config sets `{name}={value!r}`; VCC-T5 supports only {accepted[0]!r} (the value "
                    "every published configuration uses)."
                )
    for name in ORIGINAL_IGNORED_FIELDS:
        fields.pop(name, None)
    return ours


def num_vanilla_layers_from_original(encoder_layers) -> int:
    """The original's `encoder_layers` class-path list -> the number of leading vanilla layers. Only the pattern
    vanilla* VCC* is supported (the only one any published configuration uses)."""
    if not isinstance(encoder_layers, (list, tuple)) or not encoder_layers:
        raise ValueError(f"`encoder_layers` must be a non-empty list of layer class paths, got {encoder_layers!r}.")
    unknown = sorted({layer for layer in encoder_layers if layer not in (ORIGINAL_VANILLA_LAYER, ORIGINAL_VCC_LAYER)})
    if unknown:
        raise ValueError(
            f"`encoder_layers` names unknown layer classes {unknown}; expected {ORIGINAL_VANILLA_LAYER!r} or "
            f"{ORIGINAL_VCC_LAYER!r}."
        )
    num_vanilla = 0
    while num_vanilla < len(encoder_layers) and encoder_layers[num_vanilla] == ORIGINAL_VANILLA_LAYER:
        num_vanilla += 1
    if any(layer != ORIGINAL_VCC_LAYER for layer in encoder_layers[num_vanilla:]):
        raise ValueError(
            "`encoder_layers` must be vanilla layers followed by VCC layers (the only pattern the published "
            f"configurations use); got {list(encoder_layers)}."
        )
    return num_vanilla
