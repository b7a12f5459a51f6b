"""What the fine-tuning examples (``examples/finetune_summarization.py``, ``examples/finetune_dodo.py``) share around
``Trainer``: reading the data files, deciding what to run, resuming, and keeping what a user has in ``--output_dir``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .configuration.config_overrides import check_config_fields  # noqa: F401  (the examples import it here)

#: The datasets loader of each data file suffix.
DATA_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def load_data_files(train_file: str | None, validation_file: str | None):
    """A ``DatasetDict`` of the given files (``.json``/``.jsonl``/``.csv``/``.parquet``, read by their suffix); a file
    with no record, or of another kind, is a ``ValueError`` naming its option."""
    from datasets import DatasetDict, load_dataset

    files = {split: (option, path) for split, option, path in (("train", "--train_file", train_file),
                                                               ("validation", "--validation_file", validation_file))
             if path is not None}
    if not files:
        raise ValueError("Pass --dataset_name, or --train_file and/or --validation_file (.json, .jsonl, .csv or "
                         ".parquet).")
    for option, path in files.values():
        suffix = Path(path).suffix.lower()
        if suffix not in DATA_LOADERS:
            raise ValueError(f"{option} {path}: expected a {' / '.join(DATA_LOADERS)} file, got {suffix or 'no suffix'}.")
        if not Path(path).is_file():
            raise ValueError(f"{option} {path}: no such file.")
        if Path(path).stat().st_size == 0:
            raise ValueError(f"{option} {path} is empty; it needs at least one record.")
    from datasets.exceptions import DatasetGenerationError

    from .corpus import _first_line

    raw = DatasetDict()
    for split, (option, path) in files.items():
        # one file at a time, each by its own suffix (a .csv training file and a .jsonl validation file): datasets
        # reads the files of one call as one table, and a validation file with other columns than the training file's
        # (an "id" more) failed with a CastError that named neither file
        loader = DATA_LOADERS[Path(path).suffix.lower()]
        try:
            raw[split] = load_dataset(loader, data_files={split: path})[split]
        except ValueError as error:  # e.g. 'Instruction "train" corresponds to no data!' for a file of no record
            raise ValueError(f"{option} {path} holds no record that datasets can read ({_first_line(error)}).") \
                from None
        except DatasetGenerationError as error:  # a JSON line that is not an object, a CSV cut short...
            reason = (_first_line_not_a_json_object(path) if loader == "json" else None) or _first_line(
                error.__cause__ or error)  # (the reader's own error, not datasets' wrapper)
            raise ValueError(f"{option} {path} cannot be read as {loader} ({reason}).") from None
        if len(raw[split]) == 0:
            raise ValueError(f"{option} {path} holds no record.")
    return raw


def load_named_dataset(name: str, config_name: str | None = None):
    """``load_dataset(--dataset_name, --dataset_config_name)``; data it cannot parse (a JSON line that is not an
    object in a local dataset folder...) is a ``ValueError`` naming the option, not datasets' traceback ending in
    "DatasetGenerationError: An error occurred while generating the dataset"."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    from .corpus import _first_line

    try:
        return load_dataset(name, config_name)
    except DatasetGenerationError as error:
        raise ValueError(f"--dataset_name {name}: datasets cannot read its data "
                         f"({_first_line(error.__cause__ or error)}).") from None


def _first_line_not_a_json_object(path: str) -> str | None:
    """Where a JSON-lines file holds a line that is not a JSON object: "line N is not a JSON object: ..." (Arrow's own
    message counts the rows of its block, not the file's lines), or what else is wrong in a file of one JSON document;
    None if nothing is."""
    import json

    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        document = json.loads(text)
    except ValueError:
        pass
    else:  # one JSON document: a list of records (or a dict of columns)
        if isinstance(document, list):
            return next((f"item {index} of its JSON list is not an object: {json.dumps(item)[:80]}"
                         for index, item in enumerate(document) if not isinstance(item, dict)), None)
        return None if isinstance(document, dict) else f"it holds {text.strip()[:80]}, not JSON objects"
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:
            return f"line {number} is not valid JSON: {error}"
        if not isinstance(value, dict):
            return f"line {number} is not a JSON object: {line.strip()[:80]}"
    return None


