"""The examples run as they are (their smoke modes, as CI runs them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from hub_recorder import single_commit

from longreach import hub

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_finetune_summarization_smoke(tmp_path):
    output_dir = tmp_path / "finetuned"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_summarization.py"), "--smoke", "--output_dir", str(output_dir)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics["train_loss"] > 0 and metrics["epoch"] > 0
    for key in ("eval_rouge1", "eval_rouge2", "eval_rougeLsum"):  # generation during evaluation, scored offline
        assert 0.0 <= metrics[key] <= 100.0
    assert metrics["eval_gen_len"] > 0
    assert (tmp_path / "finetuned-smoke-inputs" / "tiny-locost").is_dir()  # beside the output, not left in /tmp
    assert "summary of the first validation document:" in result.stdout  # reloaded through pipeline("summarization")
    assert {"model.safetensors", "modeling_locost.py", "pipeline_summarization.py", "tokenizer.json"} <= set(
        hub.hub_files(output_dir))
    assert "Fine-tuned with `examples/finetune_summarization.py`" in ModelCard.load(output_dir / "README.md").text


def test_finetune_summarization_pushes_with_our_card(tmp_path, monkeypatch, recorder):
    """`--push_to_hub` uploads through longreach (the Trainer's own upload would replace our model card)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    example.main(["--smoke", "--output_dir", str(tmp_path / "ft"), "--push_to_hub", "--hub_model_id", "someone/ft",
                  "--max_steps", "1", "--do_eval", "false"])
    commit = single_commit(recorder)
    repo_id, files = commit["repo_id"], commit["files"]
    assert repo_id == "someone/ft"
    assert {"README.md", "model.safetensors", "modeling_locost.py", "tokenizer.json"} <= set(files)
    assert "training_args.bin" not in files
    assert "Fine-tuned with `examples/finetune_summarization.py`" in files["README.md"].decode()
    assert hub.read_card_state(tmp_path / "ft" / "README.md")["base_model"].endswith("tiny-locost")  # where from


def test_finetune_summarization_config_overrides_reach_a_checkpoint(tmp_path, monkeypatch):
    """--config_overrides also changes a loaded checkpoint's config (e.g. the log-length scaling of its cross-attention)."""
    from longreach import LocostConfig, LocostForConditionalGeneration
    from tokenizer_helpers import word_level_tokenizer

    LocostForConditionalGeneration(LocostConfig(vocab_size=64, d_model=16, d_state=4, d_kv=4, d_ff=32, num_layers=1,
                                                num_heads=4)).save_pretrained(tmp_path / "tiny")
    word_level_tokenizer(vocab_size=64).save_pretrained(tmp_path / "tiny")
    example = _load_example("finetune_summarization", monkeypatch)
    for overrides, expected in ((None, None), ('{"cross_attention_logn_length": 256}', 256)):
        model, _ = example.load_model_and_tokenizer(example.ModelArguments(model_name_or_path=str(tmp_path / "tiny"),
                                                                           config_overrides=overrides))
        assert model.config.cross_attention_logn_length == expected
        assert model.decoder.config.cross_attention_logn_length == expected  # what the decoder reads


# ---------------------------------------------------------------------------------------------------------------------
# examples/finetune_dodo.py
# ---------------------------------------------------------------------------------------------------------------------


