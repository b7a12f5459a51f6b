"""``longreach demo``: train a small LOCOST summarizer from scratch on this machine, offline, in a few minutes.

What it does, end to end, with no network and no argument:

1. **Data.** Builds a small long-document summarization set from text that is on every machine where longreach is
   installed (see :func:`build_corpus` for the provenance): the long descriptions of the installed Python
   distributions paired with their one-line ``Summary``, and the docstrings of the Python standard library paired
   with their first line (PEP 257's summary line). Documents and summaries are real text written by people; the split
   into training and held-out documents is a fixed hash of the document's name.
2. **Tokenizer.** Trains a byte-level BPE tokenizer on the training documents (T5 conventions: ``<pad>`` = 0,
   ``</s>`` = 1 appended to every sequence, ``<unk>`` = 2).
3. **Model.** A small LOCOST (gated bidirectional S4D encoder, T5 decoder) initialised from scratch, with short SSM
   timescales (see ``DemoSettings.ssm_dt_min``) so that what it learns on short training inputs holds on long ones,
   and log-length scaling of the cross-attention beyond its longest training input (see below).
4. **Lead pretraining** (self-supervised, training documents only, :func:`lead_pretraining_examples`): copy the first
   words of a text that starts at a sentence or a random word of a training document. ``Seq2SeqTrainer`` with
   ``DataCollatorForSeq2Seq`` (progress bar and loss on the way).
5. **Summarization training** on the (document, summary) pairs, mixed with copy pairs so the model keeps copying.
6. **Evaluation.** Summaries of the held-out documents (never trained on, read whole) with ``generate()``, scored
   with ROUGE-1/2/Lsum (``rouge_score``), next to the lead baseline (the document's first statement, 12 words at most),
   and the ROUGE-1 margin over it with its paired bootstrap interval over the documents
   (:func:`paired_bootstrap_interval`).
7. **Hub-ready save** to ``--output_dir`` (``./longreach-demo`` by default, kept): weights (safetensors), code files,
   ``auto_map``, ``custom_pipelines``, tokenizer and model card, written beside the folder and renamed into place. A
   rerun replaces a model an earlier demo left there; any other non-empty folder is refused before training.
8. **Reload** through ``pipeline("summarization", model=DIR, trust_remote_code=True)`` and summary of the longest
   held-out document, read whole, beside its reference and its lead.
9. **Corpus command** (``longreach summarize --input ... --output ...``) on the held-out set; its first lines.

The result depends on the Python version, the installed distributions, the thread count and the CPU's vector
instructions (the last two through floating-point summation order: AVX2 and AVX-512 machines train different weights);
on one machine, two runs give the same numbers. An AVX-512 machine repeats an AVX2 machine's run when torch, MKL and
oneDNN are held to AVX2 (``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``): that
reproduced the AVX2 machine's run installed as the README says, below (20.64 / 4.47 / 17.48, the same summary; code of
334b425 with its parent's README, as installed then), to the last digit.

Measured with the defaults (1,000 lead-pretraining steps, 1,000 summarization steps) on 2026-11-27, on a 2-core AMD
EPYC machine with AVX-512 (Python 3.11, torch 2.13 CPU), otherwise idle, in two environments (the corpus depends on
what is installed, so the two trained on different data and are two draws of the same recipe):

- installed exactly as the README says (``pip install -e ".[train]"``: 1,426 training and 39 held-out documents): 257 s
  from the first stage to the end (4 min 21 s wall clock with Python's start-up; lead pretraining 101 s, summarization
  150 s, evaluation 1 s), peak RSS 2.2 GB; held-out ROUGE-1/2/Lsum 21.49 / 5.44 / 18.09 against the lead's 20.04 / 5.27
  / 17.27 (1.45 above the lead in ROUGE-1); the longest held-out document (1,272 tokens) summarized "multiprocess:
  better multiprocessing and multithreading in Python" (reference "better multiprocessing and multithreading in
  Python");
- in the repository's development environment (the test extras add matplotlib and with it fonttools: 1,433 training
  and 40 held-out documents): 255 s (4 min 20 s wall clock), held-out 20.43 / 4.96 / 17.50 against the lead's 20.21 /
  5.52 / 17.50, 0.22 above the lead; the longest held-out document (fonttools, 5,717 tokens) summarized "What is this?
  fontTools is a library for manipulating fonts, written in Python." (reference "Tools to manipulate font files"; the
  lead skips the question, the model copied it);
- the same two, with torch, MKL and oneDNN held to AVX2 as above (the AVX2 machine's numbers, by that check): installed
  as the README says 20.13 / 3.80 / 16.39 against the lead's 20.04 / 5.27 / 17.27, 0.09 above the lead, the longest
  held-out document summarized "multiprocess: better multiprocessing in Python About Multiprocess is a for", in 258 s;
  in the development environment 19.56 / 4.05 / 16.34 against 20.21 / 5.52 / 17.50, 0.65 under the lead, in 256 s.

Since 2026-11-27 the demo also prints the ROUGE-1 margin's 95% paired bootstrap interval over the held-out documents
(:func:`paired_bootstrap_interval`); computed from the saved summaries of the first two runs above, -0.38 to +3.66 and
-2.45 to +2.68: with 39 or 40 documents, each of these margins is a draw with the lead. Scored on every training
document instead (nine folds of ``benchmarks/demo_recipe.py``, each leaving another tenth of them out of training; 365
documents), the recipe was 0.74 under the lead (-1.62 to -0.01): in expectation it sits just under the lead, mostly on
the READMEs (``benchmarks/results/demo.md``).

Before 2026-11-27 the corpus also held this library's own README (its long description, which quotes held-out
documents, a held-out reference summary and the demo's results) and two standard-library docstrings that repeat a
held-out one's opening; :func:`build_corpus` leaves them out now. The same defaults with them: on a slower 2-core AMD
EPYC machine with AVX2 only, 20.64 against the lead's 20.04 installed as the README says and 19.84 against 20.21 in
the development environment, in 497 s (8 min 26 s wall clock; lead pretraining 197 s, summarization 272 s) and 517 s;
on the AVX-512 machine above, 19.89 and 19.83 against 20.04 installed as the README says and 20.81 against 20.21 in
the development environment, in 248-267 s. The ten-minute budget is set by the slower machine: the data are the same
size (three documents fewer), so its time holds.

Over those nine runs of the present defaults and one more (installed as the README says, with one thread: 20.45 against
20.04 in 416 s) the margins over the lead were +0.60, -0.37, -0.15, -0.21, +0.60, +1.45, +0.22, +0.09, -0.65 and +0.41:
above the lead in six, under it in four, about a point either way, as ten runs of the earlier defaults predicted (their
mean was the lead's score). The model learns to copy a document's opening, with a few copy errors, and to read documents
ten times longer than its training inputs through log-length scaling of the cross-attention
(``LocostConfig.cross_attention_logn_length``); it does not write abstractive summaries. The lead pretraining went from
1,500 to 1,000 steps on 2026-11-26 (and the evaluation from ``Seq2SeqTrainer.predict``, 53 s, to batches of similar
lengths, 4 s, the same summaries) to stay under ten minutes on a slow day. The record of the earlier runs, of what the
scaling changed and of the forty or so recipes tried is ``benchmarks/results/demo.md``.

The workflow is the one to use with a converted, pretrained LOCOST (``examples/finetune_summarization.py``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import site
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .metrics import rouge_per_document, rouge_scores

#: Held-out documents have at least this many words (they stand for "long documents"); training documents may be
#: shorter (``DemoSettings.min_training_words``).
MIN_DOCUMENT_WORDS = 80
#: Corpus documents keep at most this many words (the corpus is built here; the model itself reads any length).
MAX_DOCUMENT_WORDS = 2500
#: One document in HELD_OUT_EVERY goes to the held-out set (by hash of its name).
HELD_OUT_EVERY = 10
#: This library's distribution name: its README is not a corpus document (see :func:`distribution_examples`).
_OWN_NAME = "longreach"

#: Where the demo keeps its model when no --output_dir is given (relative to the current directory).
DEFAULT_OUTPUT_DIR = "longreach-demo"
#: The model card of a folder written by the demo contains this; only such folders are replaced by a rerun.
_DEMO_CARD_MARK = "Trained from scratch by `longreach demo`"


class DemoError(RuntimeError):
    """The demo cannot run on this machine (missing extras, too little local text)."""


class OutputDirError(DemoError):
    """The output folder holds something the demo did not write (a usage error: pick another folder)."""


def _written_by_demo(folder: Path) -> bool:
    card = folder / "README.md"
    return card.is_file() and _DEMO_CARD_MARK in card.read_text(encoding="utf-8", errors="replace")


#: What a demo run writes beside its model folder, in ``<output_dir>-heldout`` (the held-out set, summarized).
HELD_OUT_FILES = {"documents.jsonl", "documents.tmp", "summaries.jsonl", "summaries.errors.jsonl",
                  "summaries.metrics.json", "summaries.settings.json"}


def held_out_dir(output_dir: Path) -> Path:
    return output_dir.with_name(output_dir.name + "-heldout")


def _demo_model_files() -> set[str]:
    """The names a demo run writes into its model folder: the weights, config, tokenizer and card, and the code files
    of a Hub-ready LOCOST folder (those of this version, plus the names earlier versions wrote)."""
    from .modeling.remote_code import collect_flat_sources

    code = collect_flat_sources(["longreach.modeling.modeling_locost", "longreach.configuration.configuration_locost",
                                 "longreach.pipelines.pipeline_summarization"])
    return set(code) | {"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "special_tokens_map.json", "training_args.bin"}


def _foreign_files(folder: Path, ours: set[str]) -> list[str]:
    """Names in ``folder`` that a demo run did not write (its own temporary files, ``.name...``, count as its own)."""
    return sorted(path.name for path in folder.iterdir()
                  if path.name not in ours and not any(path.name.startswith(f".{name}") for name in ours))


def check_output_dir(output_dir: Path) -> None:
    """Before minutes of training: the demo may write ``output_dir`` (it does not exist, is empty, or holds an earlier
    demo model and nothing else) and ``<output_dir>-heldout`` beside it (the same), and can create them there."""
    shown, given = str(output_dir), output_dir.expanduser()
    output_dir = output_dir.expanduser().resolve()
    if output_dir == Path.cwd().resolve() or output_dir.parent == output_dir:
        raise OutputDirError(f"--output_dir {shown!r} is the current folder or a root; the demo replaces its folder "
                             "whole, so pass a folder of its own (e.g. --output_dir longreach-demo).")
    for link in (given, held_out_dir(given)):
        if link.is_symlink():  # the demo replaces the folder itself (the link), and checked the target's neighbour
            raise OutputDirError(f"--output_dir {shown!r}: {str(link)!r} is a symbolic link (to "
                                 f"{os.readlink(link)!r}); the demo replaces its folders whole, so pass the folder "
                                 "itself or a new one.")
    ancestor = output_dir.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputDirError(f"--output_dir {shown!r}: {str(ancestor)!r} is a file, not a folder.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputDirError(f"--output_dir {shown!r}: cannot write in {str(ancestor)!r}; pass a folder you can write.")
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputDirError(f"--output_dir {shown!r} is a file; pass a folder path (it is created).")
    if output_dir.is_dir() and any(output_dir.iterdir()):
        if not _written_by_demo(output_dir):
            raise OutputDirError(f"--output_dir {shown!r} is not empty and was not written by the demo; pass an "
                                 "empty or new folder (e.g. --output_dir longreach-demo-2).")
        foreign = _foreign_files(output_dir, _demo_model_files())
        if foreign:
            raise OutputDirError(f"--output_dir {shown!r} holds an earlier demo model and files the demo did not write "
                                 f"({', '.join(foreign[:5])}), which a rerun would delete; move them away or pass "
                                 "another folder.")
    beside = held_out_dir(output_dir)
    if beside.exists() and not beside.is_dir():
        raise OutputDirError(f"--output_dir {shown!r}: {str(beside)!r}, where the demo writes the held-out set, is a "
                             "file; move it away or pass another folder.")
    if beside.is_dir():
        foreign = _foreign_files(beside, HELD_OUT_FILES)
        if foreign:
            raise OutputDirError(f"--output_dir {shown!r}: {str(beside)!r}, where the demo writes the held-out set, "
                                 f"holds files the demo did not write ({', '.join(foreign[:5])}); move them away or "
                                 "pass another folder.")


@contextlib.contextmanager
def _replaced_atomically(output_dir: Path):
    """Yield a staging folder beside ``output_dir``; on success it takes the place of ``output_dir`` by renames, so
    the folder is never half-written (an earlier demo model there is removed only once the new one is in place)."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the kept folder gets the usual permissions
    try:
        yield staging
        previous = None
        if output_dir.exists():
            previous = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
            os.replace(output_dir, previous / output_dir.name)
        os.replace(staging, output_dir)
        if previous is not None:
            shutil.rmtree(previous)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass(frozen=True)
