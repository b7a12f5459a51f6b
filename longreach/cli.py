"""The ``longreach`` command.

    longreach demo [--output_dir DIR]                      train, evaluate, save and reload a small LOCOST (offline)
    longreach convert {locost,vcc,dodo} OPTIONS...          convert an original checkpoint (the converter's options)
    longreach summarize --model PATH_OR_REPO FILE           summarize a text file ("-": stdin) with any longreach model
    longreach summarize --model M --input SRC --output OUT.jsonl
                                                            summarize a corpus (folder, jsonl/csv/parquet, Hub dataset)
    longreach push FOLDER REPO_ID                           upload a saved checkpoint with its code, tokenizer and card
    longreach model-cards [--output_dir model_cards]        regenerate the reference model cards from the templates

Progress goes to stderr, results to stdout. A mistake gets one line on stderr that names it and the fix, exit code 2
for usage errors and 1 for failures; ``--debug`` shows the traceback instead (a bare ``longreach`` or ``longreach
convert`` prints its usage). A corpus run that finished with documents it could not summarize (``OUT.errors.jsonl``)
exits with code 3, so that a script or scheduler sees that ``OUT`` is not complete. ``--version`` prints the version.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

#: A corpus run finished, but some documents are in its errors file (not 1 or 2: the run itself did not fail).
INCOMPLETE_EXIT_CODE = 3

#: ``longreach convert NAME`` -> the converter module (imported only when that converter is used).
CONVERTERS = {
    "locost": "longreach.conversion.convert_locost_original_checkpoint",
    "vcc": "longreach.conversion.convert_vcc_original_checkpoint",
    "dodo": "longreach.conversion.convert_dodo_original_checkpoint",
}


class CommandError(Exception):
    """A command cannot do what was asked; the message is one line naming the problem and the fix (exit code 1)."""

    exit_code = 1


class UsageError(CommandError):
    """The command line is wrong (exit code 2)."""

    exit_code = 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line (a :class:`UsageError`) instead of the usage text and an exit."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


@contextlib.contextmanager
def one_line_argparse_errors():
    """Usage errors of the parsers the sub-commands bring (the converters', the demo's: plain ``argparse``, as they
    also run on their own) become one line, as the ``longreach`` parser's are."""
    error = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = OneLineArgumentParser.error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = error


#: Set by :func:`main` from ``--debug``: the sub-commands that catch their own errors let them through.
_DEBUG = False


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def non_empty(text: str) -> str:
    """A path, name or column: an empty string would fall back to a default (or the current folder) unnoticed."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty value, got {text!r}")
    return text


DTYPES = ("auto", "float32", "float16", "bfloat16")


def _progress(message: str, end: str = "\n") -> None:
    print(message, file=sys.stderr, end=end, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------------------------------


def convert(argv: list[str]) -> int:
    """``longreach convert NAME ARGS...``: run the converter's own ``main(ARGS)``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: longreach convert {" + ",".join(CONVERTERS) + "} [converter options]\n\n"
            "Convert a checkpoint written by the authors' original code into a Hub-ready longreach folder.\n"
            "`longreach convert NAME --help` lists that converter's options.",
            file=sys.stdout if argv else sys.stderr,
        )
        return 0 if argv else 2
    name, converter_argv = argv[0], argv[1:]
    if name not in CONVERTERS:
        print(f"error: unknown converter {name!r}; choose one of {sorted(CONVERTERS)}.", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(CONVERTERS[name])
    except ModuleNotFoundError as error:
        if error.name != CONVERTERS[name]:
            raise
        print(f"error: the {name} converter ({CONVERTERS[name]}) is not part of this longreach installation.",
              file=sys.stderr)
        return 1
    program, sys.argv[0] = sys.argv[0], f"longreach convert {name}"  # the converter's --help names this command
    try:
        with one_line_argparse_errors():
            return module.main(converter_argv, debug=_DEBUG)
    finally:
        sys.argv[0] = program


# ---------------------------------------------------------------------------------------------------------------------
# summarize
# ---------------------------------------------------------------------------------------------------------------------


def _generation_progress(max_new_tokens: int | None):
    """A stopping criterion that never stops generation and reports how many tokens were generated (stderr)."""
    import torch
    from transformers import StoppingCriteria

    class GenerationProgress(StoppingCriteria):
        def __init__(self):
            self.start_length, self.start_time = None, time.perf_counter()

        def __call__(self, input_ids, scores, **kwargs):
            if self.start_length is None:
                self.start_length = input_ids.shape[1] - 1
            generated = input_ids.shape[1] - self.start_length
            total = f"/{max_new_tokens}" if max_new_tokens else ""
            _progress(f"\rgenerating: {generated}{total} tokens ({time.perf_counter() - self.start_time:.1f}s)", end="")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return GenerationProgress()


OUR_MODEL_TYPES = ("locost", "vcc_t5", "dodo_llama")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "tokenizer_config.json")


