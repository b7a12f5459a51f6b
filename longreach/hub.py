"""Model cards and Hub uploads for longreach checkpoints.

Model cards are rendered with ``huggingface_hub``'s ``ModelCard`` / ``ModelCardData`` from the Jinja templates in
``longreach/model_card_templates/`` (one per model family). The converters call :func:`write_model_card` on every
folder they write; ``longreach model-cards`` regenerates the reference cards in ``model_cards/``.

Uploads: transformers' ``push_to_hub`` replaces ``README.md`` with the remote card or a generic one, and pushes the
tokenizer in a separate commit. :func:`push_model_to_hub` (which ``model.push_to_hub(repo_id, tokenizer=tok)`` calls
for every longreach model) and :func:`push_folder_to_hub` instead upload, in one commit, exactly what a Hub user needs:

* ``config.json`` with ``auto_map`` and ``custom_pipelines["summarization"]``, and ``generation_config.json``;
* the flat code files the config points to (``modeling_*.py``, ``configuration_*.py``, their sibling imports and
  ``pipeline_summarization.py``);
* the weights as safetensors (pickled weights are refused);
* the tokenizer files, if any;
* our model card as ``README.md``.

Everything else in a folder (``training_args.bin``, optimizer states, ``checkpoint-*`` folders, logs) stays local.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError
from transformers.dynamic_module_utils import get_relative_imports

logger = logging.getLogger(__name__)

#: Namespace of the reference cards in ``model_cards/`` (the repositories the converted checkpoints are published to).
HUB_NAMESPACE = "longreach"

#: Files a Hub user needs, besides the code files named by ``auto_map`` / ``custom_pipelines`` (and their imports).
WEIGHT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "spiece.model",
    "tokenizer.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json",
)
#: Where a tokenizer saves its named chat templates besides the default one (transformers' ``CHAT_TEMPLATE_DIR``).
CHAT_TEMPLATES_FOLDER = "additional_chat_templates"
README = "README.md"

_MARKER = re.compile(r"<!-- longreach-model-card (?P<json>\{.*?\}) -->")


@dataclass(frozen=True)
class ModelCardInfo:
    """What a family's model card says about itself (the rest lives in its template)."""

    template: str
    model_type: str
    license: str
    pipeline_tag: str
    tags: tuple[str, ...]
    default_repo_name: str


MODEL_CARDS: dict[str, ModelCardInfo] = {
    "locost": ModelCardInfo(
        template="locost.md",
        model_type="locost",
        # Neither the authors' repository nor their Hub release states a license (checked): "unknown", see the card.
        license="unknown",
        pipeline_tag="summarization",
        tags=("summarization", "long-document", "state-space-model", "s4d", "t5", "locost", "longreach", "custom_code"),
        default_repo_name="locost-gsg-pretrained",
    ),
    "vcc_t5": ModelCardInfo(
        template="vcc_t5.md",
        model_type="vcc_t5",
        license="apache-2.0",  # the authors' code (awslabs/vip-token-centric-compression) is Apache-2.0
        pipeline_tag="summarization",
        tags=("summarization", "long-document", "t5", "token-compression", "vcc", "longreach", "custom_code"),
        default_repo_name="vcc-t5-base",
    ),
    "dodo_llama": ModelCardInfo(
        template="dodo_llama.md",
        model_type="dodo_llama",
        # The authors' Dodo code has no LICENSE file and no released weights; the base model's license applies too.
        license="unknown",
        pipeline_tag="text-generation",
        tags=("text-generation", "llama", "context-compression", "lora", "peft", "dodo", "summarization", "longreach",
              "custom_code"),
        default_repo_name="dodo-llama",
    ),
}

#: Other names accepted for a family (CLI sub-commands, converter names, model types).
ALIASES = {"vcc": "vcc_t5", "vcc-t5": "vcc_t5", "dodo": "dodo_llama", "dodo-llama": "dodo_llama"}


def card_key(model_name: str) -> str:
    """``"locost"``, ``"vcc_t5"`` or ``"dodo_llama"`` for a family name, alias or ``config.model_type``."""
    key = ALIASES.get(model_name, model_name)
    if key not in MODEL_CARDS:
        raise ValueError(
            f"`model_name` must be one of {sorted(MODEL_CARDS)} (or {sorted(ALIASES)}), got {model_name!r}."
        )
    return key


