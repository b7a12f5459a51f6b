#!/usr/bin/env python
"""Fine-tune LOCOST or VCC-T5 for (long-document) summarization with ``Seq2SeqTrainer``.

Data comes from local JSON / JSON-lines files or a Hub dataset; ROUGE-1/2/Lsum are computed with ``rouge_score``
(``evaluate.load("rouge")`` would need the Hub) on summaries generated during evaluation. The result is saved
Hub-ready (weights, code files, ``auto_map``, ``custom_pipelines``, tokenizer, model card) and loads with
``pipeline("summarization", model=OUTPUT_DIR, trust_remote_code=True)``.

Examples::

    # a converted LOCOST checkpoint on local files (one JSON object per line: {"document": ..., "summary": ...})
    python examples/finetune_summarization.py --model_name_or_path locost-hf \
        --train_file train.jsonl --validation_file val.jsonl --output_dir locost-finetuned \
        --max_source_length 4096 --max_target_length 512 --learning_rate 5e-4 --lr_scheduler_type constant \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 32 --num_train_epochs 60 --bf16

    # a Hub dataset, with its own column names
    python examples/finetune_summarization.py --model_name_or_path locost-hf --dataset_name ccdv/arxiv-summarization \
        --text_column article --summary_column abstract --output_dir locost-arxiv

    # trained (and evaluated) on 4,096-token inputs, to be used later on whole documents of 16K: scale the saved
    # model's cross-attention beyond 4,096 tokens (LocostConfig.cross_attention_logn_length; no effect up to 4,096)
    python examples/finetune_summarization.py --model_name_or_path locost-hf --train_file train.jsonl ... \
        --max_source_length 4096 --config_overrides '{"cross_attention_logn_length": 4096}'

    # VCC-T5 (the VIP mask is built by the model's prepare_summarization_inputs, exactly as at inference)
    python examples/finetune_summarization.py --model_name_or_path vcc-t5-hf --train_file train.jsonl ...

    # VCC-T5 answering questions: each example's question is the VIP tokens, as pipeline(..., question=...) lays it
    # out at inference (prepare_question_inputs); --summary_column holds the answers
    python examples/finetune_summarization.py --model_name_or_path vcc-t5-hf --train_file qa.jsonl \
        --text_column context --question_column question --summary_column answer ...

    # ... and upload the result (code files, tokenizer and model card included) with --push_to_hub --hub_model_id you/name

    # the CI smoke test: a tiny LOCOST and a tiny dataset built on the fly, a few steps, offline
    python examples/finetune_summarization.py --smoke --output_dir /tmp/smoke

Every ``Seq2SeqTrainingArguments`` option is accepted (``--eval_strategy steps --eval_steps 500``,
``--generation_num_beams 4``, ``--activation_checkpointing``...). Without ``--do_train`` / ``--do_eval`` the script
trains if there is training data and evaluates if there is validation data. Evaluation always generates
(``predict_with_generate``).
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import longreach  # noqa: F401  (registers LOCOST / VCC-T5 with the Auto classes)
from longreach.finetuning import (
    check_best_model_metric,
    check_columns,
    check_config_fields,
    check_not_the_model_folder,
    check_one_data_source,
    check_output_dir,
    check_questions,
    check_text_columns,
    check_training_arguments,
    create_hub_repo,
    decide_what_to_run,
    exit_with_one_line_errors,
    first_text,
    hub_repo_id,
    json_option,
    load_data_files,
    load_named_dataset,
    pop_option,
    train_or_resume,
    upload_output_dir,
)
from longreach.hub import write_model_card
from longreach.metrics import rouge_scores
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)

MODEL_TYPES = ("locost", "vcc_t5")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A longreach checkpoint (folder or Hub id) of a LOCOST or VCC-T5 model."}
    )
    model_type: str | None = field(
        default=None, metadata={"help": f"Train from scratch instead: one of {MODEL_TYPES} (needs --tokenizer_name)."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": 'JSON object of config fields: the sizes for --model_type (\'{"d_model": 256}\'), or changes '
                  'to a checkpoint\'s config (\'{"cross_attention_logn_length": 4096}\': beyond 4,096 input tokens, '
                  "scale the cross-attention logits by ln n / ln 4096, for documents longer than the training inputs)."},
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset name."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration."})
    train_file: str | None = field(default=None, metadata={"help": "Training file (.json, .jsonl, .csv, .parquet)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation file (same kinds)."})
    text_column: str = field(default="document", metadata={"help": "Column with the documents."})
    summary_column: str = field(default="summary", metadata={"help": "Column with the reference summaries."})
    question_column: str | None = field(
        default=None, metadata={"help": "Column with a question per example (VCC-T5: its VIP tokens); the summary "
                                        "column then holds the answers."})
    max_source_length: int = field(default=4096, metadata={"help": "Document tokens kept for training."})
    max_target_length: int = field(default=512, metadata={"help": "Summary tokens kept (training and generation)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N validation examples."})
    smoke: bool = field(default=False, metadata={"help": "Tiny offline end-to-end run (what CI runs)."})


# ---------------------------------------------------------------------------------------------------------------------
# Features and batches
# ---------------------------------------------------------------------------------------------------------------------


def encode_documents(model, tokenizer, documents: list[str], max_source_length: int,
                     questions: list[str] | None = None) -> tuple[dict, int]:
    """Token features of ``documents``, as the model wants them at inference (``prepare_summarization_inputs``: for
    VCC-T5 the task prefix and its VIP mask; with ``questions``, ``prepare_question_inputs``: the question as the VIP
    tokens), one unpadded list per document and per feature; and how many documents were cut to
    ``max_source_length``."""
    if questions is not None:
        inputs, dropped = model.prepare_question_inputs(tokenizer, list(questions), documents,
                                                        max_input_length=max_source_length)
    elif getattr(model, "prepare_summarization_inputs", None) is None:
        encoded = tokenizer(documents, truncation=True, max_length=max_source_length)
        full = tokenizer(documents)["input_ids"]
        return dict(encoded), sum(len(ids) > max_source_length for ids in full)
    else:
        inputs, dropped = model.prepare_summarization_inputs(tokenizer, documents, max_input_length=max_source_length)
    keep = inputs["attention_mask"].bool().cpu()
    features = {
        name: [row[mask].tolist() for row, mask in zip(tensor.cpu(), keep)]
        for name, tensor in inputs.items()
        if tensor.shape == keep.shape  # per-token features (input_ids, attention_mask, VIP mask, ...)
    }
    return features, sum(count > 0 for count in dropped)


@dataclass
class SummarizationCollator:
    """``DataCollatorForSeq2Seq`` plus padding of the model's extra per-token features (such as a VIP mask)."""

    seq2seq: DataCollatorForSeq2Seq

    def __call__(self, features: list[dict]) -> dict:
        tokenizer = self.seq2seq.tokenizer
        length = max(len(f["input_ids"]) for f in features)
        extra = [k for k in features[0] if k not in ("input_ids", "attention_mask", "labels", "token_type_ids")
                 and isinstance(features[0][k], list) and len(features[0][k]) == len(features[0]["input_ids"])]
        if extra:
            features = [dict(f) for f in features]
            for f in features:
                for key in extra:
                    padding = [0] * (length - len(f[key]))
                    f[key] = padding + f[key] if tokenizer.padding_side == "left" else f[key] + padding
        return self.seq2seq(features)