def check_device(device: str | None) -> None:
    """``--device``: a device torch knows, and one this machine has."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a device name: use cpu, cuda, cuda:1, mps, ...") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}); "
                         "use --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {device}: MPS is not available on this machine; use --device cpu")


def check_model_location(model_path: str, tokenizer_path: str | None) -> tuple[dict, dict]:
    """``--model`` / ``--tokenizer`` before anything is loaded: local paths never go to the Hub, an original (not
    converted) checkpoint gets the convert command, a folder without a tokenizer asks for ``--tokenizer``. Returns the
    ``from_pretrained`` keyword arguments for the model and for the tokenizer (``local_files_only`` for a Hub id found
    only in the cache, so that loading it makes no network attempt)."""
    from .hub import HubAccessError, looks_like_local_path, pretrained_location

    for path, option in ((model_path, "--model"), (tokenizer_path, "--tokenizer")):
        if path is None:
            continue
        try:
            found = pretrained_location(path, option)
        except HubAccessError as error:  # a missing local path is a usage error, an unreachable Hub id is not
            local = looks_like_local_path(path) and not Path(path).expanduser().exists()
            raise (UsageError if local else CommandError)(str(error)) from None
        if option == "--model":
            location = tokenizer_location = found
        else:
            if Path(path).expanduser().is_file():  # from_pretrained would take a file's path for a Hub id
                raise UsageError(f"--tokenizer {path} is a file; pass the folder that holds it (with "
                                 "tokenizer_config.json), or a Hub id")
            tokenizer_location = found
    folder = Path(model_path).expanduser()
    if not folder.exists():
        return location, tokenizer_location
    if not folder.is_dir():
        raise UsageError(f"--model {model_path} is a file; pass the folder that holds config.json and the weights")
    config_file = folder / "config.json"
    model_type = None
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
            model_type = config.get("model_type") or "/".join(config.get("architectures") or []) or None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CommandError(f"--model {model_path}: config.json is not valid JSON") from None
    if model_type not in OUR_MODEL_TYPES:
        originals = sorted(p.name for p in folder.iterdir() if p.suffix in (".ckpt", ".bin", ".pt", ".safetensors"))
        if model_type is None and not originals:
            raise UsageError(f"--model {model_path} holds no model (no config.json); pass a converted longreach folder")
        guess = ("locost" if "locost" in str(model_type).lower() else "dodo" if "llama" in str(model_type).lower()
                 else "vcc" if "t5" in str(model_type).lower() else "locost|vcc|dodo")
        found = f"a {model_type} config" if model_type else f"{', '.join(originals[:2])}"
        raise UsageError(f"--model {model_path} is not a longreach model ({found}); if it is an authors' original "
                         f"checkpoint, convert it first: longreach convert {guess} --checkpoint_path {model_path} "
                         "--pytorch_dump_folder_path CONVERTED")
    if tokenizer_path is None and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"--model {model_path} has no tokenizer: pass --tokenizer PATH_OR_REPO (the tokenizer the "
                         "model was trained with)")
    return location, tokenizer_location


def load_summarizer(model_path: str, tokenizer_path: str | None = None, device: str | None = None,
                    dtype: str | None = None):
    """A ``LongSummarizationPipeline`` for a LOCOST, VCC-T5 or Dodo checkpoint (folder or Hub id), after the checks
    of :func:`check_model_location` and :func:`check_device`; a tokenizer larger than the model's vocabulary is
    refused."""
    import longreach  # noqa: F401  (registers the model classes)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    from .pipelines.pipeline_summarization import LongSummarizationPipeline

    check_device(device)
    location, tokenizer_location = check_model_location(model_path, tokenizer_path)
    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=True, **location)
        auto_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        # transformers' check for a PEFT adapter does not inherit local_files_only: it would retry the Hub first
        offline = {"adapter_kwargs": {"local_files_only": True}} if location.get("local_files_only") else {}
        model = auto_class.from_pretrained(model_path, trust_remote_code=True, dtype=dtype or "auto", **location,
                                           **offline)
    except OSError as error:
        raise CommandError(f"--model {model_path}: {str(error).strip().splitlines()[0]}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path, **tokenizer_location)
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot load the tokenizer of {tokenizer_path or model_path}: "
                           f"{str(error).strip().splitlines()[0]}") from None
    vocab_size = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab_size:
        raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but the model only {vocab_size} embeddings: it is "
                         "not this model's tokenizer; pass the right one with --tokenizer")
    return LongSummarizationPipeline(model=model, tokenizer=tokenizer, device=device)


def _generate_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ("max_new_tokens", "num_beams", "length_penalty",
                                                   "no_repeat_ngram_size", "repetition_penalty", "min_new_tokens",
                                                   "do_sample", "cache_implementation")
            if getattr(args, name, None) is not None}


def _check_generation_options(args: argparse.Namespace, model) -> None:
    """Options that only some models take, refused before any document is read."""
    for option in ("question", "question_column"):
        if getattr(args, option, None) is not None and getattr(model, "prepare_question_inputs", None) is None:
            raise UsageError(f"--{option}: {type(model).__name__} ({model.config.model_type}) has no question format; "
                             "it only summarizes. VCC-T5 and Dodo models answer questions")
    if getattr(args, "cache_implementation", None) == "static" and model.config.model_type == "dodo_llama":
        raise UsageError(f"--cache_implementation static: {type(model).__name__} decodes with its own dynamic cache, "
                         "which holds the nuggets; leave the option out or pass dynamic")


def _check_max_input_length(args: argparse.Namespace, summarizer) -> None:
    """A corpus run's ``--max_input_length`` that leaves no room for any document (Dodo's: at or under its prompt's
    prefix tokens), refused once, before any document, rather than in the errors file for every one of them."""
    prepare = getattr(summarizer.model, "prepare_summarization_inputs", None)
    if args.max_input_length is None or prepare is None:
        return
    try:
        prepare(summarizer.tokenizer, ["a document"], max_input_length=args.max_input_length)
    except ValueError as error:
        if "max_input_length" in str(error):
            raise UsageError(f"--max_input_length {args.max_input_length}: {error}") from None


def _read_document(file: str) -> str:
    try:
        if file == "-" and sys.stdin is None:  # started with standard input closed (`<&-`)
            raise CommandError("FILE - reads standard input, which is closed; pipe a document in or pass a FILE")
        if file == "-":  # the bytes, decoded here: the locale's text stream may pass bad bytes on as surrogates
            stdin_bytes = getattr(sys.stdin, "buffer", None)  # (none where stdin was replaced by a text stream)
            document = sys.stdin.read() if stdin_bytes is None else stdin_bytes.read().decode("utf-8")
            # newlines as a FILE is read (universal newlines): a Windows document piped in is the same document
            document = document.replace("\r\n", "\n").replace("\r", "\n")
        else:
            with open(file, encoding="utf-8") as handle:
                document = handle.read()
        # a byte order mark (Windows editors write one) is not the document's first word; removed after decoding, so
        # that an error's offset counts it
        document = document.removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        name = "standard input" if file == "-" else file
        convert = "iconv -f latin1 -t utf-8 FILE | longreach summarize ... -" if file == "-" else \
            f"iconv -f latin1 -t utf-8 {file}"
        raise CommandError(f"{name} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                           f"{error.start}): convert it first, e.g. {convert}") from None
    except OSError as error:
        raise CommandError(f"cannot read {file!r}: {error.strerror}") from None
    if not document.strip():
        raise CommandError(f"{file!r} holds no text to summarize.")
    return document


def _same_file(first: str, second: str) -> bool:
    """Whether two paths name one file: by identity where both exist (a case-insensitive file system, macOS's and
    Windows' defaults, takes ``Doc.txt`` for ``doc.txt``; a hard link), else by their resolved paths."""
    try:
        return os.path.samefile(first, second)
    except OSError:
        return Path(first).resolve() == Path(second).resolve()


def summarize(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.input is None):
        raise UsageError("longreach summarize: give one document as FILE, or a corpus as --input SRC --output OUT.jsonl")
    for name in ("file", "input", "output", "model", "tokenizer"):  # "--output=~/x": no shell expands ~ after "="
        if getattr(args, name) not in (None, "-") and getattr(args, name).startswith("~"):
            setattr(args, name, os.path.expanduser(getattr(args, name)))
    given = {name: getattr(args, name, None) for name in ("max_new_tokens", "min_new_tokens")}
    if None not in given.values() and given["min_new_tokens"] > given["max_new_tokens"]:
        raise UsageError(f"longreach summarize: --min_new_tokens {given['min_new_tokens']} is more than "
                         f"--max_new_tokens {given['max_new_tokens']}; a summary cannot be both")
    if args.input is not None:
        return summarize_corpus_command(args)
    if args.output_jsonl_options_given:
        raise UsageError("longreach summarize: --split/--text_column/--id_column/--reference_column/--question_column/"
                         "--max_batch_tokens are for a corpus (--input SRC --output OUT.jsonl)")
    if args.output == "-":  # standard output, as for FILE "-"
        args.output = None
    if args.output and args.file != "-" and _same_file(args.output, args.file):
        raise UsageError(f"longreach summarize: --output {args.output} is the document FILE; choose another file for "
                         "the summary")
    if args.output:  # before minutes of loading and generating, not after
        _check_output_path(args.output, expected="the path of the file to write the summary to")
    start = time.perf_counter()
    document = _read_document(args.file)
    _progress(f"loading {args.model} ...")
    summarizer = load_summarizer(args.model, args.tokenizer, args.device, args.dtype)
    model = summarizer.model
    _check_generation_options(args, model)
    num_tokens = len(summarizer.tokenizer(document)["input_ids"])
    _progress(f"{type(model).__name__} ({model.config.model_type}, {model.num_parameters() / 1e6:.1f}M parameters) "
              f"loaded in {time.perf_counter() - start:.1f}s; document: {len(document)} characters, {num_tokens} tokens")

    generate_kwargs = _generate_kwargs(args)
    from transformers import StoppingCriteriaList

    max_new_tokens = generate_kwargs.get("max_new_tokens", model.generation_config.max_new_tokens)
    generate_kwargs["stopping_criteria"] = StoppingCriteriaList([_generation_progress(max_new_tokens)])
    call_kwargs = {"max_input_length": args.max_input_length} if args.max_input_length else {}
    if args.question is not None:
        call_kwargs["question"] = args.question
    with warnings.catch_warnings(record=True) as caught:  # shown as one line each (dropped tokens, ...)
        warnings.simplefilter("always", UserWarning)
        summary = summarizer(document, **call_kwargs, **generate_kwargs)[0]["summary_text"]
    _progress(f"\ndone in {time.perf_counter() - start:.1f}s")
    for warning in caught:
        _progress(f"warning: {warning.message}")
    if args.output:
        output = Path(os.path.realpath(args.output))  # a symlink's target is written: the link itself stays
        temporary = output.with_name(f".{output.name}.tmp-{os.getpid()}")  # renamed into place: never half-written
        try:
            if output.exists() and not output.is_file():  # /dev/stdout, a FIFO: written to, not renamed over
                output.write_text(summary + "\n", encoding="utf-8")
            else:
                output.parent.mkdir(parents=True, exist_ok=True)
                temporary.write_text(summary + "\n", encoding="utf-8")
                os.replace(temporary, output)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise CommandError(f"cannot write --output {args.output}: {error.strerror}") from None
        _progress(f"summary written to {args.output}")
    else:
        try:
            summary.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
        except UnicodeEncodeError:
            _progress(f"warning: standard output's encoding ({sys.stdout.encoding}) lacks characters of the summary, "
                      "written as \\uXXXX escapes; --output FILE writes UTF-8 (or set PYTHONUTF8=1)")
        except (LookupError, TypeError):  # a stream without a codec name: written as it is
            pass
        print(summary)
    return 0


def _weight_files(model: str, file_times: bool = False) -> dict:
    """``{"model_files": {name: [bytes, SHA-256]}}`` of a local model folder's weight files (empty for a Hub id): a
    model retrained into the same folder makes other summaries, which a rerun must not mix with the first run's, though
    the path is the same; a copy of the same weights (with new file times, or another node's copy) is the same model.
    ``file_times``: ``[bytes, modification time in ns]`` instead, what earlier versions recorded
    (see `_recorded_file_times`)."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return {}
    files = sorted(path for path in folder.iterdir() if path.suffix in (".safetensors", ".bin") and path.is_file())
    if file_times:
        return {"model_files": {path.name: [path.stat().st_size, path.stat().st_mtime_ns] for path in files}}
    return {"model_files": {path.name: [path.stat().st_size, _sha256(path.resolve(), path.stat().st_mtime_ns)]
                            for path in files}}


def _recorded_file_times(output: str) -> bool:
    """Whether OUT's settings file records the weight files' times rather than their digests (written by a version
    before the digests): a run it started is finished by comparing what it recorded, not refused as another model."""
    from .corpus import settings_path_of

    try:
        files = json.loads(settings_path_of(Path(output)).read_text(encoding="utf-8"))["model_files"]
        return bool(files) and all(isinstance(entry, list) and len(entry) == 2 and type(entry[1]) is int
                                   for entry in files.values())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def _sha256(path: Path, mtime_ns: int) -> str:
    """The file's SHA-256, once per process for unchanged file times (the settings are made twice; a read of the
    weights just before the model loads them, about a second per gigabyte)."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _run_settings(args: argparse.Namespace) -> dict:
    """What makes a corpus run's summaries (recorded beside its output; see ``corpus.check_run_settings``)."""

    def where(name: str | None) -> str | None:
        return str(Path(name).expanduser().resolve()) if name is not None and Path(name).expanduser().exists() else name

    settings = {"model": where(args.model), "tokenizer": where(args.tokenizer or args.model), "dtype": args.dtype,
                **_weight_files(args.model, file_times=_recorded_file_times(args.output)),
                "max_input_length": args.max_input_length,
                "generation": {key: value for key, value in _generate_kwargs(args).items()
                               if key != "cache_implementation"}}  # static or dynamic: the same summaries
    for option in ("question", "question_column"):  # only when given: settings recorded before them stay equal
        if getattr(args, option, None) is not None:
            settings[option] = getattr(args, option)
    # Which documents, and which column is their text and which their id: ids alone key the finished summaries, so
    # another input or column under the same ids would keep the first run's summaries of other texts.
    settings.update(input=where(args.input), text_column=args.text_column, id_column=args.id_column)
    if getattr(args, "input_kind", None) == "hub":
        settings["split"] = args.split
    return settings