def _longreach_version() -> str:
    try:
        return metadata.version("longreach")
    except metadata.PackageNotFoundError:  # running from a checkout that is not installed
        return "unknown"


def build_model_card(
    model_name: str,
    repo_id: str | None = None,
    converted_from: str | None = None,
    training_note: str | None = None,
    tags: list[str] | None = None,
    base_model: str | None = None,
) -> ModelCard:
    """Render the model card of a family.

    Args:
        model_name: ``"locost"``, ``"vcc_t5"``/``"vcc"`` or ``"dodo_llama"``/``"dodo"``.
        repo_id: the Hub repository the card is published with; its usage code loads from there. Default:
            ``longreach/<default name>``.
        converted_from: the original checkpoint the weights were converted from (written by the converters).
        training_note: a paragraph on how these weights were trained (the demo and examples use it).
        tags: extra Hub tags.
        base_model: the checkpoint these weights were fine-tuned from; a Hub repository id becomes the card's
            ``base_model`` (with ``base_model_relation: finetune``), a local path is not named in the metadata.
    """
    key = card_key(model_name)
    info = MODEL_CARDS[key]
    state = {"model": key, "repo_id": repo_id, "converted_from": converted_from, "training_note": training_note,
             "tags": list(tags or [])}
    if base_model is not None:  # (only then: the cards written without one keep their marker, and so their digest)
        state["base_model"] = base_model
    on_the_hub = base_model is not None and not looks_like_local_path(base_model)
    card_data = ModelCardData(
        license=info.license,
        library_name="transformers",
        pipeline_tag=info.pipeline_tag,
        tags=list(dict.fromkeys([*info.tags, *(tags or [])])),
        metrics=["rouge"] if info.pipeline_tag == "summarization" else None,
        model_name=(repo_id or info.default_repo_name).split("/")[-1],
        base_model=base_model if on_the_hub else None,
        base_model_relation="finetune" if on_the_hub else None,
    )
    template = resources.files("longreach").joinpath("model_card_templates", info.template).read_text(encoding="utf-8")
    marker = f"<!-- longreach-model-card {json.dumps(state, sort_keys=True)} -->"
    card = ModelCard.from_template(
        card_data,
        template_str=template,
        repo_id=repo_id or f"{HUB_NAMESPACE}/{info.default_repo_name}",
        converted_from=converted_from,
        training_note=training_note,
        longreach_version=_longreach_version(),
        marker=marker,
    )
    # the digest of the text as rendered tells an unedited card from a hand-edited one even after the templates or
    # the version it names have changed (a fresh rendering would then differ from it)
    state_with_digest = {**state, "sha256": _card_digest(str(card))}
    digested = f"<!-- longreach-model-card {json.dumps(state_with_digest, sort_keys=True)} -->"
    return ModelCard(str(card).replace(marker, digested, 1))


def _card_digest(text: str) -> str:
    """SHA-256 of a card's text without its longreach marker (which holds the digest)."""
    return hashlib.sha256(_MARKER.sub("", text, count=1).encode("utf-8")).hexdigest()


def card_is_unedited(readme: str | Path) -> bool:
    """Whether the longreach card ``readme`` is as it was rendered: by its recorded digest, or, for a card written
    before digests were recorded, by a fresh rendering with the same parameters."""
    return _text_is_unedited(Path(readme).read_text(encoding="utf-8"))


def _text_is_unedited(text: str) -> bool:
    """:func:`card_is_unedited` for a card's text."""
    state = _read_marker(text)
    if state is None:
        return False
    if "sha256" in state:
        return _card_digest(text) == state["sha256"]
    unedited = build_model_card(state["model"], state.get("repo_id"), state.get("converted_from"),
                                state.get("training_note"), state.get("tags"), state.get("base_model"))
    return _MARKER.sub("", text, count=1) == _MARKER.sub("", str(unedited), count=1)


