"""Summarize a whole corpus: many documents, batched by length, resumable, sharded across processes.

    longreach summarize --model PATH_OR_REPO --input SRC --output OUT.jsonl [--max_batch_tokens N] [generation options]

``SRC`` is a text file, a folder of ``.txt`` / ``.md`` files (one document per file, its relative path as id), a
``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file or a Hub dataset name (``--split``, ``--text_column``,
``--id_column``, ``--reference_column``), all read with 🤗 datasets.

With ``--question TEXT`` (asked of every document) or ``--question_column`` (one question per record), VCC-T5 and Dodo
models answer the question instead of summarizing; the answer is the record's ``summary``, beside its ``question``.

* Throughput: documents are sorted by length and cut into batches whose padded size (rows x longest row) stays under
  ``max_batch_tokens``; each batch is one ``generate()`` call, so the encoder runs once per batch.
* Nothing is lost: every finished summary is appended to ``OUT`` as one JSON line (``id``, ``summary``,
  ``input_tokens``, ``truncated``, ``text_digest``) and flushed to disk batch by batch. Rerunning the same command skips
  the ids already in ``OUT`` (a line cut short by a crash is dropped and redone) whose text is the one summarized
  (:func:`text_digest`): a document edited since is summarized again, and its new record replaces the old one. A
  malformed record, or a document whose generation fails, goes to ``OUT.errors.jsonl`` with its id and the error, and
  the run goes on.
* Several processes (``torchrun`` / ``accelerate launch``: ``RANK`` and ``WORLD_SIZE``) split the documents; each
  appends to its own ``OUT.part-R-of-W.jsonl`` (resumable on its own) and rank 0 merges the parts into ``OUT``.
* With a reference column, ROUGE-1/2/Lsum (``rouge-score``) is printed and written to ``OUT.metrics.json``; answers
  to a question are also scored with SQuAD's exact match and F1. A reference may list several acceptable texts (a
  list of strings, or SQuAD's ``answers`` ``{"text": [...], ...}``): the best of them counts, as in SQuAD.
* What makes a summary (model, tokenizer, ``--max_input_length``, generation options, the question, the input and its
  text and id columns) is kept in ``OUT.settings.json``; a rerun with other settings is refused rather than mixing two
  runs in ``OUT``.
* One run at a time: a run holds ``OUT``'s lock (``.OUT.lock`` beside it) until its parts are merged; a second run
  on the same ``OUT`` is refused at once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
TABLE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
#: Files that are not one document's text, and what to do with them (read as text, a .tsv would be one document).
NOT_READ_SUFFIXES = {
    **dict.fromkeys((".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".tgz", ".7z"), "decompress it first"),
    ".tsv": "write it as .csv (comma-separated)",
    **dict.fromkeys((".ndjson", ".jsonlines"), "rename it to .jsonl (the same format)"),
    **dict.fromkeys((".xlsx", ".xls", ".ods", ".arrow", ".feather", ".pkl", ".pickle"),
                    "save it as .jsonl, .csv or .parquet"),
    **dict.fromkeys((".pdf", ".docx", ".doc", ".odt", ".rtf", ".epub"), "extract its text into a .txt file first"),
}


class CorpusError(ValueError):
    """The corpus cannot be read as asked; the message is one line that says what to change."""


@dataclass
class Corpus:
    """Documents to summarize (``ids``, ``texts``, optional ``references``; ``questions`` where each record asks its
    own) and the records that could not be read."""

    ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    references: list[str | list[str] | None] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    questions: list[str] | None = None

    def add(self, record_id: str, text, reference=None, question=None) -> None:
        fields = {"id": record_id, "text": text, "reference": reference, "question": question}
        for name, value in fields.items():
            if isinstance(value, str) and (position := _lone_surrogate(value)) is not None:
                # a JSON escape such as "\ud800" alone: no UTF-8 for it, so it could be neither read nor written
                self.errors.append({"id": _printable(record_id), "error": f"the {name} is not valid Unicode: a lone "
                                    f"surrogate U+{ord(value[position]):04X} at character {position}"})
                return
        if not isinstance(text, str) or not text.strip():
            self.errors.append({"id": record_id, "error": f"no text to summarize (got {type(text).__name__} "
                                                          f"{str(text)[:40]!r})"})
            return
        if self.questions is not None and (not isinstance(question, str) or not question.strip()):
            self.errors.append({"id": record_id, "error": f"no question (got {type(question).__name__} "
                                                          f"{str(question)[:40]!r})"})
            return
        self.ids.append(record_id)
        self.texts.append(text)
        self.references.append(_reference_texts(reference))
        if self.questions is not None:
            self.questions.append(question)


def text_digest(text: str, question: str | None = None) -> str:
    """A record's ``text_digest``: the first 16 hex digits of the SHA-256 of the document it summarizes (and of the
    question it answers, where there is one), so that a rerun tells an edited document from the one it summarized."""
    import hashlib

    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass"))
    if question is not None:
        digest.update(b"\0" + question.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def _reference_texts(reference) -> str | list[str] | None:
    """A record's reference: its text, or the list of its non-empty texts where it holds several acceptable answers (a
    list of strings, or 🤗 SQuAD's ``answers`` ``{"text": [...], "answer_start": [...]}``); None where it has none."""
    if isinstance(reference, dict):
        reference = reference.get("text")
    if isinstance(reference, str):
        return reference if reference.strip() else None  # "" = none
    if isinstance(reference, (list, tuple)):
        texts = [text for text in reference if isinstance(text, str) and text.strip()]
        return texts or None
    return None