class DemoSettings:
    """Sizes and schedule of one demo run (the defaults: 497-517 s end to end on a slow 2-core CPU machine, 248-267 s
    on a faster one; see the module docstring)."""

    vocab_size: int = 4000
    d_model: int = 128
    d_state: int = 32
    num_layers: int = 2
    num_decoder_layers: int = 2
    num_heads: int = 4
    d_ff: int = 256
    dropout_rate: float = 0.0
    #: Initial SSM step sizes: timescales 1/(0.5·Δ) of 4 to 67 tokens (the released default, Δ from 1e-3, reaches
    #: 2,000 tokens). A model trained on inputs of 48 to 128 tokens then reads documents of thousands of tokens as it
    #: read its training inputs; with the default timescales it wrote garbage beyond its training length (measured).
    ssm_dt_min: float = 0.03
    ssm_dt_max: float = 0.5
    batch_size: int = 32
    #: Training documents may be shorter than the held-out ones (which have at least MIN_DOCUMENT_WORDS words).
    min_training_words: int = 15
    max_train_documents: int | None = None
    # Stage 1, lead pretraining (self-supervised on the training documents): copy the first words of a text.
    lead_pretraining_steps: int = 1000
    lead_learning_rate: float = 2e-3
    lead_source_length: int = 48
    lead_words: int = 12
    lead_random_windows: int = 8
    # Stage 2, summarization: document -> its summary.
    max_source_length: int = 128
    max_target_length: int = 32
    learning_rate: float = 5e-4
    max_steps: int = 1000
    copy_examples_per_summary: float = 4.0
    max_eval_documents: int = 48
    generation_max_new_tokens: int = 32
    #: Beam search, without `no_repeat_ngram_size`: the summaries copy names that repeat in a document's opening
    #: ("Blinker Blinker provides ..."), and a ban on repeated BPE 3-grams broke them ("Blinker Blin6 a fast dis.").
    generation_num_beams: int = 4