def build_compute_metrics(tokenizer, references: list[str] | None = None,
                          reference_labels: list[list[int]] | None = None):
    """ROUGE of the generated summaries against ``references``, the validation set's summaries as written (the labels
    are cut to --max_target_length; they stand in only where the references are not known). Each prediction's
    reference is found by its labels (``reference_labels``, those of the validation features in order), not by its
    place: the evaluation may see the examples in another order (``--train_sampling_strategy group_by_length``)."""
    import numpy as np

    def compute_metrics(eval_prediction) -> dict[str, float]:
        predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
        predictions = np.where(predictions >= 0, predictions, tokenizer.pad_token_id)
        summaries = tokenizer.batch_decode(predictions, skip_special_tokens=True)
        targets = None
        if references is not None and reference_labels is not None and len(references) == len(summaries):
            # (Seq2SeqTrainer pads the labels to the generation length with the pad token, or EOS without one)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            targets = references_in_order(labels, references, reference_labels, pad)
        if targets is None:
            targets = tokenizer.batch_decode(np.where(labels >= 0, labels, tokenizer.pad_token_id),
                                             skip_special_tokens=True)
        metrics = rouge_scores(summaries, targets, digits=4)
        metrics["gen_len"] = float(np.mean([np.count_nonzero(row != tokenizer.pad_token_id) for row in predictions]))
        return metrics

    return compute_metrics