def decide_what_to_run(training_args, raw, argv: list[str]) -> None:
    """Without ``--do_train`` / ``--do_eval`` on the command line, do what the data allows: train if there is a train
    split, evaluate if there is a validation split. (``TrainingArguments`` turns ``do_eval`` on by itself for an
    evaluation strategy, which must not stop training.)"""
    given = {argument.split("=")[0] for argument in argv}
    if training_args.do_predict:
        raise ValueError("--do_predict: these scripts have no test split to predict on; evaluate with --do_eval and "
                         "--validation_file, or write summaries with `longreach summarize --input FILE`.")
    if not {"--do_train", "--do_eval"} & given:
        training_args.do_train = "train" in raw
        training_args.do_eval = "validation" in raw
    for option, split, data in (("--do_train", "train", "--train_file"), ("--do_eval", "validation",
                                                                          "--validation_file")):
        if option in given and getattr(training_args, option[2:]) and split not in raw:
            raise ValueError(f"{option} needs {split} data: pass {data} (or a --dataset_name with a {split} split).")
    if not (training_args.do_train or training_args.do_eval):  # (it ended with no word, as if it had run)
        if {"--do_train", "--do_eval"} & given:
            raise ValueError(f"Nothing to run: --do_train and --do_eval are both off (the data has {sorted(raw)}); "
                             "turn one of them on.")
        raise ValueError(f"Nothing to run: the data has no train or validation split (it has {sorted(raw)}); pass "
                         "--train_file and/or --validation_file, or a --dataset_name with a train or validation split.")


def pop_option(argv: list[str], option: str) -> tuple[str | None, list[str]]:
    """The value of ``option`` on a command line (``--option VALUE`` or ``--option=VALUE``; the last one given, as
    argparse reads it) and the command line without it."""
    value, rest, skip = None, [], False
    for index, argument in enumerate(argv):
        if skip:
            skip = False
        elif argument == option and index + 1 < len(argv):
            value, skip = argv[index + 1], True
        elif argument.startswith(option + "="):
            value = argument[len(option) + 1:]
        else:
            rest.append(argument)
    return value, rest


def check_one_data_source(data_args) -> None:
    """``--dataset_name`` or ``--train_file`` / ``--validation_file``: given both, the files were dropped unread."""
    files = [f"--{name} {value}" for name in ("train_file", "validation_file")
             if (value := getattr(data_args, name, None)) is not None]
    if getattr(data_args, "dataset_name", None) is not None and files:
        raise ValueError(f"--dataset_name {data_args.dataset_name} and {' and '.join(files)}: give a dataset or data "
                         "files, not both (a dataset brings its own splits).")


def _holds_optimizer_state(checkpoint: Path) -> bool:
    """Whether a Trainer checkpoint can resume training as it was: its optimizer's state (``optimizer.pt``, FSDP's
    ``optimizer_0``, DeepSpeed's ``global_step*``); ``--save_only_model`` writes none."""
    return any(checkpoint.glob("optimizer*")) or any(checkpoint.glob("global_step*"))