SMOKE_SETTINGS = DemoSettings(
    vocab_size=400, d_model=32, d_state=8, num_layers=1, num_decoder_layers=1, num_heads=2, d_ff=64, batch_size=4,
    max_train_documents=40, lead_pretraining_steps=2, lead_random_windows=1, max_source_length=128,
    max_target_length=16, learning_rate=1e-3, max_steps=2, max_eval_documents=4, generation_max_new_tokens=8,
)


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------

_FENCED_CODE = re.compile(r"^\s*(```|~~~).*?^\s*\1[^\n]*$", re.M | re.S)
_MARKDOWN_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_RST_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")
_URL = re.compile(r"https?://\S+")
_HTML_TAG = re.compile(r"<[^>\n]+>")
_DROPPED_LINE = re.compile(
    r"^\s*(\.\. |\|[\w -]+\||:\w+:|[=\-~^*#+`'\"_.:]{3,}\s*$|\[!\[|<img|<a |<p |</|<!--)"
)


_SECTION_ADORNMENT = re.compile(r"^\s*([=\-~^*#+`'\"_.:])\1{2,}\s*$")


def _drop_section_adornments(text: str) -> str:
    """Remove title underlines and overlines (reStructuredText sections, Markdown setext headings): a line of one
    repeated punctuation character at least as long as the title line above it, or such a line two lines above an
    identical one (an overline). Done before code fences are found: a "~~~~" underline does not open a code block."""
    lines = text.splitlines()
    adornment = [bool(_SECTION_ADORNMENT.match(line)) for line in lines]
    keep = []
    for index, line in enumerate(lines):
        previous = lines[index - 1].strip() if index else ""
        underline = adornment[index] and previous and not adornment[index - 1] and len(previous) <= len(line.strip())
        overline = (adornment[index] and index + 2 < len(lines) and lines[index + 2].strip() == line.strip()
                    and 0 < len(lines[index + 1].strip()) <= len(line.strip()))
        if not (underline or overline):
            keep.append(line)
    return "\n".join(keep)