def references_in_order(label_rows, references: list[str], reference_labels: list[list[int]],
                        pad_token_id: int | None = None) -> list[str] | None:
    """The reference of each row of ``label_ids`` (padded with -100, and by ``Seq2SeqTrainer`` with ``pad_token_id``
    up to the generation length), matched on the labels of the features it came from, both without their trailing
    padding; equal labels take their references in the data's order. None if a row matches no feature."""

    def key(tokens) -> tuple[int, ...]:
        kept = [int(token) for token in tokens if token != -100]
        while kept and kept[-1] == pad_token_id:
            kept.pop()
        return tuple(kept)

    unused: dict[tuple[int, ...], list[int]] = {}
    for index, labels in enumerate(reference_labels):
        unused.setdefault(key(labels), []).append(index)
    ordered = []
    for row in label_rows:
        indices = unused.get(key(row))
        if not indices:
            return None
        ordered.append(references[indices.pop(0)])
    return ordered


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def load_model_and_tokenizer(model_args: ModelArguments):
    from longreach.hub import pretrained_location

    overrides = json_option(model_args.config_overrides, "--config_overrides")
    if model_args.tokenizer_name is not None:
        pretrained_location(model_args.tokenizer_name, "--tokenizer_name")
    if model_args.model_name_or_path is not None:
        pretrained_location(model_args.model_name_or_path, "--model_name_or_path")
        config = AutoConfig.from_pretrained(model_args.model_name_or_path, trust_remote_code=True)
        check_config_fields(type(config), overrides, "--config_overrides")
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
        model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path, trust_remote_code=True,
                                                      **overrides)
        return model, tokenizer
    if model_args.model_type not in MODEL_TYPES or model_args.tokenizer_name is None:
        raise ValueError(
            "Pass --model_name_or_path, or --model_type (one of "
            f"{MODEL_TYPES}) with --tokenizer_name to train from scratch; got model_type={model_args.model_type!r}, "
            f"tokenizer_name={model_args.tokenizer_name!r}."
        )
    check_config_fields(type(AutoConfig.for_model(model_args.model_type)), overrides, "--config_overrides")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    config = AutoConfig.for_model(
        model_args.model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id, **overrides,
    )
    return AutoModelForSeq2SeqLM.from_config(config), tokenizer


def load_raw_datasets(data_args: DataArguments):
    check_one_data_source(data_args)
    if data_args.dataset_name is not None:
        return load_named_dataset(data_args.dataset_name, data_args.dataset_config_name)
    return load_data_files(data_args.train_file, data_args.validation_file)


