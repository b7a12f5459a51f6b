"""Shared machinery of the converters: safe loading, explicit key maps, output-folder safety and verification.

Rules every converter follows:

* Pickles are read with ``torch.load(..., weights_only=True)``; classes a pickle needs (a pickled config object) are
  replaced by allow-listed stand-ins that only collect attributes. Nothing in a checkpoint is ever executed.
* Every source key is mapped by an explicit rule. A key no rule accounts for, or a key the model expects and the
  source lacks, stops the conversion with a message naming them. Tied duplicates are dropped only after checking
  that they equal their source tensor.
* The output folder must be new or empty and must not overlap the input; the input is never written to.
* The model exists once: it is built on the meta device and the converted tensors become its weights; ``torch.save``
  files are memory-mapped (a Lightning checkpoint's optimizer states are never read); what is verified after saving
  is each tensor's SHA-256, and the model is released before the saved folder is reloaded. The peak is about one copy
  of the converted weights (``benchmarks/benchmark_conversion_memory.py``), where holding the source, the model and
  the reloaded model at once needed three: for Dodo's 7B Llama in float32, 28 GB rather than 84.
* Everything is written into a hidden staging folder (``.NAME.incomplete-PID-*`` beside a new output folder,
  ``.incomplete-PID-*`` inside an existing empty one, which is kept with its mount, mode and group), reloaded from
  there and every tensor compared bit for bit with the source; only then is that folder renamed to the output (or its
  files moved into it, ``config.json`` last). A conversion that fails, is interrupted or gets SIGTERM removes it; one
  killed outright never leaves a folder that loads under the output's name, and a rerun into the same path works.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file as load_safetensors

from ..modeling.remote_code import disk_full, process_alive

logger = logging.getLogger(__name__)


class ConversionError(ValueError):
    """A checkpoint cannot be converted as asked; the message says why."""


# ---------------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------------


def pickled_class_stand_in(module: str, name: str) -> type:
    """A class importable by ``torch.load(weights_only=True)`` under ``module.name`` that only stores attributes.

    Used for config objects pickled inside Lightning checkpoints (e.g. ``models_config.LOCOSTConfig``); after
    loading, ``vars(obj)`` holds the original attributes.
    """
    stand_in = type(name, (), {"__doc__": f"Allow-listed stand-in for the pickled class {module}.{name}."})
    stand_in.__module__ = module
    return stand_in


def safe_torch_load(path: str | os.PathLike, allowed_classes: Iterable[type] = ()) -> object:
    """``torch.load`` with ``weights_only=True`` on CPU, with extra allow-listed classes.

    Failures become one-line :class:`ConversionError` s that name the cause: a truncated or corrupt file, a file that
    is not a ``torch.save`` checkpoint, or a pickled object outside the allow-list (never loaded: unpickling arbitrary
    objects can run code).
    """
    import pickle

    _check_is_file(path)
    with torch.serialization.safe_globals(list(allowed_classes)):
        try:
            try:  # memory-mapped: tensors are read when used, and a checkpoint's optimizer states never are
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):  # a file of torch's legacy (non-zip) format cannot be mapped
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            # torch words it "Unsupported global: GLOBAL x.y" or "unsupported GLOBAL x.y whose module x is blocked"
            unsupported = re.search(r"unsupported (?:global:? )?GLOBAL (\S+)", str(error), flags=re.IGNORECASE)
            if unsupported:
                raise ConversionError(
                    f"{path} holds a pickled {unsupported.group(1)}, which torch.load(weights_only=True) does not load: "
                    "it is not on our allow-list of tensors and containers (unpickling arbitrary objects can run code)."
                ) from None
            detail = _error_detail(error)
            raise ConversionError(f"{path} is not a PyTorch checkpoint, or it is corrupt: {detail}") from None
        except (OSError, RuntimeError, EOFError) as error:
            with open(path, "rb") as handle:
                zip_archive = handle.read(2) == b"PK"  # torch.save's format; truncated, it is no valid zip any more
            kind = ("truncated or corrupt (its zip archive cannot be read)" if zip_archive
                    else "truncated, corrupt or not a PyTorch checkpoint")
            raise ConversionError(f"{path} is {kind}: {_error_detail(error)}") from None
        except MemoryError:
            raise
        except Exception as error:  # the unpickler on bytes that are no pickle: KeyError, IndexError, ValueError, ...
            raise ConversionError(
                f"{path} is not a PyTorch checkpoint (unpickling it failed: {_error_detail(error)})."
            ) from None


#: Lines of torch.load's errors that only give generic advice (about weights_only, the docs, filing issues).
_BOILERPLATE = re.compile(
    r"^(?:Weights only load failed|\(\d\)|In PyTorch 2\.6|Please file an issue|Check the documentation)", re.IGNORECASE
)


def _error_detail(error: BaseException, limit: int = 200) -> str:
    """The informative line of an exception's message (torch.load wraps it in generic advice), shortened."""
    text = str(error)
    unpickler = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    informative = [line for line in lines if not _BOILERPLATE.match(line)]
    detail = unpickler.group(1).strip() if unpickler else (informative or lines or [""])[0]
    if len(detail) < 8:  # KeyError: 101 and the like
        detail = f"{type(error).__name__}: {detail}".rstrip(": ")
    return detail if len(detail) <= limit else detail[: limit - 3] + "..."


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception's whole message on one line (its lines joined), shortened to ``limit`` characters."""
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _check_is_file(path: str | os.PathLike) -> None:
    if not Path(path).is_file():
        raise ConversionError(f"{path} is {'a folder' if Path(path).is_dir() else 'missing'}; expected a weights file.")


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object from ``path``; anything else is a one-line :class:`ConversionError` naming the file."""
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConversionError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path} is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno}).") from None
    if not isinstance(payload, dict):
        raise ConversionError(f"{path} must hold a JSON object, got {type(payload).__name__}.")
    return payload


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file or a ``torch.save`` state dict (``weights_only=True``); failures are
    one-line :class:`ConversionError` s naming the file."""
    path = Path(path)
    if path.suffix == ".safetensors":
        _check_is_file(path)
        from safetensors import SafetensorError

        try:
            return load_safetensors(str(path))
        except SafetensorError as error:
            raise ConversionError(f"{path} is truncated or corrupt (safetensors: {error}).") from None
    state_dict = safe_torch_load(path)
    if not isinstance(state_dict, dict):
        raise ConversionError(f"{path} does not hold a state dict (got {type(state_dict).__name__}).")
    check_state_dict(state_dict, str(path))
    return state_dict