def _check_output_path(output: str, expected: str = "a file path ending in .jsonl") -> None:
    """Before the corpus and the model are read: ``--output`` names a file that can be created where it is (its
    missing folders are made)."""
    path = Path(output).expanduser()
    if path.is_dir():
        raise UsageError(f"longreach summarize: --output {output} is a folder; give {expected}")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"longreach summarize: --output {output}: {ancestor} is a file, so no folder can hold the "
                         "summaries there; choose another path")


def process_device(device: str | None, world_size: int) -> str | None:
    """The device of this process: under torchrun / accelerate launch (``world_size > 1``), with no ``--device`` or
    with ``--device cuda``, the GPU of its ``LOCAL_RANK`` (``cuda`` alone would put every process on GPU 0), or the CPU
    without one; otherwise ``device`` as given."""
    if world_size > 1 and device in (None, "cuda"):
        import torch

        if device == "cuda" or torch.cuda.is_available():
            return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return "cpu"
    return device


def _documents(count: int) -> str:
    return f"{count} document" + ("" if count == 1 else "s")


def _gather_run_statistics(stats: dict, world_size: int) -> dict:
    """The statistics of every process summed (their peak memory: the largest), for the run's closing line."""
    if world_size == 1:
        return stats
    import torch.distributed as dist

    every = [None] * world_size
    summed = ("documents", "input_tokens", "truncated", "skipped_already_done", "edited_since_summarized")
    dist.all_gather_object(every, {key: stats[key] for key in (*summed, "seconds", "peak_memory_bytes")})
    return {**{key: sum(s[key] for s in every) for key in summed}, "seconds": max(s["seconds"] for s in every),
            "peak_memory_bytes": max(s["peak_memory_bytes"] for s in every)}