def write_model_card(
    output_folder: str | Path,
    model_name: str,
    converted_from: str | None = None,
    repo_id: str | None = None,
    training_note: str | None = None,
    tags: list[str] | None = None,
    base_model: str | None = None,
) -> Path:
    """Write the family's model card as ``output_folder/README.md`` (converters call this). Returns its path.

    Written under a temporary name and renamed into place; a ``README.md`` there that is not a longreach card (the
    user's own), or a longreach card edited by hand since it was written, is refused with a ``ValueError``, not
    replaced."""
    card = build_model_card(model_name, repo_id, converted_from, training_note, tags, base_model)
    path = Path(output_folder) / README
    if path.exists() and read_card_state(path) is None:
        raise ValueError(f"{path} exists and is not a longreach model card; move it away (it would be replaced).")
    if path.exists() and not card_is_unedited(path):  # as a push keeps it, and `longreach model-cards` refuses it
        raise ValueError(f"{path} is a longreach model card edited by hand since it was generated; writing a new one "
                         "would lose the edits: move it away.")
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(str(card), encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def write_reference_model_cards(output_dir: str | Path = "model_cards") -> list[Path]:
    """(Re)generate ``model_cards/locost.md``, ``vcc_t5.md`` and ``dodo_llama.md`` from the templates.

    Each card is written under a temporary name and renamed into place; a file of that name that is not a longreach
    card (someone's own notes) is refused with a ``ValueError`` before anything is written."""
    output_dir = Path(output_dir).expanduser()
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"`output_dir` {str(output_dir)!r} is a file; pass a folder (it is created).")
    paths = [output_dir / f"{key}.md" for key in MODEL_CARDS]
    foreign = [path.name for path in paths if path.exists() and read_card_state(path) is None]
    if foreign:
        raise ValueError(f"`output_dir` {str(output_dir)!r} holds {', '.join(foreign)}, which are not longreach model "
                         "cards; move them away or pass another folder.")
    edited = [path.name for path in paths if path.exists() and not card_is_unedited(path)]
    if edited:  # (as push keeps a hand-edited card instead of rendering it again)
        raise ValueError(f"`output_dir` {str(output_dir)!r} holds {', '.join(edited)}, edited by hand since they were "
                         "generated; regenerating would lose the edits: move them away or pass another folder.")
    output_dir.mkdir(parents=True, exist_ok=True)
    for key, path in zip(MODEL_CARDS, paths):
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            temporary.write_text(str(build_model_card(key)), encoding="utf-8")
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    return paths


def read_card_state(readme: str | Path) -> dict | None:
    """The parameters a longreach card was rendered with, or ``None`` if ``readme`` is not a longreach card."""
    path = Path(readme)
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # not one of ours (we write UTF-8), and not text this library could keep either
        raise ValueError(f"{path} is not UTF-8 text, so not a longreach model card; move it away.") from None
    marker = _read_marker(text)
    if marker is not None:
        marker.pop("sha256", None)  # the text's digest (see `card_is_unedited`), not a parameter
    return marker


def _read_marker(text: str) -> dict | None:
    match = _MARKER.search(text)
    return json.loads(match.group("json")) if match else None


# ---------------------------------------------------------------------------------------------------------------------
# Uploads
# ---------------------------------------------------------------------------------------------------------------------


def _code_files(folder: Path, config: dict) -> set[str]:
    """The ``.py`` files the config points to, and (recursively) the sibling modules they import, as transformers'
    remote-code loader finds them; a missing one is named in a ValueError."""
    entry_points = list((config.get("auto_map") or {}).values())
    entry_points += [task["impl"] for task in (config.get("custom_pipelines") or {}).values() if "impl" in task]
    pending = [reference.split("--")[-1].rsplit(".", 1)[0] + ".py" for reference in entry_points]
    found = set()
    while pending:
        name = pending.pop()
        if name in found:
            continue
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{folder} lacks the code file {name!r} that config.json or another code file needs.")
        found.add(name)
        pending += [f"{module}.py" for module in get_relative_imports(path)]  # what the remote-code loader follows
    return found


