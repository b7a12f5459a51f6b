"""Convert a VCC-T5 checkpoint written by the authors' code (github.com/awslabs/vip-token-centric-compression), or a
plain T5 checkpoint, to longreach's ``VCCT5ForConditionalGeneration``.

Accepted inputs (``--checkpoint_path``):

(a) the Hugging Face copy the original writes next to every checkpoint (``hf_ckpts/epoch=...-step=.../``):
    ``config.json`` says ``model_type: "t5"`` and carries the VCC fields under their original names
    (``encoder_layers``, ``short_segment_size``, ``num_important_tokens``, ``num_fine_blocks``, ...), plus
    ``pytorch_model.bin``;
(b) the original PyTorch-Lightning ``.ckpt`` (weights under ``model.``). It holds no config: ``--config_path`` names
    the ``config.json`` of the matching HF copy (or any config in that format);
(c) a plain transformers T5 folder (``t5-base``, a fine-tuned T5, ...) plus ``--vcc_preset base|large|3b`` and/or
    explicit VCC options, to start continued pretraining or fine-tuning of VCC-T5 from public T5 weights.

Usage::

    python -m longreach.conversion.convert_vcc_original_checkpoint --checkpoint_path PATH \
        --pytorch_dump_folder_path OUT [--config_path CONFIG_JSON] [--tokenizer_name_or_path T] \
        [--vcc_preset base] [--num_vip_slots 48 ...] [--push_to_hub REPO_ID]

Explicit VCC options override the checkpoint's own values (the authors change `num_important_tokens` per task).
The vocabulary size is taken from the embedding. The original stores the shared relative-attention-bias table once
per encoder block; the copies must be equal and only block 0's is kept (T5's layout). The output is a Hub-ready
folder: ``model.safetensors``, ``config.json`` (``model_type: vcc_t5``, ``auto_map``), ``generation_config.json``
(greedy; ``max_new_tokens`` = the original's ``max_decoder_length`` − 1 when given), the code files, the tokenizer if given,
and a model card.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from ..configuration.configuration_vcc_t5 import VCC_FIELDS, VCC_T5_PRESETS, VCCT5Config, pop_original_vcc_fields
from ..modeling.modeling_vcc_t5 import VCCT5ForConditionalGeneration
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
    prepare_output_folder,
    read_json,
    safe_torch_load,
    strip_prefix,
)

logger = logging.getLogger(__name__)

_ENCODER_T5_KEYS = (
    r"layer\.0\.SelfAttention\.(?:q|k|v|o)\.weight"
    r"|layer\.0\.layer_norm\.weight"
    r"|layer\.1\.DenseReluDense\.(?:wi|wi_0|wi_1|wo)\.weight"
    r"|layer\.1\.layer_norm\.weight"
)
_DECODER_T5_KEYS = (
    r"layer\.0\.SelfAttention\.(?:q|k|v|o|relative_attention_bias)\.weight"
    r"|layer\.0\.layer_norm\.weight"
    r"|layer\.1\.EncDecAttention\.(?:q|k|v|o)\.weight"
    r"|layer\.1\.layer_norm\.weight"
    r"|layer\.2\.DenseReluDense\.(?:wi|wi_0|wi_1|wo)\.weight"
    r"|layer\.2\.layer_norm\.weight"
)
_SHARED_BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"

#: Original / T5 key -> longreach key: names are T5's on both sides. Tied copies (embeddings, the per-block copies of
#: the shared relative-bias table) are checked equal to their source and dropped.
VCC_KEY_MAP = KeyMap(
    rules=[
        (r"shared\.weight", r"shared.weight"),
        (r"lm_head\.weight", r"lm_head.weight"),  # only reached when the head is not tied (see ``tied``)
        (r"encoder\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.weight", _SHARED_BIAS),
        (rf"encoder\.block\.(\d+)\.({_ENCODER_T5_KEYS})", r"encoder.block.\1.\2"),
        (r"encoder\.final_layer_norm\.weight", r"encoder.final_layer_norm.weight"),
        (rf"decoder\.block\.(\d+)\.({_DECODER_T5_KEYS})", r"decoder.block.\1.\2"),
        (r"decoder\.final_layer_norm\.weight", r"decoder.final_layer_norm.weight"),
    ],
    tied={
        r"encoder\.embed_tokens\.weight": "shared.weight",
        r"decoder\.embed_tokens\.weight": "shared.weight",
        r"encoder\.block\.[1-9]\d*\.layer\.0\.SelfAttention\.relative_attention_bias\.weight": _SHARED_BIAS,
    },
)

#: T5 fields copied from the source config (everything else is derived, training bookkeeping or transformers
#: metadata). ``vocab_size`` is replaced by the embedding's row count.
T5_FIELDS = (
    "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads", "relative_attention_num_buckets",
    "relative_attention_max_distance", "dropout_rate", "layer_norm_epsilon", "initializer_factor",
    "feed_forward_proj", "pad_token_id", "eos_token_id", "decoder_start_token_id",
)
def has_original_vcc_fields(config: dict) -> bool:
    return "encoder_layers" in config or "num_important_tokens" in config


#: The VCC options a plain T5 checkpoint needs when no preset is given.
REQUIRED_VCC_OPTIONS = ("num_vanilla_layers", "segment_length", "num_vip_slots", "block_size", "num_refined_blocks")


def vcc_config_from_sources(
    source_config: dict,
    vocab_size: int,
    preset: str | None = None,
    vcc_options: dict | None = None,
    source: str = "the config",
) -> tuple[VCCT5Config, dict]:
    """``(VCCT5Config, generation defaults)`` from a T5 / original VCC config dict, a preset and explicit options.

    Priority of the VCC fields: explicit options > the source's own VCC fields > the preset. A plain T5 config needs a
    preset or the five structural options (`REQUIRED_VCC_OPTIONS`). ``source`` (the config file) names it in errors.
    """
    model_type = source_config.get("model_type", "t5")
    if model_type not in ("t5", VCCT5Config.model_type):
        raise ConversionError(
            f"{source}: expected a T5 or VCC-T5 config (model_type 't5'), got model_type {model_type!r}."
        )
    fields = {name: source_config[name] for name in T5_FIELDS if source_config.get(name) is not None}
    # Tied head + d_model**-0.5 rescaling (T5 v1.0) or not (v1.1). transformers v5 T5 configs always say
    # tie_word_embeddings=true and store the distinction in scale_decoder_outputs.
    for name in ("scale_decoder_outputs", "tie_word_embeddings"):
        if name in source_config and not isinstance(source_config[name], bool):
            raise ConversionError(
                f"{source}: {name} is {source_config[name]!r}; expected true or false (a JSON boolean)."
            )
    if "scale_decoder_outputs" in source_config:
        fields["tie_word_embeddings"] = source_config["scale_decoder_outputs"]
    else:
        fields["tie_word_embeddings"] = source_config.get("tie_word_embeddings", True)
    fields["vocab_size"] = vocab_size
    vcc_options = {name: value for name, value in (vcc_options or {}).items() if value is not None}

    try:
        if model_type == VCCT5Config.model_type:
            vcc_fields = {name: source_config[name] for name in VCC_FIELDS if name in source_config}
        elif has_original_vcc_fields(source_config):
            vcc_fields = pop_original_vcc_fields(dict(source_config), fields.get("num_layers"))
        else:
            vcc_fields = {}
    except (ValueError, TypeError) as error:
        raise ConversionError(f"{source}: unsupported original VCC configuration: {error}") from error

    if vcc_fields and preset is not None:
        logger.warning("--vcc_preset %r ignored: the checkpoint's config has its own VCC fields.", preset)
    elif not vcc_fields:
        if preset is None:
            absent = [name for name in REQUIRED_VCC_OPTIONS if name not in vcc_options]
            if absent:
                raise ConversionError(
                    "The checkpoint is a plain T5 (its config has no VCC fields). Pass --vcc_preset base|large|3b, or "
                    f"all of: {', '.join('--' + name for name in REQUIRED_VCC_OPTIONS)} (missing: {absent})."
                )
        else:
            if preset not in VCC_T5_PRESETS:
                raise ConversionError(f"Unknown --vcc_preset {preset!r}; choose one of {sorted(VCC_T5_PRESETS)}.")
            preset_values = VCC_T5_PRESETS[preset]
            if fields.get("num_layers") != preset_values["num_layers"]:
                logger.warning(
                    "The T5 checkpoint has %s encoder layers; the %r preset was made for %d. Using %d vanilla layers "
                    "and the rest as VCC layers.", fields.get("num_layers"), preset, preset_values["num_layers"],
                    preset_values["num_vanilla_layers"],
                )
            vcc_fields = {name: preset_values[name] for name in VCC_FIELDS}

    generation = {}
    max_decoder_length = source_config.get("max_decoder_length")
    if max_decoder_length is not None:
        if isinstance(max_decoder_length, bool) or not isinstance(max_decoder_length, int) or max_decoder_length < 2:
            raise ConversionError(
                f"{source}: max_decoder_length is {max_decoder_length!r}; expected an integer >= 2 (it counts the "
                "decoder start token)."
            )
        # the original's generate(max_length=...) counts the decoder start token: that many tokens minus one, as
        # max_new_tokens (a max_length in the generation config would make every call with max_new_tokens warn)
        generation["max_new_tokens"] = max_decoder_length - 1
    try:
        config = VCCT5Config(**fields, **{**vcc_fields, **vcc_options})
    except (ValueError, TypeError) as error:
        given = f" with the options {vcc_options}" if vcc_options else ""
        raise ConversionError(f"{source}{given}: invalid VCC-T5 configuration: {error}") from error
    return config, generation


def read_checkpoint(checkpoint_path: Path, config_path: Path | None = None) -> tuple[dict, dict]:
    """``(state dict with T5 names, source config dict)`` from a folder or a Lightning ``.ckpt``."""
    if checkpoint_path.is_dir():
        return load_folder_checkpoint(checkpoint_path, config_path)
    if not checkpoint_path.is_file():
        raise ConversionError(f"--checkpoint_path {checkpoint_path} does not exist.")
    check_not_a_weights_file(checkpoint_path)
    if config_path is None:
        raise ConversionError(
            f"{checkpoint_path} is a Lightning checkpoint, which holds no model config (the original never saves "
            "hyper-parameters). Pass --config_path: the config.json of the matching Hugging Face copy "
            "(hf_ckpts/epoch=...-step=.../config.json)."
        )
    checkpoint = safe_torch_load(checkpoint_path)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConversionError(f"{checkpoint_path} is not a Lightning checkpoint (no 'state_dict' entry).")
    state_dict = strip_prefix(checkpoint["state_dict"], "model.", str(checkpoint_path))
    return state_dict, read_json(config_path)


def convert_vcc_checkpoint(
    checkpoint_path: str | Path,
    pytorch_dump_folder_path: str | Path,
    config_path: str | Path | None = None,
    tokenizer_name_or_path: str | None = None,
    vcc_preset: str | None = None,
    vcc_options: dict | None = None,
    push_to_hub: str | None = None,
    base_model_id: str | None = None,
) -> Path:
    """Convert, save Hub-ready, reload and verify every tensor. Returns the output folder. ``base_model_id``: the Hub
    id of the T5 the checkpoint was fine-tuned from, named in the model card."""
    check_base_model_id(base_model_id)
    checkpoint_path = Path(checkpoint_path)
    config_path = Path(config_path) if config_path is not None else None
    output = prepare_output_folder(pytorch_dump_folder_path, [checkpoint_path, config_path])
    check_push_target(push_to_hub)
    source_state_dict, source_config = read_checkpoint(checkpoint_path, config_path)
    if "shared.weight" not in source_state_dict:
        raise ConversionError(f"{checkpoint_path}: no 'shared.weight' (the token embedding); is this a T5 checkpoint?")
    shared = source_state_dict["shared.weight"]
    if not isinstance(shared, torch.Tensor) or shared.dim() != 2:
        got = f"a {shared.dim()}-D tensor" if isinstance(shared, torch.Tensor) else f"a {type(shared).__name__}"
        raise ConversionError(f"{checkpoint_path}: 'shared.weight' (the token embedding) is {got}; expected a "
                              "[vocab_size, d_model] tensor.")
    if config_path is not None:
        config_source = str(config_path)
    elif Path(checkpoint_path).is_dir():
        config_source = str(Path(checkpoint_path) / "config.json")
    else:
        config_source = f"the config of {checkpoint_path}"
    config, generation = vcc_config_from_sources(
        source_config, shared.shape[0], vcc_preset, vcc_options, source=config_source
    )

    model = empty_model(VCCT5ForConditionalGeneration, config)
    tied_targets = set(model._tied_weights_keys) - (set() if config.tie_word_embeddings else {"lm_head.weight"})
    key_map = VCC_KEY_MAP
    if config.tie_word_embeddings:
        key_map = KeyMap(key_map.rules, {**key_map.tied, r"lm_head\.weight": "shared.weight"})
    elif "lm_head.weight" not in source_state_dict:
        # A transformers v5 T5 v1.1 saved right after initialisation: tied storage, but no output rescaling.
        logger.warning("No lm_head.weight in an untied checkpoint: the head starts as a copy of shared.weight.")
        source_state_dict = {**source_state_dict, "lm_head.weight": source_state_dict["shared.weight"].clone()}
    expected_keys = [key for key in model.state_dict() if key not in tied_targets]
    converted = key_map.apply(source_state_dict, expected_keys, source=str(checkpoint_path))
    del source_state_dict, shared  # their tensors are held by `converted` alone, so a cast frees each source tensor
    converted, dtype = load_converted(model, converted, tied_targets, source=str(checkpoint_path))
    model.generation_config.num_beams = 1  # the paper evaluates with greedy decoding
    for name, value in generation.items():
        setattr(model.generation_config, name, value)

    converted_model = ConvertedModel(model, converted)
    del model, converted  # finish_conversion holds them alone, and releases them before reloading the saved folder
    finish_conversion(
        converted_model, output, card_name="vcc_t5", source=str(checkpoint_path),
        tokenizer_name_or_path=tokenizer_name_or_path or find_local_tokenizer(checkpoint_path),
        push_to_hub=push_to_hub, reload_kwargs={"dtype": dtype}, base_model=base_model_id,
    )
    return output


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_path", required=True,
                        help="Original HF copy folder, Lightning .ckpt, or a plain transformers T5 folder.")
    parser.add_argument("--pytorch_dump_folder_path", required=True, help="New or empty output folder.")
    parser.add_argument("--config_path", default=None,
                        help="config.json to use instead of the checkpoint's own (required for a Lightning .ckpt).")
    parser.add_argument("--tokenizer_name_or_path", default=None, help="Tokenizer to save with the model (default: one found beside the checkpoint).")
    parser.add_argument("--push_to_hub", default=None, metavar="REPO_ID", help="Also upload the result to this Hub repo.")
    add_base_model_id_argument(parser, "the T5 the checkpoint was fine-tuned from (e.g. google-t5/t5-base)")
    vcc = parser.add_argument_group("VCC options (override the checkpoint's values; a plain T5 needs a preset or all)")
    vcc.add_argument("--vcc_preset", choices=sorted(VCC_T5_PRESETS), default=None,
                     help="The paper's setting for t5-base (4 vanilla layers) or t5-large / t5-3b (6).")
    vcc.add_argument("--num_vanilla_layers", type=int, default=None, help="Leading segment-local layers.")
    vcc.add_argument("--segment_length", type=int, default=None, help="Segment length of the vanilla layers.")
    vcc.add_argument("--num_vip_slots", type=int, default=None, help="Uncompressed VIP slots (num_important_tokens).")
    vcc.add_argument("--block_size", type=int, default=None, help="Tokens per block.")
    vcc.add_argument("--num_refined_blocks", type=int, default=None, help="Refined blocks per layer (num_fine_blocks).")
    vcc.add_argument("--scale_correction", type=_bool, default=None, help="true/false.")
    vcc.add_argument("--exploration_probability", type=float, default=None, help="Training-time exploration (explore_prob).")
    return expand_user_paths(parser.parse_args(argv))


def main(argv: list[str] | None = None, *, debug: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    vcc_options = {name: getattr(args, name) for name in VCC_FIELDS}
    try:
        output = convert_vcc_checkpoint(
            args.checkpoint_path, args.pytorch_dump_folder_path, args.config_path, args.tokenizer_name_or_path,
            args.vcc_preset, vcc_options, args.push_to_hub, args.base_model_id,
        )
    except ConversionError as error:
        if debug:  # `longreach --debug convert ...`: the traceback
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Converted VCC-T5 checkpoint written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
