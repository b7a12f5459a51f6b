"""LOCOST configuration (Le Bronnec et al., "LOCOST: State-Space Models for Long Document Abstractive Summarization",
EACL 2024)."""

from __future__ import annotations

from transformers import PreTrainedConfig

from .config_overrides import FieldTypesCheckedOnAssignment, check_field_types, pop_field_overrides


class LocostConfig(FieldTypesCheckedOnAssignment, PreTrainedConfig):
    r"""
    Configuration of a [`LocostForConditionalGeneration`]: an encoder of gated bidirectional S4D state-space blocks
    (no attention, O(L log L) in the input length) and a T5 v1.1 decoder. The defaults are the released model
    (`flbbb/locost-gsg-pretrained`, 234.7M parameters).

    Fields of the authors' `LOCOSTConfig` that nothing reads (`local_radius`, `global_block_size`,
    `encoder_attention_type`, `ssm_type`) are not kept; their `use_fast_fft_conv` is `ssm_authors_fft_size` below,
    off unless asked for.

    The encoder's computation settings (`encoder_chunk_length`, `encoder_accelerator_chunk_length`,
    `ssm_kernel_chunk_size`, `ssm_kernel_cache_lengths`, `ssm_kernel_cache_bytes`, `ssm_authors_fft_size`) can be
    changed on a loaded model through `model.config`: they apply from its next call. The others are read when the model
    is built, as T5's are.

    Args:
        vocab_size (`int`, defaults to 32100):
            Rows of the shared token embedding (the LongT5 tokenizer's `len(tokenizer)`).
        d_model (`int`, defaults to 768):
            Hidden size of both stacks; also the number of SSM channels H.
        d_state (`int`, defaults to 512):
            SSM state size N. N/2 complex modes are stored per channel (each stands for a conjugate pair), so the
            released 512 is the paper's "N = 256". Must be even.
        d_kv (`int`, defaults to 64):
            Size of one decoder attention head.
        d_ff (`int`, defaults to 2048):
            Inner size of the feed-forward sublayers (encoder and decoder).
        num_layers (`int`, defaults to 12):
            Number of encoder (SSM) blocks.
        num_decoder_layers (`int`, *optional*):
            Number of decoder blocks; defaults to `num_layers`.
        num_heads (`int`, defaults to 12):
            Decoder attention heads.
        num_ssm_heads (`int`, defaults to 1):
            Kept for checkpoint compatibility. The authors' exact path only runs with 1 (H = d_model channels, each
            with its own kernel); any other value is refused.
        relative_attention_num_buckets (`int`, defaults to 32):
            Buckets of the decoder's relative position bias.
        relative_attention_max_distance (`int`, defaults to 128):
            Distance beyond which relative positions share a bucket.
        dropout_rate (`float`, defaults to 0.1):
            Dropout on embeddings, every residual branch, inside the feed-forward, on decoder attention weights and
            after the final norms. None inside the SSM.
        layer_norm_epsilon (`float`, defaults to 1e-6):
            RMSNorm epsilon.
        initializer_factor (`float`, defaults to 1.0):
            Scale of T5's weight initialisation.
        feed_forward_proj (`str`, defaults to `"gated-gelu"`):
            `"gated-gelu"` (T5 v1.1, tanh GELU) or a plain activation such as `"relu"`.
        bidirectional (`bool`, defaults to `True`):
            Causal and anti-causal kernels (two C vectors sharing A, B, Δ). `False` gives a causal-only SSM.
        gating (`bool`, defaults to `True`):
            Multiply the SSM output by the linear gate `q_proj(x)` (no activation), as the authors do.
        ssm_dt_min (`float`, defaults to 1e-3), ssm_dt_max (`float`, defaults to 1e-1):
            Range of the log-uniform initialisation of the step size Δ (training from scratch only).
        ssm_kernel_chunk_size (`int`, defaults to 256):
            Largest number of lags per chunk when computing the SSM kernel (below it, a power of two near
            √(2L) lags for the bidirectional kernel). Bounds the kernel's intermediate memory, O(d_model · d_state/2 · chunk), whatever the input length.
        ssm_kernel_cache_lengths (`int`, defaults to 2), ssm_kernel_cache_bytes (`int`, defaults to 33554432):
            Inference kernel cache of each encoder layer (eval mode, no gradient through the SSM parameters): the FFT
            of the SSM kernel of up to `ssm_kernel_cache_lengths` most recent input lengths, at most
            `ssm_kernel_cache_bytes` per layer (32 MiB: lengths up to about 5.4K tokens at d_model 768, 384 MiB over
            the 12 released layers), plus, on the CPU, a copy of the layer's SSM parameters (6 MiB) that it is checked
            against. Any parameter change or `.train()` / `.eval()` invalidates it; on an accelerator, where it is keyed
            on the parameters' storage and version counter, an edit through `.data` needs `clear_kernel_cache()` or
            `.eval()`. 0 turns it off.
        encoder_chunk_length (`int`, *optional*, defaults to 2048):
            Without autograd, inputs longer than this are encoded in pieces: projections, gate and feed-forward over
            chunks of this many positions and the FFT convolution over groups of channels, writing the residual stream
            in place (about two [batch, length, d_model] float tensors at a time, the released model encodes 1M
            tokens). Same function as the one-piece path up to float rounding, and faster on CPU as well as smaller
            (pieces stay in the caches: at the released size and 16K tokens, 2 threads, one encoder block took 1.86 s
            against 2.45 s in one piece, the whole encoder 389 MiB above the weights against 873 MiB). `None` never
            chunks. Applies on CPU; see the next field for GPUs and other accelerators.
        encoder_accelerator_chunk_length (`int`, *optional*, defaults to 32768):
            `encoder_chunk_length` for inputs on an accelerator (any device but the CPU), where every piece and channel
            group costs kernel launches that the device waits for: on an H200 in bfloat16 at the released size, pieces
            of 2048 positions took 0.163 s for 16K tokens and 0.710 s for 64K, pieces of 32768 0.038 s and 0.160 s,
            with 873 and 1184 MiB above the weights (`benchmarks/benchmark_locost_chunking.py`). `None` never chunks.
        ssm_authors_fft_size (`bool`, defaults to `False`):
            Reproduce the authors' CUDA fast path (`use_fast_fft_conv=True` in their configs): an FFT size rounded to
            a power of two, which is a *different function* whenever the (even-padded) length is not a power of two
            (anti-causal lags misplaced or lost). Only for bit-compatibility with outputs of their GPU runs; the
            converters never turn it on by themselves.
        cross_attention_logn_length (`int`, *optional*):
            For inputs longer than the model was trained on: the number N of encoder tokens of its training inputs.
            Where an example has n > N (unmasked) encoder tokens, the decoder's cross-attention logits are multiplied
            by ln n / ln N, so that a position that stood out among N keeps standing out among n (log-length scaling,
            Chiang & Cholak 2022; Qwen's `use_logn_attn`). Up to N tokens nothing changes, so training is unaffected
            and it can be set on a trained model (`benchmarks/benchmark_logn_scaling.py` measures it). Without it, a
            small model trained on 128-token inputs and reading documents of 500 tokens or more (`longreach demo`)
            spread its cross-attention over them and stopped copying: ROUGE-1 25.8 on 40 such training documents, 32.4
            on the same documents cut to 512 tokens, 33.3 whole with N = 128. `None` (the default, and the authors'
            model) never scales.
        pad_token_id (`int`, defaults to 0), eos_token_id (`int`, defaults to 1), decoder_start_token_id (`int`,
        defaults to 0):
            Special token ids (T5 conventions).
        tie_word_embeddings (`bool`, defaults to `True`):
            Tie the LM head to the shared embedding; as in T5 this also rescales the decoder output by
            d_model**-0.5 before the head.
        scale_decoder_outputs (`bool`, *optional*):
            That rescaling, as transformers v5's T5 field; `None` (the default): rescale when tied at construction, so
            that a head untied later (PEFT's `merge_and_unload` of a trained `lm_head` unties it) keeps it.
        use_cache (`bool`, defaults to `True`):
            Cache decoder keys/values during generation.

    Example:

    ```python
    >>> import longreach
    >>> from longreach import LocostConfig, LocostForConditionalGeneration
    >>> config = LocostConfig(d_model=64, d_state=16, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=128)
    >>> model = LocostForConditionalGeneration(config)
    ```
    """

    model_type = "locost"
    # what Trainer.predict drops from the outputs: the cache (named `cache` in transformers v5 outputs)
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        "num_hidden_layers": "num_decoder_layers",  # generate() sizes the decoder cache from this
        "head_dim": "d_kv",
    }

    vocab_size: int = 32100
    d_model: int = 768
    d_state: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 12
    num_decoder_layers: int | None = None
    num_heads: int = 12
    num_ssm_heads: int = 1
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    initializer_factor: float = 1.0
    feed_forward_proj: str = "gated-gelu"
    bidirectional: bool = True
    gating: bool = True
    ssm_dt_min: float = 1e-3
    ssm_dt_max: float = 1e-1
    ssm_kernel_chunk_size: int = 256
    ssm_kernel_cache_lengths: int = 2
    ssm_kernel_cache_bytes: int = 32 * 2**20
    encoder_chunk_length: int | None = 2048
    encoder_accelerator_chunk_length: int | None = 32768
    ssm_authors_fft_size: bool = False
    cross_attention_logn_length: int | None = None
    is_encoder_decoder: bool = True
    use_cache: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    decoder_start_token_id: int | None = 0
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool | None = None

    def __post_init__(self, **kwargs):
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        super().__post_init__(**kwargs)
        if self.scale_decoder_outputs is None:
            self.scale_decoder_outputs = bool(self.tie_word_embeddings)
        self.validate_locost()

    def validate(self) -> None:
        """`save_pretrained`'s check before writing config.json: the parent's validators, then this model's, so that a
        setting assigned after construction that the model cannot run is refused before it is saved, not on load."""
        super().validate()
        self.validate_locost()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # field overrides are validated with the stored values (see `pop_field_overrides`); a stored
        # `scale_decoder_outputs` gives way to an overriding `tie_word_embeddings`, which alone means both
        if "tie_word_embeddings" in kwargs and "scale_decoder_outputs" not in kwargs:
            config_dict = {key: value for key, value in config_dict.items() if key != "scale_decoder_outputs"}
        config_dict = pop_field_overrides(cls, config_dict, kwargs)
        return super().from_dict(config_dict, **kwargs)

    def validate_locost(self) -> None:
        """Refuse settings the model cannot run, naming the field, the value and what is expected."""
        from ..modeling.t5_blocks import check_t5_config

        check_t5_config(self)  # the T5 fields both T5-style configs share
        if not isinstance(self.d_state, int) or isinstance(self.d_state, bool) or self.d_state < 2 or self.d_state % 2:
            raise ValueError(
                f"`d_state` must be a positive even integer (N/2 complex modes are stored), got {self.d_state!r}."
            )
        if self.num_ssm_heads != 1:
            raise ValueError(
                f"`num_ssm_heads` must be 1 (one SSM kernel per channel, the only setting the authors' exact path "
                f"runs), got {self.num_ssm_heads!r}."
            )
        for name in ("d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads", "vocab_size",
                     "ssm_kernel_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        for name in ("ssm_kernel_cache_lengths", "ssm_kernel_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative integer (0 turns the kernel cache off), got {value!r}.")
        for name in ("encoder_chunk_length", "encoder_accelerator_chunk_length"):
            chunk = getattr(self, name)
            if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
                raise ValueError(f"`{name}` must be a positive integer or None, got {chunk!r}.")
        check_field_types(self, LocostConfig)  # the fields not checked above have their annotated types too
        if not 0 < self.ssm_dt_min <= self.ssm_dt_max:
            raise ValueError(
                f"`ssm_dt_min` and `ssm_dt_max` must satisfy 0 < min <= max, got {self.ssm_dt_min} and {self.ssm_dt_max}."
            )
