"""What the fine-tuning examples (``examples/finetune_summarization.py``, ``examples/finetune_dodo.py``) share around
``Trainer``: reading the data files, deciding what to run, resuming, and keeping what a user has in ``--output_dir``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: The datasets loader of each data file suffix.
DATA_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def load_data_files(train_file: str | None, validation_file: str | None):
    """A ``DatasetDict`` of the given files (``.json``/``.jsonl``/``.csv``/``.parquet``, read by their suffix); a file
    with no record, or of another kind, is a ``ValueError`` naming its option."""
    from datasets import load_dataset

    files = {split: (option, path) for split, option, path in (("train", "--train_file", train_file),
                                                               ("validation", "--validation_file", validation_file))
             if path is not None}
    if not files:
        raise ValueError("Pass --dataset_name, or --train_file and/or --validation_file (.json, .jsonl, .csv or "
                         ".parquet).")
    loaders = set()
    for option, path in files.values():
        suffix = Path(path).suffix.lower()
        if suffix not in DATA_LOADERS:
            raise ValueError(f"{option} {path}: expected a {' / '.join(DATA_LOADERS)} file, got {suffix or 'no suffix'}.")
        if not Path(path).is_file():
            raise ValueError(f"{option} {path}: no such file.")
        if Path(path).stat().st_size == 0:
            raise ValueError(f"{option} {path} is empty; it needs at least one record.")
        loaders.add(DATA_LOADERS[suffix])
    if len(loaders) > 1:
        raise ValueError(f"--train_file and --validation_file must be of one kind (json, csv or parquet), got "
                         f"{sorted(loaders)}.")
    raw = load_dataset(loaders.pop(), data_files={split: path for split, (_, path) in files.items()})
    for split, (option, path) in files.items():
        if len(raw[split]) == 0:
            raise ValueError(f"{option} {path} holds no record.")
    return raw


def decide_what_to_run(training_args, raw, argv: list[str]) -> None:
    """Without ``--do_train`` / ``--do_eval`` on the command line, do what the data allows: train if there is a train
    split, evaluate if there is a validation split. (``TrainingArguments`` turns ``do_eval`` on by itself for an
    evaluation strategy, which must not stop training.)"""
    if not {"--do_train", "--do_eval"} & {argument.split("=")[0] for argument in argv}:
        training_args.do_train = "train" in raw
        training_args.do_eval = "validation" in raw


def resume_checkpoint(training_args) -> str | None:
    """The checkpoint ``Trainer.train`` resumes from: ``--resume_from_checkpoint PATH``; ``True`` or ``last`` for the
    last complete one in ``--output_dir``; and, when not given, that same last complete checkpoint if the folder holds
    one (a rerun of the same command continues, as documented, instead of starting over and deleting the earlier
    checkpoints). A checkpoint is complete once ``trainer_state.json``, written last, is there: one cut short by a crash
    is skipped."""
    asked = training_args.resume_from_checkpoint
    if asked is not None and str(asked).lower() not in ("true", "last"):
        return asked
    output_dir = Path(training_args.output_dir)
    steps = sorted(((int(match.group(1)), path) for path in output_dir.iterdir() if path.is_dir()
                    and (match := _CHECKPOINT.match(path.name))), reverse=True) if output_dir.is_dir() else []
    complete = [path for _, path in steps if (path / "trainer_state.json").is_file()]
    if not complete:
        if asked is not None:
            raise ValueError(f"--resume_from_checkpoint {asked}: {output_dir} holds no complete checkpoint.")
        return None
    last_step = next(step for step, path in steps if path == complete[0])
    skipped = [path.name for step, path in steps if step > last_step]
    if getattr(training_args, "process_index", 0) == 0:  # once, not once per process under torchrun
        print(f"Resuming from {complete[0]}" + (f" (skipping the incomplete {', '.join(skipped)})" if skipped else "")
              + "; pass another --output_dir to start over.", file=sys.stderr)
    return str(complete[0])


def check_output_dir(output_dir: str | Path) -> None:
    """Before training: ``--output_dir`` gets a model card (``README.md``) at the end; one that is not a longreach card
    (the user's own) is refused now rather than overwritten then."""
    from .hub import read_card_state

    readme = Path(output_dir) / "README.md"
    if readme.is_file() and read_card_state(readme) is None:
        raise ValueError(f"--output_dir {output_dir} holds a README.md that is not a longreach model card, which the "
                         "model card written after training would replace; move it away or pass another folder.")