def _state_is_whole(checkpoint: Path) -> bool:
    """Whether ``checkpoint/trainer_state.json`` is there and whole: a kill, a full disk or a machine crash while it
    was written leaves it empty or cut short (and ``Trainer.train`` would fail on it at every rerun)."""
    import json

    try:
        json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def _checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the ``checkpoint-N`` folders in ``output_dir``, the last first."""
    output_dir = Path(output_dir)
    return sorted(((int(match.group(1)), path) for path in output_dir.iterdir() if path.is_dir()
                   and (match := _CHECKPOINT.match(path.name))), reverse=True) if output_dir.is_dir() else []


def resume_checkpoint(training_args) -> str | None:
    """The checkpoint ``Trainer.train`` resumes from: ``--resume_from_checkpoint PATH``; ``True`` or ``last`` for the
    last complete one in ``--output_dir``; and, when not given, that same last complete checkpoint if the folder holds
    one (a rerun of the same command continues, as documented, instead of starting over and deleting the earlier
    checkpoints). A checkpoint is complete once ``trainer_state.json``, written last, is there and whole: one cut short
    by a crash is skipped."""
    asked = training_args.resume_from_checkpoint
    if asked is not None and str(asked).lower() not in ("true", "last"):
        return asked
    output_dir = Path(training_args.output_dir)
    steps = _checkpoints(output_dir)
    complete = [path for _, path in steps if _state_is_whole(path)]
    if not complete:
        if asked is not None:
            raise ValueError(f"--resume_from_checkpoint {asked}: {output_dir} holds no complete checkpoint.")
        return None
    last_step = next(step for step, path in steps if path == complete[0])
    skipped = [path.name for step, path in steps if step > last_step]
    if not _holds_optimizer_state(complete[0]) and finished_state(str(complete[0]), training_args) is None:
        # resumed, it would go on with a new optimizer and a restarted learning-rate schedule: another loss curve
        raise ValueError(f"--output_dir {output_dir}: {complete[0]} holds no optimizer state (saved with "
                         "--save_only_model), so training cannot continue as it was; pass --resume_from_checkpoint "
                         f"{complete[0]} to go on from its weights with a new optimizer, or another --output_dir.")
    if getattr(training_args, "process_index", 0) == 0:  # once, not once per process under torchrun
        print(f"Resuming from {complete[0]}" + (f" (skipping the incomplete {', '.join(skipped)})" if skipped else "")
              + "; pass another --output_dir to start over.", file=sys.stderr)
    return str(complete[0])


def check_checkpoint_matches(checkpoint: str | None, model, output_dir: str | Path) -> None:
    """A checkpoint to resume from holds this model: the same ``model_type`` and sizes in its ``config.json``.
    Another model's checkpoints (a folder reused for another run) would otherwise fail deep in the optimizer's state
    ("parameter group that doesn't match the size"), or load half the weights."""
    import json

    if checkpoint is None or not (Path(checkpoint) / "config.json").is_file():
        return
    saved = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    ours = model.config.to_dict()
    for field in ("model_type", "vocab_size", "d_model", "hidden_size", "num_layers", "num_decoder_layers",
                  "num_hidden_layers", "d_ff", "intermediate_size", "num_heads", "num_attention_heads"):
        if field in saved and field in ours and saved[field] != ours[field]:
            raise ValueError(f"--output_dir {output_dir}: {checkpoint} holds another model ({field} {saved[field]!r}, "
                             f"this one's {ours[field]!r}), so training cannot resume from it; pass another "
                             "--output_dir.")


def finished_state(checkpoint: str | None, training_args):
    """The ``TrainerState`` of ``checkpoint`` if its run is finished (None otherwise): it reached ``--max_steps``, or,
    for a run counted in epochs, the steps of its ``--num_train_epochs`` and as many epochs were asked for.
    ``Trainer.train`` would still run one more step from it (transformers checks ``max_steps`` only after a step), or
    none and save empty metrics over the run's, so a rerun of a finished command would replace what it saved."""
    from transformers import TrainerState

    state_file = Path(checkpoint) / "trainer_state.json" if checkpoint is not None else None
    if state_file is None or not state_file.is_file():
        return None
    state = TrainerState.load_from_json(str(state_file))
    if training_args.max_steps > 0:
        return state if state.global_step >= training_args.max_steps else None
    counted_in_epochs = state.max_steps > 0 and state.num_train_epochs >= training_args.num_train_epochs
    return state if counted_in_epochs and state.global_step >= state.max_steps else None


