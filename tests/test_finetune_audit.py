"""From an audit of the fine-tuning examples as a user runs them (tiny local models and data, a few steps)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_examples import _load_example
from tokenizer_helpers import word_level_tokenizer
from transformers import EvalPrediction


def _summarization_rows(count: int) -> list[dict]:
    """Documents of very different lengths (so that grouping by length reorders them), one-word summaries."""
    return [{"document": " ".join(f"w{3 + (k * 7 + i) % 58}" for i in range(5 + 9 * ((k * 5) % 7))),
             "summary": f"w{10 + k}"} for k in range(count)]


def test_rouge_scores_each_summary_against_its_own_reference_in_any_order(monkeypatch):
    """The evaluation may see the validation examples in another order (`--train_sampling_strategy group_by_length`
    sorts them by length): each generated summary was scored against the reference at its place in the data, another
    example's."""
    example = _load_example("finetune_summarization", monkeypatch)
    tokenizer = word_level_tokenizer(vocab_size=64)
    references = ["w10 w11", "w12", "w13 w14 w15", "w12"]  # two equal references too
    labels = [tokenizer(text_target=reference)["input_ids"] for reference in references]
    compute_metrics = example.build_compute_metrics(tokenizer, references, labels)
    order = [2, 0, 3, 1]
    width = max(len(row) for row in labels)
    label_ids = np.array([labels[i] + [-100] * (width - len(labels[i])) for i in order])
    predictions = np.array([[0] + labels[i] + [0] * (width - len(labels[i])) for i in order])  # perfect summaries
    metrics = compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids))
    assert metrics["rouge1"] == metrics["rougeLsum"] == 100.0


def test_group_by_length_evaluation_scores_against_the_right_references(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    example.smoke_arguments(str(tmp_path / "ft"))
    model = tmp_path / "ft-smoke-inputs" / "tiny-locost"
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _summarization_rows(8)))
    scored = []
    rouge_scores = example.rouge_scores
    monkeypatch.setattr(example, "rouge_scores", lambda summaries, targets, **kw: scored.append(targets) or
                        rouge_scores(summaries, targets, **kw))
    labels_seen = []
    build = example.build_compute_metrics

    def recording_build(tokenizer, *args):
        compute_metrics = build(tokenizer, *args)

        def record(prediction):
            labels_seen.append(tokenizer.batch_decode(np.where(prediction.label_ids >= 0, prediction.label_ids, 0),
                                                      skip_special_tokens=True))
            return compute_metrics(prediction)
        return record

    monkeypatch.setattr(example, "build_compute_metrics", recording_build)
    example.main(["--model_name_or_path", str(model), "--validation_file", str(tmp_path / "val.jsonl"),
                  "--output_dir", str(tmp_path / "eval"), "--report_to", "none", "--use_cpu",
                  "--per_device_eval_batch_size", "2", "--max_target_length", "12",
                  "--train_sampling_strategy", "group_by_length"])
    expected = [row["summary"] for row in _summarization_rows(8)]
    assert labels_seen[0] != expected  # (the test needs an evaluation in another order than the data's)
    assert scored[0] == labels_seen[0]  # each summary against its own example's reference



