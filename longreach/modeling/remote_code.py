"""Hub-ready saving: every folder written by ``save_pretrained`` loads where ``longreach`` is not installed.

transformers' remote-code loader (``trust_remote_code=True``) only follows *single-dot sibling* imports
(``from .t5_blocks import T5Block``) of the files that sit next to ``config.json``. Our package has sub-packages
(``longreach/configuration``, ``longreach/modeling``, ``longreach/pipelines``), so its modules import each other
with ``..`` imports. On save we therefore write *flat copies* of every module a model needs, with each
package-relative import rewritten to a sibling import, and we fill ``config.auto_map`` (AutoConfig, AutoModel and
the task class) and ``config.custom_pipelines["summarization"]``.

This module is itself copied into checkpoints (the models import it), so it only imports the standard library and
transformers. It works in both worlds: from the installed package, and from a flat copy loaded as remote code (then
every import is already a sibling import and the rewrite is the identity).
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

# `from <dots><dotted.name> import ...` at the start of a line (multi-line import lists only change what follows).
_RELATIVE_IMPORT = re.compile(r"^(?P<head>[ \t]*from[ \t]+)(?P<dots>\.+)(?P<name>[\w.]*)(?P<tail>[ \t]+import\b)", re.M)

#: The summarization pipeline's class (see :func:`_pipeline_module_for` for its module).
PIPELINE_CLASS = "LongSummarizationPipeline"
#: ``save_pretrained(..., push_to_hub=True, **options)``: the options that belong to the upload (as in transformers).
_PUSH_OPTIONS = ("repo_id", "commit_message", "commit_description", "token", "private", "revision", "create_pr", "tags")


def _resolve_relative(module_name: str, dots: str, name: str, is_package: bool) -> str:
    """Absolute module name of ``from <dots><name> import ...`` written inside ``module_name``."""
    package = module_name if is_package else module_name.rpartition(".")[0]
    return importlib.util.resolve_name(dots + name, package)


def _module_file(module_name: str) -> Path:
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    if getattr(module, "__file__", None) is None:
        raise ValueError(f"Cannot export module {module_name!r} as remote code: it has no source file.")
    return Path(module.__file__)


def collect_flat_sources(root_modules: list[str]) -> dict[str, str]:
    """Source text of ``root_modules`` and everything they import relatively, as ``{file_name: flat source}``.

    Relative imports are rewritten to sibling imports (``from ..configuration.configuration_locost import X`` becomes
    ``from .configuration_locost import X``). Two different modules with the same file name would collide in the
    flat folder; that is refused rather than silently overwritten. Two copies of one file are not a collision: a
    model loaded as remote code has its configuration module loaded twice by transformers, once for ``AutoConfig``
    and once as the modeling module's sibling, from two folders of the modules cache.
    """
    sources: dict[str, str] = {}
    origin: dict[str, tuple[str, str]] = {}  # file name -> (module name, source text)
    pending = list(root_modules)
    while pending:
        module_name = pending.pop()
        path = _module_file(module_name)
        if path.name == "__init__.py":
            raise ValueError(f"Remote code cannot import a package ({module_name!r}); import its modules directly.")
        text = path.read_text(encoding="utf-8")
        if path.name in origin:
            first_name, first_text = origin[path.name]
            if first_name != module_name and first_text != text:
                raise ValueError(
                    f"Two modules would both be saved as {path.name!r}: {first_name!r} and {module_name!r}."
                )
            continue
        origin[path.name] = (module_name, text)

        def rewrite(match: re.Match) -> str:
            if not match.group("name"):
                raise ValueError(
                    f"{module_name}: `from {match.group('dots')} import ...` cannot be exported as remote code; "
                    "import the sibling module by name instead."
                )
            target = _resolve_relative(module_name, match.group("dots"), match.group("name"), is_package=False)
            pending.append(target)
            return f"{match.group('head')}.{target.rpartition('.')[2]}{match.group('tail')}"

        sources[path.name] = _RELATIVE_IMPORT.sub(rewrite, text)
    return sources


def _pipeline_module_for() -> str | None:
    """Module name of the summarization pipeline (installed, or a flat remote copy beside this module).

    The import is relative and written out on purpose: transformers copies every file that a remote-code module
    imports relatively (even inside a function) next to it, so a model loaded as remote code, where longreach is not
    installed, has the pipeline's file beside its own and saves it too (with ``custom_pipelines`` that still load)."""
    try:
        from ..pipelines.pipeline_summarization import LongSummarizationPipeline
    except ImportError:
        return None
    return LongSummarizationPipeline.__module__


