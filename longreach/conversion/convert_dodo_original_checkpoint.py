"""Convert a Dodo checkpoint written by the authors' code (their ``nugget.codec`` package) to
longreach, or export a longreach Dodo model back to standard PEFT adapter folders.

Three modes:

1. The authors' PyTorch-Lightning checkpoint (trainable tensors only) plus the base Llama folder::

       python -m longreach.conversion.convert_dodo_original_checkpoint --checkpoint_path ckpt/weights.ckpt \
           [--hparams_path ckpt/hparams.yaml] [--base_model_path BASE] --pytorch_dump_folder_path OUT \
           [--base_model_id HUB_ID] [--push_to_hub REPO]

   The hyper-parameters come from ``--hparams_path``, else the checkpoint's ``hyper_parameters``, else ``hparams.yaml``
   next to it. Their ``pretrained`` entry (the base model) is resolved relative to the checkpoint folder's parent (and
   then the checkpoint folder) unless ``--base_model_path`` is given. A DeepSpeed ZeRO folder must first be turned into
   a single file with Lightning's ``convert_zero_checkpoint_to_fp32_state_dict``. ``--base_model_id`` (modes 1 and 2)
   names the base model's Hub id in the model card (``base_model``: the Hub's model tree); only a local folder is read.

2. PEFT adapter folders (``adapter_config.json`` + ``adapter_model.bin``/``.safetensors``) plus a scorer file, either
   the plain state dict of the scorer FFN (the authors' ``load_scorer`` format) or the generic Nugget package's
   ``{"scorer_states": {"non_linear": ...}, "kwargs": ...}``; the options the folders do not record are explicit::

       python -m longreach.conversion.convert_dodo_original_checkpoint --encoder_adapter_path A/encoder \
           --decoder_adapter_path A/decoder --scorer_path scorer.pt --base_model_path BASE \
           [--soft_prompt_path FILE | --soft_prompt_length 0] [--nugget_layer 3 --nugget_ratio 0.1 ...] \
           --pytorch_dump_folder_path OUT

3. The reverse: ``--export_peft_from DODO_FOLDER --pytorch_dump_folder_path OUT`` writes ``OUT/<adapter>/`` PEFT folders
   that ``PeftModel.from_pretrained(llama, OUT/encoder, adapter_name="encoder")`` loads, ``OUT/scorer.pt`` and
   ``OUT/soft_prompt.safetensors``.

Safety (as every longreach converter): pickles are read with ``torch.load(weights_only=True)``; only
``--unsafe_allow_pickle_code_execution`` (for a trusted file that holds other objects) lifts that, and says so. Every
key is mapped by an explicit rule and a missing or unmatched key stops the conversion; the unused
``soft_emb_tc`` tensor is the one documented drop. The output folder must be new or empty. The result is saved as
safetensors, reloaded and compared tensor by tensor with the sources before success is reported.

Numerics: the converted model computes the original's ``+ s`` score term (``score_in_forward=True``) and
``int(n * ratio + 0.99)`` nugget counts. The original's decoder mask-order bug (see
``DodoLlamaConfig.legacy_decoder_mask_order``) is fixed unless ``--legacy_decoder_mask_order`` is given.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from ..configuration.configuration_dodo import DodoLlamaConfig
from ..modeling.modeling_dodo import DodoLlamaForCausalLM
from .conversion_utils import (
    ConversionError,
    ConvertedModel,
    KeyMap,
    add_base_model_id_argument,
    assign_weights,
    check_base_model_id,
    check_floating_dtypes,
    check_push_target,
    check_state_dict,
    convert_dtypes_in_place,
    empty_model,
    expand_user_paths,
    find_local_tokenizer,
    finish_conversion,
    load_state_dict_from_folder,
    load_weights_file,
    one_line,
    prepare_output_folder,
    read_json,
    safe_torch_load,
    staged_output,
    widest_floating_dtype,
)

logger = logging.getLogger(__name__)

#: Trainable tensors of the authors' Lightning checkpoint -> longreach names.
LIGHTNING_RULES = [
    (
        r"nugget\.lora_llama\.base_model\.model\.model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
        r"\.lora_(A|B)\.(\w+)\.weight",
        r"model.layers.\1.self_attn.\2.lora_\3.\4.weight",
    ),
    (r"nugget\.encoder\.scorer\.(0|2)\.(weight|bias)", r"nugget_scorer.\1.\2"),
    (r"nugget\.decoder\.soft_emb\.weight", r"soft_prompt.weight"),
]
#: Tensors the original saves but never uses; dropped on purpose (and logged).
DROPPED_LIGHTNING_KEYS = {
    "nugget.decoder.soft_emb_tc.weight": "created and saved by the original, never used"
}

#: A PEFT adapter folder's keys (peft 0.4.0 and current) -> longreach names; ``{adapter}`` is filled in.
PEFT_RULE = (
    r"base_model\.model\.model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.lora_(A|B)\.weight",
    r"model.layers.\1.self_attn.\2.lora_\3.{adapter}.weight",
)

#: The scorer FFN's plain state dict.
SCORER_KEYS = ("0.weight", "0.bias", "2.weight", "2.bias")

#: Hyper-parameters that define the model (compared between the checkpoint and hparams.yaml).
MODEL_HPARAMS = (
    "pretrained",
    "encoder_type",
    "nugget_layer",
    "ratio",
    "lora",
    "soft",
    "ind_scorer",
    "freeze_decoder",
    "auto",
)


# ---------------------------------------------------------------------------------------------------------------------
# Reading the original files
# ---------------------------------------------------------------------------------------------------------------------


def load_pickle(path: Path, allow_code_execution: bool = False) -> object:
    """``torch.load(weights_only=True)``; with ``allow_code_execution`` a trusted file may fall back to unpickling."""
    try:
        return safe_torch_load(path)
    except ConversionError:
        if not allow_code_execution:
            raise
        logger.warning(
            "Loading %s with torch.load(weights_only=False) because --unsafe_allow_pickle_code_execution was given: "
            "unpickling can execute arbitrary code; only do this for files you trust.",
            path,
        )
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except MemoryError:
            raise
        except Exception as error:  # truncated or not a pickle at all: no better with weights_only=False
            raise ConversionError(
                f"{path} cannot be loaded even with --unsafe_allow_pickle_code_execution: {one_line(error, 200)}"
            ) from None


def read_lightning_checkpoint(
    checkpoint_path: Path, hparams_path: Path | None = None, allow_code_execution: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, hyper_parameters)`` of the authors' ``weights.ckpt``."""
    if checkpoint_path.is_dir():
        raise ConversionError(
            f"--checkpoint_path {checkpoint_path} is a folder (a DeepSpeed ZeRO checkpoint?). Convert it to one file "
            "first: `from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict; "
            "convert_zero_checkpoint_to_fp32_state_dict(folder, 'weights.lightning.ckpt')`, then pass that file."
        )
    if not checkpoint_path.is_file():
        raise ConversionError(f"--checkpoint_path {checkpoint_path} does not exist.")
    checkpoint = load_pickle(checkpoint_path, allow_code_execution)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConversionError(f"{checkpoint_path} is not a Lightning checkpoint (no 'state_dict' entry).")
    check_state_dict(checkpoint["state_dict"], f"{checkpoint_path} ('state_dict')")
    from_checkpoint = checkpoint.get("hyper_parameters") or {}
    if not isinstance(from_checkpoint, Mapping):
        raise ConversionError(f"{checkpoint_path}: 'hyper_parameters' is a {type(from_checkpoint).__name__}, expected "
                              "a mapping; pass --hparams_path.")
    from_checkpoint = dict(from_checkpoint)
    yaml_path = hparams_path or (checkpoint_path.parent / "hparams.yaml")
    from_yaml = None
    if hparams_path is not None or yaml_path.is_file():
        if not yaml_path.is_file():
            raise ConversionError(f"--hparams_path {yaml_path} does not exist.")
        import yaml

        try:
            from_yaml = yaml.safe_load(yaml_path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
            raise ConversionError(f"{yaml_path} cannot be read as YAML: {one_line(error, 200)}") from None
        if not isinstance(from_yaml, dict):
            raise ConversionError(f"{yaml_path} does not hold a mapping of hyper-parameters.")
    if from_yaml is not None and from_checkpoint:
        clashes = {
            key: (from_checkpoint[key], from_yaml[key])
            for key in MODEL_HPARAMS
            if key in from_checkpoint and key in from_yaml and from_checkpoint[key] != from_yaml[key]
        }
        if clashes:
            raise ConversionError(
                f"The hyper-parameters in {checkpoint_path} and {yaml_path} disagree (checkpoint, yaml): {clashes}."
            )
    hparams = from_yaml if hparams_path is not None else (from_checkpoint or from_yaml)
    if not hparams:
        raise ConversionError(f"No hyper-parameters in {checkpoint_path} and no hparams.yaml; pass --hparams_path.")
    return checkpoint["state_dict"], hparams


def resolve_base_model(pretrained: str | None, checkpoint_path: Path | None, base_model_path: str | None) -> Path:
    """The base Llama folder: ``--base_model_path``, else the checkpoint's ``pretrained`` entry (relative paths are
    resolved against the checkpoint folder's parent, then the checkpoint folder)."""
    if base_model_path is not None:
        candidates = [Path(base_model_path)]
    elif pretrained:
        pretrained_path = Path(pretrained)
        candidates = [pretrained_path] if pretrained_path.is_absolute() else []
        if checkpoint_path is not None and not pretrained_path.is_absolute():
            candidates += [checkpoint_path.parent.parent / pretrained_path, checkpoint_path.parent / pretrained_path]
    else:
        raise ConversionError("The base model is unknown: pass --base_model_path (a Llama folder with config.json).")
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    raise ConversionError(
        f"No base Llama folder (config.json + weights) at {[str(c) for c in candidates]}. If {pretrained!r} is a Hub "
        "name, download it (`huggingface-cli download NAME --local-dir DIR`) and pass --base_model_path DIR."
    )


def read_base_config(base_path: Path) -> dict:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(base_path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ConversionError(
            f"The base model's {base_path / 'config.json'} cannot be read: {one_line(error)}"
        ) from None
    if config.model_type != "llama":
        raise ConversionError(f"The base model at {base_path} is a {config.model_type!r} model; Dodo needs a Llama.")
    fields = {key: value for key, value in config.to_dict().items() if key not in ("model_type", "architectures")}
    rope = fields.get("rope_parameters") or {}
    if rope.get("rope_theta", 10000.0) != 10000.0:
        logger.warning(
            "The base model uses rope_theta=%s. The authors' code ran on transformers 4.32, which ignores rope_theta "
            "(always 10000); the converted model uses the base model's value.",
            rope.get("rope_theta"),
        )
    return fields


def _hparam(hparams: dict, key: str, default, kind: type):
    """``hparams[key]`` as ``kind`` (``default`` when absent); any other value (null included) is a ConversionError."""
    if key not in hparams:
        return default
    value = hparams[key]
    expected = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConversionError(f"hyper-parameter {key}={value!r}: expected {expected}.")
    try:
        converted = kind(value)
        if kind is int and converted != float(value):  # 3.5 is no layer index
            raise ValueError
    except (ValueError, TypeError, OverflowError):
        raise ConversionError(f"hyper-parameter {key}={value!r}: expected {expected}.") from None
    return converted


def dodo_fields_from_hparams(hparams: dict, num_hidden_layers: int) -> dict:
    """`DodoLlamaConfig` fields from the authors' hyper-parameters (``hparams.yaml`` / ``hyper_parameters``)."""
    encoder_type = hparams.get("encoder_type", "nugget")
    if encoder_type != "nugget":
        raise ConversionError(
            f"encoder_type={encoder_type!r}: only Dodo checkpoints (encoder_type 'nugget') can be converted; the "
            "'llama' and 'compress' baselines are not Dodo models."
        )
    if hparams.get("auto") and not hparams.get("ind_scorer", True):
        raise ConversionError("auto=True needs ind_scorer=True (the original asserts it); this checkpoint has both.")
    for key in ("new_line_stop", "extractive"):
        if hparams.get(key):
            logger.warning("%s=True is a LLaMA-2-specific generation option of the original; it is not converted.", key)
    nugget_layer = _hparam(hparams, "nugget_layer", 3, int)
    ind_scorer = bool(hparams.get("ind_scorer", True))
    fields = {
        "nugget_layer": nugget_layer,
        "nugget_ratio": _hparam(hparams, "ratio", 0.1, float),
        "nugget_count_rounding": "dodo",
        "force_last_nugget": True,
        "scorer_features": "base_final_norm" if ind_scorer else "encoder_hidden",
        "nugget_encoding": "reencode" if hparams.get("auto") else "encoder_pass",
        "score_in_forward": True,
        "soft_prompt_length": _hparam(hparams, "soft", 0, int) if hparams.get("soft") else 0,  # null/false: none
        "lora_r": _hparam(hparams, "lora", 32, int),
        "lora_alpha": 32.0,  # hard-coded by the authors
        "lora_dropout": 0.1,
        "lora_target_modules": ["q_proj", "v_proj", "o_proj"],
        "lora_layers": None if ind_scorer else list(range(nugget_layer, num_hidden_layers)),
        "encoder_adapter_name": "encoder",
        "decoder_adapter_name": "encoder" if hparams.get("freeze_decoder") else "decoder",
    }
    if hparams.get("freeze_decoder"):
        logger.warning(
            "freeze_decoder=True: the original's decoder silently runs with the *encoder* adapter (its "
            "disable_adapter() call has no effect); the converted model does the same (decoder_adapter_name='encoder')."
        )
    return fields


# ---------------------------------------------------------------------------------------------------------------------
# Key maps
# ---------------------------------------------------------------------------------------------------------------------


def base_key_map(config: DodoLlamaConfig) -> KeyMap:
    """Base Llama keys -> the LoRA-wrapped model's names (``q_proj.weight`` -> ``q_proj.base_layer.weight``)."""
    layers = r"\d+" if config.lora_layers is None else "|".join(str(layer) for layer in config.lora_layers)
    modules = "|".join(config.lora_target_modules)
    rules = [
        (
            rf"model\.layers\.({layers})\.self_attn\.({modules})\.(weight|bias)",
            r"model.layers.\1.self_attn.\2.base_layer.\3",
        ),
        (
            r"(model\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.(?:weight|bias))",
            r"\1",
        ),
        (r"(model\.layers\.\d+\.(?:input|post_attention)_layernorm\.weight)", r"\1"),
        (r"(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight)", r"\1"),
    ]
    tied = {r"lm_head\.weight": "model.embed_tokens.weight"} if config.tie_word_embeddings else {}
    return KeyMap(rules, tied)


def convert_base_state_dict(base_path: Path, config: DodoLlamaConfig, expected: set[str]) -> dict[str, torch.Tensor]:
    state_dict = load_state_dict_from_folder(base_path)
    # transformers 4.x wrote the RoPE frequencies as a buffer in some versions; they are recomputed from the config
    state_dict = {key: value for key, value in state_dict.items() if not key.endswith("rotary_emb.inv_freq")}
    expected_base = {key for key in expected if not DodoLlamaForCausalLM._is_trainable_weight(key)}
    return base_key_map(config).apply(state_dict, expected_base, source=str(base_path))


def _expected_keys(model: DodoLlamaForCausalLM) -> set[str]:
    keys = set(model.state_dict())
    if model.config.tie_word_embeddings:
        keys.discard("lm_head.weight")
    return keys


# ---------------------------------------------------------------------------------------------------------------------
# PEFT folders and scorer files
# ---------------------------------------------------------------------------------------------------------------------


def read_peft_adapter(folder: Path, allow_code_execution: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ConversionError(f"{folder} is not a PEFT adapter folder (no adapter_config.json).")
    adapter_config = read_json(config_file)
    if adapter_config.get("peft_type", "LORA") != "LORA":
        raise ConversionError(f"{folder} holds a {adapter_config.get('peft_type')} adapter; Dodo uses LoRA.")
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (folder / name).is_file():
            if name.endswith(".safetensors"):
                weights = load_weights_file(folder / name)
            else:
                weights = load_pickle(folder / name, allow_code_execution)
            check_state_dict(weights, str(folder / name))
            return adapter_config, weights
    raise ConversionError(f"No adapter_model.safetensors or adapter_model.bin in {folder}.")


def _adapter_number(adapter_config: dict, key: str, default, kind: type, config_file: Path):
    """``adapter_config[key]`` as ``kind``; a missing ``r`` or a non-number is a ConversionError naming the file."""
    value = adapter_config.get(key)
    value = default if value is None else value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer()):
        return kind(value)
    expected = "an integer" if kind is int else "a number"
    raise ConversionError(f"{config_file}: {key}={value!r}, expected {expected}.")


#: PEFT LoraConfig fields whose non-default values change what an adapter computes, beyond Dodo's plain LoRA
#: (the default each must have: rank-stabilised scaling, DoRA, per-module ranks or alphas, transposed weights, biases,
#: trained copies of whole modules, replicated layers).
_PLAIN_LORA_DEFAULTS = {"use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
                        "fan_in_fan_out": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
                        "layer_replication": None}


def unsupported_lora_options(adapter_config: dict) -> list[str]:
    """``name=value`` of each option of a PEFT ``adapter_config.json`` that plain LoRA does not compute (absent, or
    ``null`` / empty for the patterns and lists, is the default)."""
    found = []
    for name, default in _PLAIN_LORA_DEFAULTS.items():
        value = adapter_config.get(name, default)
        if value != default and not (value in (None, {}, [], "none") and default in (None, {}, "none")):
            found.append(f"{name}={value!r}")
    return found


def lora_targets_from_adapter_config(
    adapter_config: dict, num_hidden_layers: int
) -> tuple[list[str], list[int] | None]:
    """``(target modules, layers or None for all)`` of a LoRA config, found by matching its ``target_modules`` (regex
    string or list) against the Llama module names as PEFT does."""
    targets = adapter_config.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as error:
            raise ConversionError(f"target_modules {targets!r} is not a valid regular expression ({error}).") from None
    elif not isinstance(targets, (list, tuple)) or not all(isinstance(target, str) for target in targets):
        raise ConversionError(f"target_modules {targets!r}: expected a regular expression or a list of module names.")
    layers_to_transform = adapter_config.get("layers_to_transform")
    if layers_to_transform is not None and not (
        isinstance(layers_to_transform, int) or (isinstance(layers_to_transform, (list, tuple))
                                                 and all(isinstance(layer, int) for layer in layers_to_transform))
    ):
        raise ConversionError(f"layers_to_transform {layers_to_transform!r}: expected a layer index or a list of them.")
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    matched: set[tuple[int, str]] = set()
    for layer in range(num_hidden_layers):
        for module in modules:
            parent = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            name = f"model.layers.{layer}.{parent}.{module}"
            if isinstance(targets, str):
                hit = re.fullmatch(targets, name) is not None
            else:
                hit = any(name == target or name.endswith("." + target) for target in targets)
                if hit and layers_to_transform is not None:
                    allowed = [layers_to_transform] if isinstance(layers_to_transform, int) else layers_to_transform
                    hit = layer in allowed
            if hit:
                matched.add((layer, module))
    if not matched:
        raise ConversionError(f"target_modules {targets!r} matches no Llama attention projection.")
    found_modules = sorted({module for _, module in matched}, key=modules.index)
    found_layers = sorted({layer for layer, _ in matched})
    if any(module.endswith(("gate_proj", "up_proj", "down_proj")) for module in found_modules) or matched != {
        (layer, module) for layer in found_layers for module in found_modules
    }:
        raise ConversionError(
            f"target_modules {targets!r} selects {sorted(matched)}; Dodo supports the same attention projections "
            "(q/k/v/o) on a set of layers."
        )
    return found_modules, (None if len(found_layers) == num_hidden_layers else found_layers)


def read_scorer(path: Path, allow_code_execution: bool = False) -> dict[str, torch.Tensor]:
    """The scorer FFN from a plain state dict or the generic Nugget package's ``scorer_states`` file (written by its
    ``save_nuggets``)."""
    if path.suffix == ".safetensors":
        payload = load_weights_file(path)
    else:
        payload = load_pickle(path, allow_code_execution)
    if not isinstance(payload, dict):
        raise ConversionError(f"{path} does not hold a dict (got {type(payload).__name__}).")
    if "scorer_states" in payload:
        states = payload["scorer_states"]
        kwargs = payload.get("kwargs") or {}
        logger.info(
            "%s is a Nugget-package scorer file (kwargs %s). Its recorded scorer_layer/value_ffn are not trusted (the "
            "package always writes 3/True); value_ffn is unused for Llama and dropped.",
            path,
            kwargs,
        )
        payload = states.get("non_linear") if isinstance(states, dict) else None
        if payload is None:
            raise ConversionError(f"{path}: 'scorer_states' has no 'non_linear' entry.")
    elif "non_linear" in payload:
        payload = payload["non_linear"]
    check_state_dict(payload, f"{path} (scorer)")
    keys = set(payload)
    if keys != set(SCORER_KEYS):
        raise ConversionError(
            f"{path}: expected the scorer FFN keys {list(SCORER_KEYS)}; unexpected {sorted(keys - set(SCORER_KEYS))}, "
            f"missing {sorted(set(SCORER_KEYS) - keys)}."
        )
    return {f"nugget_scorer.{key}": tensor for key, tensor in payload.items()}


def read_soft_prompt(path: Path, allow_code_execution: bool = False) -> torch.Tensor:
    """A ``[soft, hidden]`` tensor from a safetensors/pt file (a tensor, or a dict with exactly one 2-D tensor or with
    the Lightning key ``nugget.decoder.soft_emb.weight``), or from the authors' Lightning checkpoint."""
    if path.suffix == ".safetensors":
        payload = load_weights_file(path)
    else:
        payload = load_pickle(path, allow_code_execution)
    if isinstance(payload, dict) and "state_dict" in payload:
        payload = payload["state_dict"]
    if isinstance(payload, dict):
        for key in ("nugget.decoder.soft_emb.weight", "soft_prompt.weight", "soft_emb.weight", "weight"):
            if key in payload:
                payload = payload[key]
                break
        else:
            tensors = [value for value in payload.values() if isinstance(value, torch.Tensor) and value.dim() == 2]
            if len(tensors) != 1:
                raise ConversionError(f"{path}: cannot tell which tensor is the soft prompt (keys {sorted(payload)}).")
            payload = tensors[0]
    if not isinstance(payload, torch.Tensor) or payload.dim() != 2:
        raise ConversionError(f"{path} must hold a [soft_prompt_length, hidden_size] tensor.")
    return payload


# ---------------------------------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------------------------------


def _build_and_save(
    config: DodoLlamaConfig,
    tensors: dict[str, torch.Tensor],
    base_path: Path,
    output: Path,
    source: str,
    max_new_tokens: int | None,
    tokenizer_name_or_path: str | None,
    push_to_hub: str | None,
    dtype: str | None = None,
    base_model_id: str | None = None,
) -> Path:
    """Load base + Dodo tensors into a model of ``config``, save it Hub-ready, reload and verify every tensor."""
    model = empty_model(DodoLlamaForCausalLM, config)
    expected = _expected_keys(model)
    converted = convert_base_state_dict(base_path, config, expected)
    overlap = set(converted) & set(tensors)
    if overlap:
        raise ConversionError(f"{source}: keys given twice: {sorted(overlap)}")
    converted.update(tensors)
    tensors.clear()  # `converted` is their only holder now, so the cast below frees each source tensor in turn
    missing = sorted(expected - set(converted))
    unexpected = sorted(set(converted) - expected)
    if missing or unexpected:
        raise ConversionError(
            f"{source}: the checkpoint does not match the model.\nMissing keys: {missing}\n"
            f"Unexpected keys: {unexpected}"
        )
    shapes = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
    wrong = {
        key: (tuple(tensor.shape), shapes[key])
        for key, tensor in converted.items()
        if tuple(tensor.shape) != shapes[key]
    }
    if wrong:
        raise ConversionError(f"{source}: tensor shapes differ from the model's (checkpoint, model): {wrong}")
    check_floating_dtypes(model, converted, source)
    # One dtype for the model: by default the widest of the sources (lossless: the authors keep float32 adapters).
    # In 16 bits the adapters, scorer and soft prompt stay float32, as `from_pretrained` loads them (PEFT's layout).
    target_dtype = getattr(torch, dtype) if dtype else widest_floating_dtype(converted.values())
    trainable_dtype = torch.float32 if target_dtype in (torch.float16, torch.bfloat16) else target_dtype
    source_dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in converted.values() if t.is_floating_point()})
    if dtype is None and len(source_dtypes) > 1:  # e.g. a bfloat16 base with float32 adapters: the file grows
        logger.info("The sources hold %s tensors: the converted model is %s throughout (lossless); --dtype %s keeps "
                    "a smaller file instead (the adapters, scorer and soft prompt stay float32).",
                    " and ".join(source_dtypes), str(target_dtype).removeprefix("torch."),
                    next(name for name in source_dtypes if getattr(torch, name) != target_dtype))
    convert_dtypes_in_place(
        converted, lambda key: trainable_dtype if DodoLlamaForCausalLM._is_trainable_weight(key) else target_dtype
    )
    model.to(target_dtype)
    assign_weights(model, converted, {"lm_head.weight"} if config.tie_word_embeddings else set(), source)

    generation_file = base_path / "generation_config.json"
    if generation_file.is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(base_path)
        if model.generation_config.do_sample:  # (Llama-2's own file samples: do_sample, temperature 0.6, top_p 0.9)
            logger.info("%s samples (do_sample=True); the converted model decodes greedily, as the authors do (paper "
                        "§5): pass do_sample=True to generate() to sample.", generation_file)
            model.generation_config.do_sample = False
            for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):  # sampling only: unset
                setattr(model.generation_config, name, None)
    if max_new_tokens is not None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConversionError(f"--max_new_tokens {max_new_tokens!r}: expected a positive integer.")
        model.generation_config.max_new_tokens = max_new_tokens  # the authors generate greedily (paper §5)
    tokenizer_source = tokenizer_name_or_path or find_local_tokenizer(base_path)

    def base_stays_frozen(reloaded: DodoLlamaForCausalLM) -> None:
        trainable = {name for name, param in reloaded.named_parameters() if param.requires_grad}
        if not all(DodoLlamaForCausalLM._is_trainable_weight(name) for name in trainable):
            raise ConversionError(
                "Verification failed: base weights of the reloaded model are trainable (should be frozen)."
            )

    converted_model = ConvertedModel(model, converted)
    del model, converted  # finish_conversion holds them alone, and releases them before reloading the saved folder
    finish_conversion(
        converted_model, output, card_name="dodo_llama", source=source, tokenizer_name_or_path=tokenizer_source,
        push_to_hub=push_to_hub, reload_kwargs={"dtype": target_dtype}, extra_check=base_stays_frozen,
        base_model=base_model_id,
    )
    return output