def load_state_dict_from_folder(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict of a transformers-style folder: ``model.safetensors``, ``pytorch_model.bin`` or a sharded index."""
    folder = Path(folder)
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return load_weights_file(folder / single)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index} has no 'weight_map' object.")
            shards = sorted(set(weight_map.values()))
            state_dict: dict[str, torch.Tensor] = {}
            for shard in shards:
                state_dict.update(load_weights_file(folder / shard))
            return state_dict
    raise ConversionError(
        f"No weights in {folder}: expected model.safetensors, pytorch_model.bin or a sharded index next to config.json."
    )


def load_folder_checkpoint(folder: Path, config_path: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state dict, config dict)`` of a ``save_pretrained`` folder; ``config_path`` replaces its config.json."""
    if config_path is not None and not Path(config_path).is_file():
        raise ConversionError(f"--config_path {config_path} does not exist or is not a file.")
    config_file = config_path or folder / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"No config.json in {folder} (pass --config_path).")
    return load_state_dict_from_folder(folder), read_json(config_file)


def strip_prefix(state_dict: dict[str, torch.Tensor], prefix: str, source: str) -> dict[str, torch.Tensor]:
    """Keys of a Lightning ``state_dict`` without the LightningModule attribute prefix (e.g. ``model.``)."""
    check_state_dict(state_dict, f"{source} ('state_dict')")
    other = [key for key in state_dict if not key.startswith(prefix)]
    if other:
        raise ConversionError(f"{source}: expected every state_dict key to start with {prefix!r}; these do not: {other}")
    return {key[len(prefix):]: value for key, value in state_dict.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Key mapping
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class KeyMap:
    """Explicit mapping from source keys to our keys.

    ``rules`` is a list of ``(source regex, target template)`` applied with ``re.fullmatch``; the first matching rule
    wins. ``tied`` maps source keys that must equal another *source* key and are then dropped (tied copies).
    """

    rules: list[tuple[str, str]]
    tied: dict[str, str] = field(default_factory=dict)

    def apply(self, state_dict: dict[str, torch.Tensor], expected_keys: Iterable[str], source: str) -> dict[str, torch.Tensor]:
        check_state_dict(state_dict, source)
        converted: dict[str, torch.Tensor] = {}
        unexpected: list[str] = []
        for key, tensor in state_dict.items():
            tie_source = self._tie_source(key)
            if tie_source is not None:
                if tie_source not in state_dict:
                    raise ConversionError(f"{source}: {key!r} is a tied copy of {tie_source!r}, which is missing.")
                if not torch.equal(tensor, state_dict[tie_source]):
                    raise ConversionError(
                        f"{source}: {key!r} should be a tied copy of {tie_source!r} but differs from it; refusing to "
                        "drop a distinct weight."
                    )
                continue
            for pattern, template in self.rules:
                match = re.fullmatch(pattern, key)
                if match:
                    target = match.expand(template)
                    if target in converted:
                        raise ConversionError(f"{source}: two source keys map to {target!r}.")
                    converted[target] = tensor.contiguous()
                    break
            else:
                unexpected.append(key)
        expected = set(expected_keys)
        missing = sorted(expected - set(converted))
        unmapped = sorted(set(converted) - expected)
        if unexpected or missing or unmapped:
            lines = [f"{source}: the checkpoint does not match the model."]
            if unexpected:
                lines.append(f"Unexpected keys (no mapping rule): {sorted(unexpected)}")
            if unmapped:
                lines.append(f"Keys mapped to names the model does not have: {unmapped}")
            if missing:
                lines.append(f"Missing keys (the model needs them, the checkpoint lacks them): {missing}")
            raise ConversionError("\n".join(lines))
        return converted

    def _tie_source(self, key: str) -> str | None:
        for pattern, source_key in self.tied.items():
            match = re.fullmatch(pattern, key)
            if match:
                return match.expand(source_key)
        return None


def check_state_dict(state_dict: object, source: str) -> None:
    """``state_dict`` must be a mapping of string keys to tensors; anything else is a :class:`ConversionError` naming
    ``source`` and the first offending key."""
    if not isinstance(state_dict, Mapping):
        raise ConversionError(f"{source}: expected a state dict (a mapping of names to tensors), got "
                              f"{type(state_dict).__name__}.")
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            what = f"{key!r} holds a value of type {type(value).__name__}" if isinstance(key, str) else f"key {key!r}"
            raise ConversionError(f"{source}: {what}; expected string keys and tensor values (is this a state dict?).")


def widest_floating_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The widest floating dtype among ``tensors`` (float32 if none): converting to it loses nothing. float16 and
    bfloat16 together give float32 (neither holds the other's values)."""
    dtypes = {tensor.dtype for tensor in tensors if tensor.is_floating_point()}
    if not dtypes:
        return torch.float32
    widest = max(dtypes, key=lambda dtype: torch.finfo(dtype).bits)
    if torch.finfo(widest).bits == 16 and {torch.float16, torch.bfloat16} <= dtypes:
        return torch.float32
    return widest


def empty_model(model_class: type, config) -> torch.nn.Module:
    """``model_class(config)`` with its weights on the meta device: no memory and no random initialisation, since
    every weight comes from the checkpoint (:func:`load_converted` makes the converted tensors the model's weights).
    Non-persistent buffers (Llama's RoPE frequencies) stay on meta: a converter saves this model and never runs it;
    what it returns and checks is the saved folder, reloaded."""
    with torch.device("meta"):
        return model_class(config)


def convert_dtypes_in_place(tensors: dict[str, torch.Tensor], target_dtype) -> None:
    """Cast the floating tensors of ``tensors`` to ``target_dtype(key)`` one at a time, replacing each entry: a source
    tensor nothing else holds is freed as soon as its cast exists, so the peak is one copy plus one tensor."""
    for key in list(tensors):
        if tensors[key].is_floating_point():
            tensors[key] = tensors[key].to(target_dtype(key))


def assign_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], tied: set[str], source: str) -> None:
    """Make ``tensors`` the weights of ``model`` (``load_state_dict(assign=True)``: no copy), tie the tied ones
    (``tied``: keys that come from their tie) and check that no weight is left empty."""
    seen = set()
    for key, tensor in tensors.items():  # two weights must not share memory (save_pretrained would drop one)
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and pointer in seen:
            tensors[key] = tensor.clone()
        seen.add(pointer)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if set(missing) - tied or unexpected:
        raise ConversionError(f"{source}: loading into the model failed: missing {sorted(set(missing) - tied)}, "
                              f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    empty = sorted(key for key, tensor in model.state_dict().items() if tensor.is_meta)
    if empty:
        raise ConversionError(f"{source}: no tensor for {empty} after loading and tying the weights.")


def load_converted(model: torch.nn.Module, converted: dict[str, torch.Tensor], tied: set[str],
                   source: str) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    """Load ``converted`` (our names; ``tied`` keys come from their tie) into ``model`` (best built with
    :func:`empty_model`) in the checkpoint's own precision (its widest floating dtype: a bfloat16 checkpoint gives a
    bfloat16 model, with the modules the model keeps in float32 upcast, which loses nothing). Shapes are checked first
    and every mismatch is named. ``converted`` is cast in place and its tensors become the model's weights. Returns
    it (the tensors to verify after saving) and the dtype."""
    shapes = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
    wrong = {key: (tuple(tensor.shape), shapes[key]) for key, tensor in converted.items()
             if key in shapes and tuple(tensor.shape) != shapes[key]}
    if wrong:
        lines = [f"{key}: checkpoint {list(have)}, model {list(need)}" for key, (have, need) in sorted(wrong.items())]
        raise ConversionError(f"{source}: tensor shapes differ from the model's (is the config the checkpoint's?):\n"
                              + "\n".join(lines))
    check_floating_dtypes(model, converted, source)
    dtype = widest_floating_dtype(converted.values())
    # Modules the model keeps in float32 in half precision (as from_pretrained does: LOCOST's SSM parameters)
    kept = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        kept += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    half = torch.finfo(dtype).bits == 16  # float64 stays float64 everywhere
    float32_kept = re.compile("|".join(map(re.escape, kept))) if kept and half else None

    def target_dtype(key: str) -> torch.dtype:
        return torch.float32 if float32_kept is not None and float32_kept.search(key) else dtype

    convert_dtypes_in_place(converted, target_dtype)
    model.to(dtype)
    if float32_kept is not None:
        for name, module in model.named_modules():
            if name and float32_kept.search(name):
                module.float()
    assign_weights(model, converted, tied, source)
    return converted, dtype


def check_floating_dtypes(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """A floating model tensor must come from a floating tensor (``load_state_dict`` would silently cast an integer
    one); names every key, the dtype given and the one expected."""
    model_tensors = model.state_dict()
    wrong = [
        f"{key}: checkpoint {tensor.dtype}, expected a floating dtype (the model's is {model_tensors[key].dtype})"
        for key, tensor in sorted(tensors.items())
        if key in model_tensors and model_tensors[key].is_floating_point() and not tensor.is_floating_point()
    ]
    if wrong:
        raise ConversionError(f"{source}: tensors of a non-floating dtype where the model has floating weights:\n"
                              + "\n".join(wrong))


# ---------------------------------------------------------------------------------------------------------------------
# Output folder and verification
# ---------------------------------------------------------------------------------------------------------------------


def prepare_output_folder(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None]) -> Path:
    """Check ``output`` (absent or an empty folder, not overlapping any input) and return it resolved.

    Nothing is created under its name: converters write through :func:`staged_output`. Staging folders left by a
    killed conversion into the same output are removed.
    """
    output = Path(output).expanduser().resolve()
    if output == Path.cwd().resolve() or output.parent == output:
        raise ConversionError(f"--pytorch_dump_folder_path {output} is the current folder or a root; the converted "
                              "folder is renamed into place, so pass a folder of its own.")
    for source in inputs:
        if source is None:
            continue
        source = Path(source).resolve()
        # A folder input may neither be, contain, nor lie inside the output; a file input may not be the output.
        overlaps = output == source or output in source.parents or (source.is_dir() and source in output.parents)
        if overlaps:
            raise ConversionError(
                f"--pytorch_dump_folder_path {output} overlaps the input {source}; choose a separate folder (the "
                "converter never writes into its input)."
            )
    if output.exists():
        if not output.is_dir():
            raise ConversionError(f"--pytorch_dump_folder_path {output} exists and is not a folder.")
        _remove_stale_staging(output, _STAGING_PREFIX)  # left inside it by a killed conversion into it
        if any(output.iterdir()):
            raise ConversionError(
                f"--pytorch_dump_folder_path {output} is not empty; refusing to overwrite. Pass a new or empty folder."
            )
    ancestor = output.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConversionError(f"--pytorch_dump_folder_path {output}: {ancestor} is a file, not a folder.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConversionError(f"--pytorch_dump_folder_path {output}: cannot write in {ancestor}.")
    if not output.parent.is_dir():
        return output  # its parent folders are created by staged_output, once the conversion gets that far
    _remove_stale_staging(output.parent, f".{output.name}{_STAGING_PREFIX}")
    return output


#: Staging folders are named PREFIX + "PID-" + random (beside a new output folder: "." + its name + PREFIX ...).
_STAGING_PREFIX = ".incomplete-"


def _remove_stale_staging(folder: Path, prefix: str) -> None:
    """Remove the staging folders in ``folder`` whose conversion process is gone."""
    for stale in folder.glob(f"{prefix}*"):
        pid = stale.name[len(prefix):].split("-")[0]
        if stale.is_dir() and not (pid.isdigit() and process_alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)


def check_not_a_weights_file(checkpoint_path: Path) -> None:
    """A ``save_pretrained`` weights file (``model.safetensors``, ``pytorch_model.bin``, a shard) given where a Lightning
    ``.ckpt`` or a folder is expected: the converter reads the folder, with its config.json."""
    name = checkpoint_path.name
    if checkpoint_path.suffix == ".safetensors" or name.startswith("pytorch_model") or name.endswith(".index.json"):
        raise ConversionError(f"--checkpoint_path {checkpoint_path} is a weights file of a save_pretrained folder; pass "
                              f"the folder that holds it and its config.json ({checkpoint_path.parent}).")


def expand_user_paths(args):
    """``args`` with a leading ``~`` of every option expanded: ``--checkpoint_path=~/ckpt`` reaches us with its ``~``
    (no shell expands it after "=")."""
    for name, value in vars(args).items():
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
    return args


def check_base_model_id(base_model_id: str | None) -> None:
    """``--base_model_id``: the Hub repository id of the model the converted weights build on, which the model card
    names as its ``base_model`` (the Hub's model tree); the weights themselves come from ``--base_model_path``."""
    from ..hub import looks_like_local_path

    if base_model_id is not None and (not isinstance(base_model_id, str) or looks_like_local_path(base_model_id)):
        raise ConversionError(
            f"--base_model_id {base_model_id!r}: expected a Hub repository id such as 'meta-llama/Llama-2-7b-chat-hf' "
            "(the card names it as the base model; the local folder of its weights is --base_model_path)."
        )


def add_base_model_id_argument(parser, base_model: str) -> None:
    """A converter's ``--base_model_id`` option (see :func:`check_base_model_id`)."""
    parser.add_argument("--base_model_id", default=None, metavar="HUB_ID",
                        help=f"Hub id of {base_model}: the model card names it as its base_model (default: none).")


def check_push_target(repo_id: str | None) -> None:
    """Before converting, what ``--push_to_hub REPO_ID`` needs: a valid repository id, the Hub online and reachable,
    a login (a conversion of minutes must not end in a network error)."""
    if repo_id is None:
        return
    from huggingface_hub import get_token

    from ..hub import _REPO_ID, hub_is_offline, hub_reachable

    if not _REPO_ID.match(repo_id) or "/" not in repo_id:
        raise ConversionError(f"--push_to_hub {repo_id!r} is not a Hub repository id; expected 'namespace/name'.")
    if hub_is_offline():
        raise ConversionError("--push_to_hub: HF_HUB_OFFLINE is set; unset it, or convert without --push_to_hub and "
                              "upload later with `longreach push`.")
    if not hub_reachable():
        raise ConversionError("--push_to_hub: the Hub cannot be reached from this machine; convert without it and "
                              "upload later with `longreach push`.")
    if get_token() is None:
        raise ConversionError("--push_to_hub: not logged in to the Hub; run `hf auth login` or set HF_TOKEN.")


@contextmanager
def staged_output(output: Path) -> Iterator[Path]:
    """Yield a hidden folder to write into; when the block succeeds, its files become ``output``, and when it fails
    (an exception, Ctrl-C, or SIGTERM: a scheduler's time limit, ``docker stop``) it is removed.

    A new ``output`` is a sibling folder renamed into place. An existing (empty) ``output`` folder is kept, with its
    mount (a container's volume: a rename over it fails), mode and group: the staging folder is made inside it, and
    its files are moved into it at the end, ``config.json`` last (a folder without one does not load).
    """
    keep_folder = output.is_dir()
    created = [] if keep_folder else [folder for folder in [output.parent, *output.parent.parents]
                                      if not folder.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    prefix = _STAGING_PREFIX if keep_folder else f".{output.name}{_STAGING_PREFIX}"
    staging = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=output if keep_folder else output.parent))
    umask = os.umask(0)
    os.umask(umask)
    # mkdtemp makes it private; the converted folder gets the usual permissions (and in a setgid folder, its group)
    staging.chmod((0o777 & ~umask) | (staging.parent.stat().st_mode & stat.S_ISGID))
    previous_handler = _exit_on_sigterm()
    try:
        yield staging
        for path in staging.rglob("*"):
            if path.is_file() and not path.is_symlink():
                path.chmod(0o666 & ~umask)  # as other files are made (safetensors writes its weights 0600)
        if keep_folder:
            for name in sorted(os.listdir(staging), key=lambda name: name == "config.json"):
                os.replace(staging / name, output / name)
            staging.rmdir()
        else:
            os.rename(staging, output)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # the parent folders this conversion made, innermost first, if still empty
            try:
                folder.rmdir()
            except OSError:
                break
        if disk_full(error):  # not a traceback naming the staging folder
            raise ConversionError(f"No space left on device while writing the converted checkpoint to {output}; "
                                  "nothing was written there: free some space or choose a folder on another disk."
                                  ) from error
        raise
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)