def run(model_args: ModelArguments, data_args: DataArguments, training_args: Seq2SeqTrainingArguments,
        argv: list[str] | None = None) -> dict:
    """Train and/or evaluate. ``argv`` (the command line) tells whether --do_train / --do_eval were asked for."""
    for option in ("max_source_length", "max_target_length"):
        if getattr(data_args, option) < 1:
            raise ValueError(f"--{option} must be a positive number of tokens, got {getattr(data_args, option)}.")
    check_not_the_model_folder(training_args.output_dir, "--model_name_or_path", model_args.model_name_or_path)
    set_seed(training_args.seed)
    if not training_args.predict_with_generate and argv is not None and "--predict_with_generate" in {
            argument.split("=")[0] for argument in argv}:
        raise ValueError("--predict_with_generate false: this script evaluates the summaries it generates (ROUGE); "
                         "leave the option out (evaluation always generates).")
    training_args.predict_with_generate = True
    if training_args.generation_max_length is None:  # counts the decoder start token: max_target_length new tokens
        training_args.generation_max_length = data_args.max_target_length + 1
    elif training_args.generation_max_length < 2:  # (it failed in generate(), at the first evaluation, unnamed)
        raise ValueError(f"--generation_max_length must be >= 2 (the decoder start token, then at least one new "
                         f"token), got {training_args.generation_max_length}.")
    # the data before the model (minutes to load for a large one): what is wrong with it is named at once
    raw = load_raw_datasets(data_args)
    if argv is not None:
        decide_what_to_run(training_args, raw, argv)
    elif not (training_args.do_train or training_args.do_eval):  # neither asked for: do what the data allows
        training_args.do_train, training_args.do_eval = "train" in raw, "validation" in raw
    check_training_arguments(training_args, data_args.max_train_samples, data_args.max_eval_samples)
    check_best_model_metric(training_args, {"loss", "rouge1", "rouge2", "rougeLsum", "gen_len"})
    if training_args.do_train:
        # before training: the card written after it keeps what is there, and no earlier model is replaced
        check_output_dir(training_args.output_dir, training_args)
        create_hub_repo(training_args)  # --push_to_hub: fails now rather than after training
    columns = [data_args.text_column, data_args.summary_column] + (
        [data_args.question_column] if data_args.question_column else [])
    check_columns(raw, columns, training_args, "--text_column / --summary_column / --question_column")
    model, tokenizer = load_model_and_tokenizer(model_args)
    if data_args.question_column is not None and getattr(model, "prepare_question_inputs", None) is None:
        raise ValueError(f"--question_column {data_args.question_column}: {type(model).__name__} has no question "
                         "format (VCC-T5 has: the question as its VIP tokens); leave the option out to train "
                         "summaries.")

    def features(split: str, limit: int | None):
        if split not in raw:
            return None
        dataset = raw[split]
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset))))
        check_text_columns(dataset, columns, split)
        if data_args.question_column:
            check_questions(dataset, data_args.question_column, split, document_column=data_args.text_column)
        cut, cut_summaries = [0], [0]

        def preprocess(batch):
            encoded, num_cut = encode_documents(
                model, tokenizer, batch[data_args.text_column], data_args.max_source_length,
                batch[data_args.question_column] if data_args.question_column else None)
            cut[0] += num_cut
            summaries = batch[data_args.summary_column]
            cut_summaries[0] += sum(len(ids) > data_args.max_target_length
                                    for ids in tokenizer(text_target=summaries)["input_ids"])
            encoded["labels"] = tokenizer(text_target=summaries, truncation=True,
                                          max_length=data_args.max_target_length)["input_ids"]
            return encoded

        # `new_fingerprint` spares datasets from hashing the model captured by `preprocess`.
        mapped = dataset.map(preprocess, batched=True, batch_size=64, remove_columns=dataset.column_names,
                             load_from_cache_file=False, new_fingerprint=f"{split}-{data_args.max_source_length}")
        if cut[0]:
            print(f"{cut[0]} of {len(dataset)} {split} documents are longer than --max_source_length="
                  f"{data_args.max_source_length} tokens and were cut to it.", file=sys.stderr)
        if cut_summaries[0]:
            print(f"{cut_summaries[0]} of {len(dataset)} {split} summaries are longer than --max_target_length="
                  f"{data_args.max_target_length} tokens and were cut to it"
                  + (" (ROUGE is scored against the summaries as written)." if split == "validation" else "."),
                  file=sys.stderr)
        return mapped

    train_dataset = features("train", data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = features("validation", data_args.max_eval_samples) if training_args.do_eval else None
    # The Trainer's own upload would replace our model card with its generic one: upload at the end with longreach.
    push_to = hub_repo_id(training_args) if training_args.push_to_hub else None
    training_args.push_to_hub = False
    collator = SummarizationCollator(DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100))
    references = None
    if eval_dataset is not None:
        validation = raw["validation"]
        if data_args.max_eval_samples is not None:
            validation = validation.select(range(min(data_args.max_eval_samples, len(validation))))
        references = list(validation[data_args.summary_column])
    trainer = Seq2SeqTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, data_collator=collator,
        compute_metrics=build_compute_metrics(tokenizer, references,
                                              eval_dataset["labels"] if eval_dataset is not None else None),
    )
    metrics = {}
    generation_config = copy.deepcopy(model.generation_config)
    if training_args.do_train:
        train_metrics, _ = train_or_resume(trainer, training_args)
        metrics.update(train_metrics)
        model.generation_config = generation_config  # evaluation fills in every default (max_length=20, ...)
        trainer.save_model()  # Hub-ready: weights, code files, auto_map, custom_pipelines, tokenizer
        if trainer.is_world_process_zero():  # several processes (torchrun): the first writes the card
            write_model_card(
                training_args.output_dir, model.config.model_type,
                training_note=f"Fine-tuned with `examples/finetune_summarization.py` on "
                f"{data_args.dataset_name or data_args.train_file} ({len(train_dataset)} documents"
                + (f", answering the questions of its `{data_args.question_column}` column: pass `question=` to the "
                   "pipeline)." if data_args.question_column else ")."),
                base_model=model_args.model_name_or_path,
            )
        trainer.accelerator.wait_for_everyone()  # the folder is complete before any process reads it
    if training_args.do_eval and eval_dataset is not None:
        # new tokens as during training (generation_max_length counts the decoder start), not a checkpoint's own
        evaluation = trainer.evaluate(max_new_tokens=training_args.generation_max_length - 1)
        trainer.save_metrics("eval", evaluation)
        metrics.update(evaluation)
    if metrics:  # none when a finished run was only loaded and not evaluated (log_metrics fails on none)
        trainer.log_metrics("all", metrics)
    if push_to is not None and training_args.do_train and trainer.is_world_process_zero():
        commit = upload_output_dir(training_args, push_to)
        print(f"Uploaded to {push_to}: {getattr(commit, 'commit_url', commit)}")
    return metrics