def convert_dodo_checkpoint(
    checkpoint_path: str | Path,
    pytorch_dump_folder_path: str | Path,
    hparams_path: str | Path | None = None,
    base_model_path: str | Path | None = None,
    tokenizer_name_or_path: str | None = None,
    legacy_decoder_mask_order: bool = False,
    push_to_hub: str | None = None,
    allow_pickle_code_execution: bool = False,
    dtype: str | None = None,
    base_model_id: str | None = None,
) -> Path:
    """Mode 1: the authors' Lightning ``weights.ckpt`` (+ hyper-parameters) and the base Llama folder
    (``base_model_id``: its Hub id, named in the model card)."""
    check_base_model_id(base_model_id)
    checkpoint_path = Path(checkpoint_path)
    hparams_path = Path(hparams_path) if hparams_path is not None else None
    state_dict, hparams = read_lightning_checkpoint(checkpoint_path, hparams_path, allow_pickle_code_execution)
    base_path = resolve_base_model(
        hparams.get("pretrained"), checkpoint_path, str(base_model_path) if base_model_path else None
    )
    output = prepare_output_folder(pytorch_dump_folder_path, [checkpoint_path, hparams_path, base_path])
    check_push_target(push_to_hub)
    base_fields = read_base_config(base_path)
    hparams_source = hparams_path or f"the hyper-parameters of {checkpoint_path}"
    try:
        dodo_fields = dodo_fields_from_hparams(hparams, base_fields["num_hidden_layers"])
        new_tokens = _hparam(hparams, "new_tokens", None, int) if hparams.get("new_tokens") is not None else None
        if new_tokens is not None and new_tokens < 1:
            raise ConversionError(f"hyper-parameter new_tokens={new_tokens!r}: expected a positive integer.")
        config = DodoLlamaConfig(**base_fields, **dodo_fields, legacy_decoder_mask_order=legacy_decoder_mask_order)
    except ConversionError as error:
        raise ConversionError(f"{hparams_source}: {error}") from None
    except (ValueError, TypeError) as error:
        raise ConversionError(
            f"{hparams_source} (with the base model {base_path}) give an invalid Dodo configuration: {one_line(error)}"
        ) from None

    for key, reason in DROPPED_LIGHTNING_KEYS.items():
        if key in state_dict:
            logger.info("Dropping %s: %s.", key, reason)
    kept = {key: value for key, value in state_dict.items() if key not in DROPPED_LIGHTNING_KEYS}
    expected_keys = _expected_keys(empty_model(DodoLlamaForCausalLM, config))
    expected_trainable = {key for key in expected_keys if DodoLlamaForCausalLM._is_trainable_weight(key)}
    tensors = KeyMap(LIGHTNING_RULES).apply(kept, expected_trainable, source=str(checkpoint_path))
    del state_dict, kept  # `tensors` holds the trainable tensors alone
    return _build_and_save(
        config,
        tensors,
        base_path,
        output,
        str(checkpoint_path),
        new_tokens,
        tokenizer_name_or_path,
        push_to_hub,
        dtype,
        base_model_id,
    )