def summarize_corpus_command(args: argparse.Namespace) -> int:
    """``longreach summarize --input SRC --output OUT.jsonl``: see :mod:`longreach.corpus`."""
    from . import corpus as corpus_module

    if args.output is None or not args.output.endswith(".jsonl"):
        raise UsageError(f"longreach summarize --input needs --output OUT.jsonl (one JSON line per summary), got "
                         f"{args.output!r}")
    kind = corpus_module.input_kind(args.input)
    if kind == "unsupported":
        raise UsageError(corpus_module.unsupported_input(args.input))
    given = getattr(args, "table_options_given", [])
    if kind in ("folder", "text") and given:
        raise UsageError(f"longreach summarize: {' / '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to table "
                         "files and Hub datasets, not to "
                         f"--input {args.input} (a {'folder of text files' if kind == 'folder' else 'text file'}); "
                         "leave them out")
    if args.question is not None and args.question_column is not None:
        raise UsageError("longreach summarize: --question asks one question of every document, --question_column one "
                         "per record; give one of them")
    if kind == "table" and "--split" in given:
        raise UsageError(f"longreach summarize: --split applies to Hub datasets; --input {args.input} is one file, "
                         "read whole; leave it out")
    if kind in ("table", "text") and _same_file(args.output, os.path.expanduser(args.input)):
        raise UsageError(f"longreach summarize: --output {args.output} is the --input file; choose another file for "
                         "the summaries")
    _check_output_path(args.output)
    output = Path(args.output).expanduser()
    if output.exists() and not output.is_file():  # a FIFO would block the read of its records, /dev/null the fsync
        raise UsageError(f"longreach summarize: --output {args.output} is not a regular file (a pipe or a device); "
                         "the summaries are appended and reread on a rerun: give a file path ending in .jsonl")
    needed = ([("datasets", "🤗 datasets reads table files and Hub datasets")] if kind in ("table", "hub") else []) + (
        [("rouge_score", "rouge-score scores --reference_column")] if args.reference_column else [])
    for module, why in needed:  # before the model loads, not after the summaries
        if importlib.util.find_spec(module) is None:
            raise CommandError(f"longreach summarize: {why}, and {module} is not installed: pip install "
                               "'longreach[train]'")
    args.input_kind = kind
    rank, world_size = corpus_module.distributed_rank()
    device = process_device(args.device, world_size)
    try:
        corpus = corpus_module.read_corpus(args.input, split=args.split, text_column=args.text_column,
                                           id_column=args.id_column, reference_column=args.reference_column,
                                           question_column=args.question_column)
    except corpus_module.CorpusError as error:
        raise UsageError(str(error)) from None
    unusable = "unreadable" if args.question_column is None else "unreadable or without a question"
    _progress(f"{len(corpus.ids)} documents in {args.input}" + (f" ({len(corpus.errors)} {unusable})" if corpus.errors
                                                                 else ""))
    with contextlib.ExitStack() as stack:
        try:  # held until the parts are merged: a second run on the same --output is refused at once
            stack.enter_context(corpus_module.output_lock(args.output, rank))
        except corpus_module.CorpusError as error:
            raise UsageError(str(error)) from None
        return _summarize_corpus_locked(args, corpus, rank, world_size, device)