def train_or_resume(trainer, training_args) -> tuple[dict, int]:
    """``trainer.train()``, resumed from :func:`resume_checkpoint`, its metrics and state written to ``--output_dir``
    (``train_results.json``, ``trainer_state.json``); ``(metrics, global step)``. A checkpoint that already reached
    ``--max_steps`` is loaded, not trained on."""
    checkpoint = resume_checkpoint(training_args)
    check_checkpoint_matches(checkpoint, trainer.model, training_args.output_dir)
    state = finished_state(checkpoint, training_args)
    if state is not None:
        # with --load_best_model_at_end the run ended on its best checkpoint's weights, which are what it saved
        best = state.best_model_checkpoint if training_args.load_best_model_at_end else None
        weights = best if best is not None and Path(best).is_dir() else checkpoint
        if trainer.is_world_process_zero():
            goal = (f"--max_steps {training_args.max_steps}" if training_args.max_steps > 0
                    else f"--num_train_epochs {training_args.num_train_epochs:g}")
            print(f"{checkpoint} already reached {goal}: nothing to train; the weights of {weights} are loaded. "
                  f"Raising {goal.split()[0]} trains further from {checkpoint}, on the learning-rate schedule of the "
                  "longer run (its first step keeps the finished run's last rate, 0 for a decaying schedule).",
                  file=sys.stderr)
        trainer._load_from_checkpoint(weights)  # the weights, as train() loads them when it resumes
        trainer.state = state  # its step and epoch, which the evaluation reports
        return {}, state.global_step
    result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    return result.metrics, result.global_step


def check_best_model_metric(training_args, metrics: set[str]) -> None:
    """``--metric_for_best_model`` names a metric the evaluation computes (``metrics``, without the ``eval_``
    prefix): another name fails only after the first evaluation, with a KeyError deep in the Trainer."""
    name = training_args.metric_for_best_model
    if name is not None and name.removeprefix("eval_") not in metrics:
        raise ValueError(f"--metric_for_best_model {name}: the evaluation computes {sorted(metrics)} (with or without "
                         "the eval_ prefix).")


#: The weight files of a model saved with ``save_pretrained`` (one file or the index of its shards).
_WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)


def check_output_dir(output_dir: str | Path, training_args=None) -> None:
    """Before training: ``--output_dir`` gets a model card (``README.md``) at the end; one that is not a longreach card
    (the user's own), or one edited by hand, is refused now rather than overwritten then. With ``training_args``, a
    model an earlier run saved there is refused too when there is no checkpoint to resume from (``--save_strategy
    no``, or checkpoints deleted): the run would start again from the model it starts from and replace it when it
    saves."""
    from .hub import card_is_unedited, read_card_state

    readme = Path(output_dir) / "README.md"
    if readme.is_file() and read_card_state(readme) is None:
        raise ValueError(f"--output_dir {output_dir} holds a README.md that is not a longreach model card, which the "
                         "model card written after training would replace; move it away or pass another folder.")
    if readme.is_file() and not card_is_unedited(readme):
        raise ValueError(f"--output_dir {output_dir} holds a model card edited by hand since it was generated, which "
                         "the model card written after training would replace; move it away or pass another folder.")
    saved = [name for name in _WEIGHT_FILES if (Path(output_dir) / name).is_file()]
    if training_args is not None and training_args.resume_from_checkpoint is None and saved and \
            not any(_state_is_whole(path) for _, path in _checkpoints(output_dir)):
        raise ValueError(f"--output_dir {output_dir} holds the model an earlier run saved ({saved[0]}) and no "
                         "checkpoint to resume from: this run would start over and replace it. Pass another "
                         f"--output_dir (with --model_name_or_path {output_dir} to train that model further), or move "
                         "it away to start over.")