def _exit_on_sigterm():
    """In the main thread: SIGTERM raises ``SystemExit(143)`` (so that the staging folder is removed, as on Ctrl-C);
    returns the handler it replaced, or None where none was installed."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, terminate)
    return previous if previous is not None else signal.SIG_DFL


def find_local_tokenizer(*candidates: str | os.PathLike | None) -> str | None:
    """The first of ``candidates`` (folders, or files whose folder is used) that holds tokenizer files."""
    names = ("tokenizer.json", "tokenizer.model", "spiece.model", "tokenizer_config.json")
    for candidate in candidates:
        if candidate is None:
            continue
        folder = Path(candidate) if Path(candidate).is_dir() else Path(candidate).parent
        if any((folder / name).is_file() for name in names):
            return str(folder)
    return None


def tensor_fingerprint(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """``(dtype, shape, SHA-256 of the bytes)``: equal fingerprints mean bit-identical tensors, and comparing them
    needs neither tensor to be kept."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(data.numpy()).hexdigest()


def verify_tensors(model: torch.nn.Module, expected: dict[str, tuple], source: str) -> None:
    """Every tensor fingerprinted in ``expected`` (:func:`tensor_fingerprint`) must be in ``model``, bit-identical
    (dtype, shape and value)."""
    state_dict = model.state_dict()
    problems = []
    for key, fingerprint in expected.items():
        if key not in state_dict:
            problems.append(f"{key}: missing after reload")
        elif tensor_fingerprint(state_dict[key]) != fingerprint:
            problems.append(f"{key}: differs after reload")
    if problems:
        raise ConversionError(f"Verification of {source} failed:\n" + "\n".join(problems))