def convert_dodo_peft_folders(
    encoder_adapter_path: str | Path,
    decoder_adapter_path: str | Path | None,
    scorer_path: str | Path,
    base_model_path: str | Path,
    pytorch_dump_folder_path: str | Path,
    soft_prompt_path: str | Path | None = None,
    soft_prompt_length: int | None = None,
    nugget_layer: int = 3,
    nugget_ratio: float = 0.1,
    nugget_count_rounding: str = "dodo",
    scorer_features: str = "base_final_norm",
    score_in_forward: bool = True,
    legacy_decoder_mask_order: bool = False,
    tokenizer_name_or_path: str | None = None,
    max_new_tokens: int | None = None,
    push_to_hub: str | None = None,
    allow_pickle_code_execution: bool = False,
    dtype: str | None = None,
    nugget_encoding: str = "encoder_pass",
    base_model_id: str | None = None,
) -> Path:
    """Mode 2: PEFT adapter folders (φ and θ; θ may be omitted: the decoder then uses φ, as ``freeze_decoder=True``)
    plus a scorer file, a soft prompt file (or ``soft_prompt_length=0``) and the base Llama folder
    (``base_model_id``: its Hub id, named in the model card)."""
    check_base_model_id(base_model_id)
    encoder_adapter_path, scorer_path, base_path = Path(encoder_adapter_path), Path(scorer_path), Path(base_model_path)
    decoder_adapter_path = Path(decoder_adapter_path) if decoder_adapter_path is not None else None
    soft_prompt_path = Path(soft_prompt_path) if soft_prompt_path is not None else None
    inputs = [encoder_adapter_path, decoder_adapter_path, scorer_path, base_path, soft_prompt_path]
    output = prepare_output_folder(pytorch_dump_folder_path, inputs)
    check_push_target(push_to_hub)
    if not (base_path / "config.json").is_file():
        raise ConversionError(f"--base_model_path {base_path} is not a Llama folder (no config.json).")
    base_fields = read_base_config(base_path)
    layers = base_fields["num_hidden_layers"]

    adapters = {"encoder": read_peft_adapter(encoder_adapter_path, allow_pickle_code_execution)}
    if decoder_adapter_path is not None:
        adapters["decoder"] = read_peft_adapter(decoder_adapter_path, allow_pickle_code_execution)
    settings = {}
    adapter_folders = {"encoder": encoder_adapter_path, "decoder": decoder_adapter_path}
    for name, (adapter_config, _) in adapters.items():
        config_file = adapter_folders[name] / "adapter_config.json"
        unsupported = unsupported_lora_options(adapter_config)
        if unsupported:
            raise ConversionError(
                f"{config_file} sets {', '.join(unsupported)}: Dodo's adapters are plain LoRA (W + (alpha / r) B A on "
                "the target modules), so these weights would convert into another model. Convert an adapter trained "
                "without them."
            )
        try:
            modules, lora_layers = lora_targets_from_adapter_config(adapter_config, layers)
        except ConversionError as error:
            raise ConversionError(f"{config_file}: {error}") from None
        settings[name] = (
            _adapter_number(adapter_config, "r", None, int, config_file),
            _adapter_number(adapter_config, "lora_alpha", 8, float, config_file),
            tuple(modules),
            None if lora_layers is None else tuple(lora_layers),
        )
    if len(set(settings.values())) != 1:
        raise ConversionError(
            f"The adapters differ in (r, lora_alpha, target modules, layers): {settings}; Dodo needs one LoRA setting."
        )
    r, alpha, modules, lora_layers = settings["encoder"]
    modules, lora_layers = list(modules), (None if lora_layers is None else list(lora_layers))
    dropout = _adapter_number(adapters["encoder"][0], "lora_dropout", 0.0, float,
                              encoder_adapter_path / "adapter_config.json")

    tensors: dict[str, torch.Tensor] = {}
    for name, (_, weights) in adapters.items():
        rule = (PEFT_RULE[0], PEFT_RULE[1].format(adapter=name))
        expected = {
            f"model.layers.{layer}.self_attn.{module}.lora_{part}.{name}.weight"
            for layer in (lora_layers if lora_layers is not None else range(layers))
            for module in modules
            for part in "AB"
        }
        tensors.update(KeyMap([rule]).apply(weights, expected, source=f"adapter {name!r}"))
    tensors.update(read_scorer(scorer_path, allow_pickle_code_execution))
    if soft_prompt_path is not None:
        soft = read_soft_prompt(soft_prompt_path, allow_pickle_code_execution)
        if soft_prompt_length is not None and soft_prompt_length != soft.shape[0]:
            raise ConversionError(
                f"--soft_prompt_length {soft_prompt_length} but {soft_prompt_path} holds {soft.shape[0]} rows."
            )
        tensors["soft_prompt.weight"] = soft
        soft_prompt_length = soft.shape[0]
    elif soft_prompt_length is None or soft_prompt_length > 0:
        raise ConversionError(
            "PEFT folders and scorer files do not hold the soft prompt: pass --soft_prompt_path (a tensor file or the "
            "authors' weights.ckpt) or --soft_prompt_length 0 for a model without one."
        )

    try:
        config = DodoLlamaConfig(
            **base_fields,
            nugget_layer=nugget_layer,
            nugget_ratio=nugget_ratio,
            nugget_count_rounding=nugget_count_rounding,
            scorer_features=scorer_features,
            nugget_encoding=nugget_encoding,
            score_in_forward=score_in_forward,
            soft_prompt_length=soft_prompt_length,
            lora_r=r,
            lora_alpha=alpha,
            lora_dropout=dropout,
            lora_target_modules=modules,
            lora_layers=lora_layers,
            encoder_adapter_name="encoder",
            decoder_adapter_name="decoder" if decoder_adapter_path is not None else "encoder",
            legacy_decoder_mask_order=legacy_decoder_mask_order,
        )
    except (ValueError, TypeError) as error:
        raise ConversionError(
            f"The options and adapter configs ({encoder_adapter_path}/adapter_config.json) with the base model "
            f"{base_path} give an invalid Dodo configuration: {one_line(error)}"
        ) from None
    source = f"{encoder_adapter_path} + {decoder_adapter_path} + {scorer_path}"
    del adapters  # `tensors` holds their weights alone
    return _build_and_save(
        config, tensors, base_path, output, source, max_new_tokens, tokenizer_name_or_path, push_to_hub, dtype,
        base_model_id,
    )