def _summarize_corpus_locked(args: argparse.Namespace, corpus, rank: int, world_size: int, device) -> int:
    """The corpus run itself, under ``--output``'s run lock (:func:`longreach.corpus.output_lock`)."""
    from . import corpus as corpus_module

    try:  # before minutes of loading the model: a rerun with other settings is refused at once
        unrecorded = corpus_module.check_run_settings(args.output, _run_settings(args), record=False)
    except corpus_module.CorpusError as error:
        raise UsageError(str(error)) from None
    summarizer = load_summarizer(args.model, args.tokenizer, device, args.dtype)
    _check_generation_options(args, summarizer.model)
    _check_max_input_length(args, summarizer)
    if unrecorded:  # written once the run can start
        corpus_module.write_run_settings(args.output, _run_settings(args))
    try:
        stats = corpus_module.summarize_corpus(
            summarizer, corpus, args.output, max_batch_tokens=args.max_batch_tokens,
            max_input_length=args.max_input_length, generate_kwargs=_generate_kwargs(args), question=args.question,
            rank=rank, world_size=world_size,
        )
    except corpus_module.CorpusError as error:
        raise CommandError(str(error)) from None
    except OSError as error:  # the output cannot be written (a full disk): what is written so far is kept
        target = corpus_module.part_path(Path(args.output), rank, world_size)
        raise CommandError(f"cannot write {target}: {error.strerror or error}; the summaries written before are kept, "
                           "and rerunning the same command goes on from them") from None
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        dist.barrier()  # every part is complete before rank 0 merges
    stats = _gather_run_statistics(stats, world_size)
    exit_code = 0
    if rank == 0:
        merged = corpus_module.merge_parts(args.output, corpus, world_size)
        by = f"{world_size} processes (the slowest's time, the largest peak)" if world_size > 1 else "this process"
        _progress(f"{stats['documents']} documents ({stats['input_tokens']} input tokens) summarized in "
                  f"{stats['seconds']:.1f}s by {by}, {stats['skipped_already_done']} already done; peak memory "
                  f"{stats['peak_memory_bytes'] / 2**20:.0f} MiB; {len(merged)} summaries in {args.output}")
        known = set(corpus.ids) | {str(error["id"]) for error in corpus.errors}
        gone = [str(record["id"]) for record in merged if str(record["id"]) not in known]
        if gone:  # kept (nothing is lost), but said: they are not summaries of this --input
            _progress(f"warning: {args.output} holds {len(gone)} summar{'y' if len(gone) == 1 else 'ies'} of ids no "
                      f"longer in --input {args.input} (e.g. {gone[:3]}), kept at its end")
        if stats["edited_since_summarized"]:
            _progress(f"{_documents(stats['edited_since_summarized'])} edited since {args.output} summarized them: "
                      "summarized again, their new records replace the old ones")
        if stats["truncated"]:
            limit = (f"--max_input_length {args.max_input_length}" if args.max_input_length
                     else "the model's longest input")
            _progress(f"{_documents(stats['truncated'])} of this run cut to {limit}, their ends not read: their "
                      "records say \"truncated\": true")
        errors_file = corpus_module.errors_path_of(Path(args.output))
        if errors_file.exists():
            count = len(corpus_module.json_lines(errors_file))
            _progress(f"{_documents(count)} could not be summarized: see {errors_file} (exit code "
                      f"{INCOMPLETE_EXIT_CODE})")
            exit_code = INCOMPLETE_EXIT_CODE
        if args.reference_column:
            metrics = corpus_module.corpus_rouge(args.output, corpus, merged)
            if metrics:
                print(json.dumps(metrics))
            else:
                _progress(f"no summarized document has a reference in --reference_column {args.reference_column!r}: "
                          "no ROUGE")
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return exit_code