@dataclass
class ConvertedModel:
    """A converted model and the tensors it was loaded from, handed to :func:`finish_conversion` as their only
    holder: it releases them once the model is saved, before the saved folder is reloaded (a converter that kept a
    reference would hold the model twice at the reload)."""

    model: torch.nn.Module | None
    tensors: dict[str, torch.Tensor] | None

    def release(self) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        model, tensors, self.model, self.tensors = self.model, self.tensors, None, None
        if model is None or tensors is None:
            raise RuntimeError("this ConvertedModel was already released")
        return model, tensors


def finish_conversion(
    converted_model: ConvertedModel,
    output: Path,
    *,
    card_name: str,
    source: str,
    tokenizer_name_or_path: str | None = None,
    push_to_hub: str | None = None,
    reload_kwargs: dict | None = None,
    extra_check=None,
    base_model: str | None = None,
):
    """The common end of every converter; returns the reloaded model.

    Saves the model of ``converted_model`` Hub-ready into ``output`` (safetensors, code files, ``auto_map``), adds the
    tokenizer if given and the model card, releases the model, reloads the folder with ``from_pretrained`` and checks
    every converted tensor bit for bit by its SHA-256 (plus ``extra_check(reloaded)`` if given) *before* anything is
    reported or uploaded; then pushes in one commit if asked. ``base_model`` (a Hub id) is named in the card.
    """
    from ..hub import pretrained_location, push_folder_to_hub, write_model_card

    tokenizer = None
    if tokenizer_name_or_path is not None:  # before anything is written: a tokenizer that cannot be had stops here
        from transformers import AutoTokenizer

        try:
            location = pretrained_location(tokenizer_name_or_path, "--tokenizer_name_or_path")
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_name_or_path, **location)
        except (OSError, ValueError) as error:
            message = one_line(error, limit=500)
            if not message.startswith("--tokenizer_name_or_path"):  # pretrained_location's errors name it already
                message = f"--tokenizer_name_or_path {tokenizer_name_or_path}: {message}"
            raise ConversionError(message) from error
    else:
        logger.warning("No tokenizer given or found beside the checkpoint: the folder holds no tokenizer, so the "
                       "pipeline and `longreach summarize` will need one (--tokenizer).")
    with staged_output(output) as staging:
        model, converted = converted_model.release()
        model_class = type(model)
        fingerprints = {key: tensor_fingerprint(tensor) for key, tensor in converted.items()}
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        write_model_card(staging, card_name, converted_from=source, base_model=base_model)
        del model, converted
        gc.collect()  # the model is gone before its saved copy is loaded: one copy at a time
        reloaded = model_class.from_pretrained(staging, **(reload_kwargs or {}))
        verify_tensors(reloaded, fingerprints, source=str(output))
        if extra_check is not None:
            extra_check(reloaded)
    logger.info("Converted %s -> %s: %d tensors verified.", source, output, len(fingerprints))
    if push_to_hub:  # one commit: weights, code files, tokenizer and the model card, as verified above
        push_folder_to_hub(output, push_to_hub)
    return reloaded


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