def _own_class(model) -> type:
    """Our class that ``model`` was built from: the first class of its MRO whose module defines the classes that
    ``auto_map`` names. Skipped: FSDP2's ``FSDP<Name>`` (``fully_shard`` swaps an instance's class for it; its module is
    torch's) and subclasses written by the user (a notebook's cell has no source file, and a script's file is theirs,
    not code to upload); their folders load with our class, as a subclass of T5 loads as T5."""
    names = set(model._hub_auto_classes.values())
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if names and all(getattr(getattr(module, name, None), "__module__", None) == cls.__module__ for name in names):
            return cls
    raise ValueError(f"{type(model).__name__} is not built on a class of a longreach modeling module.")


#: The folders `Trainer` saves checkpoints in (transformers' `PREFIX_CHECKPOINT_DIR` + the step).
_TRAINER_CHECKPOINT = re.compile(r"^checkpoint-\d+$")


def _saving_a_trainer_checkpoint() -> bool:
    """Whether a `transformers.Trainer` (or a subclass) is saving a checkpoint: its `_save_checkpoint` is on the stack.
    (A `save_pretrained("checkpoint-1")` of the user's own writes nothing beside that folder.)"""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        caller = frame.f_locals.get("self")
        if frame.f_code.co_name == "_save_checkpoint" and isinstance(caller, trainer_module.Trainer):
            return True
        frame = frame.f_back
    return False


def _write_beside_trainer_output(output_dir: Path, sources: dict[str, str], auto_map: dict[str, str]) -> None:
    """The code files in a `Trainer`'s ``output_dir`` too, when it saves a ``checkpoint-N`` inside it.

    With ``push_to_hub=True`` the Trainer uploads ``output_dir`` at every save, after copying into it only the
    checkpoint's config, generation config and weights: the config's ``auto_map`` then names code files that the
    upload lacks, and the repository does not load with ``trust_remote_code=True`` until training ends. A file of the
    same name that is not ours (``output_dir`` holds no config.json mapping to these files) is never replaced."""
    config_file = output_dir / "config.json"
    ours = False
    if config_file.is_file():
        try:
            ours = (json.loads(config_file.read_text(encoding="utf-8")).get("auto_map") or {}) == auto_map
        except (ValueError, UnicodeDecodeError):
            ours = False
    kept = []
    for file_name, text in sources.items():
        target = output_dir / file_name
        if target.exists() and not ours and target.read_text(encoding="utf-8", errors="replace") != text:
            kept.append(file_name)
            continue
        write_text_atomically(target, text)
    if kept:
        warnings.warn(f"{output_dir} holds {', '.join(sorted(kept))}, not written by longreach: left as they are, so "
                      "an upload of that folder (Trainer's push_to_hub) may not load with trust_remote_code=True.",
                      UserWarning, stacklevel=3)


def write_text_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text``, or what it held before: never a half-written file."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


#: ``save_pretrained`` writes into a hidden folder inside the target, named this + PID + host + random.
_SAVE_STAGING_PREFIX = ".longreach-save-"
#: A weights shard, as transformers names them (``model-00001-of-00003.safetensors``).
_SHARD = re.compile(r"^(?P<stem>.+?)-\d{5}-of-\d{5}\.(safetensors|bin)$")


#: A staging folder untouched for this long is a killed save's, whatever machine made it (no save takes a day).
_STALE_AFTER_SECONDS = 24 * 3600


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a staging folder's owner)."""
    if os.name == "nt":  # os.kill(pid, 0) sends CTRL_C_EVENT there: counted alive (never taken for a dead one's)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_saves(folder: Path) -> None:
    """The staging folders that killed saves left in ``folder``: those of this machine whose process is gone, and
    any untouched for a day (a save killed on another machine or in another container)."""
    host, now = socket.gethostname(), time.time()
    for stale in folder.glob(f"{_SAVE_STAGING_PREFIX}*"):
        pid, _, rest = stale.name[len(_SAVE_STAGING_PREFIX):].partition("-")
        try:
            if not stale.is_dir():
                continue
            old = now - stale.stat().st_mtime > _STALE_AFTER_SECONDS
        except OSError:  # (removed meanwhile)
            continue
        if old or (pid.isdigit() and rest.startswith(f"{host}-") and not process_alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)