# ---------------------------------------------------------------------------------------------------------------------
# push, model-cards, demo
# ---------------------------------------------------------------------------------------------------------------------


def push_preflight() -> None:
    """Before an upload: online, the Hub reachable, logged in (each failure is one line, at once)."""
    from huggingface_hub import get_token

    from . import hub

    if hub.hub_is_offline():
        raise CommandError("cannot push: HF_HUB_OFFLINE is set; unset it and retry")
    if not hub.hub_reachable():
        raise CommandError("cannot push: the Hub cannot be reached from this machine; check the network and retry")
    if get_token() is None:
        raise CommandError("cannot push: not logged in to the Hub; run `hf auth login` or set HF_TOKEN")


def push(args: argparse.Namespace) -> int:
    from .hub import push_folder_to_hub

    from .hub import _REPO_ID, hub_files

    if not Path(args.folder).is_dir():
        raise UsageError(f"longreach push: {args.folder} is not a folder; pass a saved checkpoint folder")
    if not _REPO_ID.match(args.repo_id):
        raise UsageError(f"longreach push: {args.repo_id!r} is not a Hub repository id; expected 'namespace/name'")
    try:
        hub_files(args.folder)  # what would be uploaded, and whether the folder can be: before any network check
    except ValueError as error:
        raise UsageError(f"longreach push: {str(error).strip().splitlines()[0]}") from None
    push_preflight()
    try:
        commit = push_folder_to_hub(args.folder, args.repo_id, private=args.private or None,
                                    commit_message=args.commit_message)
    except ValueError as error:
        raise CommandError(str(error).strip().splitlines()[0]) from None
    except OSError as error:  # huggingface_hub's HTTP errors are OSErrors
        raise CommandError(f"the upload failed: {str(error).strip().splitlines()[0]}") from None
    print(getattr(commit, "commit_url", commit))
    return 0