@pytest.mark.parametrize("order", ["data", "group_by_length"])
def test_rouge_is_scored_against_the_summaries_as_written_when_they_are_cut(tmp_path, monkeypatch, order):
    """Seq2SeqTrainer pads the label rows to the generation length with the pad token: matched with those pads, no
    row found its reference, and ROUGE was scored against the labels cut to --max_target_length, while the run says
    it is scored against the summaries as written."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    example.smoke_arguments(str(tmp_path / "ft"))
    model = tmp_path / "ft-smoke-inputs" / "tiny-locost"
    topics = ["state space models", "token compression", "context nuggets", "relative position buckets"]
    rows = [{"document": " ".join(f"Paragraph {p} explains how {topics[k]} works." for p in range(1 + 3 * k)),
             "summary": f"How {topics[k]} keep long inputs affordable."} for k in range(4)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    scored = []
    rouge_scores = example.rouge_scores
    monkeypatch.setattr(example, "rouge_scores", lambda summaries, targets, **kw: scored.append(targets) or
                        rouge_scores(summaries, targets, **kw))
    grouping = ["--train_sampling_strategy", "group_by_length"] if order == "group_by_length" else []
    example.main(["--model_name_or_path", str(model), "--validation_file", str(tmp_path / "val.jsonl"),
                  "--output_dir", str(tmp_path / "eval"), "--report_to", "none", "--use_cpu",
                  "--per_device_eval_batch_size", "2", "--max_target_length", "4", *grouping])
    assert sorted(scored[0]) == sorted(row["summary"] for row in rows)  # not the labels cut to 4 tokens


@pytest.mark.parametrize("name", ["finetune_summarization", "finetune_dodo"])
def test_a_rerun_without_checkpoints_does_not_replace_the_finished_model(tmp_path, monkeypatch, name):
    """A run saved without checkpoints (`--save_strategy no`, as the smoke runs do, or checkpoints deleted to free the
    disk): a rerun into the same --output_dir had nothing to resume, started over from the original model and
    replaced the fine-tuned one without a word."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example(name, monkeypatch)
    output_dir = tmp_path / "ft"
    smoke = example.smoke_arguments(str(output_dir))
    argv = smoke[0] if name == "finetune_dodo" else smoke
    argv = [a for i, a in enumerate(argv) if a != "--do_eval"] + ["--do_eval", "false", "--max_steps", "1"]
    example.main(argv)
    weights = (output_dir / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=re.escape(f"--output_dir {output_dir} holds the model an earlier run saved "
                                                   "(model.safetensors) and no checkpoint to resume from")):
        example.main(argv)
    assert (output_dir / "model.safetensors").read_bytes() == weights
    # evaluating it is fine; so is training further from it into another folder
    evaluation = example.main(argv + ["--do_train", "false", "--do_eval", "true", "--validation_file",
                                      argv[argv.index("--train_file") + 1]])
    assert evaluation["eval_loss"] > 0
    option = "--model_name_or_path" if name == "finetune_summarization" else "--base_model_name_or_path"
    further = list(argv)
    if name == "finetune_dodo":  # a Dodo checkpoint is continued with --model_name_or_path, without --dodo_config
        at = further.index("--dodo_config")
        del further[at:at + 2]
        option_at = further.index(option)
        further[option_at] = "--model_name_or_path"
    else:
        option_at = further.index(option)
    further[option_at + 1] = str(output_dir)
    further[further.index("--output_dir") + 1] = str(tmp_path / "further")
    assert example.main(further)["train_loss"] > 0
    assert (output_dir / "model.safetensors").read_bytes() == weights


def test_bad_generation_max_length_is_refused_before_training(tmp_path, monkeypatch):
    """--generation_max_length 1 (or 0) trained the whole run, then failed at the first evaluation inside generate()
    ("`max_new_tokens` must be greater than 0, but is 0"), naming no option."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    argv = example.smoke_arguments(str(tmp_path / "ft"))
    for value in ("1", "0"):
        message = (f"--generation_max_length must be >= 2 (the decoder start token, then at least one new token), "
                   f"got {value}.")
        with pytest.raises(ValueError, match=re.escape(message)):
            example.main(argv + ["--generation_max_length", value])
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("name", ["finetune_summarization", "finetune_dodo"])
def test_data_with_neither_a_train_nor_a_validation_split_is_refused(tmp_path, monkeypatch, name):
    """A --dataset_name folder with a test split only: the run did nothing, printed `{}` and exited 0."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example(name, monkeypatch)
    smoke = example.smoke_arguments(str(tmp_path / "ft"))
    argv = smoke[0] if name == "finetune_dodo" else smoke
    data = tmp_path / "only-test"
    data.mkdir()
    (data / "test.jsonl").write_text(open(argv[argv.index("--validation_file") + 1]).read())
    for option in ("--train_file", "--validation_file"):
        at = argv.index(option)
        argv = argv[:at] + argv[at + 2:]
    argv = [a for a in argv if a not in ("--do_train", "--do_eval")] + ["--dataset_name", str(data)]
    with pytest.raises(ValueError, match=re.escape("Nothing to run: the data has no train or validation split (it has "
                                                   "['test'])")):
        example.main(argv)
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("name", ["finetune_summarization", "finetune_dodo"])
def test_smoke_takes_output_dir_with_an_equals_sign(tmp_path, monkeypatch, name):
    """`--smoke --output_dir=DIR`: the smoke inputs went to a new folder of the system's temporary folder (left there,
    with an empty one beside it) instead of beside DIR."""
    import tempfile

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_folder = tempfile.mkdtemp  # (save_pretrained stages its files in a folder made inside the target)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kwargs: make_folder(**kwargs) if kwargs.get("dir")
                        else pytest.fail("a temporary folder was made"))
    example = _load_example(name, monkeypatch)
    metrics = example.main(["--smoke", f"--output_dir={tmp_path / 'ft'}", "--max_steps", "1", "--do_eval", "false"])
    assert metrics["train_loss"] > 0 and (tmp_path / "ft" / "model.safetensors").is_file()
    assert (tmp_path / "ft-smoke-inputs").is_dir()