def hub_repo_id(training_args) -> str:
    """The repository ``--push_to_hub`` uploads to: ``--hub_model_id``, or the name of ``--output_dir`` (as Trainer),
    resolved: ``--output_dir .`` is the current folder's name, not an empty repository id."""
    return training_args.hub_model_id or Path(training_args.output_dir).expanduser().resolve().name


def create_hub_repo(training_args) -> None:
    """``--push_to_hub``: the examples upload after training (with longreach's model card), so the repository is
    created before it, as ``Trainer`` does: offline, an unreachable Hub or a missing login fail at once, not after the
    run. Only the first process creates it."""
    from . import hub
    from .corpus import _first_line

    if not training_args.push_to_hub or getattr(training_args, "process_index", 0) != 0:
        return
    api = hub.HfApi(token=training_args.hub_token, library_name="longreach")
    try:
        api.create_repo(hub_repo_id(training_args), private=training_args.hub_private_repo, exist_ok=True)
    except Exception as error:  # noqa: BLE001  (offline and HTTP errors are OSErrors, httpx's connection errors not)
        raise ValueError(f"--push_to_hub: cannot create the Hub repository {hub_repo_id(training_args)!r} that the "
                         f"model would be uploaded to after training ({_first_line(error)}); fix that (`hf auth "
                         "login`, the network), or leave --push_to_hub out and upload later with `longreach push`.") \
            from None


def upload_output_dir(training_args, repo_id: str):
    """Upload ``--output_dir`` (the model saved after training) to ``repo_id``; a failed upload says how to retry it."""
    from .corpus import _first_line
    from .hub import push_folder_to_hub

    try:
        return push_folder_to_hub(training_args.output_dir, repo_id, private=training_args.hub_private_repo,
                                  token=training_args.hub_token)
    except Exception as error:  # noqa: BLE001  (as in create_hub_repo)
        raise ValueError(f"--push_to_hub: the upload to {repo_id} failed ({_first_line(error)}); the model is saved "
                         f"in {training_args.output_dir}: upload it with `longreach push {training_args.output_dir} "
                         f"{repo_id}`.") from None


def check_not_the_model_folder(output_dir: str | Path, option: str, model_path: str | None) -> None:
    """``--output_dir`` must not be the folder the model is read from: saving there would replace its weights."""
    if model_path is not None and Path(model_path).expanduser().exists() and \
            Path(output_dir).expanduser().resolve() == Path(model_path).expanduser().resolve():
        raise ValueError(f"--output_dir {output_dir} is the {option} folder: training would overwrite the model it "
                         "starts from; pass another --output_dir.")


def check_training_arguments(training_args, max_train_samples: int | None, max_eval_samples: int | None) -> None:
    """What ``Trainer`` would take without a word (a run of no step, which still saves the model as fine-tuned) or
    fail on deep inside (a division by ``gradient_accumulation_steps`` 0), named by its option."""
    if training_args.gradient_accumulation_steps < 1:
        raise ValueError(
            f"--gradient_accumulation_steps must be >= 1, got {training_args.gradient_accumulation_steps}."
        )
    output_dir = Path(training_args.output_dir).expanduser()
    if output_dir.exists() and not output_dir.is_dir():  # ("[Errno 17] File exists" once the data was prepared)
        raise ValueError(f"--output_dir {training_args.output_dir} is a file, expected a folder (new or holding an "
                         "earlier run of this script) for the model, its checkpoints and metrics.")
    for option, value in (("--max_train_samples", max_train_samples), ("--max_eval_samples", max_eval_samples)):
        if value is not None and value < 1:
            raise ValueError(f"{option} must be >= 1 (or left out for all), got {value}.")
    asked = getattr(training_args, "resume_from_checkpoint", None)
    if training_args.do_train and asked is not None and str(asked).lower() not in ("true", "last") and \
            not Path(asked).is_dir():
        raise ValueError(f"--resume_from_checkpoint {asked}: no such checkpoint folder (or pass `last` for the last "
                         "complete checkpoint in --output_dir).")
    if training_args.do_train and training_args.max_steps <= 0 and training_args.num_train_epochs <= 0:
        raise ValueError(f"--num_train_epochs {training_args.num_train_epochs} with --max_steps "
                         f"{training_args.max_steps}: the run would train no step; give a positive value to one.")