def model_cards(args: argparse.Namespace) -> int:
    from .hub import write_reference_model_cards

    try:
        paths = write_reference_model_cards(args.output_dir)
    except ValueError as error:
        raise UsageError(f"longreach model-cards: {str(error).replace('`output_dir`', '--output_dir')}") from None
    except OSError as error:
        raise CommandError(f"cannot write the model cards into --output_dir {args.output_dir}: "
                           f"{error.strerror or error}") from None
    for path in paths:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="longreach", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n")[1])
    parser.add_argument("--version", action="store_true", help="Print the version and exit.")
    parser.add_argument("--debug", action="store_true", help="Show the traceback of an error.")
    commands = parser.add_subparsers(dest="command", metavar="{demo,convert,summarize,push,model-cards}",
                                     parser_class=OneLineArgumentParser)

    demo = commands.add_parser("demo", help="Train, evaluate, save and reload a small LOCOST summarizer, offline.",
                               add_help=False)
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    commands.add_parser("convert", help="Convert an original LOCOST / VCC-T5 / Dodo checkpoint.", add_help=False)

    summarize_parser = commands.add_parser(
        "summarize", help="Summarize a text file, or a whole corpus into a resumable JSONL file.")
    summarize_parser.add_argument("--model", required=True, type=non_empty,
                                  help="Model folder or Hub repository id.")
    summarize_parser.add_argument("file", nargs="?", default=None, help="One text file to summarize ('-' reads stdin).")
    summarize_parser.add_argument("--tokenizer", default=None, type=non_empty,
                                  help="Tokenizer (default: the model's folder).")
    summarize_parser.add_argument("--question", default=None, type=non_empty,
                                  help="Ask this question of the document (or of every document of a corpus) instead "
                                       "of summarizing it; the answer is written where the summary would be (VCC-T5: "
                                       "the question as VIP tokens; Dodo: the paper's question-answering prompt).")
    corpus_options = summarize_parser.add_argument_group(
        "corpus", "Many documents: --input SRC --output OUT.jsonl (resumable; under torchrun each process takes a share)")
    corpus_options.add_argument("--input", default=None, type=non_empty,
                                help="A text file, a folder of .txt/.md, a .jsonl/.json/.csv/.parquet file or a Hub "
                                     "dataset name.")
    corpus_options.add_argument("--split", default=None, type=non_empty,
                                help="Dataset split (Hub datasets; default: train).")
    corpus_options.add_argument("--text_column", default=None, type=non_empty,
                                help="Column holding the documents (default: text).")
    corpus_options.add_argument("--id_column", default=None, type=non_empty,
                                help="Column holding unique ids (default: row number).")
    corpus_options.add_argument("--reference_column", default=None, type=non_empty,
                                help="Column holding reference summaries (or answers): ROUGE (with a question, "
                                     "also SQuAD's exact match and F1) is printed and written to OUT.metrics.json. A "
                                     "list of texts, or SQuAD's answers {\"text\": [...]}, scores the best of them.")
    corpus_options.add_argument("--question_column", default=None, type=non_empty,
                                help="Column holding a question per record, answered instead of a summary (VCC-T5, "
                                     "Dodo); each record of OUT keeps its question.")
    corpus_options.add_argument("--max_batch_tokens", type=positive_int, default=None,
                                help="Padded tokens per generate() call (rows x longest row; default: 16384).")
    generation = summarize_parser.add_argument_group("generation")
    generation.add_argument("--max_new_tokens", type=positive_int, default=None)
    generation.add_argument("--min_new_tokens", type=positive_int, default=None)
    generation.add_argument("--num_beams", type=positive_int, default=None)
    generation.add_argument("--length_penalty", type=finite_float, default=None)
    generation.add_argument("--no_repeat_ngram_size", type=positive_int, default=None)
    generation.add_argument("--repetition_penalty", type=positive_float, default=None,
                            help="Above 1 discourages repeated tokens (1: no penalty).")
    generation.add_argument("--do_sample", action=argparse.BooleanOptionalAction, default=None,
                            help="Sample (--do_sample) or pick the likeliest tokens (--no-do_sample); default: the "
                                 "checkpoint's generation_config (one that samples gives other summaries each run).")
    generation.add_argument("--cache_implementation", default=None, choices=["dynamic", "static"],
                            help="static (LOCOST, VCC-T5): preallocated decoder caches, the same summaries; on a "
                                 "GPU generate() then compiles the decoding step (CUDA graphs). A new batch shape "
                                 "may compile again: worth it on long runs.")
    generation.add_argument("--max_input_length", type=positive_int, default=None,
                            help="Keep at most this many input tokens (VCC-T5 with a question: the question's too; a "
                                 "warning reports what is dropped; with "
                                 "--input, each record's \"truncated\" field, and a count at the end).")
    summarize_parser.add_argument("--device", default=None,
                                  help="e.g. cpu, cuda, cuda:1, mps (default: the accelerator transformers' pipelines "
                                       "choose: cuda, mps on Apple Silicon, ..., else cpu; under torchrun: "
                                       "cuda:LOCAL_RANK, else cpu).")
    summarize_parser.add_argument("--dtype", default=None, choices=DTYPES,
                                  help="Weights' dtype (default: the checkpoint's).")
    summarize_parser.add_argument("--output", default=None, type=non_empty,
                                  help="One document: write the summary to this file instead of stdout (\"-\": stdout). "
                                       "A corpus: the JSONL file to append the summaries to.")

    push_parser = commands.add_parser("push", help="Upload a saved checkpoint folder with our model card.")
    push_parser.add_argument("folder", type=non_empty)
    push_parser.add_argument("repo_id", type=non_empty)
    push_parser.add_argument("--private", action="store_true")
    push_parser.add_argument("--commit_message", default=None)

    cards = commands.add_parser("model-cards", help="Regenerate model_cards/*.md from the templates.")
    cards.add_argument("--output_dir", default="model_cards", type=non_empty)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("longreach")
    except metadata.PackageNotFoundError:
        import longreach

        return longreach.__version__