def test_pop_option_reads_both_spellings():
    from longreach.finetuning import pop_option

    assert pop_option(["--a", "1", "--output_dir", "x", "--b"], "--output_dir") == ("x", ["--a", "1", "--b"])
    assert pop_option(["--output_dir=x", "--a"], "--output_dir") == ("x", ["--a"])
    assert pop_option(["--output_dir", "x", "--output_dir=y"], "--output_dir") == ("y", [])
    assert pop_option(["--output_dirs", "x"], "--output_dir") == (None, ["--output_dirs", "x"])


def test_dodo_an_empty_prompt_trains_from_bos_as_generation_starts(monkeypatch):
    """--prompt_column with an empty prompt: training started the decoder on the target itself (its first token
    never learned, no BOS), while generation (and rows without a prompt column) start from BOS."""
    from test_workflows_vcc_t5_dodo import llama_word_tokenizer

    example = _load_example("finetune_dodo", monkeypatch)
    tokenizer = llama_word_tokenizer()
    data_args = example.DataArguments(prompt_column="prompt")
    batch = {"context": ["w1 w2 w3", "w4 w5"], "prompt": ["", "w6"], "target": ["w7 w8", "w9"]}
    features = example.ExampleEncoder(None, tokenizer, data_args)(batch)
    target = tokenizer("w7 w8", add_special_tokens=False)["input_ids"]
    assert features["input_ids"][0] == [tokenizer.bos_token_id] + target + [tokenizer.eos_token_id]
    assert features["prompt_length"][0] == 1
    row = {key: values[0] for key, values in batch.items()}
    prompt = example.generation_inputs(tokenizer, None, data_args, row)["input_ids"][0].tolist()
    assert prompt == features["input_ids"][0][:features["prompt_length"][0]]  # generation starts as training did
    assert features["input_ids"][1][:1] == tokenizer("w6", add_special_tokens=False)["input_ids"]  # a prompt: as is


@pytest.mark.parametrize("task", ["summarization", "question_answering"])
def test_dodo_a_blank_document_is_named_by_its_row_in_the_data(tmp_path, monkeypatch, task):
    """Dodo's summarization and question prompts refuse a blank document: the run failed inside a batch of the
    tokenization with "got '' for document 2", its place in a batch of 64, naming neither the row nor the column."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_dodo", monkeypatch)
    argv, inputs = example.smoke_arguments(str(tmp_path / "d"))
    rows = [json.loads(line) for line in (inputs / "train.jsonl").read_text().splitlines()]
    rows = (rows * 4)[:70]
    rows[66] = {**rows[66], "context": " "}
    (inputs / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv += ["--task", task] + (["--question_column", "prompt"] if task == "question_answering" else [])
    at = argv.index("--prompt_column")
    argv = argv[:at] + argv[at + 2:]
    expected = "a document to summarize" if task == "summarization" else "the document its question is asked of"
    with pytest.raises(ValueError, match=re.escape(f"The train data: row 66 of column 'context' is ' ', expected "
                                                   f"{expected}")):
        example.main(argv)
    assert not (tmp_path / "d").exists()


def test_both_stages_turned_off_is_named_as_such(tmp_path, monkeypatch):
    """`--do_eval false` alone (do_train is off unless asked for): nothing to run, but the data has a validation split;
    the message said it had none."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example("finetune_summarization", monkeypatch)
    argv = [a for a in example.smoke_arguments(str(tmp_path / "ft")) if a not in ("--do_train", "--do_eval")]
    message = ("Nothing to run: --do_train and --do_eval are both off (the data has ['train', 'validation']); turn one "
               "of them on.")
    with pytest.raises(ValueError, match=re.escape(message)):
        example.main(argv + ["--do_eval", "false"])
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("name, text, reason", [
    ("train.jsonl", '{"document": "a b", "summary": "a"}\n[1, 2]\n', "line 2 is not a JSON object: [1, 2]"),
    ("train.jsonl", '{"document": "a b", "summary": "a"}\n{"document": "c\n', "line 2 is not valid JSON"),
    ("train.jsonl", '"a document"\n', 'it holds "a document", not JSON objects'),
    ("train.json", '[{"document": "a b", "summary": "a"}, 3]', "item 1 of its JSON list is not an object: 3"),
    ("train.csv", 'document,summary\n"a b,a\n', "EOF inside string"),
])
def test_a_data_file_that_cannot_be_parsed_is_named_with_its_bad_line(tmp_path, monkeypatch, name, text, reason):
    """A JSON line that is not an object (or not JSON), a CSV cut short: a traceback ending in datasets'
    "DatasetGenerationError: An error occurred while generating the dataset", which named neither the file nor the
    line (Arrow's "Column() changed from object to string in row 0" counts the rows of its block)."""
    from longreach.finetuning import load_data_files

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    good = tmp_path / name.replace("train", "validation")
    good.write_text('document,summary\n"a b",a\n' if name.endswith(".csv") else '{"document": "a b", "summary": "a"}\n')
    bad = tmp_path / name
    bad.write_text(text)
    kind = "csv" if name.endswith(".csv") else "json"
    with pytest.raises(ValueError, match=re.escape(f"--train_file {bad} cannot be read as {kind} (") + ".*"
                       + re.escape(reason)):
        load_data_files(str(bad), str(good))
    assert len(load_data_files(str(good), None)["train"]) == 1  # (a file that parses still loads)