def clean_text(text: str) -> str:
    """Markdown/reStructuredText to plain prose: no code blocks, directives, badges, tags, URLs or underlines."""
    text = _FENCED_CODE.sub(" ", _drop_section_adornments(text))
    lines = [line for line in text.splitlines() if not _DROPPED_LINE.match(line)]
    text = "\n".join(lines)
    text = _MARKDOWN_LINK.sub(r"\1", text)
    text = _RST_LINK.sub(r"\1", text)
    text = _URL.sub(" ", text)
    text = _HTML_TAG.sub(" ", text)
    text = re.sub(r"[*`#|]+", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def _example(source: str, name: str, document: str, summary: str, min_words: int) -> dict | None:
    document, summary = clean_text(document), clean_text(summary)
    words = document.split()
    if len(words) < min_words or len(summary.split()) < 3 or summary.upper() == "UNKNOWN":
        return None
    return {"source": source, "name": name, "document": " ".join(words[:MAX_DOCUMENT_WORDS]), "summary": summary}


def _site_directories() -> list[str]:
    """Where ``pip install`` puts distributions: this environment's site-packages, the user's, and the base
    interpreter's when a virtual environment includes them (``--system-site-packages``). Not the vendored copies some
    packages add to ``sys.path`` at run time, which would make the corpus depend on what was imported before."""
    paths = sysconfig.get_paths()
    on_path = [entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")]
    directories = [paths["purelib"], paths["platlib"], site.getusersitepackages(), *on_path]
    return [d for d in dict.fromkeys(directories) if Path(d).is_dir()]


def distribution_examples(min_words: int = MIN_DOCUMENT_WORDS) -> list[dict]:
    """(long description, ``Summary``) of every installed distribution but this library, once per distribution name
    (longreach's description is the project's README, which quotes the demo's held-out documents, a held-out summary
    and the demo's results: held-out text that would be trained on, and that changes with every edit of the README)."""
    examples = {}
    for distribution in metadata.distributions(path=_site_directories()):
        meta = distribution.metadata
        name = (meta.get("Name") or "").strip()
        if not name or name.lower() in examples or name.lower() == _OWN_NAME:
            continue
        description = meta.get_payload() or meta.get("Description") or ""
        example = _example("distribution", name, description, meta.get("Summary") or "", min_words)
        if example is not None:
            examples[name.lower()] = example
    return [examples[key] for key in sorted(examples)]


#: Packages of generated data, tools and demos rather than documented library code.
_SKIPPED_STDLIB_PACKAGES = {"idlelib", "pydoc_data", "lib2to3", "turtledemo", "ensurepip", "encodings", "test",
                            "tkinter"}


def _documented_nodes(tree: ast.Module):
    """The module, its classes and functions, and their methods (not functions nested in functions)."""
    yield tree
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
            if isinstance(node, ast.ClassDef):
                pending.extend(node.body)


def stdlib_docstring_examples(min_words: int = MIN_DOCUMENT_WORDS) -> list[dict]:
    """(docstring body, summary line) of the standard library's modules, classes and functions (PEP 257 layout:
    summary line, blank line, body). Sources are parsed with ``ast``; nothing is imported."""
    examples = []
    stdlib = [sysconfig.get_paths()["stdlib"]]
    for module_name in sorted(sys.stdlib_module_names):
        if module_name.startswith("_"):
            continue
        # The path finder on the stdlib folder only: no import hooks (setuptools' distutils shim would change sys.path).
        spec = importlib.machinery.PathFinder.find_spec(module_name, stdlib)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        paths = [Path(spec.origin)]
        if spec.submodule_search_locations and module_name not in _SKIPPED_STDLIB_PACKAGES:
            paths += sorted(Path(spec.origin).parent.glob("*.py"))[:40]  # a package: its own modules too
        for path in paths:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module_path = module_name if path == Path(spec.origin) else f"{module_name}.{path.stem}"
            for node in _documented_nodes(tree):
                docstring = ast.get_docstring(node)
                lines = (docstring or "").strip().splitlines()
                if len(lines) < 3 or lines[1].strip():
                    continue
                name = f"{module_path}:{getattr(node, 'name', '<module>')}:{getattr(node, 'lineno', 0)}"
                example = _example("stdlib", name, "\n".join(lines[2:]), lines[0], min_words)
                if example is not None:
                    examples.append(example)
    return examples


def document_bucket(example: dict) -> int:
    """The example's split bucket, a fixed hash of its source and name modulo ``HELD_OUT_EVERY`` (0: held out)."""
    return int(hashlib.sha256(f"{example['source']}:{example['name']}".encode()).hexdigest(), 16) % HELD_OUT_EVERY


def build_corpus(min_training_words: int = MIN_DOCUMENT_WORDS) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` examples with keys ``source``, ``name``, ``document``, ``summary``.

    Provenance: ``importlib.metadata`` (the ``Summary`` and long description of each installed distribution, as
    written by its authors in its package metadata) and the standard library's source files (docstrings). Exact
    duplicates of a document are kept once. Held out: the documents whose name hashes to 0 modulo
    ``HELD_OUT_EVERY`` and that have at least ``MIN_DOCUMENT_WORDS`` words; training documents need
    ``min_training_words``. The split depends on the name only, so the held-out set is the same for any
    ``min_training_words``.

    So that no held-out text is trained on, this library's own README is not a document
    (:func:`distribution_examples`), and no training document contains a held-out document's summary or lead
    (:func:`without_overlap`; measured: two standard-library docstrings that repeat a held-out one's opening).
    """
    min_words = min(min_training_words, MIN_DOCUMENT_WORDS)
    train, held_out, seen = [], [], set()
    for example in distribution_examples(min_words) + stdlib_docstring_examples(min_words):
        if example["document"] in seen:
            continue
        seen.add(example["document"])
        words = len(example["document"].split())
        if document_bucket(example) == 0:
            if words >= MIN_DOCUMENT_WORDS:
                held_out.append(example)
        elif words >= min_training_words:
            train.append(example)
    return without_overlap(train, held_out), held_out


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


def without_overlap(train: list[dict], evaluated: list[dict], min_words: int = 4) -> list[dict]:
    """The ``train`` examples whose document contains no evaluated document's summary or lead
    (:func:`lead_baseline`) of at least ``min_words`` words, case, whitespace and final punctuation ignored:
    near-duplicates across the split (a docstring repeated in a sibling function, a README that quotes a held-out
    summary) are not trained on."""
    quoted = {_normalized(text).rstrip(".!?:;, ") for example in evaluated
              for text in (example["summary"], lead_baseline(example["document"]))}
    quoted = [text for text in quoted if len(text.split()) >= min_words]
    kept = []
    for example in train:
        document = _normalized(example["document"])
        if not any(text in document for text in quoted):
            kept.append(example)
    return kept


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and metrics
# ---------------------------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts``, with T5's special tokens and ids
    (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2) and ``</s>`` appended to every sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    # the space that add_prefix_space puts before the first word is taken off again when decoding
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", backend.token_to_id("</s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False, model_max_length=1_000_000,
    )


#: Where one sentence ends and the next begins (after ".", "!" or "?").
_SENTENCE_BOUNDARY = re.compile(r"(?<=[.!?])\s+")


def lead_sentence(document: str) -> str:
    """The document's first sentence that is a statement: questions ("What is this?") and sentences of fewer than
    three words (headings such as "Overview.") are skipped; the first sentence if every one is."""
    sentences = _SENTENCE_BOUNDARY.split(document.strip())
    for sentence in sentences:
        if not sentence.endswith("?") and len(sentence.split()) >= 3:
            return sentence
    return sentences[0]


def lead_baseline(document: str, num_words: int = 12) -> str:
    """The usual extractive baseline: the document's first sentence (:func:`lead_sentence`), at most ``num_words``
    words."""
    return " ".join(lead_sentence(document).split()[:num_words])


def lead_pretraining_examples(train: list[dict], num_words: int, random_windows: int, seed: int,
                              document_starts: bool = True) -> list[dict]:
    """Self-supervised (text, target) pairs from the *training* documents: the text from each sentence start, with
    its lead (:func:`lead_baseline`) as target, and from ``random_windows`` random word positions per document, with
    the next ``num_words`` words as target. Summaries are not used; ``document_starts=False`` leaves out the pairs that
    begin where a document begins (mixed with the summaries, where the document's start must map to its summary).

    Learning to copy is what a model trained from scratch lacks first, and what a summarizer of these documents
    builds on (the lead is a strong baseline here): the "Lead" self-supervised objective of PEGASUS (Zhang et al.,
    2020) applied at every sentence."""
    import random

    rng = random.Random(seed)
    pairs = []
    for example in train:
        words = example["document"].split()
        start = 0
        for sentence in _SENTENCE_BOUNDARY.split(example["document"].strip()):
            text = words[start:]
            if len(text) >= 15 and (start or document_starts):
                pairs.append({"document": " ".join(text), "summary": lead_baseline(" ".join(text), num_words)})
            start += len(sentence.split())
        for _ in range(random_windows if len(words) >= 30 else 0):
            start = rng.randrange(1 - int(document_starts), len(words) - 15)
            pairs.append({"document": " ".join(words[start:]), "summary": " ".join(words[start:start + num_words])})
    rng.shuffle(pairs)
    return pairs


# ---------------------------------------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------------------------------------


def build_model(settings: DemoSettings, tokenizer, train: list[dict]):
    """The demo's LOCOST, initialised from scratch, with its generation settings."""
    from .configuration.configuration_locost import LocostConfig
    from .modeling.modeling_locost import LocostForConditionalGeneration

    config = LocostConfig(
        vocab_size=len(tokenizer), d_model=settings.d_model, d_state=settings.d_state, d_kv=settings.d_model // settings.num_heads,
        d_ff=settings.d_ff, num_layers=settings.num_layers, num_decoder_layers=settings.num_decoder_layers,
        num_heads=settings.num_heads, dropout_rate=settings.dropout_rate, ssm_dt_min=settings.ssm_dt_min,
        ssm_dt_max=settings.ssm_dt_max, pad_token_id=tokenizer.pad_token_id,
        # trained on inputs of at most max_source_length tokens, it reads whole documents of thousands (see the field)
        cross_attention_logn_length=settings.max_source_length,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    )
    model = LocostForConditionalGeneration(config)
    model.generation_config.max_new_tokens = settings.generation_max_new_tokens
    model.generation_config.num_beams = settings.generation_num_beams
    # No summary shorter than the shortest training summary (3 words, 3 tokens here): like the `min_length` of
    # summarization checkpoints (BART-large-CNN's is 56), from the training data only. Without it, one run's summary of
    # the longest held-out document was the first 2 tokens of its name ("multipro") and end of sequence.
    model.generation_config.min_new_tokens = min(
        len(ids) for ids in tokenizer([e["summary"] for e in train], add_special_tokens=False)["input_ids"]
    )
    return model


def seq2seq_features(tokenizer, examples: list[dict], max_source_length: int | None,
                     max_target_length: int) -> list[dict]:
    """``input_ids``, ``attention_mask`` and ``labels`` of (document, summary) examples; documents cut to
    ``max_source_length`` tokens unless it is None."""
    sources = tokenizer([e["document"] for e in examples], truncation=max_source_length is not None,
                        max_length=max_source_length)
    targets = tokenizer(text_target=[e["summary"] for e in examples], truncation=True, max_length=max_target_length)
    return [{"input_ids": ids, "attention_mask": mask, "labels": labels}
            for ids, mask, labels in zip(sources["input_ids"], sources["attention_mask"], targets["input_ids"])]


def summarization_mix(train: list[dict], settings: DemoSettings, seed: int) -> list[dict]:
    """Stage 2's examples: the (document, summary) pairs, mixed with ``copy_examples_per_summary`` copy pairs per
    summary that do not start at a document's start (trained on summaries alone, this small model forgets how to copy
    and writes the summaries' style with the wrong words: measured), shuffled."""
    import random

    copy_examples = lead_pretraining_examples(train, settings.lead_words, settings.lead_random_windows, seed,
                                              document_starts=False)
    mix = train + copy_examples[: int(settings.copy_examples_per_summary * len(train))]
    random.Random(seed).shuffle(mix)
    return mix


def stage_training_arguments(output_dir: str, batch_size: int, steps: int, learning_rate: float, seed: int,
                             **overrides):
    """``Seq2SeqTrainingArguments`` of one training stage: AdamW with linear decay after a short warm-up, on the GPU
    when there is one; ``overrides`` (logging, Adam's betas, ...) are passed on."""
    import torch
    from transformers import Seq2SeqTrainingArguments

    arguments = dict(
        output_dir=output_dir, per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        learning_rate=learning_rate, lr_scheduler_type="linear", warmup_steps=min(50, steps // 10), max_steps=steps,
        weight_decay=0.01, save_strategy="no", eval_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), seed=seed, data_seed=seed, dataloader_num_workers=0,
    )
    return Seq2SeqTrainingArguments(**{**arguments, **overrides})


class _Stage:
    """Numbered progress lines on stdout, with the elapsed time."""

    def __init__(self, total: int):
        self.total, self.index, self.start = total, 0, time.perf_counter()

    def __call__(self, message: str) -> None:
        self.index += 1
        print(f"[{self.index}/{self.total}] {message}  ({time.perf_counter() - self.start:.0f}s)", flush=True)


def run_demo(output_dir: str | Path = DEFAULT_OUTPUT_DIR, settings: DemoSettings = DemoSettings(), seed: int = 0) -> dict:
    """Run the demo; returns ``{"rouge", "lead_rouge", "output_dir", "summary", ...}`` (also printed)."""
    from transformers import (
        DataCollatorForSeq2Seq, Seq2SeqTrainer, pipeline, set_seed,
    )
    from transformers.utils import logging as hf_logging

    from .hub import hub_files, write_model_card

    missing = [name for name in ("accelerate", "rouge_score") if importlib.util.find_spec(name) is None]
    if missing:
        raise DemoError(f"The demo needs {', '.join(missing)} (training and ROUGE): pip install 'longreach[train]'.")
    output_dir = Path(output_dir).expanduser()
    check_output_dir(output_dir)  # before minutes of training, not after
    stage = _Stage(9)
    set_seed(seed)
    hf_logging.set_verbosity_error()
    workdir = tempfile.TemporaryDirectory(prefix="longreach-demo-")  # Trainer's scratch folder only

    train, held_out = build_corpus(settings.min_training_words)
    if settings.max_train_documents is not None:
        train = train[: settings.max_train_documents]
    held_out = sorted(held_out, key=lambda e: e["name"])[: settings.max_eval_documents]
    if len(train) < 2 * settings.batch_size or not held_out:
        raise DemoError(f"Not enough documents on this machine for the demo (train {len(train)}, held out "
                           f"{len(held_out)}).")
    train_words = [len(e["document"].split()) for e in train]
    held_out_words = [len(e["document"].split()) for e in held_out]
    stage(f"Data: {len(train)} training documents ({sum(train_words) // len(train_words)} words on average) and "
          f"{len(held_out)} held-out documents ({sum(held_out_words) // len(held_out_words)} words on average, up to "
          f"{max(held_out_words)}) from installed package descriptions and standard-library docstrings")

    tokenizer = train_tokenizer([e["document"] for e in train] + [e["summary"] for e in train], settings.vocab_size)
    stage(f"Tokenizer: byte-level BPE with {len(tokenizer)} tokens, trained on the training documents")

    model = build_model(settings, tokenizer, train)
    generation_config = copy.deepcopy(model.generation_config)
    stage(f"Model: LOCOST from scratch, {model.num_parameters() / 1e6:.1f}M parameters ({settings.num_layers} SSM "
          f"encoder blocks, {settings.num_decoder_layers} T5 decoder blocks, d_model {settings.d_model})")

    def train_model(name: str, examples: list[dict], source_length: int, steps: int, learning_rate: float):
        args = stage_training_arguments(str(Path(workdir.name) / name), settings.batch_size, steps, learning_rate, seed,
                                        logging_steps=max(steps // 5, 1), disable_tqdm=False)
        trainer = Seq2SeqTrainer(
            model=model, args=args, processing_class=tokenizer,
            train_dataset=seq2seq_features(tokenizer, examples, source_length, settings.max_target_length),
            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        )
        return trainer, trainer.train()

    # Stage 1: learn to read and copy (self-supervised, training documents only; see lead_pretraining_examples)
    lead_examples = lead_pretraining_examples(train, settings.lead_words, settings.lead_random_windows, seed)
    print(f"    lead pretraining: {settings.lead_pretraining_steps} steps of {settings.batch_size} (text, its first "
          f"words) pairs from {len(lead_examples)} sentence starts and random positions of the training documents",
          flush=True)
    _, lead_result = train_model("lead", lead_examples, settings.lead_source_length,
                                 settings.lead_pretraining_steps, settings.lead_learning_rate)
    stage(f"Lead pretraining done: final training loss {lead_result.training_loss:.3f}")

    # Stage 2: the summaries, mixed with copy pairs (see summarization_mix)
    summary_mix = summarization_mix(train, settings, seed)
    print(f"    summarization: {settings.max_steps} steps of {settings.batch_size} from {len(train)} (document, "
          f"summary) pairs and {len(summary_mix) - len(train)} copy pairs (inputs cut to "
          f"{settings.max_source_length} tokens for training only; evaluation reads whole documents)", flush=True)
    trainer, train_result = train_model("summaries", summary_mix, settings.max_source_length, settings.max_steps,
                                        settings.learning_rate)
    stage(f"Training done: final training loss {train_result.training_loss:.3f}")

    model.generation_config = generation_config  # Seq2SeqTrainer filled in every default (max_length=20, ...)
    summaries = summarize_whole(model, tokenizer, [e["document"] for e in held_out])  # held-out documents read whole
    references = [e["summary"] for e in held_out]
    leads = [lead_baseline(e["document"]) for e in held_out]
    rouge, lead = rouge_scores(summaries, references), rouge_scores(leads, references)
    stage(f"ROUGE on {len(held_out)} held-out documents (F1 x100): "
          + ", ".join(f"{k.upper().replace('ROUGE', 'ROUGE-')} {v:.2f}" for k, v in rouge.items())
          + "  |  lead baseline: " + ", ".join(f"{v:.2f}" for v in lead.values()))
    margin, margin_interval = round(rouge["rouge1"] - lead["rouge1"], 2), paired_bootstrap_interval(
        summaries, leads, references)
    print(f"    ROUGE-1 {margin:+.2f} against the lead; 95% paired bootstrap interval over the {len(held_out)} "
          f"documents {margin_interval[0]:+.2f} to {margin_interval[1]:+.2f} (one that contains 0 is a draw)",
          flush=True)

    with _replaced_atomically(output_dir) as staging:
        trainer.save_model(str(staging))  # weights, code files, auto_map, custom_pipelines, tokenizer
        (staging / "training_args.bin").unlink(missing_ok=True)
        write_model_card(staging, "locost", repo_id=None,
                         training_note=_training_note(settings, train, held_out, rouge, lead))
    stage(f"Saved Hub-ready to {output_dir}: {', '.join(hub_files(output_dir))}, README.md")

    summarizer = pipeline("summarization", model=str(output_dir), trust_remote_code=True)
    longest = max(held_out, key=lambda e: len(e["document"]))
    num_tokens = len(summarizer.tokenizer(longest["document"])["input_ids"])
    summary = summarizer(longest["document"])[0]["summary_text"]
    stage(f"Reloaded with pipeline('summarization', model=DIR, trust_remote_code=True); longest held-out document: "
          f"{longest['name']} ({num_tokens} tokens)")
    print(f"    reference: {longest['summary']}\n    summary:   {summary}\n"
          f"    lead:      {lead_baseline(longest['document'])}", flush=True)

    corpus_dir = held_out_dir(output_dir)  # beside the model: the held-out set, summarized
    corpus_dir.mkdir(exist_ok=True)
    documents_file, summaries_file = corpus_dir / "documents.jsonl", corpus_dir / "summaries.jsonl"
    for name in ("summaries.jsonl", "summaries.errors.jsonl", "summaries.metrics.json", "summaries.settings.json"):
        (corpus_dir / name).unlink(missing_ok=True)  # an earlier demo's summaries: this run's model is new
    with open(documents_file.with_suffix(".tmp"), "w", encoding="utf-8") as handle:
        for example in held_out:
            handle.write(json.dumps({"name": example["name"], "document": example["document"],
                                     "summary": example["summary"]}) + "\n")
    documents_file.with_suffix(".tmp").replace(documents_file)
    command = ["summarize", "--model", str(output_dir), "--input", str(documents_file), "--text_column", "document",
               "--id_column", "name", "--reference_column", "summary", "--output", str(summaries_file)]
    stage(f"The held-out set through the corpus command: longreach {' '.join(command)}")
    from .cli import main as cli_main

    code = cli_main(command)
    if code == 130:  # Ctrl-C during the corpus command: the demo is interrupted, not failed
        raise KeyboardInterrupt
    if code != 0:
        raise DemoError(f"`longreach {' '.join(command)}` failed (see above).")
    lines = summaries_file.read_text(encoding="utf-8").splitlines()
    print(f"    {len(lines)} summaries in {summaries_file}; the first {min(3, len(lines))}:", flush=True)
    for line in lines[:3]:
        print(f"    {line}", flush=True)

    result = {"rouge": rouge, "lead_rouge": lead, "rouge1_margin": margin, "rouge1_margin_interval": margin_interval,
              "output_dir": str(output_dir), "summary": summary,
              "corpus_summaries": str(summaries_file),
              "reference": longest["summary"], "document_name": longest["name"], "document_tokens": num_tokens,
              "train_documents": len(train), "held_out_documents": len(held_out),
              "training_loss": train_result.training_loss, "seconds": round(time.perf_counter() - stage.start, 1)}
    workdir.cleanup()
    return result


def paired_bootstrap_interval(predictions: list[str], baseline: list[str], references: list[str],
                              samples: int = 1000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """The ``confidence`` interval of the mean ROUGE-1 difference (x100), ``predictions`` minus ``baseline``, over
    ``samples`` resamplings of the documents with replacement (the paired bootstrap; Koehn, "Statistical Significance
    Tests for Machine Translation Evaluation", EMNLP 2004). An interval that contains 0 is a draw with this many
    documents. Deterministic for a given ``seed``."""
    import random

    if not len(predictions) == len(baseline) == len(references) or not references:
        raise ValueError(f"`predictions`, `baseline` and `references` must be non-empty and of one length; got "
                         f"{len(predictions)}, {len(baseline)} and {len(references)}.")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be between 0 and 1 (exclusive), got {confidence}.")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"`samples` must be a positive integer (resamplings of the documents), got {samples!r}.")
    differences = [100 * (ours["rouge1"] - theirs["rouge1"]) for ours, theirs in
                   zip(rouge_per_document(predictions, references), rouge_per_document(baseline, references))]
    rng, count = random.Random(seed), len(differences)
    means = sorted(sum(rng.choices(differences, k=count)) / count for _ in range(samples))
    tail = (1.0 - confidence) / 2
    low, high = means[int(tail * samples)], means[min(samples - 1, int((1.0 - tail) * samples))]
    return round(low, 2), round(high, 2)


def summarize_whole(model, tokenizer, documents: list[str], max_batch_tokens: int = 16384) -> list[str]:
    """Summaries of ``documents`` read whole, with the model's generation config, in batches of similar lengths
    (the corpus command's plan: each batch pads to its own longest document; in one batch of 32 in name order the
    demo's 40 held-out documents padded to 5,712 tokens and took 53 s, against a few seconds planned)."""
    import torch

    from .corpus import plan_batches

    encoded = tokenizer(documents)["input_ids"]
    summaries: list[str | None] = [None] * len(documents)
    model.eval()
    for batch in plan_batches([len(ids) for ids in encoded], max_batch_tokens):
        inputs = tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, return_tensors="pt").to(model.device)
        with torch.inference_mode():
            output_ids = model.generate(**inputs)
        for i, summary in zip(batch, tokenizer.batch_decode(output_ids, skip_special_tokens=True)):
            summaries[i] = summary
    return summaries


def _training_note(settings: DemoSettings, train: list[dict], held_out: list[dict], rouge: dict, lead: dict) -> str:
    return (
        "Trained from scratch by `longreach demo` on one machine, offline, as a demonstration (a small model, not a "
        f"general summarizer): {len(train)} documents made of the long descriptions of installed Python distributions "
        "(summary: their one-line `Summary` metadata) and Python standard-library docstrings (summary: their first "
        f"line). First {settings.lead_pretraining_steps} steps of lead pretraining (copy the first words of a text "
        f"starting at a sentence or a random word of a training document), then {settings.max_steps} steps on the "
        f"summaries, batches of {settings.batch_size}, with `Seq2SeqTrainer`. ROUGE F1 on {len(held_out)} held-out "
        f"documents: ROUGE-1 {rouge['rouge1']:.2f}, ROUGE-2 {rouge['rouge2']:.2f}, ROUGE-Lsum {rouge['rougeLsum']:.2f} "
        f"(lead baseline: {lead['rouge1']:.2f} / {lead['rouge2']:.2f} / {lead['rougeLsum']:.2f})."
    )


def main(argv: list[str] | None = None, *, debug: bool = False) -> int:
    parser = argparse.ArgumentParser(
        prog="longreach demo",
        description="Train a small LOCOST summarizer from scratch on local text, evaluate ROUGE, save it Hub-ready "
        "and summarize a long document through pipeline('summarization'). Offline; a few minutes on 2 CPU cores.",
    )
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR,
                        help=f"Where to keep the model (default: ./{DEFAULT_OUTPUT_DIR}; a rerun replaces the model an "
                        "earlier demo run left there, and refuses any other non-empty folder).")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max_steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tiny run for the test suite
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # print the result as JSON at the end
    args = parser.parse_args(argv)
    settings = SMOKE_SETTINGS if args.smoke else DemoSettings()
    if args.max_steps is not None:
        from dataclasses import replace

        settings = replace(settings, max_steps=args.max_steps)
    try:
        result = run_demo(args.output_dir, settings, seed=args.seed)
    except DemoError as error:
        if debug:  # `longreach --debug demo ...`: the traceback
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2 if isinstance(error, OutputDirError) else 1
    folder = result["output_dir"]
    print(f"Done in {result['seconds']:.0f}s. The model is kept in {folder}, the held-out set and its summaries in "
          f"{Path(result['corpus_summaries']).parent} (delete both when done). Use the model with:\n"
          f"    longreach summarize --model {folder} FILE.txt\n"
          f"    longreach summarize --model {folder} --input DOCS_FOLDER_OR.jsonl --output summaries.jsonl\n"
          f"    pipeline('summarization', model={folder!r}, trust_remote_code=True)  # from transformers", flush=True)
    if args.json:
        print(json.dumps(result))
    return 0