def hub_files(folder: str | Path) -> list[str]:
    """Names of the files :func:`push_folder_to_hub` uploads from ``folder`` (``README.md`` excluded: it is
    generated), after checking that the folder is a complete Hub-ready longreach checkpoint."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"`folder` must hold a saved model (config.json); {folder} has none.")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path} is not valid JSON ({error}).") from None
    auto_map = config.get("auto_map") or {}
    if "AutoConfig" not in auto_map or "summarization" not in (config.get("custom_pipelines") or {}):
        raise ValueError(
            f"{config_path} has no `auto_map`/`custom_pipelines`: the folder was not written by a longreach model's "
            "save_pretrained, so Hub users could not load it with trust_remote_code=True. Load and re-save it with "
            "longreach first."
        )
    names = {path.name for path in folder.iterdir() if path.is_file()}
    weights = {name for name in names if any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_PATTERNS)}
    if not any(name.endswith(".safetensors") for name in weights):
        raise ValueError(
            f"{folder} holds no safetensors weights (found: {sorted(names)}); only safetensors are uploaded."
        )
    for index in sorted(name for name in weights if name.endswith(".index.json")):  # a sharded checkpoint
        try:
            shards = set(json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"].values())
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{folder / index} is not a shard index (no `weight_map`).") from None
        missing = sorted(shards - names)
        if missing:  # a folder still being written or copied: the repository could not be loaded
            raise ValueError(f"{folder / index} names shards that are not in {folder}: {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''}; upload a complete checkpoint.")
    selected = weights | (names & set(CONFIG_FILES)) | (names & set(TOKENIZER_FILES)) | _code_files(folder, config)
    templates = folder / CHAT_TEMPLATES_FOLDER  # the tokenizer's named chat templates ("tool_use", ...)
    selected |= {f"{CHAT_TEMPLATES_FOLDER}/{path.name}" for path in templates.glob("*.jinja") if path.is_file()}
    if not names & set(TOKENIZER_FILES):
        logger.warning(
            "%s has no tokenizer files: Hub users will need to bring their own tokenizer, and "
            "pipeline('summarization', ...) will not work from this repository alone.", folder
        )
    left_out = sorted((names - selected) - {README})
    if left_out:
        logger.info("Not uploaded (not needed to use the model): %s", ", ".join(left_out))
    return sorted(selected)


def stale_code_files(folder: str | Path, names: list[str], model_type: str | None) -> list[str]:
    """The code files among ``names`` in ``folder`` whose text differs from what the installed longreach writes for a
    ``model_type`` model (a folder saved by another version, or edited by hand)."""
    from . import DodoLlamaForCausalLM, LocostForConditionalGeneration, VCCT5ForConditionalGeneration
    from .modeling.remote_code import collect_flat_sources
    from .pipelines import pipeline_summarization

    classes = {cls.config_class.model_type: cls for cls in (
        LocostForConditionalGeneration, VCCT5ForConditionalGeneration, DodoLlamaForCausalLM)}
    if model_type not in classes:
        return []
    model_class = classes[model_type]
    installed = collect_flat_sources([model_class.__module__, model_class.config_class.__module__,
                                      pipeline_summarization.__name__])
    folder = Path(folder)
    return sorted(name for name in names if name in installed
                  and (folder / name).read_text(encoding="utf-8", errors="replace") != installed[name])


def _card_for_upload(folder: Path, config: dict, repo_id: str, tags: list[str] | None) -> str:
    """Our model card for ``repo_id``: the folder's longreach card re-rendered for the repository (unless it was
    edited by hand, then it is kept as it is), or a new one for the model family."""
    readme = folder / README
    state = read_card_state(readme)
    if state is not None:
        if not card_is_unedited(readme):
            logger.info("Keeping the hand-edited model card %s.", readme)
            return readme.read_text(encoding="utf-8")
        return str(build_model_card(
            state["model"], repo_id, state.get("converted_from"), state.get("training_note"),
            list(dict.fromkeys([*(state.get("tags") or []), *(tags or [])])), state.get("base_model"),
        ))
    if readme.is_file():
        logger.warning("Replacing %s, which is not a longreach model card, with the %s card.", readme,
                       config.get("model_type"))
    return str(build_model_card(config.get("model_type", ""), repo_id, tags=tags))


# ---------------------------------------------------------------------------------------------------------------------
# Where a name points: a local folder or the Hub (checked before transformers retries the network)
# ---------------------------------------------------------------------------------------------------------------------

#: ``name`` or ``owner/name``: what the Hub accepts as a repository id.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class HubAccessError(ValueError):
    """A model, tokenizer or upload target cannot be reached; the message is one line that says what to do."""


def looks_like_local_path(name: str) -> bool:
    """True for anything that is clearly a path, never a Hub repository id: it exists, starts with ``.``, ``/`` or
    ``~``, contains a backslash or more than one ``/``, or is not a valid repository id."""
    return (Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or "\\" in name
            or not _REPO_ID.match(name))


def hub_is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the Hub's endpoint (``HF_ENDPOINT``): seconds, where a failing download retries for half a
    minute."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name), str)
               for name in ("config.json", "tokenizer_config.json", "tokenizer.json"))


def pretrained_location(name_or_path: str, what: str = "model") -> dict:
    """Check ``name_or_path`` before ``from_pretrained`` looks for it, and return the extra ``from_pretrained``
    keyword arguments (``{"local_files_only": True}`` for a Hub id found only in the local cache).

    A local path is never sent to the Hub: if it does not exist, the error says so at once. A Hub id is looked up
    offline (``HF_HUB_OFFLINE=1``) or when the Hub cannot be reached in the local cache; if it is not there, the
    error says so at once instead of after the download's retries. Raises :class:`HubAccessError`.
    """
    path = Path(name_or_path).expanduser()
    if looks_like_local_path(name_or_path):
        if not path.exists():
            raise HubAccessError(f"{what} {name_or_path!r}: no such file or folder (a local path, so the Hub was not "
                                 "asked); check the path.")
        return {}
    if hub_is_offline() or not hub_reachable():
        if _in_hub_cache(name_or_path):
            return {"local_files_only": True}
        reason = "HF_HUB_OFFLINE is set" if hub_is_offline() else "the Hub cannot be reached"
        raise HubAccessError(f"{what} {name_or_path!r} is not a local folder, {reason} and it is not in the local "
                             "cache: pass a local folder, or connect and retry.")
    return {}


def push_folder_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    tags: list[str] | None = None,
):
    """Upload a saved longreach checkpoint (model + optional tokenizer) with our model card, in one commit.

    Returns the ``CommitInfo`` of the commit. Raises ValueError if the folder is not Hub-ready (see
    :func:`hub_files`).
    """
    folder = Path(folder)
    names = hub_files(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    stale = stale_code_files(folder, names, config.get("model_type"))
    if stale:
        logger.warning(
            "%s: the code files %s differ from those longreach %s writes (the folder was saved by another version): "
            "Hub users will run the folder's code. To upload this version's code, load the model with longreach and "
            "save_pretrained it again first.", folder, ", ".join(stale), _longreach_version()
        )

    api = HfApi(token=token, library_name="longreach", library_version=_longreach_version())
    # the full id ("someone/name" for "name"): the card's code must name the repository users will load
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):  # a new branch is made, as transformers does
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    card = _card_for_upload(folder, config, repo_id, tags)
    if read_card_state(folder / README) is None or card_is_unedited(folder / README):  # a local edit comes first
        remote = _remote_card(api, repo_id, revision)
        if remote is not None and _read_marker(remote) is not None and not _text_is_unedited(remote):
            logger.warning("Keeping the model card of %s, edited by hand since longreach generated it (as "
                           "transformers' push_to_hub keeps the repository's card).", repo_id)
            card = remote
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in names]
    operations.append(CommitOperationAdd(path_in_repo=README, path_or_fileobj=card.encode("utf-8")))
    return api.create_commit(
        repo_id=repo_id,
        operations=operations,
        commit_message=commit_message or f"Upload {config.get('model_type', 'model')} with longreach",
        commit_description=commit_description,
        revision=revision,
        create_pr=create_pr,
    )


def _remote_card(api: HfApi, repo_id: str, revision: str | None) -> str | None:
    """The text of the repository's ``README.md`` at ``revision``, or ``None`` where it has none."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = api.hf_hub_download(repo_id, README, revision=revision, local_dir=tmp)
        except (EntryNotFoundError, RevisionNotFoundError):
            return None
        return Path(path).read_text(encoding="utf-8", errors="replace")


def push_model_to_hub(
    model,
    repo_id: str,
    *,
    tokenizer=None,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | None = None,
    **push_kwargs,
):
    """Save ``model`` (and ``tokenizer``) Hub-ready to a temporary folder and upload it with :func:`push_folder_to_hub`.

    The model card is the one of the folder the model was loaded from, when that is a longreach card (so a converted
    checkpoint keeps its provenance), else a new card for the model's family.
    """
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        source = Path(str(getattr(model, "name_or_path", "") or ""))
        if source.is_dir() and read_card_state(source / README) is not None:
            (Path(tmp) / README).write_text((source / README).read_text(encoding="utf-8"), encoding="utf-8")
        return push_folder_to_hub(tmp, repo_id, tags=tags, **push_kwargs)