@pytest.mark.parametrize("name", ["finetune_summarization", "finetune_dodo"])
def test_an_unknown_option_is_a_usage_error(name):
    """A mistyped option (`--max_stpes 10`): "error: Some specified arguments are not used by the HfArgumentParser"
    with exit status 1, where argparse (and the `longreach` CLI) say "unrecognized arguments" with status 2."""
    import subprocess
    import sys

    from test_examples import EXAMPLES

    result = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--max_stpes", "10", "--output_dir", "out"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().endswith(f"{name}.py: error: unrecognized arguments: --max_stpes 10")
    assert "Traceback" not in result.stderr and not result.stdout



def test_train_and_validation_files_with_other_columns_load(tmp_path, monkeypatch):
    """A validation file with one column more than the training file (an "id"): datasets read both files as one table
    and failed with "DatasetGenerationError" (a CastError: "column names don't match"), naming neither file."""
    from longreach.finetuning import load_data_files

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = _summarization_rows(3)
    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))
    validation.write_text(json.dumps({"id": "v0", **rows[2]}) + "\n")
    raw = load_data_files(str(train), str(validation))
    assert raw["train"].column_names == ["document", "summary"] and raw["train"]["summary"] == ["w10", "w11"]
    assert raw["validation"].column_names == ["id", "document", "summary"] and raw["validation"]["id"] == ["v0"]