def _lone_surrogate(text: str) -> int | None:
    """The position of the first lone UTF-16 surrogate in ``text`` (None if it has none)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as error:
        return error.start


def _printable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes, so that it can be written as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------------


def input_kind(source: str) -> str:
    """What ``--input`` names: ``"folder"``, ``"text"`` (one text file), ``"table"`` (a ``.jsonl`` / ``.json`` /
    ``.csv`` / ``.parquet`` file), ``"hub"`` (a Hub dataset name), ``"unsupported"`` (a file of a format that is not
    read, such as ``.tsv`` or ``.jsonl.gz``: see :func:`unsupported_input`) or ``"missing"`` (a local path that is not
    there: anything :func:`~longreach.hub.looks_like_local_path` calls a path, and a name with a text or table suffix
    that is not ``namespace/name``, such as a mistyped ``corpus.jsonl``)."""
    from .hub import looks_like_local_path

    path = Path(source).expanduser()
    if path.is_dir():
        return "folder"
    if path.is_file():
        if path.suffix.lower() in NOT_READ_SUFFIXES:
            return "unsupported"
        return "table" if path.suffix.lower() in TABLE_BUILDERS else "text"
    has_file_suffix = path.suffix.lower() in (*TABLE_BUILDERS, *TEXT_SUFFIXES)
    if looks_like_local_path(source) or (has_file_suffix and (source.count("/") != 1 or path.parent.exists())):
        return "missing"
    return "hub"


def unsupported_input(source: str) -> str:
    """The one-line message for ``--input`` naming a file of a format that is not read (:data:`NOT_READ_SUFFIXES`)."""
    suffix = Path(source).suffix.lower()
    return (f"--input {source}: {suffix} files are not read (only .txt / .md text and .jsonl / .json / .csv / "
            f".parquet tables); {NOT_READ_SUFFIXES[suffix]}.")


def read_corpus(source: str, *, split: str = "train", text_column: str = "text", id_column: str | None = None,
                reference_column: str | None = None, question_column: str | None = None) -> Corpus:
    """Read ``source`` (see the module docstring). Raises :class:`CorpusError` for what the user must change."""
    from .hub import HubAccessError, pretrained_location

    path = Path(source).expanduser()
    corpus = Corpus(questions=[] if question_column else None)
    kind = input_kind(source)
    if question_column and kind in ("folder", "text"):
        raise CorpusError(f"--question_column applies to table files and Hub datasets, not to --input {source}; "
                          "ask one question of every document with --question.")
    if kind == "folder":
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise CorpusError(f"--input {source}: the folder holds no {' / '.join(TEXT_SUFFIXES)} files.")
        for file in files:
            _add_text_file(corpus, file, _path_id(file.relative_to(path).as_posix()))
    elif kind == "text":
        _add_text_file(corpus, path, _path_id(path.name))
        if corpus.errors:
            raise CorpusError(f"--input {source}: {corpus.errors[0]['error']}")
    elif kind == "missing":
        raise CorpusError(f"--input {source}: no such file or folder.")
    elif kind == "unsupported":
        raise CorpusError(unsupported_input(source))
    else:
        import datasets

        if kind == "table":
            builder, arguments = TABLE_BUILDERS[path.suffix.lower()], {"data_files": str(path), "split": "train"}
        else:  # a Hub dataset
            try:
                pretrained_location(source, "--input dataset")
            except HubAccessError as error:
                raise CorpusError(str(error)) from None
            builder, arguments = source, {"split": split}
        # A JSONL file that datasets cannot read is read line by line below: its parser's error log would only alarm.
        json_log = logging.getLogger("datasets.packaged_modules.json.json")
        json_log_level = json_log.level
        if kind == "table" and path.suffix.lower() == ".jsonl":
            json_log.setLevel(logging.CRITICAL)
        try:
            table = datasets.load_dataset(builder, **arguments)
            if builder == "csv":  # read again as text: ids such as 001 stay "001" (pandas' guess: 1, or 1.0 near a gap)
                features = datasets.Features({name: datasets.Value("string") for name in table.column_names})
                # and as written: pandas' default missing-value words ("NA", "null", "nan", "None", ...) are text here
                # (Namibia's code, a document that says "None"); only an empty cell is missing
                table = datasets.load_dataset(builder, features=features, keep_default_na=False, **arguments)
            elif kind == "table" and builder == "json" and id_column and not _is_text_column(table, id_column):
                # Arrow reads a column of JSON numbers with one float in it as floats: 1 becomes "1.0" (an id that
                # changes when a 2.5 joins the file) and 2**53 + 1 becomes 2**53; numbers mixed with strings make a
                # column of JSON values whose strings are parsed again: "007" becomes 7. The ids as Python reads them.
                raw_ids = _json_values(path, id_column)
                if len(raw_ids) == len(table):
                    table = table.remove_columns(id_column).add_column(id_column, [
                        None if value is None else str(value) for value in raw_ids])
        except Exception as error:  # noqa: BLE001  datasets raises many types; the user gets its first line
            if kind == "table" and path.suffix.lower() == ".jsonl":
                table = _read_jsonl_lines(path, corpus)  # one bad line must not stop the run: read line by line
            elif kind == "table" and _holds_no_records(path):
                raise CorpusError(f"--input {source}: the file holds no records.") from None
            else:
                raise CorpusError(f"--input {source}: cannot be read as a dataset: {_first_line(error)}") from None
        finally:
            json_log.setLevel(json_log_level)
        columns = table.column_names
        if not columns and kind == "table":
            reason = f" ({corpus.errors[0]['id']}: {corpus.errors[0]['error']})" if corpus.errors else ""
            raise CorpusError(f"--input {source}: the file holds no records{reason}.")
        for name, option in ((text_column, "--text_column"), (id_column, "--id_column"),
                             (reference_column, "--reference_column"), (question_column, "--question_column")):
            if name is not None and name not in columns:
                raise CorpusError(f"{option} {name!r} is not a column of {source}; its columns are {columns}.")
        for index, row in enumerate(table):
            if row is None:  # a JSONL line that is not a JSON object (in the errors already): it keeps its row number
                continue
            if id_column and (row[id_column] is None or str(row[id_column]).strip() == ""):
                corpus.errors.append({"id": f"<row {index}>", "error": f"no id in --id_column {id_column!r}"})
                continue
            record_id = str(row[id_column]) if id_column else str(index)
            corpus.add(record_id, row[text_column], row[reference_column] if reference_column else None,
                       row[question_column] if question_column else None)
    seen, duplicates = set(), []
    for record_id in corpus.ids + [error["id"] for error in corpus.errors]:
        if record_id in seen:
            duplicates.append(record_id)
        seen.add(record_id)
    if duplicates:
        raise CorpusError(f"ids must be unique (they key the resumable output), but {len(duplicates)} repeat, e.g. "
                          f"{duplicates[:3]}: choose another --id_column.")
    return corpus


class _Rows(list):
    """The records of a JSONL file read line by line, with the ``column_names`` of a 🤗 dataset; a line that is not a
    JSON object is a ``None`` row, so that the rows after it keep the numbers (the default ids) they have once it is
    fixed and 🤗 datasets reads the whole file."""

    @property
    def column_names(self) -> list[str]:
        return list(dict.fromkeys(key for row in list.__iter__(self) if row is not None for key in row))

    def __iter__(self):
        columns = self.column_names
        return (None if row is None else {column: row.get(column) for column in columns}
                for row in list.__iter__(self))


def _read_jsonl_lines(path: Path, corpus: Corpus) -> _Rows:
    """The JSON objects of a JSONL file that 🤗 datasets could not read as a whole; each line that is not a JSON object
    goes to the corpus's errors (id ``<line N>``) and the rest is summarized."""
    rows = _Rows()
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as handle:  # -sig: a BOM is not the record's
        text = handle.read()
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            corpus.errors.append({"id": f"<line {number}>", "error": f"not JSON: {error.msg} (column {error.colno})"})
            rows.append(None)
            continue
        if not isinstance(record, dict):
            corpus.errors.append({"id": f"<line {number}>", "error": f"not a JSON object: {type(record).__name__}"})
            record = None
        rows.append(record)
    return rows