def _load_example(name: str, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # dataclasses look their module up there
    spec.loader.exec_module(example)
    return example


def test_finetune_dodo_smoke_trains_adapters_scorer_and_soft_prompt_only(tmp_path):
    from safetensors.torch import load_file

    output_dir = tmp_path / "dodo"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_dodo.py"), "--smoke", "--output_dir", str(output_dir)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics["train_loss"] > 0 and metrics["eval_loss"] > 0 and metrics["eval_perplexity"] > 1
    # joint training: both adapters, the scorer and the soft prompt moved; the base did not
    assert metrics["parameters_changed"] == {"base": False, "encoder_adapter": True, "decoder_adapter": True,
                                             "scorer": True, "soft_prompt": True}
    assert "generated for the first validation example:" in result.stdout  # reloaded with trust_remote_code
    # the saved checkpoint, checked independently: base tensors equal the base Llama's, LoRA B (zero at start) moved
    assert Path(metrics["smoke_inputs"]).parent == tmp_path  # the smoke inputs live beside the output, not in /tmp
    base = load_file(str(Path(metrics["smoke_inputs"]) / "tiny-llama" / "model.safetensors"))
    saved = load_file(str(output_dir / "model.safetensors"))
    for key, tensor in base.items():
        assert torch.equal(saved.get(key, saved.get(key.replace(".weight", ".base_layer.weight"))), tensor), key
    still_zero = sorted(key for key in saved if ".lora_B." in key and saved[key].abs().sum() == 0)
    # φ's pass is only used for its keys and values: the last layer's query and output projections get no gradient
    assert still_zero == ["model.layers.2.self_attn.o_proj.lora_B.encoder.weight",
                          "model.layers.2.self_attn.q_proj.lora_B.encoder.weight"]
    config = json.loads((output_dir / "config.json").read_text())
    assert config["model_type"] == "dodo_llama" and config["nugget_ratio"] == 0.2 and config["lora_r"] == 4
    assert {"model.safetensors", "modeling_dodo.py", "pipeline_summarization.py", "tokenizer.json"} <= set(
        hub.hub_files(output_dir))
    assert "Trained with `examples/finetune_dodo.py` (continuation)" in ModelCard.load(output_dir / "README.md").text


def test_finetune_dodo_features_carry_their_length_for_group_by_length(monkeypatch):
    """`--train_sampling_strategy group_by_length` groups by a "length" column: context and target tokens (without one
    it grouped by the target alone, and autoencoding rows, without `input_ids`, crashed the sampler)."""
    from tokenizer_helpers import word_level_tokenizer

    example = _load_example("finetune_dodo", monkeypatch)
    encoder = example.ExampleEncoder(None, word_level_tokenizer(vocab_size=64), example.DataArguments())
    features = encoder({"context": ["w1 w2 w3 w4 w5", "w6 w7"], "target": ["w8 w9", "w10 w11 w12"]})
    assert features["length"] == [len(context) + len(ids) for context, ids in
                                  zip(features["context_input_ids"], features["input_ids"])]
    assert features["length"][0] > features["length"][1]


def test_finetune_dodo_uses_the_authors_optimizer_and_schedule(tmp_path, monkeypatch):
    from transformers import HfArgumentParser

    example = _load_example("finetune_dodo", monkeypatch)
    (args,) = HfArgumentParser(example.DodoTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"])
    # spec dodo.md §6: AdamW (0.9, 0.95), eps 1e-5, weight decay 0.1, lr 1e-4, cosine after 2000 warm-up steps
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (0.9, 0.95, 1e-5, 0.1)
    assert args.learning_rate == 1e-4 and args.warmup_steps == 2000 and args.lr_scheduler_type == "cosine"
    assert args.remove_unused_columns is False

    from longreach import DodoLlamaConfig, DodoLlamaForCausalLM

    model = DodoLlamaForCausalLM(DodoLlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                 nugget_layer=1, lora_r=2))
    args.scorer_learning_rate, args.warmup_steps, args.schedule_horizon_steps = 3e-4, 10, 300
    trainer = example.DodoTrainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, torch.optim.AdamW)
    lora, rest = optimizer.param_groups
    names = {id(param): name for name, param in model.named_parameters()}
    assert lora["lr"] == 1e-4 and all(".lora_" in names[id(p)] for p in lora["params"])
    assert rest["lr"] == 3e-4 and {names[id(p)].split(".")[0] for p in rest["params"]} == {"nugget_scorer",
                                                                                          "soft_prompt"}
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert {names[id(p)] for group in (lora, rest) for p in group["params"]} == trainable  # nothing of the base
    for group in (lora, rest):
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-5 and group["weight_decay"] == 0.1
    # warm-up then half a cosine over the horizon (the authors: 150 x warmup), not over the run's 20 steps
    scheduler = trainer.create_scheduler(num_training_steps=20, optimizer=optimizer)
    for _ in range(155):
        optimizer.step()
        scheduler.step()
    assert rest["lr"] == pytest.approx(3e-4 * 0.5, rel=1e-6) and lora["lr"] == pytest.approx(1e-4 * 0.5, rel=1e-6)


