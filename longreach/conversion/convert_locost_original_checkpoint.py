"""Convert a LOCOST checkpoint written by the authors' code (github.com/flbbb/locost-summarization) to longreach.

Accepted inputs (``--checkpoint_path``):

* the folder the original ``save_pretrained`` writes (``config.json`` without ``model_type`` +
  ``pytorch_model.bin``; also ``model.safetensors`` or a sharded index), e.g. the Hub release
  ``flbbb/locost-gsg-pretrained`` downloaded with ``huggingface-cli download``;
* a PyTorch-Lightning ``.ckpt`` from the authors' training scripts (weights under ``model.``; the config is the
  pickled ``models_config.LOCOSTConfig`` in ``hyper_parameters``, or ``--config_path`` names a config.json).

Usage::

    python -m longreach.conversion.convert_locost_original_checkpoint --checkpoint_path PATH \
        --pytorch_dump_folder_path OUT [--tokenizer_name_or_path T] [--push_to_hub REPO_ID]

The output is a Hub-ready folder: ``model.safetensors``, ``config.json`` (``model_type: locost``, ``auto_map``),
``generation_config.json``, the code files, the tokenizer if given, and a model card.

Numerics: the converted model computes the authors' *exact* convolution (FFT of size 2L). A config with
``use_fast_fft_conv: true`` selected their CUDA path, which differs for input lengths that are not powers of two
(see `LocostConfig.ssm_authors_fft_size`); we warn and compute the exact function.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from pathlib import Path


from ..configuration.configuration_locost import LocostConfig
from ..modeling.modeling_locost import LocostForConditionalGeneration
from .conversion_utils import (
    ConversionError,
    ConvertedModel,
    KeyMap,
    add_base_model_id_argument,
    check_base_model_id,
    check_not_a_weights_file,
    check_push_target,
    empty_model,
    expand_user_paths,
    find_local_tokenizer,
    finish_conversion,
    load_converted,
    load_folder_checkpoint,
    one_line,
    pickled_class_stand_in,
    prepare_output_folder,
    read_json,
    safe_torch_load,
    strip_prefix,
)

logger = logging.getLogger(__name__)

_DECODER_T5_KEYS = (
    r"layer\.0\.SelfAttention\.(?:q|k|v|o|relative_attention_bias)\.weight"
    r"|layer\.0\.layer_norm\.weight"
    r"|layer\.1\.EncDecAttention\.(?:q|k|v|o)\.weight"
    r"|layer\.1\.layer_norm\.weight"
    r"|layer\.2\.DenseReluDense\.(?:wi|wi_0|wi_1|wo)\.weight"
    r"|layer\.2\.layer_norm\.weight"
)

#: Original key -> longreach key. The decoder and feed-forward names are T5's in both.
LOCOST_KEY_MAP = KeyMap(
    rules=[
        (r"shared\.weight", r"shared.weight"),
        (r"lm_head\.weight", r"lm_head.weight"),  # only reached when the head is not tied (see ``tied``)
        (r"encoder\.block\.(\d+)\.layer\.0\.layer_prenorm\.weight", r"encoder.block.\1.layer.0.layer_norm.weight"),
        (r"encoder\.block\.(\d+)\.layer\.0\.ssm_layer\.(q_proj|k_proj)\.(weight|bias)", r"encoder.block.\1.layer.0.ssm.\2.\3"),
        (r"encoder\.block\.(\d+)\.layer\.0\.ssm_layer\.output_linear\.(weight|bias)", r"encoder.block.\1.layer.0.ssm.out_proj.\2"),
        (r"encoder\.block\.(\d+)\.layer\.0\.ssm_layer\.D", r"encoder.block.\1.layer.0.ssm.conv.D"),
        (
            r"encoder\.block\.(\d+)\.layer\.0\.ssm_layer\.kernel\.(C|B|inv_A_real|A_imag|log_dt)",
            r"encoder.block.\1.layer.0.ssm.conv.\2",
        ),
        (
            r"encoder\.block\.(\d+)\.layer\.1\.(DenseReluDense\.(?:wi|wi_0|wi_1|wo)\.weight|layer_norm\.weight)",
            r"encoder.block.\1.layer.1.\2",
        ),
        (r"encoder\.final_layer_norm\.weight", r"encoder.final_layer_norm.weight"),
        (rf"decoder\.block\.(\d+)\.({_DECODER_T5_KEYS})", r"decoder.block.\1.\2"),
        (r"decoder\.final_layer_norm\.weight", r"decoder.final_layer_norm.weight"),
    ],
    tied={r"encoder\.embed_tokens\.weight": "shared.weight", r"decoder\.embed_tokens\.weight": "shared.weight"},
)

#: Fields copied from the original config. Everything else is derived (``dense_act_fn``, ``is_gated_act``), dead in
#: the original (``local_radius``, ``global_block_size``, ``encoder_attention_type``, ``ssm_type``) or generic
#: transformers 4.x bookkeeping.
COPIED_FIELDS = (
    "vocab_size", "d_model", "d_state", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
    "num_ssm_heads", "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate",
    "layer_norm_epsilon", "initializer_factor", "feed_forward_proj", "bidirectional", "gating", "pad_token_id",
    "eos_token_id", "decoder_start_token_id", "tie_word_embeddings",
)


def is_original_locost_config(config: dict) -> bool:
    """The original config has no ``model_type``; it is recognised by its architecture name or the SSM fields."""
    architectures = config.get("architectures") or []
    return "LOCOSTForConditionalGeneration" in architectures or {"d_state", "num_ssm_heads"} <= set(config)


def locost_config_from_original(original: dict, source: str = "the original config") -> LocostConfig:
    """A `LocostConfig` from the original config dict; ``source`` (the file it came from) names it in errors."""
    if not is_original_locost_config(original):
        raise ConversionError(
            "The config does not look like an original LOCOST config (no 'LOCOSTForConditionalGeneration' "
            f"architecture and no d_state/num_ssm_heads fields); got keys {sorted(original)}."
        )
    if original.get("use_fast_fft_conv"):
        logger.warning(
            "The original config selects the authors' CUDA fast FFT path (use_fast_fft_conv=true). Its FFT size is "
            "rounded to a power of two, which computes a different function whenever the padded length is not a "
            "power of two. The converted model computes the exact convolution the architecture defines."
        )
    fields = {name: original[name] for name in COPIED_FIELDS if original.get(name) is not None}
    fields.setdefault("tie_word_embeddings", True)  # transformers 4.x default, not written to config.json
    try:
        return LocostConfig(**fields)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"{source}: invalid LOCOST configuration: {one_line(error)}") from None


def read_original_checkpoint(checkpoint_path: Path, config_path: Path | None = None) -> tuple[dict, dict]:
    """``(state dict with original names, original config as a dict)`` from a folder or a Lightning ``.ckpt``."""
    if checkpoint_path.is_dir():
        return load_folder_checkpoint(checkpoint_path, config_path)
    if not checkpoint_path.is_file():
        raise ConversionError(f"--checkpoint_path {checkpoint_path} does not exist.")
    check_not_a_weights_file(checkpoint_path)
    stand_in = pickled_class_stand_in("models_config", "LOCOSTConfig")
    checkpoint = safe_torch_load(checkpoint_path, allowed_classes=[stand_in])
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConversionError(f"{checkpoint_path} is not a Lightning checkpoint (no 'state_dict' entry).")
    state_dict = strip_prefix(checkpoint["state_dict"], "model.", str(checkpoint_path))
    if config_path is not None:
        return state_dict, read_json(config_path)
    hyper_parameters = checkpoint.get("hyper_parameters") or {}
    pickled = hyper_parameters.get("config") if isinstance(hyper_parameters, Mapping) else None
    if pickled is None:
        raise ConversionError(f"{checkpoint_path} holds no pickled config; pass --config_path CONFIG_JSON.")
    if isinstance(pickled, Mapping):  # a config saved as a plain dict
        return state_dict, dict(pickled)
    if isinstance(pickled, stand_in):
        return state_dict, dict(vars(pickled))
    raise ConversionError(
        f"{checkpoint_path}: hyper_parameters['config'] is a {type(pickled).__name__}, not a config object or mapping; "
        "pass --config_path CONFIG_JSON."
    )


def convert_locost_checkpoint(
    checkpoint_path: str | Path,
    pytorch_dump_folder_path: str | Path,
    tokenizer_name_or_path: str | None = None,
    config_path: str | Path | None = None,
    push_to_hub: str | None = None,
    base_model_id: str | None = None,
) -> Path:
    """Convert, save Hub-ready, reload and verify every tensor. Returns the output folder. ``base_model_id``: the Hub
    id of the checkpoint these weights were fine-tuned from, named in the model card."""
    check_base_model_id(base_model_id)
    checkpoint_path = Path(checkpoint_path)
    output = prepare_output_folder(pytorch_dump_folder_path, [checkpoint_path, config_path])
    check_push_target(push_to_hub)
    original_state_dict, original_config = read_original_checkpoint(checkpoint_path, Path(config_path) if config_path else None)
    if config_path is not None:
        config_source = str(config_path)
    elif checkpoint_path.is_dir():
        config_source = str(checkpoint_path / "config.json")
    else:
        config_source = f"the config pickled in {checkpoint_path}"
    config = locost_config_from_original(original_config, config_source)

    model = empty_model(LocostForConditionalGeneration, config)
    tied = set(model._tied_weights_keys) if config.tie_word_embeddings else set(model._tied_weights_keys) - {"lm_head.weight"}
    key_map = LOCOST_KEY_MAP
    if config.tie_word_embeddings:
        key_map = KeyMap(key_map.rules, {**key_map.tied, r"lm_head\.weight": "shared.weight"})
    expected_keys = [key for key in model.state_dict() if key not in tied]
    converted = key_map.apply(original_state_dict, expected_keys, source=str(checkpoint_path))
    del original_state_dict  # its tensors are held by `converted` alone, so a cast frees each source tensor
    converted, dtype = load_converted(model, converted, tied, source=str(checkpoint_path))
    model.generation_config.max_new_tokens = 512  # the authors' evaluation setting (greedy, 512 new tokens)

    converted_model = ConvertedModel(model, converted)
    del model, converted  # finish_conversion holds them alone, and releases them before reloading the saved folder
    finish_conversion(
        converted_model, output, card_name="locost", source=str(checkpoint_path),
        tokenizer_name_or_path=tokenizer_name_or_path or find_local_tokenizer(checkpoint_path),
        push_to_hub=push_to_hub, reload_kwargs={"dtype": dtype}, base_model=base_model_id,
    )
    return output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_path", required=True, help="Original save_pretrained folder or Lightning .ckpt.")
    parser.add_argument("--pytorch_dump_folder_path", required=True, help="New or empty output folder.")
    parser.add_argument("--tokenizer_name_or_path", default=None, help="Tokenizer to save with the model (e.g. google/long-t5-local-base; default: one found beside the checkpoint).")
    parser.add_argument("--config_path", default=None, help="config.json to use instead of the checkpoint's own.")
    parser.add_argument("--push_to_hub", default=None, metavar="REPO_ID", help="Also upload the result to this Hub repo.")
    add_base_model_id_argument(parser, "the checkpoint these weights were fine-tuned from")
    return expand_user_paths(parser.parse_args(argv))


def main(argv: list[str] | None = None, *, debug: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        output = convert_locost_checkpoint(
            args.checkpoint_path, args.pytorch_dump_folder_path, args.tokenizer_name_or_path, args.config_path,
            args.push_to_hub, args.base_model_id,
        )
    except ConversionError as error:
        if debug:  # `longreach --debug convert ...`: the traceback
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Converted LOCOST checkpoint written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