def _json_values(path: Path, column: str) -> list:
    """``column``'s value in each record of a JSON (an array of objects) or JSON Lines file, as Python's json reads
    them (integers stay integers); [] when the file is neither."""
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.split("\n") if line.strip()]
        except json.JSONDecodeError:
            return []
    if not isinstance(records, list) or not all(isinstance(record, dict) for record in records):
        return []
    return [record.get(column) for record in records]


def _is_text_column(table, name: str) -> bool:
    return getattr(table.features.get(name), "dtype", None) in ("string", "large_string")


def _holds_no_records(path: Path) -> bool:
    """Whether a table file is empty: no bytes, a CSV header alone, or a JSON ``[]`` (🤗 datasets' own message for
    these is about its splits)."""
    try:
        text = path.read_text(encoding="utf-8-sig", errors="replace").strip()
    except OSError:
        return False
    suffix = path.suffix.lower()
    return not text or (suffix == ".csv" and "\n" not in text) or (suffix == ".json" and text in ("[]", "{}"))


def _first_line(error: BaseException) -> str:
    """The error's first line; with the first line of its cause where it has one (🤗 datasets wraps the reader's own
    error, e.g. pandas' "Expected 2 fields in line 3, saw 3", in "An error occurred while generating the dataset")."""
    message = str(error).strip()
    line = message.splitlines()[0][:300] if message else type(error).__name__
    cause = error.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in message:
        line += f" ({str(cause).strip().splitlines()[0][:300]})"
    return line