def test_finetune_dodo_pushes_with_our_card(tmp_path, monkeypatch, recorder):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_dodo", monkeypatch)
    example.main(["--smoke", "--output_dir", str(tmp_path / "ft"), "--push_to_hub", "--hub_model_id", "someone/dodo",
                  "--max_steps", "1", "--do_eval", "false"])
    commit = single_commit(recorder)
    repo_id, files = commit["repo_id"], commit["files"]
    assert repo_id == "someone/dodo"
    assert {"README.md", "model.safetensors", "modeling_dodo.py", "configuration_dodo.py", "tokenizer.json"} <= set(
        files)
    assert "training_args.bin" not in files
    readme = files["README.md"].decode()
    assert "Trained with `examples/finetune_dodo.py`" in readme and 'model="someone/dodo"' in readme
    assert f"`{hub.read_card_state(tmp_path / 'ft' / 'README.md')['base_model']}`" in readme  # the card's "from"


def test_finetune_summarization_trains_with_an_eval_strategy_and_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    """An evaluation strategy without --do_train still trains (TrainingArguments turns do_eval on by itself); a rerun of
    the same command into the same --output_dir continues from its last complete checkpoint instead of starting over;
    summaries longer than --max_target_length are announced."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    output_dir = tmp_path / "ft"
    argv = [a for a in example.smoke_arguments(str(output_dir)) if a not in ("--do_train", "--do_eval")]
    argv += ["--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps", "--save_steps", "2",
             "--max_steps", "2", "--max_target_length", "3"]
    metrics = example.main(argv)
    assert metrics["train_loss"] > 0 and (output_dir / "model.safetensors").is_file()
    err = capsys.readouterr().err
    assert "summaries are longer than --max_target_length=3 tokens and were cut to it" in err
    assert "ROUGE is scored against the summaries as written" in err
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    example.main([a if a != "2" or argv[i - 1] != "--max_steps" else "4" for i, a in enumerate(argv)])
    assert f"Resuming from {output_dir / 'checkpoint-2'}" in capsys.readouterr().err
    state = json.loads((output_dir / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["log_history"][0]["step"] == 2  # continued, not restarted
    # metrics and state are written as transformers' examples write them
    assert {"train_results.json", "eval_results.json", "all_results.json", "trainer_state.json"} <= {
        path.name for path in output_dir.iterdir()}
    assert json.loads((output_dir / "trainer_state.json").read_text())["global_step"] == 4
    # a rerun of the finished command trains nothing: transformers would run a fifth step from checkpoint-4 and
    # replace the saved model
    weights = (output_dir / "model.safetensors").read_bytes()
    metrics = example.main([a if a != "2" or argv[i - 1] != "--max_steps" else "4" for i, a in enumerate(argv)])
    assert f"{output_dir / 'checkpoint-4'} already reached --max_steps 4: nothing to train" in capsys.readouterr().err
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (output_dir / "model.safetensors").read_bytes() == weights and "train_loss" not in metrics
    assert metrics["epoch"] == state["epoch"] > 0  # the evaluation is the checkpoint's, at its epoch
    assert metrics["eval_rouge1"] == json.loads((output_dir / "eval_results.json").read_text())["eval_rouge1"]


def test_finetune_summarization_trains_vcc_t5_to_answer_questions(tmp_path, monkeypatch, capsys):
    """--question_column: each example's question is its VIP tokens, laid out as `pipeline(..., question=...)` does at
    inference (`prepare_question_inputs`); the summary column holds the answers. LOCOST refuses the option."""
    from tokenizer_helpers import word_level_tokenizer

    from longreach import VCCT5Config, VCCT5ForConditionalGeneration

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    tokenizer = word_level_tokenizer(vocab_size=64)
    torch.manual_seed(0)
    model = VCCT5ForConditionalGeneration(VCCT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.0, num_vanilla_layers=1, segment_length=32, num_vip_slots=8,
        block_size=4, num_refined_blocks=3))
    model.save_pretrained(tmp_path / "vcc")
    tokenizer.save_pretrained(tmp_path / "vcc")
    rows = [{"context": " ".join(f"w{3 + (k * 7 + i) % 58}" for i in range(40 + k)), "question": f"w{3 + k} w{4 + k}?"
             if k % 2 else f"w{5 + k}", "answer": f"w{3 + (k * 7) % 58}"} for k in range(10)]
    for name, part in (("train.jsonl", rows[:8]), ("validation.jsonl", rows[8:])):
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in part))

    documents, questions = [row["context"] for row in rows[:3]], [row["question"] for row in rows[:3]]
    features, cut = example.encode_documents(model, tokenizer, documents, 30, questions)
    inputs, dropped = model.prepare_question_inputs(tokenizer, questions, documents, max_input_length=30)
    assert cut == 3 and dropped[0] > 0
    for row, question in enumerate(questions):
        keep = inputs["attention_mask"][row].bool()
        assert features["input_ids"][row] == inputs["input_ids"][row][keep].tolist()
        assert features["vip_mask"][row] == inputs["vip_mask"][row][keep].tolist()
        assert sum(features["vip_mask"][row]) == len(tokenizer(question)["input_ids"])  # the question, its EOS too

    common = ["--text_column", "context", "--question_column", "question", "--summary_column", "answer",
              "--train_file", str(tmp_path / "train.jsonl"), "--validation_file", str(tmp_path / "validation.jsonl"),
              "--report_to", "none", "--use_cpu", "--save_strategy", "no", "--max_source_length", "64",
              "--max_target_length", "4", "--max_steps", "2", "--per_device_train_batch_size", "4"]
    metrics = example.main(["--model_name_or_path", str(tmp_path / "vcc"), "--output_dir", str(tmp_path / "qa"),
                            *common])
    assert metrics["train_loss"] > 0 and "eval_rouge1" in metrics
    assert "answer to the first validation question ('w13'):" in capsys.readouterr().out
    card = ModelCard.load(tmp_path / "qa" / "README.md").text
    assert "answering the questions of its `question` column: pass `question=` to the pipeline" in card

    # an empty question is named by its row and column (it failed inside a tokenization batch, by its place there)
    (tmp_path / "empty.jsonl").write_text("".join(json.dumps({**row, "question": "" if k == 6 else row["question"]})
                                                  + "\n" for k, row in enumerate(rows[:8])))
    with pytest.raises(ValueError, match=re.escape("The train data: row 6 of column 'question' is '', expected a "
                                                   "question")):
        example.main(["--model_name_or_path", str(tmp_path / "vcc"), "--output_dir", str(tmp_path / "o"), *common,
                      "--train_file", str(tmp_path / "empty.jsonl")])

    locost = _load_example("finetune_summarization", monkeypatch).smoke_arguments(str(tmp_path / "ft"))
    locost_model = locost[locost.index("--model_name_or_path") + 1]
    with pytest.raises(ValueError, match=re.escape("--question_column question: LocostForConditionalGeneration has "
                                                   "no question format")):
        example.main(["--model_name_or_path", locost_model, "--output_dir", str(tmp_path / "o"), *common])
    assert not (tmp_path / "o").exists()


def test_finetune_dodo_question_answering_lays_examples_out_as_the_pipeline_asks(monkeypatch):
    """--task question_answering: the context as the pipeline compresses it, the paper's D.2 prompt with the question
    as the decoder prompt (questions of different lengths: no padding left in it), then the answer and EOS."""
    from test_workflows_vcc_t5_dodo import llama_word_tokenizer, tiny_dodo

    example = _load_example("finetune_dodo", monkeypatch)
    model, tokenizer = tiny_dodo(), llama_word_tokenizer()
    data_args = example.DataArguments(task="question_answering", max_context_length=12)
    batch = {"context": ["w1 w2 w3 w4 w5", "w6 w7 " * 10], "question": ["w8", "w9 w10 w11 w12"],
             "target": ["w13 w14", "w15"]}
    features = example.ExampleEncoder(model, tokenizer, data_args)(batch)
    for row in range(2):
        inputs, _ = model.prepare_question_inputs(tokenizer, batch["question"][row], [batch["context"][row]],
                                                  max_input_length=12)
        prompt = inputs["input_ids"][0].tolist()
        assert tokenizer.decode(prompt).endswith(batch["question"][row] + " [/INST]")
        assert features["context_input_ids"][row] == inputs["context_input_ids"][0].tolist()
        answer = tokenizer(batch["target"][row], add_special_tokens=False)["input_ids"]
        assert features["input_ids"][row] == prompt + answer + [tokenizer.eos_token_id]
        assert features["prompt_length"][row] == len(prompt)
    assert len(features["context_input_ids"][1]) == 12  # cut to --max_context_length, as at inference
    generation = example.generation_inputs(tokenizer, model, data_args, {key: value[1] for key, value in batch.items()})
    assert generation["input_ids"][0].tolist() == features["input_ids"][1][:features["prompt_length"][1]]
    # a decoder prompt that fills --max_target_length would put the loss on the question, the answer cut away
    short = example.DataArguments(task="question_answering", max_context_length=12, max_target_length=12)
    prompt_tokens = features["prompt_length"][1]
    assert prompt_tokens >= 12
    with pytest.raises(ValueError, match=re.escape(f"--max_target_length 12 leaves no room for the target after a "
                                                   f"decoder prompt of {prompt_tokens} tokens")):
        example.ExampleEncoder(model, tokenizer, short)(batch)


def test_finetune_dodo_refuses_question_options_of_another_task(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_dodo", monkeypatch)
    for argv, message in ((["--question_column", "q"], "--question_column is read by --task question_answering only, "
                                                        "not by --task continuation"),
                          (["--task", "summarization", "--prompt_column", "p"],
                           "--prompt_column is read by --task continuation only, not by --task summarization")):
        with pytest.raises(ValueError, match=re.escape(message)):
            example.main(["--base_model_name_or_path", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "o"),
                          "--report_to", "none", "--use_cpu", *argv])
    assert not (tmp_path / "o").exists()


def test_finetune_summarization_final_evaluation_honours_generation_max_length(tmp_path, monkeypatch):
    """The last evaluation generated --max_target_length new tokens whatever --generation_max_length said (the
    evaluations during training honoured it); both count the decoder start token, as Seq2SeqTrainer does."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import Seq2SeqTrainer

    example = _load_example("finetune_summarization", monkeypatch)
    calls = []
    evaluate = Seq2SeqTrainer.evaluate
    monkeypatch.setattr(Seq2SeqTrainer, "evaluate", lambda self, *a, **k: calls.append(k) or evaluate(self, *a, **k))
    argv = example.smoke_arguments(str(tmp_path / "ft"))
    example.main(argv + ["--max_steps", "1", "--generation_max_length", "3"])
    assert calls[-1]["max_new_tokens"] == 2