def export_peft_adapters(dodo_model_path: str | Path, pytorch_dump_folder_path: str | Path) -> Path:
    """Mode 3: write each adapter of a longreach Dodo folder as a standard PEFT folder (+ scorer and soft prompt),
    then read everything back and compare with the model's tensors."""
    dodo_model_path = Path(dodo_model_path)
    output = prepare_output_folder(pytorch_dump_folder_path, [dodo_model_path])
    # Checked before from_pretrained: a missing folder would be looked up on the Hub, and another model's config
    # would build a default (7B-parameter) Llama.
    if not dodo_model_path.is_dir():
        raise ConversionError(f"--export_peft_from {dodo_model_path} is not a folder; expected a longreach Dodo folder "
                              "(config.json with model_type 'dodo_llama').")
    config_file = dodo_model_path / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"--export_peft_from {dodo_model_path} has no config.json; expected a longreach Dodo "
                              "folder.")
    model_type = read_json(config_file).get("model_type")
    if model_type != DodoLlamaConfig.model_type:
        raise ConversionError(
            f"--export_peft_from {dodo_model_path} holds a model_type {model_type!r} model; expected a longreach Dodo "
            f"folder (model_type {DodoLlamaConfig.model_type!r})."
        )
    try:
        model = DodoLlamaForCausalLM.from_pretrained(dodo_model_path)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as error:
        raise ConversionError(f"--export_peft_from {dodo_model_path} cannot be loaded: {one_line(error)}") from error
    state_dict = model.state_dict()
    with staged_output(output) as staging:  # renamed to `output` only once everything read back equal
        model.export_peft_adapters(staging, base_model_name_or_path=None)
        for name in model.config.adapter_names:
            _, weights = read_peft_adapter(staging / name)
            for key, tensor in weights.items():
                ours = re.sub(r"^base_model\.model\.(.*)\.(lora_[AB])\.weight$", rf"\1.\2.{name}.weight", key)
                if ours not in state_dict or not torch.equal(state_dict[ours].cpu(), tensor):
                    raise ConversionError(f"Export verification failed for {key} of adapter {name!r}.")
        scorer = read_scorer(staging / "scorer.pt")
        if any(not torch.equal(state_dict[key].cpu(), tensor) for key, tensor in scorer.items()):
            raise ConversionError("Export verification failed for the scorer.")
    logger.info("Exported the adapters of %s to %s.", dodo_model_path, output)
    return output


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_argument_group("input (one mode)")
    modes.add_argument("--checkpoint_path", help="Mode 1: the authors' Lightning weights.ckpt.")
    modes.add_argument("--encoder_adapter_path", help="Mode 2: PEFT folder of the encoder (φ) adapter.")
    modes.add_argument("--export_peft_from", help="Mode 3: a longreach Dodo folder to export as PEFT folders.")
    parser.add_argument("--pytorch_dump_folder_path", required=True, help="New or empty output folder.")
    parser.add_argument("--hparams_path", help="hparams.yaml (default: the checkpoint's own hyper-parameters).")
    parser.add_argument("--base_model_path", help="Base Llama folder (default: the hyper-parameters' `pretrained`).")
    add_base_model_id_argument(parser, "that base Llama (e.g. meta-llama/Llama-2-7b-chat-hf)")
    parser.add_argument("--decoder_adapter_path", help="Mode 2: PEFT folder of the decoder (θ) adapter.")
    parser.add_argument("--scorer_path", help="Mode 2: scorer file (plain FFN state dict or Nugget-package file).")
    parser.add_argument("--soft_prompt_path", help="Mode 2: soft prompt tensor file (or the authors' weights.ckpt).")
    parser.add_argument("--soft_prompt_length", type=int, help="Mode 2: 0 for a model without a soft prompt.")
    parser.add_argument("--nugget_layer", type=int, default=3, help="Mode 2: ι (default 3).")
    parser.add_argument("--nugget_ratio", type=float, default=0.1, help="Mode 2: nuggets per token (default 0.1).")
    parser.add_argument(
        "--nugget_count_rounding", choices=("dodo", "ceil"), default="dodo", help="Mode 2 (default dodo)."
    )
    parser.add_argument(
        "--scorer_features",
        choices=("base_final_norm", "encoder_hidden"),
        default="base_final_norm",
        help="Mode 2: base_final_norm (ind_scorer=True, default) or encoder_hidden.",
    )
    parser.add_argument(
        "--nugget_encoding",
        choices=("encoder_pass", "reencode"),
        default="encoder_pass",
        help="Mode 2: encoder_pass (auto=False, default) or reencode (the original's experimental auto=True).",
    )
    parser.add_argument(
        "--straight_through_scores",
        action="store_true",
        help="Mode 2: use s - stopgrad(s) instead of the original's + s (only for models trained so).",
    )
    parser.add_argument("--max_new_tokens", type=int, help="Mode 2: generation_config.max_new_tokens.")
    parser.add_argument(
        "--legacy_decoder_mask_order",
        action="store_true",
        help="Reproduce the original's decoder padding-mask order ([soft prompt; nuggets; tokens] instead of "
             "[nuggets; soft prompt; tokens]; it changes batched rows with fewer nuggets) for bug-for-bug parity.",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the converted model (default: the widest dtype among the sources, lossless); in float16 or "
             "bfloat16 the adapters, scorer and soft prompt stay float32, as from_pretrained loads them.",
    )
    parser.add_argument("--tokenizer_name_or_path", help="Tokenizer to save (default: the base folder's, if any).")
    parser.add_argument("--push_to_hub", metavar="REPO_ID", help="Also upload the result to this Hub repo.")
    parser.add_argument(
        "--unsafe_allow_pickle_code_execution",
        action="store_true",
        help="Allow torch.load(weights_only=False) for trusted pickles that hold other objects: this can "
        "execute arbitrary code.",
    )
    args = expand_user_paths(parser.parse_args(argv))
    chosen = [name for name in ("checkpoint_path", "encoder_adapter_path", "export_peft_from") if getattr(args, name)]
    if len(chosen) != 1:
        parser.error("pass exactly one of --checkpoint_path, --encoder_adapter_path and --export_peft_from")
    if args.encoder_adapter_path and not (args.scorer_path and args.base_model_path):
        parser.error("--encoder_adapter_path needs --scorer_path and --base_model_path")
    if args.nugget_layer < 0:
        parser.error(f"--nugget_layer {args.nugget_layer}: expected a layer index >= 0")
    if not 0 < args.nugget_ratio <= 1:  # also refuses nan
        parser.error(f"--nugget_ratio {args.nugget_ratio}: expected a number in (0, 1] (nuggets per token)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens {args.max_new_tokens}: expected a positive integer")
    if args.soft_prompt_length is not None and args.soft_prompt_length < 0:
        parser.error(f"--soft_prompt_length {args.soft_prompt_length}: expected an integer >= 0")
    return args