def smoke_arguments(output_dir: str) -> list[str]:
    """A tiny LOCOST checkpoint and JSON-lines dataset beside the output folder, and the arguments that train it."""
    import torch

    from longreach import LocostConfig, LocostForConditionalGeneration
    from longreach.demo import train_tokenizer

    # beside the output folder (not in the system's temporary folder, where nobody would remove it)
    workdir = Path(output_dir).parent / f"{Path(output_dir).name}-smoke-inputs"
    workdir.mkdir(parents=True, exist_ok=True)
    topics = ["state space models", "token compression", "context nuggets", "relative position buckets"]
    rows = []
    for index in range(24):
        topic = topics[index % len(topics)]
        document = " ".join(
            f"Paragraph {p} explains how {topic} keep long inputs affordable, with example {index} and detail {p * index}."
            for p in range(12 + index % 5)
        )
        rows.append({"document": document, "summary": f"How {topic} keep long inputs affordable."})
    for name, part in (("train.jsonl", rows[:20]), ("validation.jsonl", rows[20:])):
        (workdir / name).write_text("\n".join(json.dumps(r) for r in part) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer([r["document"] + " " + r["summary"] for r in rows], vocab_size=300)
    torch.manual_seed(0)
    model = LocostForConditionalGeneration(LocostConfig(
        vocab_size=len(tokenizer), d_model=32, d_state=8, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
    ))
    model.save_pretrained(workdir / "tiny-locost")
    tokenizer.save_pretrained(workdir / "tiny-locost")
    return [
        "--model_name_or_path", str(workdir / "tiny-locost"), "--train_file", str(workdir / "train.jsonl"),
        "--validation_file", str(workdir / "validation.jsonl"), "--output_dir", output_dir, "--do_train", "--do_eval",
        "--max_steps", "4", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
        "--learning_rate", "1e-3", "--max_source_length", "256", "--max_target_length", "12",
        "--logging_steps", "2", "--save_strategy", "no", "--report_to", "none", "--use_cpu",
        "--dataloader_num_workers", "0", "--seed", "0",
    ]


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in argv:
        output_dir, rest = pop_option(argv, "--output_dir")  # (--output_dir=DIR too)
        argv = smoke_arguments(output_dir or tempfile.mkdtemp(prefix="finetune-smoke-")) + rest
    parser = HfArgumentParser((ModelArguments, DataArguments, Seq2SeqTrainingArguments))
    model_args, data_args, training_args, unknown = parser.parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True)
    if unknown:  # as argparse does (exit status 2); HfArgumentParser itself raises a ValueError
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    metrics = run(model_args, data_args, training_args, argv)
    if training_args.do_train and training_args.process_index == 0:
        from transformers import pipeline

        summarizer = pipeline("summarization", model=training_args.output_dir, trust_remote_code=True)
        raw = load_raw_datasets(data_args)
        split = next(name for name in ("validation", "test", "train") if name in raw)
        row = first_text(raw[split], data_args.text_column)  # an empty document has no summary to show
        if row is not None:
            document = raw[split][row][data_args.text_column]
            which = "the first" if row == 0 else f"the first non-empty (row {row})"
            if data_args.question_column:
                question = raw[split][row][data_args.question_column]
                print(f"answer to {which} {split} question ({question!r}):", summarizer(
                    document, question=question, max_new_tokens=data_args.max_target_length)[0]["summary_text"])
            else:
                print(f"summary of {which} {split} document:",
                      summarizer(document, max_new_tokens=data_args.max_target_length)[0]["summary_text"])
    print(json.dumps({key: value for key, value in metrics.items() if isinstance(value, (int, float))}))
    return metrics


if __name__ == "__main__":
    exit_with_one_line_errors(main)