def test_a_rerun_of_a_finished_run_keeps_its_best_model_and_an_epoch_run_its_results(tmp_path, monkeypatch, capsys):
    """From an audit: a rerun of a finished --load_best_model_at_end run loaded the last checkpoint and saved it over
    the best model; a rerun of a finished --num_train_epochs run trained zero steps and wrote zeros over its
    train_results.json (and then failed on the empty metrics)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    output_dir = tmp_path / "best"
    argv = [a for a in example.smoke_arguments(str(output_dir)) if a not in ("--do_train", "--do_eval")]
    argv += ["--max_steps", "4", "--learning_rate", "0.3", "--eval_strategy", "steps", "--eval_steps", "1",
             "--save_strategy", "steps", "--save_steps", "1", "--load_best_model_at_end", "--metric_for_best_model",
             "loss", "--greater_is_better", "true"]  # the highest loss: a best checkpoint that is not the last
    first = example.main(argv)
    best = json.loads((output_dir / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert Path(best).name != "checkpoint-4"  # (the test needs a best checkpoint that is not the last)
    weights = (output_dir / "model.safetensors").read_bytes()
    assert weights == (Path(best) / "model.safetensors").read_bytes()
    again = example.main(argv)
    assert (output_dir / "model.safetensors").read_bytes() == weights
    assert again["eval_loss"] == first["eval_loss"]
    assert f"the weights of {best} are loaded" in capsys.readouterr().err

    output_dir = tmp_path / "epochs"
    argv = [a for a in example.smoke_arguments(str(output_dir)) if a != "--do_eval"]
    at = argv.index("--max_steps")
    argv = argv[:at] + argv[at + 2:] + ["--num_train_epochs", "1", "--save_strategy", "epoch", "--do_eval", "false"]
    trained = example.main(argv)
    results = (output_dir / "train_results.json").read_text()
    assert trained["train_loss"] > 0
    assert example.main(argv) == {}  # nothing trained, nothing evaluated
    assert "already reached --num_train_epochs 1: nothing to train" in capsys.readouterr().err
    assert (output_dir / "train_results.json").read_text() == results


def test_finetuning_helpers_keep_what_the_user_has(tmp_path):
    from types import SimpleNamespace

    from longreach.finetuning import check_one_data_source, check_output_dir, load_data_files, resume_checkpoint

    (tmp_path / "README.md").write_text("my notes")
    with pytest.raises(ValueError, match="holds a README.md that is not a longreach model card"):
        check_output_dir(tmp_path)
    for step, complete in ((3, True), (7, True), (9, False)):  # checkpoint-9 was cut short by a crash
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"")
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text('{"global_step": %d}' % step)
    args = dict(output_dir=str(tmp_path), max_steps=20, num_train_epochs=3)
    assert resume_checkpoint(SimpleNamespace(**args, resume_from_checkpoint=None)) == str(tmp_path / "checkpoint-7")
    assert resume_checkpoint(SimpleNamespace(**args, resume_from_checkpoint="last")) == str(tmp_path / "checkpoint-7")
    assert resume_checkpoint(SimpleNamespace(**{**args, "output_dir": str(tmp_path / "new")},
                                             resume_from_checkpoint=None)) is None
    # a checkpoint saved with --save_only_model resumed with a new optimizer and schedule: another loss curve
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "trainer_state.json").write_text('{"global_step": 8}')
    with pytest.raises(ValueError, match=r"checkpoint-8 holds no optimizer state \(saved with --save_only_model\)"):
        resume_checkpoint(SimpleNamespace(**args, resume_from_checkpoint=None))
    assert resume_checkpoint(SimpleNamespace(**args, resume_from_checkpoint=str(tmp_path / "checkpoint-8"))) == str(
        tmp_path / "checkpoint-8")  # asked for by name: its weights, with a new optimizer
    assert resume_checkpoint(SimpleNamespace(**{**args, "max_steps": 8}, resume_from_checkpoint=None)) == str(
        tmp_path / "checkpoint-8")  # a finished run is loaded, not trained: nothing to resume
    with pytest.raises(ValueError, match="--dataset_name d and --validation_file v.jsonl: give a dataset or data"):
        check_one_data_source(SimpleNamespace(dataset_name="d", train_file=None, validation_file="v.jsonl"))
    (tmp_path / "train.csv").write_text("document,summary\n001 a b c,x y\n")
    (tmp_path / "empty.csv").write_text("")
    assert load_data_files(str(tmp_path / "train.csv"), None)["train"][0]["document"] == "001 a b c"
    with pytest.raises(ValueError, match="--validation_file .*empty.csv is empty"):
        load_data_files(str(tmp_path / "train.csv"), str(tmp_path / "empty.csv"))
    with pytest.raises(ValueError, match=r"--train_file .*notes.txt: expected a \.json / \.jsonl / \.csv / \.parquet"):
        load_data_files(str(tmp_path / "notes.txt"), None)
    # datasets' own message for these named neither the file nor the option
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "header.csv").write_text("document,summary\n")
    (tmp_path / "none.json").write_text("[]")
    (tmp_path / "train.jsonl").write_text('{"document": "a b", "summary": "a"}\n')
    for train, validation in (("train.jsonl", "blank.jsonl"), ("train.csv", "header.csv"), (None, "none.json")):
        with pytest.raises(ValueError, match=f"--validation_file .*{validation} holds no record"):
            load_data_files(train and str(tmp_path / train), str(tmp_path / validation))


def test_finetune_summarization_refuses_what_would_lose_work_or_train_nothing(tmp_path, monkeypatch):
    """From an audit: --output_dir equal to the model folder overwrote the model, a run of no step saved the untrained
    model as fine-tuned, a misspelt --config_overrides field was stored and ignored, and bad values failed deep in
    the Trainer or the tokenizer without naming their option, column or row."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    inputs = tmp_path / "ft-smoke-inputs"
    example.smoke_arguments(str(tmp_path / "ft"))  # the tiny checkpoint and data files
    model = inputs / "tiny-locost"
    weights = (model / "model.safetensors").read_bytes()
    common = ["--train_file", str(inputs / "train.jsonl"), "--report_to", "none", "--use_cpu", "--save_strategy", "no",
              "--max_source_length", "64", "--max_target_length", "8"]
    cases = [
        (["--model_name_or_path", str(model), "--output_dir", str(model), "--max_steps", "1"],
         "is the --model_name_or_path folder: training would overwrite the model"),
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--num_train_epochs", "-1"],
         "the run would train no step"),
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--gradient_accumulation_steps",
          "0"], "--gradient_accumulation_steps must be >= 1, got 0"),
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--max_train_samples", "0"],
         "--max_train_samples must be >= 1"),
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--config_overrides", "{d_model:3"],
         "--config_overrides is not valid JSON"),
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--config_overrides",
          '{"d_modle": 3}'], "--config_overrides: ['d_modle'] is not a field of LocostConfig"),
        (["--model_type", "locost", "--tokenizer_name", str(model), "--output_dir", str(tmp_path / "o"),
          "--config_overrides", '{"d_modle": 3}'], "--config_overrides: ['d_modle'] is not a field of LocostConfig"),
        (["--model_name_or_path", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "o")],
         "--model_name_or_path"),
        # transformers named no option, after loading the model and data
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--resume_from_checkpoint",
          str(tmp_path / "nowhere")], f"--resume_from_checkpoint {tmp_path / 'nowhere'}: no such checkpoint folder"),
        # transformers would ignore --do_predict and a --do_eval without data, and fail after the first evaluation on
        # a metric the evaluation does not compute (a KeyError)
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--do_predict"],
         "--do_predict: these scripts have no test split to predict on"),
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--do_train", "--do_eval"],
         "--do_eval needs validation data: pass --validation_file"),
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--metric_for_best_model",
          "rougeL"], "--metric_for_best_model rougeL: the evaluation computes ['gen_len', 'loss', 'rouge1'"),
        # was turned back on without a word
        (["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--predict_with_generate",
          "false"], "--predict_with_generate false: this script evaluates the summaries it generates (ROUGE)"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            example.main(arguments + common)
    assert (model / "model.safetensors").read_bytes() == weights and not (tmp_path / "o").exists()
    # an --output_dir holding another model's checkpoints: refused by name before a step, not deep in the optimizer
    foreign = tmp_path / "reused" / "checkpoint-3"
    foreign.mkdir(parents=True)
    (foreign / "config.json").write_text(json.dumps({"model_type": "vcc_t5", "d_model": 8}))
    (foreign / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (foreign / "optimizer.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(f"{foreign} holds another model (model_type 'vcc_t5', this one's "
                                                   "'locost'), so training cannot resume from it")):
        example.main(["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "reused"), "--max_steps",
                      "5", *common])
    assert sorted(path.name for path in (tmp_path / "reused").iterdir()) == ["checkpoint-3"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"document": "a b c", "summary": "a"}\n{"document": null, "summary": "b"}\n')
    with pytest.raises(ValueError, match=re.escape("The train data: row 1 of column 'document' is None, expected text")):
        example.main(["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--max_steps", "1",
                      *common, "--train_file", str(bad)])
    # run as a script, a bad argument is one line, not a traceback
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_summarization.py"), "--model_name_or_path", str(model),
         "--output_dir", str(tmp_path / "o"), "--gradient_accumulation_steps", "0", *common],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: --gradient_accumulation_steps must be >= 1")


def test_finetune_summarization_shows_the_first_non_empty_document(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    arguments = example.smoke_arguments(str(tmp_path / "ft"))
    inputs = tmp_path / "ft-smoke-inputs"
    rows = [json.loads(line) for line in (inputs / "validation.jsonl").read_text().splitlines()]
    (inputs / "validation.jsonl").write_text("".join(json.dumps(row) + "\n" for row in
                                                     [{"document": "", "summary": "none"}, *rows]))
    metrics = example.main(arguments + ["--max_steps", "1"])
    assert "eval_rouge1" in metrics  # the run ends with its metrics (it failed on the empty document before)
    assert "summary of the first non-empty (row 1) validation document:" in capsys.readouterr().out


def test_finetune_dodo_refuses_bad_settings_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_dodo", monkeypatch)
    smoke_argv, inputs = example.smoke_arguments(str(tmp_path / "d"))
    base = smoke_argv[smoke_argv.index("--base_model_name_or_path") + 1]
    config_json = (Path(base) / "config.json").read_bytes()
    common = ["--base_model_name_or_path", base, "--dodo_config", '{"nugget_layer": 2, "lora_r": 4}', "--train_file",
              smoke_argv[smoke_argv.index("--train_file") + 1], "--report_to", "none", "--use_cpu",
              "--save_strategy", "no", "--max_steps", "1"]
    cases = [
        (["--output_dir", base], "is the --base_model_name_or_path folder: training would overwrite the model"),
        (["--output_dir", str(tmp_path / "o"), "--scorer_learning_rate", "-1"], "--scorer_learning_rate must be >= 0"),
        (["--output_dir", str(tmp_path / "o"), "--schedule_horizon_steps", "-5"],
         "--schedule_horizon_steps must be >= 1"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            example.main(common + arguments)
    typo = [argument if argument != '{"nugget_layer": 2, "lora_r": 4}' else '{"nugget_layer": 2, "nuget_ratio": 0.5}'
            for argument in common]
    with pytest.raises(ValueError, match=re.escape("`dodo_config`: ['nuget_ratio'] is not a field of DodoLlamaConfig")):
        example.main(typo + ["--output_dir", str(tmp_path / "o")])
    assert (Path(base) / "config.json").read_bytes() == config_json and not (tmp_path / "o").exists()


def test_check_text_columns_names_the_row_and_skips_reading_a_clean_string_column(monkeypatch):
    """A string column without nulls passes on the Arrow table's null count, without reading its rows (sets of
    millions of rows); a null or a number is named with its column and its row in the dataset as selected."""
    import datasets

    from longreach.finetuning import check_text_columns

    with_null = datasets.Dataset.from_dict({"document": ["a", None, "c", "d"], "summary": ["s", "t", "u", "v"]})
    with pytest.raises(ValueError, match=re.escape("The train data: row 1 of column 'document' is None, expected text")):
        check_text_columns(with_null, ["document", "summary"], "train")
    check_text_columns(with_null.select([0, 2, 3]), ["document"], "train")  # the null row is not in the selection
    with pytest.raises(ValueError, match=re.escape("row 0 of column 'document' is None")):
        check_text_columns(with_null.select([3, 1]).select([1]), ["document"], "train")
    numbers = datasets.Dataset.from_dict({"document": [1, 2]})
    with pytest.raises(ValueError, match=re.escape("The validation data: row 0 of column 'document' is 1, expected text")):
        check_text_columns(numbers, ["document"], "validation")

    def no_reading(self, key):
        raise AssertionError(f"a string column without nulls was read ({key!r})")

    clean = datasets.Dataset.from_dict({"document": ["a", ""] * 1000})
    # every read of a column goes through `__getitem__` (a lazy Column from datasets 4 on, a list before)
    monkeypatch.setattr(datasets.Dataset, "__getitem__", no_reading)
    check_text_columns(clean, ["document"], "train")


def test_question_data_needs_a_document_for_each_question():
    """VCC-T5's question preparation refuses a blank document (it would answer from the question alone): the data
    are checked first, naming the row, instead of failing inside a batch of the tokenization."""
    from datasets import Dataset

    from longreach.finetuning import check_questions

    data = Dataset.from_dict({"context": ["w1 w2", " "], "question": ["w3", "w4"]})
    check_questions(data, "question", "train")  # questions alone: fine
    with pytest.raises(ValueError, match=r"The train data: row 1 of column 'context' is ' ', expected the document"):
        check_questions(data, "question", "train", document_column="context")
