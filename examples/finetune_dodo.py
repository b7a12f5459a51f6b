#!/usr/bin/env python
"""Train Dodo (compressor mode, paper §2.3) with ``Trainer``: the compressor adapter φ, the decoder adapter θ, the
scorer ϕ and the soft prompt, jointly, on (context, target) pairs. The base Llama stays frozen.

Each example is a context, compressed into nuggets, and a target the decoder learns to produce from the nuggets
(``DodoDataCollator`` batches them; one ``model(**batch)`` call compresses and decodes, so one backward pass reaches
both adapters, the scorer and the soft prompt). Four tasks:

* ``continuation`` (default): ``--context_column`` and ``--target_column`` (+ an optional ``--prompt_column``: the
  target is then ``prompt + target`` with the loss on the target only; without it the decoder starts from BOS, as
  the authors' ``generate`` does);
* ``summarization``: the document (``--context_column``) in the paper's prompt of Appendix D.3, exactly as
  ``pipeline("summarization")`` lays it out at inference (``model.prepare_summarization_inputs``), and the summary
  (``--target_column``) as the target;
* ``question_answering``: the document (``--context_column``) and a question (``--question_column``) in the paper's
  prompt of Appendix D.2, exactly as ``pipeline("summarization", ...)(document, question=...)`` lays them out at
  inference (``model.prepare_question_inputs``), and the answer (``--target_column``) as the target;
* ``autoencoding``: the target is the context itself (the paper's pre-training objective).

Data comes from local JSON / JSON-lines files or a Hub dataset. The result is saved Hub-ready (weights of the base,
both adapters, scorer and soft prompt in one safetensors file, code files, ``auto_map``, ``custom_pipelines``,
tokenizer, model card) and ``--push_to_hub`` uploads it through longreach (the Trainer's own upload would replace our
model card with a generic one).

Training defaults are the authors' (paper App. B.2 and their training code), and only the trainable tensors reach the
optimizer:

* AdamW with ``betas=(0.9, 0.95)``, ``eps=1e-5``, ``weight_decay=0.1`` on every trainable tensor (biases included),
  two parameter groups: the LoRA tensors of φ and θ at ``--learning_rate`` (the authors' ``ft_lr``) and the scorer +
  soft prompt at ``--scorer_learning_rate`` (their ``lr``; default: ``--learning_rate``). Both are 1e-4 in the paper.
  The optimizer is always this AdamW (``--optim`` is not used); ``--adam_beta1/--adam_beta2/--adam_epsilon/
  --weight_decay`` change it.
* A cosine schedule after ``--warmup_steps 2000`` linear warm-up steps (the paper's). transformers' cosine decays over
  the run's own length; the authors' code decays over ``150 × warmup`` steps (half a cosine of 300k steps with the
  paper's warm-up): ``--schedule_horizon_steps 300000`` reproduces that. For short runs use e.g.
  ``--warmup_steps 0.03`` (a ratio).
* The authors trained in bf16 mixed precision (``--bf16``), batch 1 per GPU on 16 GPUs with gradient accumulation 2
  (an effective batch of 32: ``--per_device_train_batch_size 4 --gradient_accumulation_steps 8`` on one GPU).
* ``--activation_checkpointing`` (``--gradient_checkpointing`` is its deprecated name) recomputes each decoder layer
  in the backward pass instead of keeping its activations: the main memory saver on a 7B Llama, at the cost of about
  one more forward pass. Gradients are the same as without it; ``--activation_checkpointing_kwargs
  '{"use_reentrant": true}'`` selects PyTorch's other variant and ``'{"every_n_layers": 2}'`` checkpoints every other
  layer.

Examples::

    # from a base Llama: fresh (identity) adapters, new scorer and soft prompt; Dodo settings as JSON
    python examples/finetune_dodo.py --base_model_name_or_path meta-llama/Llama-2-7b-hf \
        --dodo_config '{"nugget_ratio": 0.1, "nugget_layer": 3, "lora_r": 32}' \
        --train_file train.jsonl --validation_file val.jsonl --context_column context --target_column target \
        --output_dir dodo-llama --bf16 --per_device_train_batch_size 4 --gradient_accumulation_steps 8 \
        --activation_checkpointing

    # continue training a converted Dodo checkpoint for summarization on a Hub dataset
    python examples/finetune_dodo.py --model_name_or_path dodo-llama-hf --task summarization \
        --dataset_name ccdv/arxiv-summarization --context_column article --target_column abstract \
        --max_context_length 4096 --output_dir dodo-arxiv --push_to_hub --hub_model_id you/dodo-arxiv

    # the CI smoke test: a tiny random Llama, a tokenizer and a dataset built on the fly, a few steps, offline
    python examples/finetune_dodo.py --smoke --output_dir /tmp/dodo-smoke
    python examples/finetune_dodo.py --smoke --activation_checkpointing --output_dir /tmp/dodo-smoke-ac  # same losses

Every ``TrainingArguments`` option is accepted. Without ``--do_train`` / ``--do_eval`` the script trains if there is
training data and evaluates (loss and perplexity) if there is validation data. The last stdout line is a JSON object
with the metrics.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, HfArgumentParser, Trainer, TrainingArguments, set_seed
from transformers.trainer_utils import SchedulerType

import longreach  # noqa: F401  (registers Dodo with the Auto classes)
from longreach import DodoDataCollator, DodoLlamaForCausalLM
from longreach.finetuning import (
    check_best_model_metric,
    check_columns,
    check_documents,
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

TASKS = ("continuation", "summarization", "question_answering", "autoencoding")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A longreach Dodo checkpoint (folder or Hub id) to continue training."}
    )
    base_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Or a plain Llama checkpoint: Dodo is built around it (DodoLlamaForCausalLM.from_base_model)."},
    )
    dodo_config: str | None = field(
        default=None,
        metadata={"help": 'JSON object of DodoLlamaConfig fields for --base_model_name_or_path, e.g. '
                          '\'{"nugget_ratio": 0.1, "lora_r": 32}\'.'},
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's folder)."})


@dataclass
class DataArguments:
    task: str = field(default="continuation", metadata={"help": f"One of {TASKS}."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset name."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration."})
    train_file: str | None = field(default=None, metadata={"help": "Training file (.json, .jsonl, .csv, .parquet)."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation file (same kinds)."})
    context_column: str = field(default="context", metadata={"help": "Column with the contexts (compressed)."})
    target_column: str = field(default="target", metadata={"help": "Column with the targets (not for autoencoding)."})
    prompt_column: str | None = field(
        default=None, metadata={"help": "continuation: optional column with a prompt put before the target (no loss)."}
    )
    question_column: str = field(default="question", metadata={"help": "question_answering: column with the questions."})
    max_context_length: int = field(default=2048, metadata={"help": "Context tokens kept (BOS included)."})
    max_target_length: int = field(default=512, metadata={"help": "Decoder tokens kept (prompt included)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N validation examples."})
    smoke: bool = field(default=False, metadata={"help": "Tiny offline end-to-end run (what CI runs)."})


@dataclass
class DodoTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with the authors' defaults (paper App. B.2 and their training code)."""

    learning_rate: float = field(
        default=1e-4, metadata={"help": "Learning rate of the LoRA adapters φ and θ (the authors' ft_lr; paper 1e-4)."}
    )
    scorer_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the scorer and the soft prompt (the authors' lr; default: --learning_rate)."},
    )
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2 (the authors': 0.95)."})
    adam_epsilon: float = field(default=1e-5, metadata={"help": "AdamW epsilon (the authors': 1e-5)."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (the authors': 0.1)."})
    lr_scheduler_type: SchedulerType | str = field(default="cosine", metadata={"help": "The authors': cosine."})
    warmup_steps: float = field(
        default=2000, metadata={"help": "Linear warm-up steps (paper: 2000); a value < 1 is a ratio of the schedule."}
    )
    schedule_horizon_steps: int | None = field(
        default=None,
        metadata={"help": "Steps over which the schedule runs (default: the run's length). The authors' code: "
                          "150 x warmup_steps."},
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: DodoDataCollator needs `prompt_length`."}
    )


# ---------------------------------------------------------------------------------------------------------------------
# Optimizer and schedule (the authors' setup)
# ---------------------------------------------------------------------------------------------------------------------


def is_lora_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def dodo_parameter_groups(model: torch.nn.Module, args: DodoTrainingArguments) -> list[dict]:
    """Two AdamW groups: the LoRA tensors (φ and θ) and the rest of the trainable tensors (scorer, soft prompt)."""
    lora, rest = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (lora if is_lora_parameter(name) else rest).append(param)
    scorer_lr = args.scorer_learning_rate if args.scorer_learning_rate is not None else args.learning_rate
    groups = [{"params": lora, "lr": args.learning_rate, "weight_decay": args.weight_decay, "name": "lora"},
              {"params": rest, "lr": scorer_lr, "weight_decay": args.weight_decay, "name": "scorer_and_soft_prompt"}]
    return [group for group in groups if group["params"]]


class DodoTrainer(Trainer):
    """``Trainer`` with the authors' optimizer (AdamW, two learning rates) and an optional schedule horizon."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            args = self.args
            self.optimizer = torch.optim.AdamW(
                dodo_parameter_groups(self.model if model is None else model, args), lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, weight_decay=args.weight_decay,
            )
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        horizon = getattr(self.args, "schedule_horizon_steps", None)
        return super().create_scheduler(horizon or num_training_steps, optimizer)


# ---------------------------------------------------------------------------------------------------------------------
# Model, tokenizer and data
# ---------------------------------------------------------------------------------------------------------------------


def load_model_and_tokenizer(model_args: ModelArguments):
    from longreach.hub import pretrained_location

    if (model_args.model_name_or_path is None) == (model_args.base_model_name_or_path is None):
        raise ValueError(
            "Pass exactly one of --model_name_or_path (a Dodo checkpoint) and --base_model_name_or_path (a plain "
            f"Llama); got {model_args.model_name_or_path!r} and {model_args.base_model_name_or_path!r}."
        )
    if model_args.model_name_or_path is not None:
        if model_args.dodo_config:
            raise ValueError("--dodo_config only applies to --base_model_name_or_path (a Dodo checkpoint has its own).")
        source = model_args.model_name_or_path
        pretrained_location(source, "--model_name_or_path")
        model = DodoLlamaForCausalLM.from_pretrained(source)
    else:
        source = model_args.base_model_name_or_path
        pretrained_location(source, "--base_model_name_or_path")
        model = DodoLlamaForCausalLM.from_base_model(source, dodo_config=json_option(model_args.dodo_config,
                                                                                     "--dodo_config"))
    if model_args.tokenizer_name is not None:
        pretrained_location(model_args.tokenizer_name, "--tokenizer_name")
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or source)
    base_trainable = [name for name, param in model.named_parameters()
                      if param.requires_grad and not is_lora_parameter(name)
                      and not name.startswith(("nugget_scorer.", "soft_prompt."))]
    if base_trainable:  # DodoLlamaForCausalLM freezes the base itself; this guards against later changes
        raise ValueError(f"The base model must stay frozen, but these tensors are trainable: {base_trainable[:5]}.")
    return model, tokenizer


def load_raw_datasets(data_args: DataArguments):
    check_one_data_source(data_args)
    if data_args.dataset_name is not None:
        return load_named_dataset(data_args.dataset_name, data_args.dataset_config_name)
    return load_data_files(data_args.train_file, data_args.validation_file)


class ExampleEncoder:
    """Token features of a batch of rows for ``DodoDataCollator``: ``context_input_ids``, ``input_ids`` (the
    decoder's tokens) and ``prompt_length`` (decoder tokens without loss). Counts what had to be cut."""

    def __init__(self, model, tokenizer, data_args: DataArguments):
        self.model, self.tokenizer, self.args = model, tokenizer, data_args
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.cut_contexts = self.cut_targets = 0

    def _tokens(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def _context(self, ids: list[int]) -> list[int]:
        ids = self.bos + ids
        if len(ids) > self.args.max_context_length:
            self.cut_contexts += 1
            ids = ids[: self.args.max_context_length]
        return ids

    def _decoder(self, prompt: list[int], target: list[int]) -> tuple[list[int], int]:
        if prompt and len(prompt) >= self.args.max_target_length:  # the loss would fall on the prompt, not the target
            raise ValueError(f"--max_target_length {self.args.max_target_length} leaves no room for the target after "
                             f"a decoder prompt of {len(prompt)} tokens: raise it above {len(prompt)} (or shorten the "
                             "prompts or questions).")
        ids = prompt + target + self.eos
        if len(ids) > self.args.max_target_length:
            self.cut_targets += 1
            ids = ids[: self.args.max_target_length]
        return ids, min(len(prompt), len(ids) - 1)

    def __call__(self, batch: dict) -> dict:
        args = self.args
        contexts = batch[args.context_column]
        features = {"context_input_ids": [], "input_ids": [], "prompt_length": []}
        if args.task in ("summarization", "question_answering"):
            # the layout pipeline("summarization") uses at inference: BOS + "[INST]\n" + document, then the prompt of
            # D.3 (summaries) or D.2 (the question; the prompts are left-padded, their padding dropped here)
            inputs, dropped = model_inputs(self.model, self.tokenizer, args, list(contexts),
                                           batch[args.question_column] if args.task == "question_answering" else None)
            self.cut_contexts += sum(count > 0 for count in dropped)
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
            for ids, mask in zip(inputs["context_input_ids"], inputs["context_attention_mask"]):
                features["context_input_ids"].append(ids[mask.bool()].tolist())
            targets = self._tokens(batch[args.target_column])
        else:
            features["context_input_ids"] = [self._context(ids) for ids in self._tokens(contexts)]
            if args.task == "autoencoding":
                prompts, targets = [[] for _ in contexts], features["context_input_ids"]
            else:
                # no prompt (or an empty one): start from BOS, as the authors, and as generation_inputs does
                prompts = ([ids or list(self.bos) for ids in self._tokens(batch[args.prompt_column])]
                           if args.prompt_column else [list(self.bos) for _ in contexts])
                targets = self._tokens(batch[args.target_column])
        for prompt, target in zip(prompts, targets):
            ids, prompt_length = self._decoder(prompt, target)
            features["input_ids"].append(ids)
            features["prompt_length"].append(prompt_length)
        # what `--train_sampling_strategy group_by_length` groups by (the Trainer reads a "length" column): context and
        # target tokens of each example, the context being most of a batch's padding
        features["length"] = [len(context) + len(ids) for context, ids in zip(features["context_input_ids"],
                                                                                 features["input_ids"])]
        return features


def model_inputs(model, tokenizer, data_args: DataArguments, documents: list[str], questions: list[str] | None):
    """The pipeline's inputs for ``documents``: the summarization prompt, or, with ``questions``, the question one."""
    if questions is None:
        return model.prepare_summarization_inputs(tokenizer, documents, max_input_length=data_args.max_context_length)
    return model.prepare_question_inputs(tokenizer, list(questions), documents,
                                         max_input_length=data_args.max_context_length)


def generation_inputs(tokenizer, model, data_args: DataArguments, row: dict) -> dict[str, torch.Tensor]:
    """``generate()`` inputs for one example, laid out as in training."""
    if data_args.task in ("summarization", "question_answering"):
        question = [row[data_args.question_column]] if data_args.task == "question_answering" else None
        inputs, _ = model_inputs(model, tokenizer, data_args, [row[data_args.context_column]], question)
        return inputs
    encoder = ExampleEncoder(model, tokenizer, data_args)
    context = encoder._context(encoder._tokens([row[data_args.context_column]])[0])
    if data_args.task == "continuation" and data_args.prompt_column:
        prompt = encoder._tokens([row[data_args.prompt_column]])[0] or list(encoder.bos)  # an empty prompt: BOS
    else:
        prompt = list(encoder.bos)
    return {"input_ids": torch.tensor([prompt], dtype=torch.long),
            "context_input_ids": torch.tensor([context], dtype=torch.long)}


# ---------------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------------


def parameter_changes(before: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, bool]:
    """Which parts of the model changed since ``before`` (a copy of ``named_parameters``)."""
    groups = {"base": False, "encoder_adapter": False, "decoder_adapter": False, "scorer": False, "soft_prompt": False}
    config = model.config
    for name, param in model.named_parameters():
        if is_lora_parameter(name):
            group = "encoder_adapter" if f".{config.encoder_adapter_name}." in name else "decoder_adapter"
        elif name.startswith("nugget_scorer."):
            group = "scorer"
        elif name.startswith("soft_prompt."):
            group = "soft_prompt"
        else:
            group = "base"
        groups[group] |= not torch.equal(param.detach().cpu(), before[name])
    return groups


def run(model_args: ModelArguments, data_args: DataArguments, training_args: DodoTrainingArguments,
        argv: list[str] | None = None) -> dict:
    """Train and/or evaluate. ``argv`` (the command line) tells whether --do_train / --do_eval were asked for."""
    for option in ("max_context_length", "max_target_length"):
        if getattr(data_args, option) < 1:
            raise ValueError(f"--{option} must be a positive number of tokens, got {getattr(data_args, option)}.")
    if data_args.task not in TASKS:
        raise ValueError(f"--task must be one of {TASKS}, got {data_args.task!r}.")
    given = {argument.split("=")[0] for argument in argv or []}
    for option, task in (("--prompt_column", "continuation"), ("--question_column", "question_answering")):
        if option in given and data_args.task != task:
            raise ValueError(f"{option} is read by --task {task} only, not by --task {data_args.task}.")
    if training_args.remove_unused_columns:
        raise ValueError("--remove_unused_columns must stay False: DodoDataCollator needs `prompt_length`.")
    # the optimizer checks only the default learning rate, not a parameter group's
    if training_args.scorer_learning_rate is not None and training_args.scorer_learning_rate < 0:
        raise ValueError(f"--scorer_learning_rate must be >= 0, got {training_args.scorer_learning_rate}.")
    if training_args.schedule_horizon_steps is not None and training_args.schedule_horizon_steps < 1:
        raise ValueError(f"--schedule_horizon_steps must be >= 1, got {training_args.schedule_horizon_steps}.")
    for option in ("model_name_or_path", "base_model_name_or_path"):
        check_not_the_model_folder(training_args.output_dir, f"--{option}", getattr(model_args, option))
    set_seed(training_args.seed)
    # the data before the model (minutes to load for a large one): what is wrong with it is named at once
    raw = load_raw_datasets(data_args)
    if argv is not None:
        decide_what_to_run(training_args, raw, argv)
    elif not (training_args.do_train or training_args.do_eval):  # neither asked for: do what the data allows
        training_args.do_train, training_args.do_eval = "train" in raw, "validation" in raw
    check_training_arguments(training_args, data_args.max_train_samples, data_args.max_eval_samples)
    # (perplexity is computed after the last evaluation only: its order is eval_loss's)
    check_best_model_metric(training_args, {"loss"})
    if training_args.do_train:
        # before training: the card written after it keeps what is there, and no earlier model is replaced
        check_output_dir(training_args.output_dir, training_args)
        create_hub_repo(training_args)  # --push_to_hub: fails now rather than after training
    needed = [data_args.context_column]
    if data_args.task != "autoencoding":
        needed.append(data_args.target_column)
    if data_args.task == "continuation" and data_args.prompt_column:
        needed.append(data_args.prompt_column)
    if data_args.task == "question_answering":
        needed.append(data_args.question_column)
    check_columns(raw, needed, training_args,
                  "--context_column / --target_column / --prompt_column / --question_column")
    model, tokenizer = load_model_and_tokenizer(model_args)

    def features(split: str, limit: int | None):
        if split not in raw:
            return None
        dataset = raw[split]
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset))))
        check_text_columns(dataset, needed, split)
        if data_args.task == "question_answering":  # Dodo's prompts need a document (as at inference)
            check_questions(dataset, data_args.question_column, split, document_column=data_args.context_column)
        elif data_args.task == "summarization":
            check_documents(dataset, data_args.context_column, split)
        encoder = ExampleEncoder(model, tokenizer, data_args)
        # `new_fingerprint` spares datasets from hashing the model the encoder holds.
        mapped = dataset.map(encoder, batched=True, batch_size=64, remove_columns=dataset.column_names,
                             load_from_cache_file=False, new_fingerprint=f"dodo-{split}-{data_args.task}")
        for count, what, option in ((encoder.cut_contexts, "contexts", "max_context_length"),
                                    (encoder.cut_targets, "targets", "max_target_length")):
            if count:
                print(f"{count} of {len(dataset)} {split} {what} are longer than --{option}="
                      f"{getattr(data_args, option)} tokens and were cut to it.", file=sys.stderr)
        return mapped

    train_dataset = features("train", data_args.max_train_samples) if training_args.do_train else None
    eval_dataset = features("validation", data_args.max_eval_samples) if training_args.do_eval else None
    # The Trainer's own upload would replace our model card with its generic one: upload at the end with longreach.
    push_to = hub_repo_id(training_args) if training_args.push_to_hub else None
    training_args.push_to_hub = False
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    trainer = DodoTrainer(model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                          processing_class=tokenizer, data_collator=DodoDataCollator(pad_token_id=pad_id))
    before = {name: param.detach().cpu().clone() for name, param in model.named_parameters()} if data_args.smoke \
        else None
    metrics: dict = {}
    if training_args.do_train:
        train_metrics, global_step = train_or_resume(trainer, training_args)
        metrics.update(train_metrics)
        trainer.save_model()  # Hub-ready: weights, code files, auto_map, custom_pipelines, tokenizer
        source = data_args.dataset_name or data_args.train_file
        if trainer.is_world_process_zero():  # several processes (torchrun): the first writes the card
            write_model_card(
                training_args.output_dir, "dodo_llama",
                training_note=f"Trained with `examples/finetune_dodo.py` ({data_args.task}) on {source} "
                f"({len(train_dataset)} examples, {global_step} steps) from "
                f"`{model_args.model_name_or_path or model_args.base_model_name_or_path}`."
                + (" It answers questions: pass `question=` to the pipeline." if data_args.task == "question_answering"
                   else ""),
                base_model=model_args.model_name_or_path or model_args.base_model_name_or_path,
            )
        trainer.accelerator.wait_for_everyone()  # the folder is complete before any process reads it
    if training_args.do_eval and eval_dataset is not None:
        evaluation = trainer.evaluate()
        evaluation["eval_perplexity"] = math.exp(min(evaluation["eval_loss"], 50.0))
        trainer.save_metrics("eval", evaluation)
        metrics.update(evaluation)
    if metrics:  # none when a finished run was only loaded and not evaluated (log_metrics fails on none)
        trainer.log_metrics("all", metrics)
    if before is not None:
        metrics["parameters_changed"] = parameter_changes(before, model)
        metrics["activation_checkpointing"] = model.is_activation_checkpointing
    if push_to is not None and training_args.do_train and trainer.is_world_process_zero():
        commit = upload_output_dir(training_args, push_to)
        print(f"Uploaded to {push_to}: {getattr(commit, 'commit_url', commit)}")
    return metrics


# ---------------------------------------------------------------------------------------------------------------------
# Smoke mode
# ---------------------------------------------------------------------------------------------------------------------


SMOKE_DODO_CONFIG = {"nugget_layer": 2, "nugget_ratio": 0.2, "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0,
                     "soft_prompt_length": 1}


def build_smoke_tokenizer(texts: list[str], vocab_size: int = 320):
    """A byte-level BPE tokenizer with Llama's special ids (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2; BOS prepended)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>", clean_up_tokenization_spaces=False)


def smoke_arguments(output_dir: str) -> tuple[list[str], Path]:
    """A tiny random Llama with its tokenizer and a JSON-lines (context, prompt, target) dataset beside the output folder,
    and the arguments that train Dodo around it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # beside the output folder (not in the system's temporary folder, where nobody would remove it)
    workdir = Path(output_dir).parent / f"{Path(output_dir).name}-smoke-inputs"
    workdir.mkdir(parents=True, exist_ok=True)
    places = ["harbour", "library", "orchard", "station", "market", "observatory"]
    rows = []
    for index in range(24):
        place = places[index % len(places)]
        context = " ".join(f"At the {place}, visitor {index + s} noted detail {s * index % 7} of the {place} records."
                           for s in range(6 + index % 4))
        rows.append({"context": context, "prompt": "Where were the notes taken?", "target": f"At the {place}."})
    for name, part in (("train.jsonl", rows[:20]), ("validation.jsonl", rows[20:])):
        (workdir / name).write_text("\n".join(json.dumps(row) for row in part) + "\n", encoding="utf-8")
    tokenizer = build_smoke_tokenizer([value for row in rows for value in row.values()])
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ))
    base.save_pretrained(workdir / "tiny-llama")
    tokenizer.save_pretrained(workdir / "tiny-llama")
    arguments = [
        "--base_model_name_or_path", str(workdir / "tiny-llama"), "--dodo_config", json.dumps(SMOKE_DODO_CONFIG),
        "--train_file", str(workdir / "train.jsonl"), "--validation_file", str(workdir / "validation.jsonl"),
        "--prompt_column", "prompt", "--output_dir", output_dir, "--do_train", "--do_eval",
        "--max_steps", "4", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
        "--learning_rate", "5e-3", "--scorer_learning_rate", "1e-2", "--warmup_steps", "1",
        "--logging_steps", "2", "--save_strategy", "no", "--report_to", "none", "--use_cpu",
        "--dataloader_num_workers", "0", "--seed", "0",
    ]
    return arguments, workdir


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    smoke_inputs = None
    if "--smoke" in argv:
        output_dir, rest = pop_option(argv, "--output_dir")  # (--output_dir=DIR too)
        smoke_argv, smoke_inputs = smoke_arguments(output_dir or tempfile.mkdtemp(prefix="finetune-dodo-smoke-"))
        argv = smoke_argv + rest
    parser = HfArgumentParser((ModelArguments, DataArguments, DodoTrainingArguments))
    model_args, data_args, training_args, unknown = parser.parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True)
    if unknown:  # as argparse does (exit status 2); HfArgumentParser itself raises a ValueError
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    metrics = run(model_args, data_args, training_args, argv)
    if training_args.do_train and training_args.process_index == 0:
        # The saved folder is what Hub users get: load it the way they would (remote code) and generate.
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(training_args.output_dir, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(training_args.output_dir)
        raw = load_raw_datasets(data_args)
        split = next(name for name in ("validation", "test", "train") if name in raw)
        row = first_text(raw[split], data_args.context_column)  # an empty context has nothing to compress
        if row is not None:
            inputs = generation_inputs(tokenizer, reloaded, data_args, raw[split][row])
            with torch.no_grad():
                output = reloaded.generate(**inputs, max_new_tokens=16, do_sample=False)
            which = "the first" if row == 0 else f"the first non-empty (row {row})"
            print(f"generated for {which} {split} example:",
                  repr(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)))
    if smoke_inputs is not None:
        metrics["smoke_inputs"] = str(smoke_inputs)
    print(json.dumps({key: value for key, value in metrics.items() if isinstance(value, (int, float, str, dict))}))
    return metrics


if __name__ == "__main__":
    exit_with_one_line_errors(main)