def main(argv: list[str] | None = None, *, debug: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    unsafe = args.unsafe_allow_pickle_code_execution
    try:
        if args.checkpoint_path:
            output = convert_dodo_checkpoint(
                args.checkpoint_path,
                args.pytorch_dump_folder_path,
                args.hparams_path,
                args.base_model_path,
                args.tokenizer_name_or_path,
                args.legacy_decoder_mask_order,
                args.push_to_hub,
                unsafe,
                args.dtype,
                args.base_model_id,
            )
        elif args.encoder_adapter_path:
            output = convert_dodo_peft_folders(
                args.encoder_adapter_path,
                args.decoder_adapter_path,
                args.scorer_path,
                args.base_model_path,
                args.pytorch_dump_folder_path,
                args.soft_prompt_path,
                args.soft_prompt_length,
                args.nugget_layer,
                args.nugget_ratio,
                args.nugget_count_rounding,
                args.scorer_features,
                not args.straight_through_scores,
                args.legacy_decoder_mask_order,
                args.tokenizer_name_or_path,
                args.max_new_tokens,
                args.push_to_hub,
                unsafe,
                args.dtype,
                nugget_encoding=args.nugget_encoding,
                base_model_id=args.base_model_id,
            )
        else:
            output = export_peft_adapters(args.export_peft_from, args.pytorch_dump_folder_path)
    except ConversionError as error:
        if debug:  # `longreach --debug convert ...`: the traceback
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Dodo {'PEFT export' if args.export_peft_from else 'checkpoint'} written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