def _weights_stem(name: str) -> str | None:
    match = _SHARD.match(name)
    return match.group("stem") if match else (name.removesuffix(".safetensors") if name.endswith(".safetensors")
                                              else None)


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the disk is full: an ``OSError`` with ``ENOSPC``, or safetensors' ``SafetensorError``
    (not an ``OSError``), which a full disk raises while the weights are written ("... (os error 28)")."""
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    return type(error).__name__ == "SafetensorError" and f"(os error {errno.ENOSPC})" in str(error)


@contextmanager
def _staged_save(save_directory: Path):
    """Yield a hidden folder inside ``save_directory`` to save into; once the save is complete its files replace
    those of ``save_directory`` (weights first, ``config.json`` last) and the shards of an earlier save that the new
    one does not overwrite are removed, as transformers removes them, and so is an earlier save's other layout (its
    single file beside new shards, its index beside a new single file). A save that fails (a full disk, an exception,
    Ctrl-C) leaves the earlier checkpoint there as it was; one killed outright leaves the staging folder, which the
    next save into the folder removes."""
    save_directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_saves(save_directory)
    earlier = any(_weights_stem(name) is not None for name in os.listdir(save_directory))
    staging = Path(tempfile.mkdtemp(prefix=f"{_SAVE_STAGING_PREFIX}{os.getpid()}-{socket.gethostname()}-",
                                    dir=save_directory))
    try:
        try:
            yield staging
        except Exception as error:
            if not disk_full(error):
                raise
            kept = (" the checkpoint already there is kept as it was (saving over it needs room for both until the new "
                    "one is complete);" if earlier else " nothing was written under the names of its files;")
            raise OSError(errno.ENOSPC, f"No space left on device while saving to {save_directory}:{kept} free some "
                                        "space or save to another folder.") from error
        names = sorted(os.listdir(staging), key=lambda name: (name == "config.json", _weights_stem(name) is None))
        for name in names:
            os.replace(staging / name, save_directory / name)
        stems = {_weights_stem(name) for name in names} - {None}
        sharded = {match.group("stem") for name in names if (match := _SHARD.match(name))}
        # the other layout of the same weights: `from_pretrained` reads a single file before an index, so a single
        # file left beside a new sharded save would be loaded instead of it (transformers leaves it there)
        other_layout = {f"{stem}.safetensors" for stem in sharded} | {
            f"{stem}.safetensors.index.json" for stem in stems - sharded}
        for name in os.listdir(save_directory):
            match = _SHARD.match(name)
            stale = (match and match.group("stem") in stems) or name in other_layout
            if stale and name not in names and (save_directory / name).is_file():
                (save_directory / name).unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class HubReadyMixin:
    """Mixin for our ``PreTrainedModel`` classes: ``save_pretrained`` writes a folder that loads anywhere.

    Subclasses declare, as class attributes, which Auto classes map to which of their module's classes, and which
    Auto class the summarization pipeline loads (``None``: no pipeline entry)::

        _hub_auto_classes = {"AutoModel": "LocostModel", "AutoModelForSeq2SeqLM": "LocostForConditionalGeneration"}
        _hub_pipeline_auto_class = "AutoModelForSeq2SeqLM"
    """

    _hub_auto_classes: dict[str, str] = {}
    _hub_pipeline_auto_class: str | None = None

    def hub_auto_map(self) -> dict[str, str]:
        own = _own_class(self)
        config_module = own.config_class.__module__.rpartition(".")[2]
        model_module = own.__module__.rpartition(".")[2]
        auto_map = {"AutoConfig": f"{config_module}.{own.config_class.__name__}"}
        auto_map.update({auto: f"{model_module}.{name}" for auto, name in self._hub_auto_classes.items()})
        return auto_map

    def write_remote_code(self, save_directory: str | os.PathLike) -> list[str]:
        """Write flat code files into ``save_directory`` and record ``auto_map`` / ``custom_pipelines`` on the config.

        Returns the names of the files written. Called by :meth:`save_pretrained`; public so that tools that build
        a folder by hand (the converters) can call it too.
        """
        return self._write_remote_code(Path(save_directory), Path(save_directory))

    def _write_remote_code(self, folder: Path, save_directory: Path) -> list[str]:
        """:meth:`write_remote_code` into ``folder``, a save's staging folder (or ``save_directory`` itself)."""
        folder.mkdir(parents=True, exist_ok=True)
        own = _own_class(self)
        roots = [own.__module__, own.config_class.__module__]
        pipeline_module = _pipeline_module_for() if self._hub_pipeline_auto_class else None
        if pipeline_module is not None:
            roots.append(pipeline_module)
        sources = collect_flat_sources(roots)
        for file_name, text in sources.items():
            write_text_atomically(folder / file_name, text)
        if _TRAINER_CHECKPOINT.match(save_directory.name) and _saving_a_trainer_checkpoint():
            _write_beside_trainer_output(save_directory.parent, sources, self.hub_auto_map())

        self.config.auto_map = self.hub_auto_map()
        if pipeline_module is not None:
            self.config.custom_pipelines = {
                "summarization": {
                    "impl": f"{pipeline_module.rpartition('.')[2]}.{PIPELINE_CLASS}",
                    "pt": [self._hub_pipeline_auto_class],
                    "type": "text",
                }
            }
        return sorted(sources)

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        """Like ``PreTrainedModel.save_pretrained``, plus the code files, ``auto_map`` and ``custom_pipelines``.

        ``push_to_hub=True`` saves locally first and then uploads through :meth:`push_to_hub` (with the same
        ``max_shard_size``), so that the code files written here are part of the upload. As in transformers, a process
        that does not save (``is_main_process=False``, or not rank 0 of ``torch.distributed``) writes and uploads
        nothing.

        Unlike transformers' (which writes the weights over those of an earlier save), it never loses a checkpoint
        already in ``save_directory``: everything is written into a hidden folder inside it first and moved into
        place once complete (see :func:`_staged_save`).
        """
        if os.path.isfile(save_directory):
            raise ValueError(f"`save_directory` must be a directory, got the file {save_directory!r}.")
        hub_kwargs = {key: kwargs.pop(key) for key in _PUSH_OPTIONS if key in kwargs}
        if "max_shard_size" in kwargs:
            hub_kwargs["max_shard_size"] = kwargs["max_shard_size"]
        is_main_process = args[0] if args else kwargs.get("is_main_process", True)
        saving = getattr(self, "should_save_on_this_rank", lambda main: main)(is_main_process)
        if not saving or kwargs.get("distributed_checkpoint"):  # other ranks write nothing; DCP: every rank its part
            if saving:
                self._write_remote_code(Path(save_directory), Path(save_directory))
            result = super().save_pretrained(save_directory, *args, **kwargs)
        else:
            with _staged_save(Path(save_directory)) as staging:
                self._write_remote_code(staging, Path(save_directory))
                result = super().save_pretrained(staging, *args, **kwargs)
        if push_to_hub and saving:
            repo_id = hub_kwargs.pop("repo_id", Path(save_directory).name)
            self.push_to_hub(repo_id, **hub_kwargs)
        return result

    def push_to_hub(self, repo_id: str, *, tokenizer=None, **kwargs):
        """Upload the model, its code files, ``tokenizer`` (optional) and *our* model card, in one commit.

        transformers' ``push_to_hub`` would replace ``README.md`` with the remote card or a generic one; with longreach
        installed this goes through ``longreach.hub.push_model_to_hub`` instead (same keyword arguments:
        ``commit_message``, ``private``, ``token``, ``revision``, ``create_pr``, ``max_shard_size``, ``tags``). A flat
        copy loaded as remote code, where longreach is not installed, falls back to transformers' upload (which keeps
        the card already on the Hub) and pushes the tokenizer after it.
        """
        hub = _installed_hub_module()
        if hub is not None:
            return hub.push_model_to_hub(self, repo_id, tokenizer=tokenizer, **kwargs)
        result = super().push_to_hub(repo_id, **kwargs)
        if tokenizer is not None:
            tokenizer.push_to_hub(repo_id, **{k: v for k, v in kwargs.items() if k in ("token", "revision", "create_pr")})
        return result


def _installed_hub_module():
    """``longreach.hub`` when this module is the installed ``longreach.modeling.remote_code``, else ``None``.

    Looked up by name at call time (not imported at the top), so that flat copies stay free of absolute imports of our
    package and work where it is not installed.
    """
    suffix = ".modeling.remote_code"
    if not __name__.endswith(suffix):
        return None
    try:
        return importlib.import_module(__name__[: -len(suffix)] + ".hub")
    except ImportError:
        return None
