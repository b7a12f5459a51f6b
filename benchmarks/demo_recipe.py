"""A `longreach demo` recipe judged on a validation split, so that recipes are compared without the held-out set.

    python benchmarks/demo_recipe.py                                          # the demo's defaults
    python benchmarks/demo_recipe.py --settings '{"ssm_dt_max": 2.0}' --seed 1 --json runs.jsonl
    python benchmarks/demo_recipe.py --stage1_only --settings '{"lead_learning_rate": 3e-3}'
    for b in 1 2 3 4 5 6 7 8 9; do                                           # every fold
        python benchmarks/demo_recipe.py --validation_bucket $b --summaries fold$b.jsonl; done
    python benchmarks/demo_recipe.py --pool fold*.jsonl                       # their documents scored together

The corpus, tokenizer, model and both training stages are the demo's (:mod:`longreach.demo`), with one difference: the
training documents whose name hashes to ``VALIDATION_BUCKET`` (mod ``HELD_OUT_EVERY``; ``--validation_bucket`` picks
another of the buckets 1 to 9) are taken out of training and serve as the validation set; the demo's held-out documents
(bucket 0) are neither trained nor evaluated on. Printed as one JSON line (and appended to ``--json``):

- ``stage1_losses``: the lead pretraining's training loss at every tenth of its steps (where copying sets in);
- ``stage1_copy_loss_{N}``, ``stage2_copy_loss_{N}``: the teacher-forced loss per target token on 1,000 copy pairs
  made from the *validation* documents (:func:`longreach.demo.lead_pretraining_examples`), inputs cut to N tokens,
  after each stage (N: the lead pretraining's input length and the summarization stage's after stage 1, the latter
  after stage 2);
- after the summarization stage, on the validation documents of at least ``MIN_DOCUMENT_WORDS`` words read whole:
  ``rouge`` against their summaries, ``lead`` (the demo's lead baseline), ``margin`` (ROUGE-1, model minus lead) and
  ``margin_interval`` (its 95% paired bootstrap interval over the documents), and
  ``lead_exact`` / ``lead_rouge1``: how faithfully the summaries copy the lead (the share equal to it, and their
  ROUGE-1 against it).

Options beyond the demo's settings, for what the demo does not expose: ``--stage1_steps``, ``--stage1_batch_size``,
``--adam_beta2``, ``--stage2_dropout`` (a dropout rate for the summarization stage only), and ``--synthetic_copy_steps``
(a stage before the lead pretraining that copies the first 4 to 16 tokens of random token sequences, drawn by the
training text's token frequencies or uniformly). What was tried with it is in ``benchmarks/results/demo.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

#: Training documents in this hash bucket are the validation set (the demo holds out bucket 0).
VALIDATION_BUCKET = 1


def split_validation(train: list[dict], bucket: int = VALIDATION_BUCKET) -> tuple[list[dict], list[dict]]:
    """``(train, validation)``: the training documents in hash bucket ``bucket`` (1 to ``HELD_OUT_EVERY`` - 1; 0 is
    the demo's held-out set) go to validation, and the rest that repeat the summary or lead of a validation document
    that is scored (at least ``MIN_DOCUMENT_WORDS`` words) stay out of training, as the demo does for its held-out set
    (:func:`longreach.demo.without_overlap`)."""
    from longreach.demo import HELD_OUT_EVERY, MIN_DOCUMENT_WORDS, document_bucket, without_overlap

    if not 1 <= bucket < HELD_OUT_EVERY:
        raise ValueError(f"`bucket` must be 1 to {HELD_OUT_EVERY - 1} (0 is the demo's held-out set), got {bucket}.")
    validation = [e for e in train if document_bucket(e) == bucket]
    scored = [e for e in validation if len(e["document"].split()) >= MIN_DOCUMENT_WORDS]
    return without_overlap([e for e in train if document_bucket(e) != bucket], scored), validation


def write_summaries(path: Path, documents: list[dict], leads: list[str], summaries: list[str]) -> None:
    """One JSON line per document (name, reference, lead, summary), written beside ``path`` and renamed into place."""
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "w", encoding="utf-8") as handle:
        for document, lead, summary in zip(documents, leads, summaries):
            handle.write(json.dumps({"name": document["name"], "reference": document["summary"], "lead": lead,
                                     "summary": summary}) + "\n")
    staging.replace(path)


def pooled_margin(paths: list[str]) -> dict:
    """The validation summaries of several runs (``--summaries`` files, e.g. the nine folds) scored together: the
    documents, ROUGE of the summaries and of the leads, the ROUGE-1 margin and its 95% paired bootstrap interval over
    all the documents, and the margin of each kind of document (standard-library docstrings, distribution READMEs)."""
    from longreach.demo import paired_bootstrap_interval
    from longreach.metrics import rouge_scores

    rows = [json.loads(line) for path in paths for line in Path(path).read_text(encoding="utf-8").splitlines()]
    if not rows:
        raise ValueError(f"`paths` hold no summaries: {paths}.")

    def scored(part: list[dict]) -> dict:
        summaries, leads, references = ([r[key] for r in part] for key in ("summary", "lead", "reference"))
        rouge, lead = rouge_scores(summaries, references), rouge_scores(leads, references)
        return {"documents": len(part), "rouge": rouge, "lead": lead,
                "margin": round(rouge["rouge1"] - lead["rouge1"], 2),
                "margin_interval": list(paired_bootstrap_interval(summaries, leads, references))}

    result = {"files": len(paths), **scored(rows)}
    # standard-library names are "module:object:line", distributions' their project name
    for kind, part in (("docstrings", [r for r in rows if ":" in r["name"]]),
                       ("readmes", [r for r in rows if ":" not in r["name"]])):
        if part:
            result[kind] = scored(part)
    return result


def set_dropout(model, rate: float) -> None:
    """Every dropout of ``model`` (its ``Dropout`` modules and the attention's probability dropout) set to ``rate``."""
    from torch import nn

    model.config.dropout_rate = rate
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = rate
        elif isinstance(getattr(module, "dropout", None), float):
            module.dropout = rate


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="{}", help="JSON: DemoSettings fields to change.")
    parser.add_argument("--smoke", action="store_true", help="Start from the demo's tiny smoke settings.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage1_only", action="store_true", help="Stop after the lead pretraining.")
    parser.add_argument("--stage1_steps", type=int, default=None)
    parser.add_argument("--stage1_batch_size", type=int, default=None)
    parser.add_argument("--adam_beta2", type=float, default=0.999)
    parser.add_argument("--synthetic_copy_steps", type=int, default=0)
    parser.add_argument("--synthetic_tokens", choices=["unigram", "uniform"], default="unigram")
    parser.add_argument("--stage2_dropout", type=float, default=None,
                        help="Dropout rate of the summarization stage only (the lead pretraining keeps the settings').")
    parser.add_argument("--validation_bucket", type=int, default=VALIDATION_BUCKET,
                        help="The hash bucket (1-9) of the training documents taken out as the validation set; the "
                        "buckets 1 to 9 in turn score the recipe on every training document (cross-validation).")
    parser.add_argument("--summaries", default=None,
                        help="Write the validation documents' summaries to this JSONL file (name, reference, lead, "
                        "summary), to pool several runs' documents.")
    parser.add_argument("--pool", nargs="+", default=None, metavar="SUMMARIES",
                        help="Only score the --summaries files of earlier runs together (see pooled_margin) and exit.")
    parser.add_argument("--json", default=None, help="Append the result line to this file.")
    parser.add_argument("--save_model", default=None,
                        help="Save the trained model and its tokenizer to this folder (to try decodings on it later).")
    args = parser.parse_args(argv)
    if args.pool:
        pooled = pooled_margin(args.pool)
        print(json.dumps(pooled), flush=True)
        return pooled

    import torch
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, set_seed
    from transformers.utils import logging as hf_logging

    from longreach import demo
    from longreach.metrics import rouge_scores

    settings = replace(demo.SMOKE_SETTINGS if args.smoke else demo.DemoSettings(), **json.loads(args.settings))
    seed = args.seed
    set_seed(seed)
    hf_logging.set_verbosity_error()
    start = time.perf_counter()
    train, _held_out = demo.build_corpus(settings.min_training_words)  # the held-out documents are not used
    train, validation = split_validation(train, args.validation_bucket)
    if settings.max_train_documents is not None:
        train = train[: settings.max_train_documents]
    validation_long = sorted((e for e in validation if len(e["document"].split()) >= demo.MIN_DOCUMENT_WORDS),
                             key=lambda e: e["name"])[: settings.max_eval_documents]
    tokenizer = demo.train_tokenizer([e["document"] for e in train] + [e["summary"] for e in train],
                                     settings.vocab_size)
    model = demo.build_model(settings, tokenizer, train)
    generation_config = copy.deepcopy(model.generation_config)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    workdir = tempfile.TemporaryDirectory(prefix="demo-recipe-")

    def features(examples: list[dict], max_source_length: int | None) -> list[dict]:
        return demo.seq2seq_features(tokenizer, examples, max_source_length, settings.max_target_length)

    def train_stage(name: str, rows: list[dict], steps: int, learning_rate: float, batch_size: int) -> list[float]:
        """A stage of the demo (its training arguments), on ready features; the logged losses."""
        training_args = demo.stage_training_arguments(
            str(Path(workdir.name) / name), batch_size, steps, learning_rate, seed,
            logging_steps=max(steps // 10, 1), disable_tqdm=True, adam_beta2=args.adam_beta2)
        trainer = Seq2SeqTrainer(model=model, args=training_args, train_dataset=rows, processing_class=tokenizer,
                                 data_collator=collator)
        trainer.train()
        return [round(entry["loss"], 3) for entry in trainer.state.log_history if "loss" in entry]

    copy_pairs = demo.lead_pretraining_examples(validation, settings.lead_words, settings.lead_random_windows,
                                                seed=123)[:1000]

    @torch.no_grad()
    def copy_loss(max_source_length: int) -> float:
        model.eval()
        rows, total, count = features(copy_pairs, max_source_length), 0.0, 0
        for begin in range(0, len(rows), 64):
            batch = collator(rows[begin:begin + 64])
            tokens = int((batch["labels"] != -100).sum())
            total += float(model(**batch).loss) * tokens
            count += tokens
        model.train()
        return round(total / max(count, 1), 4)

    result = {"settings": json.loads(args.settings), "smoke": args.smoke, "seed": seed,
              "validation_bucket": args.validation_bucket,
              "stage1_steps": args.stage1_steps, "stage1_batch_size": args.stage1_batch_size,
              "adam_beta2": args.adam_beta2, "synthetic_copy_steps": args.synthetic_copy_steps,
              "stage2_dropout": args.stage2_dropout,
              "train_documents": len(train), "validation_documents": len(validation_long)}
    if args.synthetic_copy_steps:
        rng = random.Random(seed + 7)
        pool = [i for e in train for i in tokenizer(e["document"], add_special_tokens=False)["input_ids"]]
        rows = []
        for _ in range(args.synthetic_copy_steps * settings.batch_size):
            length = rng.randrange(min(20, settings.lead_source_length - 1), settings.lead_source_length)
            source = [rng.choice(pool) if args.synthetic_tokens == "unigram" else rng.randrange(3, len(tokenizer))
                      for _ in range(length)]
            rows.append({"input_ids": source + [tokenizer.eos_token_id], "attention_mask": [1] * (length + 1),
                         "labels": source[: rng.randrange(4, 17)] + [tokenizer.eos_token_id]})
        result["synthetic_losses"] = train_stage("synthetic", rows, args.synthetic_copy_steps,
                                                 settings.lead_learning_rate, settings.batch_size)

    lead_examples = demo.lead_pretraining_examples(train, settings.lead_words, settings.lead_random_windows, seed)
    result["stage1_losses"] = train_stage(
        "lead", features(lead_examples, settings.lead_source_length),
        args.stage1_steps or settings.lead_pretraining_steps, settings.lead_learning_rate,
        args.stage1_batch_size or settings.batch_size)
    for length in dict.fromkeys((settings.lead_source_length, settings.max_source_length)):
        result[f"stage1_copy_loss_{length}"] = copy_loss(length)

    if not args.stage1_only:
        if args.stage2_dropout is not None:
            set_dropout(model, args.stage2_dropout)
        mix = demo.summarization_mix(train, settings, seed)
        result["stage2_losses"] = train_stage("summaries", features(mix, settings.max_source_length),
                                              settings.max_steps, settings.learning_rate, settings.batch_size)
        result[f"stage2_copy_loss_{settings.max_source_length}"] = copy_loss(settings.max_source_length)
        if validation_long:
            model.generation_config = generation_config
            summaries = demo.summarize_whole(model, tokenizer, [e["document"] for e in validation_long])
            references = [e["summary"] for e in validation_long]
            leads = [demo.lead_baseline(e["document"]) for e in validation_long]
            result["rouge"] = rouge_scores(summaries, references)
            result["lead"] = rouge_scores(leads, references)
            result["margin"] = round(result["rouge"]["rouge1"] - result["lead"]["rouge1"], 2)
            result["margin_interval"] = list(demo.paired_bootstrap_interval(summaries, leads, references))
            result["lead_exact"] = round(sum(s.strip() == l.strip() for s, l in zip(summaries, leads)) / len(leads), 3)
            result["lead_rouge1"] = rouge_scores(summaries, leads)["rouge1"]
            if args.summaries:
                write_summaries(Path(args.summaries), validation_long, leads, summaries)
    if args.save_model:
        model.save_pretrained(args.save_model)
        tokenizer.save_pretrained(args.save_model)
    result["seconds"] = round(time.perf_counter() - start, 1)
    workdir.cleanup()
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()
    return result


if __name__ == "__main__":
    main()