def run(argv: list[str]) -> int:
    if argv and argv[0] == "convert":  # everything after the converter name belongs to the converter
        return convert(argv[1:])
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        with one_line_argparse_errors():
            return demo_main(argv[1:], debug=_DEBUG)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"longreach {_version()}")
        return 0
    if args.command == "summarize":
        table_only = ("split", "text_column", "id_column", "reference_column", "question_column")
        corpus_only = (*table_only, "max_batch_tokens")
        args.output_jsonl_options_given = any(getattr(args, name) is not None for name in corpus_only)
        args.table_options_given = [f"--{name}" for name in table_only if getattr(args, name) is not None]
        args.split = args.split or "train"
        args.text_column = args.text_column or "text"
        args.max_batch_tokens = args.max_batch_tokens or 16384
        return summarize(args)
    if args.command == "push":
        return push(args)
    if args.command == "model-cards":
        return model_cards(args)
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    global _DEBUG
    debug = "--debug" in argv  # no sub-command has an option of that name
    while "--debug" in argv:
        argv.remove("--debug")
    _DEBUG = debug
    # characters standard output's encoding lacks (cp1252 where Windows redirects it to a file or pipe, ASCII under
    # LC_ALL=C: "surrogateescape") are written as \uXXXX escapes, as Python writes them to stderr: a
    # UnicodeEncodeError lost a summary made in minutes
    stdout = sys.stdout
    errors = getattr(stdout, "errors", None)
    escaping = errors in ("strict", "surrogateescape") and hasattr(stdout, "reconfigure")
    try:
        if escaping:
            stdout.reconfigure(errors="backslashreplace")
        return run(argv)
    except CommandError as error:
        if debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001  anything unexpected: one line, the traceback with --debug
        if debug:
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"error: {type(error).__name__}: {message} (run again with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        if escaping:  # the stream's own handler back
            stdout.reconfigure(errors=errors)


if __name__ == "__main__":
    sys.exit(main())