def json_option(text: str | None, option: str) -> dict:
    """A JSON object given on the command line (``--config_overrides``, ``--dodo_config``); ``{}`` when not given."""
    import json

    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as error:
        raise ValueError(f"{option} is not valid JSON ({error.msg} at character {error.pos}): {text!r}; write e.g. "
                         '\'{"d_model": 256}\'.') from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object of config fields, got {text!r}.")
    return value


def check_columns(raw, columns: list[str], training_args, options: str) -> None:
    """Before the model loads: each split that will be used (train with ``--do_train``, validation with ``--do_eval``)
    has the ``columns``; a missing one is named with the split's columns and the ``options`` that set them."""
    for split, used in (("train", training_args.do_train), ("validation", training_args.do_eval)):
        missing = [column for column in columns if used and split in raw and column not in raw[split].column_names]
        if missing:
            raise ValueError(f"The {split} data has no column {missing[0]!r} (columns: {raw[split].column_names}); "
                             f"set {options}.")


def check_text_columns(dataset, columns: list[str], split: str) -> None:
    """Each value of ``columns`` is a string (an empty one included): a null, a number or a missing cell would
    otherwise fail in the tokenizer with a message that names neither the column nor the row. A string column of
    the Arrow table without nulls is known to pass without reading its rows."""
    for column in columns:
        feature = dataset.features.get(column)
        string_column = getattr(feature, "dtype", None) in ("string", "large_string")
        if string_column and dataset.data.column(column).null_count == 0:
            continue
        for row, value in enumerate(dataset[column]):  # read row by row (datasets' lazy Column), to name the row
            if not isinstance(value, str):
                raise ValueError(f"The {split} data: row {row} of column {column!r} is {value!r}, expected text.")


def check_questions(dataset, column: str, split: str, document_column: str | None = None) -> None:
    """Every question of ``column`` holds text (after :func:`check_text_columns`, which lets empty strings pass for
    documents and summaries), and with ``document_column`` so does the document it is asked of: an empty one would
    fail inside a batch of the tokenization (a question needs a document: VCC-T5's preparation refuses a blank one),
    named by its place in that batch."""
    for row, value in enumerate(dataset[column]):
        if not value.strip():
            raise ValueError(f"The {split} data: row {row} of column {column!r} is {value!r}, expected a question.")
    for row, value in enumerate(dataset[document_column] if document_column is not None else []):
        if not value.strip():
            raise ValueError(f"The {split} data: row {row} of column {document_column!r} is {value!r}, expected the "
                             "document its question is asked of.")


def check_documents(dataset, column: str, split: str) -> None:
    """Every document of ``column`` holds text, for a model whose summarization prompt refuses a blank one (Dodo's):
    it would fail inside a batch of the tokenization, named by its place in that batch."""
    for row, value in enumerate(dataset[column]):
        if not value.strip():
            raise ValueError(f"The {split} data: row {row} of column {column!r} is {value!r}, expected a document to "
                             "summarize.")


def first_text(dataset, column: str) -> int | None:
    """The index of the first row whose ``column`` holds non-blank text, or None."""
    return next((row for row, value in enumerate(dataset[column]) if isinstance(value, str) and value.strip()), None)


def exit_with_one_line_errors(main) -> None:
    """Run an example's ``main()``; a ``ValueError`` or ``OSError`` (a bad argument or file) ends it with
    ``error: MESSAGE`` and exit status 1 instead of a traceback (``--debug`` keeps the traceback)."""
    if "--debug" in sys.argv:
        sys.argv.remove("--debug")
        main()
        return
    try:
        main()
    except (ValueError, OSError) as error:
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
        sys.exit(f"error: {message} (run again with --debug for the traceback)")