@pytest.mark.parametrize("name", ["finetune_summarization", "finetune_dodo"])
def test_the_data_is_checked_before_the_model_is_loaded(tmp_path, monkeypatch, name):
    """A data file without the summary / target column was named only once the model was loaded (minutes for a 7B
    Llama, for each try); transformers' run_summarization.py also reads its data first."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example(name, monkeypatch)
    smoke = example.smoke_arguments(str(tmp_path / "ft"))
    argv = smoke[0] if name == "finetune_dodo" else smoke
    column = "summary" if name == "finetune_summarization" else "target"
    rows = [json.loads(line) for line in open(argv[argv.index("--train_file") + 1])]
    bad = tmp_path / "no-target.jsonl"
    bad.write_text("".join(json.dumps({k: v for k, v in row.items() if k != column}) + "\n" for row in rows))
    argv[argv.index("--train_file") + 1] = str(bad)
    monkeypatch.setattr(example, "load_model_and_tokenizer",
                        lambda *args: pytest.fail("the model was loaded before the data was checked"))
    with pytest.raises(ValueError, match=re.escape("The train data has no column ") + f".*{column}"):
        example.main(argv)
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("name", ["finetune_summarization", "finetune_dodo"])
def test_push_to_hub_that_cannot_upload_fails_before_training(tmp_path, monkeypatch, recorder, name):
    """--push_to_hub offline (or not logged in): the whole run trained, then failed at the upload ("Cannot reach
    https://huggingface.co/api/repos/create: offline mode is enabled"); Trainer creates the repository first."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    def create_repo(self, *args, **kwargs):  # what huggingface_hub raises with HF_HUB_OFFLINE=1
        raise OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/repos/create: offline mode is enabled.")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(recorder, "create_repo", create_repo)
    example = _load_example(name, monkeypatch)
    monkeypatch.setattr(example, "train_or_resume", lambda *args: pytest.fail("it trained before creating the repo"))
    with pytest.raises(ValueError, match=re.escape("--push_to_hub: cannot create the Hub repository 'someone/ft'")
                       + ".*offline mode"):
        example.main(["--smoke", "--output_dir", str(tmp_path / "ft"), "--push_to_hub", "--hub_model_id", "someone/ft",
                      "--max_steps", "1", "--do_eval", "false"])
    assert not (tmp_path / "ft" / "model.safetensors").exists()


def test_a_failed_upload_after_training_says_how_to_retry(tmp_path, monkeypatch, recorder):
    """The upload after training fails (the network went down: httpx's ConnectError, which is not an OSError, ended in
    a traceback): the message says the model is saved and how to upload it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    class ConnectError(Exception):  # (httpx's: an Exception, not an OSError)
        pass

    def create_commit(self, *args, **kwargs):
        raise ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(recorder, "create_commit", create_commit)
    example = _load_example("finetune_summarization", monkeypatch)
    output_dir = tmp_path / "ft"
    message = f"the model is saved in {output_dir}: upload it with `longreach push {output_dir} someone/ft`"
    with pytest.raises(ValueError, match=re.escape(message)):
        example.main(["--smoke", "--output_dir", str(output_dir), "--push_to_hub", "--hub_model_id", "someone/ft",
                      "--max_steps", "1", "--do_eval", "false"])
    assert (output_dir / "model.safetensors").is_file() and recorder.instances[0].repos  # created before training


@pytest.mark.parametrize("name", ["finetune_summarization", "finetune_dodo"])
def test_an_output_dir_that_is_a_file_is_named_before_anything_runs(tmp_path, monkeypatch, name):
    """--output_dir naming an existing file: "[Errno 17] File exists: '...'" once the model was loaded and the data
    prepared, without naming the option."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = _load_example(name, monkeypatch)
    output = tmp_path / "notes.txt"
    output.write_text("the user's notes\n")
    monkeypatch.setattr(example, "load_model_and_tokenizer",
                        lambda *args: pytest.fail("the model was loaded before --output_dir was checked"))
    for stages in (["--do_eval", "false"], ["--do_train", "false"]):
        with pytest.raises(ValueError, match=re.escape(f"--output_dir {output} is a file, expected a folder")):
            example.main(["--smoke", "--output_dir", str(output), "--max_steps", "1"] + stages)
        assert output.read_text() == "the user's notes\n"


def test_train_and_validation_files_of_different_kinds_load(tmp_path, monkeypatch):
    """A .csv training file with a .jsonl validation file was refused ("must be of one kind"), a limit of reading both
    in one datasets call; each file is read on its own now."""
    from longreach.finetuning import load_data_files

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = _summarization_rows(3)
    train, validation = tmp_path / "train.csv", tmp_path / "validation.jsonl"
    train.write_text("document,summary\n" + "".join(f"{row['document']},{row['summary']}\n" for row in rows[:2]))
    validation.write_text(json.dumps(rows[2]) + "\n")
    raw = load_data_files(str(train), str(validation))
    assert raw["train"]["summary"] == ["w10", "w11"] and raw["validation"]["document"] == [rows[2]["document"]]


def test_push_to_hub_names_the_repository_after_the_output_folder(tmp_path, monkeypatch):
    """Without --hub_model_id the repository is named after --output_dir, as Trainer names it; `--output_dir .` (or
    `run/`) gave an empty name, and the Hub refused the repository id ''."""
    from types import SimpleNamespace

    from longreach.finetuning import hub_repo_id

    (tmp_path / "run1").mkdir()
    monkeypatch.chdir(tmp_path / "run1")
    for output_dir in (".", "./", "../run1", str(tmp_path / "run1") + "/"):
        assert hub_repo_id(SimpleNamespace(hub_model_id=None, output_dir=output_dir)) == "run1"
    assert hub_repo_id(SimpleNamespace(hub_model_id="someone/ft", output_dir=".")) == "someone/ft"


@pytest.mark.parametrize("name", ["finetune_summarization", "finetune_dodo"])
def test_a_dataset_folder_that_cannot_be_parsed_names_the_option(tmp_path, monkeypatch, name):
    """--dataset_name DIR whose train.jsonl holds a line that is not an object: datasets' traceback
    ("DatasetGenerationError: An error occurred while generating the dataset"), naming neither option nor file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    example = _load_example(name, monkeypatch)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"document": "a b", "summary": "a"}\n[1, 2]\n')
    arguments = example.DataArguments(dataset_name=str(data))
    with pytest.raises(ValueError, match=re.escape(f"--dataset_name {data}: datasets cannot read its data (")):
        example.load_raw_datasets(arguments)