def _path_id(relative_path: str) -> str:
    """A file's id: its relative path, with bytes that are not UTF-8 (file names are bytes on POSIX) written as
    ``\\xNN`` escapes so that the id can be written to the output as text."""
    return os.fsencode(relative_path).decode("utf-8", "backslashreplace")


def _add_text_file(corpus: Corpus, file: Path, record_id: str) -> None:
    try:
        # a byte order mark is not the text's (removed after decoding, so that an error's offset counts it)
        corpus.add(record_id, file.read_text(encoding="utf-8").removeprefix("\ufeff"))
    except UnicodeDecodeError as error:
        corpus.errors.append({"id": record_id, "error": f"{file} is not UTF-8 text (byte {error.object[error.start]:#04x} "
                                                        f"at offset {error.start}): convert it, e.g. with iconv"})
    except OSError as error:
        corpus.errors.append({"id": record_id, "error": f"cannot read {file}: {error.strerror}"})


# ---------------------------------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------------------------------


def plan_batches(lengths: list[int], max_batch_tokens: int, max_batch_size: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` grouped into batches, longest documents first (a batch that does not fit in memory shows
    at once), each with ``rows x longest row <= max_batch_tokens`` (a longer document is a batch of its own)."""
    if max_batch_tokens < 1:
        raise ValueError(f"`max_batch_tokens` must be a positive integer, got {max_batch_tokens}.")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"`max_batch_size` must be a positive integer or None, got {max_batch_size}.")
    batches, current, longest = [], [], 0
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        longest_after = max(longest, lengths[index])
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (longest_after * (len(current) + 1) > max_batch_tokens or full):
            batches.append(current)
            current, longest_after = [], lengths[index]
        current.append(index)
        longest = longest_after
    if current:
        batches.append(current)
    return batches


# ---------------------------------------------------------------------------------------------------------------------
# Resumable output
# ---------------------------------------------------------------------------------------------------------------------


#: How every line we write begins (``json.dumps`` of a record whose first key is ``id``).
_RECORD_START = b'{"id": '


class _Records(dict):
    """Records by id, as :func:`finished_records` read them, and how many complete lines held them (more than the
    records where an id was written twice)."""

    lines = 0


def finished_records(path: Path, repair: bool = True) -> _Records:
    """The complete JSON lines of ``path`` by id (a later line of an id replaces an earlier one; ``.lines`` counts
    them all). A last line cut short by a crash is redone: ``repair`` removes it from the file, once every complete
    line is known to be one of our records. Anything else (a file that is not one of our outputs) stops with an error
    and is left as it is."""
    records = _Records()
    if not path.exists():
        return records
    data = path.read_bytes()
    complete, tail = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1:]
    # after a machine crash a file's last block may read back as NUL bytes (its size was written, its data was not)
    cut_short = tail.rstrip(b"\0")
    # Split on "\n" only: str.splitlines() also splits on U+2028, U+2029 and U+0085, which ids and summaries may hold.
    for number, line in enumerate(complete.decode("utf-8", errors="replace").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record.get("summary"), str):
                raise KeyError("summary")
            records[str(record["id"])] = record
            records.lines += 1
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CorpusError(f"{path} line {number} is not one of our summary records; move the file away or choose "
                              "another --output.") from None
    if cut_short and not (cut_short.startswith(_RECORD_START) or _RECORD_START.startswith(cut_short)):
        raise CorpusError(f"{path} ends with a line that is not one of our summary records; move the file away or "
                          "choose another --output.")
    if tail and repair:
        with open(path, "r+b") as handle:
            handle.truncate(len(complete))
    return records


def _keep_latest(records: dict, found: dict, texts: dict[str, str]) -> None:
    """``records.update(found)`` (a later file's record of an id replaces an earlier one's), except that a record of
    the text read now (:func:`text_digest`; one without a digest counts as such, as for a rerun) is not replaced by
    one of another text: a part file left by an interrupted run may hold the summary of a document edited since, older
    than the record that a rerun with another process count wrote into ``OUT``."""

    def current(record: dict) -> bool:
        text = texts.get(str(record["id"]))
        return (text is None or "text_digest" not in record
                or record["text_digest"] == text_digest(text, record.get("question")))

    for record_id, record in found.items():
        if record_id not in records or current(record) or not current(records[record_id]):
            records[record_id] = record


def json_lines(path: Path) -> list[dict]:
    """The JSON objects of one of our JSONL files (split on newlines only, as :func:`finished_records` reads)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _append(handle, records: Iterable[dict]) -> None:
    for record in records:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def _write_atomically(path: Path, records: Iterable[dict] | None = None, text: str | None = None) -> None:
    """``path`` holds the ``records`` (JSON lines, synced) or the ``text``, or what it held before: written under a
    temporary name renamed into place, which a failure (a full disk) removes. Where ``path`` is a symlink, its target
    is written."""
    path = Path(os.path.realpath(path))  # a symlink's target is rewritten: the link itself stays
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if text is not None:
            temporary.write_text(text, encoding="utf-8")
        else:
            with open(temporary, "w", encoding="utf-8") as handle:
                _append(handle, records)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def part_path(output: Path, rank: int, world_size: int) -> Path:
    return output if world_size == 1 else output.with_name(f"{output.name}.part-{rank}-of-{world_size}.jsonl")


def part_files(output: Path, suffix: str = ".jsonl") -> dict[Path, int]:
    """Every part file of ``output`` on disk (``OUT.part-R-of-W.jsonl``, or with ``suffix=".errors.jsonl"`` their
    errors files), whatever W, with its W: a run with another process count than an interrupted one still counts that
    run's finished summaries."""
    pattern = re.compile(rf"{re.escape(output.name)}\.part-(\d+)-of-(\d+){re.escape(suffix)}")
    if not output.parent.is_dir():
        return {}
    return {path: int(match.group(2)) for path in sorted(output.parent.iterdir())
            if (match := pattern.fullmatch(path.name))}


def errors_path_of(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + ".errors.jsonl")


def settings_path_of(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl") + ".settings.json")


def lock_path_of(output: Path) -> Path:
    return output.with_name(f".{output.name}.lock")


@contextmanager
def output_lock(output: str | os.PathLike, rank: int = 0) -> Iterator[None]:
    """Hold ``OUT``'s run lock (``.OUT.lock`` beside it) while a run reads, appends to and merges its files: a second
    run on the same ``OUT`` (two terminals, an overlapping cron job) is refused with a :class:`CorpusError` instead of
    summarizing the same documents again, mixing its settings into ``OUT`` or merging parts that are still written.
    Each process of a ``torchrun`` run locks the byte of its ``rank``, so the processes of one run share the file; the
    kernel releases the lock of a killed run. Rank 0 removes the file when its run ends. Where there are no POSIX
    locks (Windows), runs are not guarded."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    output = Path(output)
    path = lock_path_of(output)
    while True:
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:  # a read-only folder or file system: said before the model loads
            raise CorpusError(f"cannot write --output {output}: {error.strerror or error} ({error.filename})") from None
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
        except OSError:
            os.close(descriptor)
            raise CorpusError(f"--output {output} is being written by another run (its lock {path} is held); wait for "
                              "it to end, or choose another --output.") from None
        try:  # the file we locked may have been removed by a run that just ended: lock the one now there
            if os.stat(path).st_ino == os.fstat(descriptor).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(descriptor)
    try:
        yield
    finally:
        if rank == 0:
            path.unlink(missing_ok=True)  # before the lock is released: a run that waits for it locks a new file
        os.close(descriptor)


#: Run settings recorded since a later version (the input and its columns, the model's weight files): an output whose
#: settings file lacks them was written before, and is finished without comparing them.
_ADDED_LATER = ("input", "text_column", "id_column", "split", "model_files")


def check_run_settings(output: str | os.PathLike, settings: dict, record: bool = True) -> bool:
    """Record in ``OUT.settings.json`` what makes a summary (model, tokenizer, input length, generation options, the
    input and its text and id columns), or, where ``OUT`` or its parts already hold summaries made with other
    settings, stop with a :class:`CorpusError` that names them: a rerun finishes a run, it never mixes two. Output of
    a version that wrote no settings is accepted. A file there that is not ours (``OUT``, its parts or its settings)
    is refused before anything is written. ``record=False`` only checks (the CLI, before the model loads: nothing is
    written for a run that then cannot start) and returns whether the settings are still to be written
    (:func:`write_run_settings`)."""
    output = Path(output)
    path = settings_path_of(output)
    for part in [output, *part_files(output)]:  # a file that is not our output is refused before anything is written
        finished_records(part, repair=False)
    has_records = any(p.exists() and p.stat().st_size for p in [output, *part_files(output)])
    recorded = None
    if path.exists():
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass
        if not has_records and not (isinstance(recorded, dict) and {"model", "generation"} <= set(recorded)):
            raise CorpusError(f"{path} exists and is not the settings file of a summary run; move it away or choose "
                              "another --output.")
    if has_records and path.exists():
        if isinstance(recorded, dict):  # settings that this version records and an earlier one did not: not compared
            settings = {key: value for key, value in settings.items() if key in recorded or key not in _ADDED_LATER}
        if recorded != settings:
            recorded = recorded if isinstance(recorded, dict) else {}
            changed = [f"{key}: {recorded.get(key)!r} then, {settings.get(key)!r} now"
                       for key in sorted(set(recorded) | set(settings)) if recorded.get(key) != settings.get(key)]
            raise CorpusError(f"--output {output} holds summaries made with other settings ({'; '.join(changed)}); "
                              "rerun with the same settings to finish it, or choose another --output.")
        return False
    if record:
        write_run_settings(output, settings)
    return not record


def write_run_settings(output: str | os.PathLike, settings: dict) -> None:
    """Write ``OUT.settings.json`` (atomically); :func:`check_run_settings` first."""
    output = Path(output)
    path = settings_path_of(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, text=json.dumps(settings, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------


def distributed_rank() -> tuple[int, int]:
    """``(rank, world_size)`` from the launcher's environment (torchrun / accelerate launch), ``(0, 1)`` alone."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def peak_memory_bytes(device) -> int:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource  # (Unix only: imported here, so that the module itself imports everywhere)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def summarize_corpus(
    summarizer,
    corpus: Corpus,
    output: str | os.PathLike,
    *,
    max_batch_tokens: int = 16384,
    max_batch_size: int | None = None,
    max_input_length: int | None = None,
    generate_kwargs: dict | None = None,
    question: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> dict:
    """Summarize this process's share of ``corpus`` with ``summarizer`` (a :class:`LongSummarizationPipeline`) into
    ``output`` (see the module docstring); returns the run's statistics. Call :func:`merge_parts` afterwards, as the
    command does: it merges the parts of ``world_size > 1`` processes, and leaves one line per id where a rerun
    appended the new record of an edited document. With ``question`` (asked of every document) or the corpus's own
    ``questions``, the records hold the answers."""
    import torch
    from tqdm.auto import tqdm

    if question is not None and corpus.questions is not None:
        raise ValueError("Pass `question` (one for every document) or a corpus with its own questions, not both.")
    sequences = (generate_kwargs or {}).get("num_return_sequences")
    if sequences not in (None, 1):
        raise ValueError(f"`num_return_sequences`={sequences!r}: a corpus record holds one summary per document; use "
                         "the summarization pipeline for several.")
    if question is not None:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"`question` must be non-empty text, got {question!r}.")
        summarizer._check_takes_questions()
        corpus = Corpus(corpus.ids, corpus.texts, corpus.references, corpus.errors, [question] * len(corpus.ids))
    elif corpus.questions is not None:
        summarizer._check_takes_questions()

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    target = part_path(output, rank, world_size)
    finished, texts = {}, dict(zip(corpus.ids, corpus.texts))  # by id, the record merge_parts will keep
    for path in dict.fromkeys([output, target]):  # one file when this process writes OUT itself: read once
        _keep_latest(finished, finished_records(path), texts)
    for part, part_world_size in part_files(output).items():
        if part_world_size != world_size:  # left by an interrupted run with another process count (merged at the end)
            _keep_latest(finished, finished_records(part, repair=False), texts)
    digests = [text_digest(text, corpus.questions[k] if corpus.questions is not None else None)
               for k, text in enumerate(corpus.texts)]
    # done: summarized from the text read now (records written before the digest existed count as done, as then)
    edited = {corpus.ids[k] for k, digest in enumerate(digests)
              if corpus.ids[k] in finished and finished[corpus.ids[k]].get("text_digest", digest) != digest}
    done = set(finished) - edited
    errors_path = errors_path_of(target)
    errors_path.unlink(missing_ok=True)  # this run's errors only: failed documents are tried again
    errors = [error for k, error in enumerate(corpus.errors) if k % world_size == rank]

    tokenizer, model = summarizer.tokenizer, summarizer.model
    lengths = token_counts(tokenizer, corpus.texts)
    if max_input_length is not None:
        lengths = [min(length, max_input_length) for length in lengths]
    if corpus.questions is not None:  # the question is read too (VCC-T5's input, Dodo's prompt)
        lengths = [length + count for length, count in zip(lengths, token_counts(tokenizer, corpus.questions))]
    by_length = sorted(range(len(corpus.texts)), key=lambda i: (-lengths[i], corpus.ids[i]))
    mine = [i for k, i in enumerate(by_length) if k % world_size == rank and corpus.ids[i] not in done]
    edited_mine = sum(corpus.ids[i] in edited for i in mine)
    batches = [[mine[j] for j in batch] for batch in plan_batches([lengths[i] for i in mine], max_batch_tokens,
                                                                  max_batch_size)]
    generate_kwargs = dict(generate_kwargs or {})
    if torch.cuda.is_available() and model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)

    start, documents, tokens, truncated = time.perf_counter(), 0, 0, 0
    bar = tqdm(total=len(mine), unit="doc", disable=not progress, file=sys.stderr,
               desc=f"rank {rank}" if world_size > 1 else "summarizing")
    with open(target, "a", encoding="utf-8") as handle:
        for batch in batches:
            try:
                records = _summarize_batch(summarizer, corpus, batch, max_input_length, generate_kwargs, digests)
            except Exception:  # noqa: BLE001  one document may be the cause: try them one by one
                records = []
                for index in batch:
                    try:
                        records += _summarize_batch(summarizer, corpus, [index], max_input_length, generate_kwargs,
                                                    digests)
                    except Exception as error:  # noqa: BLE001  reported with its id; the run goes on
                        errors.append({"id": corpus.ids[index], "error": f"{type(error).__name__}: {_first_line(error)}"})
            _append(handle, records)
            documents += len(records)
            tokens += sum(record["input_tokens"] for record in records)
            truncated += sum(record["truncated"] for record in records)
            bar.update(len(batch))
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(docs_per_s=f"{documents / elapsed:.2f}", tokens_per_s=f"{tokens / elapsed:.0f}",
                            refresh=False)  # redrawn at tqdm's own rate, not once per batch
    bar.close()
    if errors:
        with open(errors_path, "a", encoding="utf-8") as handle:
            _append(handle, errors)
    return {"documents": documents, "input_tokens": tokens, "truncated": truncated,
            "seconds": round(time.perf_counter() - start, 3),
            "skipped_already_done": len([i for k, i in enumerate(by_length) if k % world_size == rank]) - len(mine),
            "edited_since_summarized": edited_mine,
            "errors": len(errors), "peak_memory_bytes": peak_memory_bytes(model.device), "output": str(target),
            "errors_file": str(errors_path) if errors else None}


#: Characters of text tokenized at once by :func:`token_counts`.
TOKEN_COUNT_CHARACTERS = 2**20


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    """Each text's number of tokens, tokenized a slice of about ``TOKEN_COUNT_CHARACTERS`` characters at a time: the
    ids of a whole corpus at once, only to be counted, took about 170 bytes per token of peak memory (1 GB for 2,000
    documents of 3,000 words)."""
    counts, first = [], 0
    while first < len(texts):
        last, characters = first, 0
        while last < len(texts) and (last == first or characters + len(texts[last]) <= TOKEN_COUNT_CHARACTERS):
            characters += len(texts[last])
            last += 1
        counts += [len(ids) for ids in tokenizer(texts[first:last], return_attention_mask=False)["input_ids"]]
        first = last
    return counts


def _summarize_batch(summarizer, corpus: Corpus, batch: list[int], max_input_length, generate_kwargs,
                     digests: list[str]) -> list[dict]:
    import torch

    documents, questions = [corpus.texts[i] for i in batch], None
    if corpus.questions is None:
        inputs, dropped = summarizer._prepare_inputs(documents, max_input_length)
    else:
        questions = [corpus.questions[i] for i in batch]
        inputs, dropped = summarizer._prepare_inputs(documents, max_input_length, questions)
    # the caller's options, over a plain T5's `task_specific_params["summarization"]`, as the pipeline applies them
    options = summarizer._generate_options(generate_kwargs, summarizing=questions is None)
    with torch.inference_mode():
        output_ids = summarizer.model.generate(**inputs, **options)
    if not summarizer.model.config.is_encoder_decoder:
        output_ids = output_ids[:, inputs["input_ids"].shape[1]:]  # decoder-only: drop the prompt
    if output_ids.shape[0] != len(batch):  # the model's generation config returns several per document: the first
        output_ids = output_ids.reshape(len(batch), -1, output_ids.shape[1])[:, 0]
    # decoded by the pipeline's own `postprocess`: each summary ends at its first end token (a caller's end token that
    # is not special would otherwise stay, repeated where generate() filled a finished row with it)
    end = options.get("eos_token_id", getattr(options.get("generation_config"), "eos_token_id", None))
    summaries = [record["summary_text"] for record in
                 summarizer.postprocess({"output_ids": output_ids[None]}, eos_token_id=end)]
    # what the model reads of each document: Dodo's compressed context (its `attention_mask` is the decoder prompt's)
    mask = inputs["context_attention_mask"] if "context_attention_mask" in inputs else inputs["attention_mask"]
    read = mask.sum(dim=1).tolist()
    records = [{"id": corpus.ids[i], "summary": summary, "input_tokens": int(tokens), "truncated": count > 0,
                "text_digest": digests[i]} for i, summary, tokens, count in zip(batch, summaries, read, dropped)]
    for record, question in zip(records, questions or []):
        record["question"] = question
    return records


def merge_parts(output: str | os.PathLike, corpus: Corpus, world_size: int) -> list[dict]:
    """Rank 0, after every rank finished: the parts (this run's, and any an interrupted run with another process count
    left) and an earlier ``output`` merged into ``output`` in corpus order, written atomically (not rewritten when it
    already holds them all in that order: a rerun of a finished corpus); the part files are then removed, and
    ``OUT.errors.jsonl`` holds this run's errors only. Returns the records ``output`` holds, in its order."""
    output = Path(output)
    records = finished_records(output)
    in_output, lines = list(records.values()), records.lines
    parts = list(part_files(output))
    texts = dict(zip(corpus.ids, corpus.texts))
    for part in parts:
        _keep_latest(records, finished_records(part, repair=False), texts)
    order = {record_id: k for k, record_id in enumerate(corpus.ids)}
    merged = sorted(records.values(), key=lambda record: (order.get(str(record["id"]), len(order)), str(record["id"])))
    if merged != in_output or lines != len(merged):  # new, changed or reordered records, or an id written twice
        _write_atomically(output, merged)
    errors_file = errors_path_of(output)
    this_run = [errors_path_of(part_path(output, rank, world_size)) for rank in range(world_size)] if world_size > 1 else []
    if world_size > 1:
        found = [path for path in this_run if path.exists()]
        if found:
            _write_atomically(errors_file, [error for path in found for error in json_lines(path)])
        else:
            errors_file.unlink(missing_ok=True)  # an earlier run's errors were all retried in this one
    for path in dict.fromkeys(parts + this_run + list(part_files(output, ".errors.jsonl"))):
        path.unlink(missing_ok=True)
    return merged


def corpus_rouge(output: str | os.PathLike, corpus: Corpus, records: list[dict] | None = None) -> dict | None:
    """ROUGE-1/2/Lsum (``rouge-score``) of the summaries in ``output`` (or of its ``records``, as
    :func:`merge_parts` returns them: then the file is not read again) against the corpus's references, written to
    ``OUT.metrics.json`` (atomically); ``None`` without references. Where the records answer a question
    (``--question``, ``--question_column``), SQuAD's exact match and F1 of the answers too
    (:func:`longreach.metrics.answer_scores`)."""
    from .metrics import answer_scores, rouge_scores

    output = Path(output)
    records = finished_records(output) if records is None else {str(record["id"]): record for record in records}
    pairs = [(records[record_id]["summary"], reference) for record_id, reference in zip(corpus.ids, corpus.references)
             if reference is not None and record_id in records]
    if not pairs:
        return None
    predictions, references = [summary for summary, _ in pairs], [reference for _, reference in pairs]
    scores = rouge_scores(predictions, references)
    if any("question" in record for record in records.values()):
        scores.update(answer_scores(predictions, references))
    metrics = {**scores, "documents": len(pairs)}
    path = output.with_name(output.name.removesuffix(".jsonl") + ".metrics.json")
    _write_atomically(path, text=json.dumps(metrics, indent=2) + "\n")
    return metrics
