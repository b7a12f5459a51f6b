"""Every user mistake on the command line gets one line on stderr naming the problem and the fix, exit code 2 for usage
errors and 1 for failures, no traceback (``--debug`` shows it), and no network for what is clearly a local path."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from tokenizer_helpers import word_level_tokenizer
from workflow_helpers import document, save_tiny_locost

from longreach import hub
from longreach.cli import main


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_locost(tmp_path_factory.mktemp("cli-errors") / "tiny")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(document(50), encoding="utf-8")
    return path


def run(argv, capsys, expected_code):
    """Run the command; return its one error line (after any progress lines), checking the exit code."""
    start = time.monotonic()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == expected_code, err
    assert "Traceback" not in err
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert time.monotonic() - start < 30  # no download retries
    return errors[0]


def test_version(capsys):
    import longreach

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"longreach {longreach.__version__}"


def test_python_dash_m_longreach_is_the_command(tmp_path):
    """`python -m longreach` runs the command (where the script is not on PATH: `pip install --target`, `--user`); it
    said "No module named longreach.__main__"."""
    import subprocess
    import sys
    from pathlib import Path

    import longreach

    package_root = str(Path(longreach.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "longreach"]
    version = subprocess.run([*command, "--version"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert (version.returncode, version.stdout.strip()) == (0, f"longreach {longreach.__version__}"), version.stderr
    usage = subprocess.run([*command, "summarize"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and "--model" in usage.stderr and "Traceback" not in usage.stderr


def test_a_missing_local_model_path_never_asks_the_hub(text_file, capsys, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("a local path was sent to the Hub")

    monkeypatch.setattr(hub, "hub_reachable", no_network)
    for typo in ("./modle", "models/locost/typo", "~/no-such-folder"):
        line = run(["summarize", "--model", typo, str(text_file)], capsys, 2)
        assert os.path.expanduser(typo) in line and "no such file or folder" in line  # (~: the home folder's path)


def test_a_hub_id_offline_fails_at_once(text_file, capsys, isolated_hf_env):
    line = run(["summarize", "--model", "some-org/some-model", str(text_file)], capsys, 1)
    assert "some-org/some-model" in line and "HF_HUB_OFFLINE" in line


def test_an_unconverted_original_folder_points_to_convert(fixtures_dir, text_file, capsys):
    line = run(["summarize", "--model", str(fixtures_dir / "locost" / "hf_checkpoint"), str(text_file)], capsys, 2)
    assert "longreach convert locost --checkpoint_path" in line
    line = run(["summarize", "--model", str(fixtures_dir / "vcc" / "hf_ckpt"), str(text_file)], capsys, 2)
    assert "longreach convert vcc" in line


def test_a_folder_without_tokenizer_asks_for_one(tiny_folder, tmp_path, text_file, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_folder, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    line = run(["summarize", "--model", str(bare), str(text_file)], capsys, 2)
    assert "has no tokenizer" in line and "--tokenizer" in line
    assert main(["summarize", "--model", str(bare), "--tokenizer", str(tiny_folder), str(text_file),
                 "--max_new_tokens", "2"]) == 0


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tiny_folder, tmp_path, text_file, capsys):
    word_level_tokenizer([f"x{i}" for i in range(147)]).save_pretrained(tmp_path / "big-tokenizer")
    line = run(["summarize", "--model", str(tiny_folder), "--tokenizer", str(tmp_path / "big-tokenizer"),
                str(text_file)], capsys, 2)
    assert "150 tokens" in line and "99 embeddings" in line


def test_a_non_utf8_file(tiny_folder, tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    line = run(["summarize", "--model", str(tiny_folder), str(tmp_path / "latin1.txt")], capsys, 1)
    assert "not UTF-8" in line and "iconv" in line


@pytest.mark.parametrize("option, value, expected", [
    ("--num_beams", "0", "expected a positive integer, got 0"),
    ("--max_new_tokens", "0", "expected a positive integer, got 0"),
    ("--max_input_length", "0", "expected a positive integer, got 0"),
    ("--max_new_tokens", "ten", "expected a positive integer, got 'ten'"),
    ("--dtype", "bogus", "invalid choice: 'bogus'"),
    ("--bogus_option", "1", "unrecognized arguments: --bogus_option 1"),
])
def test_bad_option_values_are_usage_errors(tiny_folder, text_file, capsys, option, value, expected):
    line = run(["summarize", "--model", str(tiny_folder), str(text_file), option, value], capsys, 2)
    assert expected in line and "--help`)" in line


def test_cuda_without_cuda(tiny_folder, text_file, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = run(["summarize", "--model", str(tiny_folder), str(text_file), "--device", "cuda"], capsys, 2)
    assert "CUDA is not available" in line and "--device cpu" in line
    line = run(["summarize", "--model", str(tiny_folder), str(text_file), "--device", "gpu0"], capsys, 2)
    assert "not a device name" in line


def test_push_offline_or_without_login(tiny_folder, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE is set" in run(["push", str(tiny_folder), "someone/tiny"], capsys, 1)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    assert "cannot be reached" in run(["push", str(tiny_folder), "someone/tiny"], capsys, 1)
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored token
    assert "not logged in" in run(["push", str(tiny_folder), "someone/tiny"], capsys, 1)


def test_debug_shows_the_traceback(text_file):
    from longreach.cli import UsageError

    with pytest.raises(UsageError, match="no such file or folder"):
        main(["--debug", "summarize", "--model", "./modle", str(text_file)])


def test_unexpected_failures_are_one_line_too(tiny_folder, text_file, capsys, monkeypatch):
    from longreach import cli

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure\nwith a second line")

    monkeypatch.setattr(cli, "load_summarizer", broken)
    line = run(["summarize", "--model", str(tiny_folder), str(text_file)], capsys, 1)
    assert line == "error: RuntimeError: simulated failure (run again with --debug for the traceback)"


def test_push_checks_the_folder_and_repository_id_before_the_network(tiny_folder, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has none" in run(["push", str(empty), "someone/tiny"], capsys, 2)
    assert "is not a Hub repository id" in run(["push", str(tiny_folder), "not a repo"], capsys, 2)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_folder, broken)
    (broken / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in run(["push", str(broken), "someone/tiny"], capsys, 2)


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--bogus"], "longreach demo: unrecognized arguments: --bogus"),
    (["convert", "locost"], "longreach convert locost: the following arguments are required: --checkpoint_path"),
    (["convert", "dodo", "--pytorch_dump_folder_path", "o", "--nonsense"],
     "longreach convert dodo: unrecognized arguments: --nonsense"),
])
def test_sub_command_usage_errors_are_one_line(argv, expected, capsys):
    assert expected in run(argv, capsys, 2)


def test_debug_reaches_the_converters_and_the_demo(tmp_path):
    from longreach.conversion.conversion_utils import ConversionError
    from longreach.demo import OutputDirError

    for argv in (["--debug", "convert", "locost"], ["convert", "locost", "--debug"]):
        with pytest.raises(ConversionError, match="does not exist"):
            main(argv + ["--checkpoint_path", str(tmp_path / "absent"), "--pytorch_dump_folder_path",
                         str(tmp_path / "out")])
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(OutputDirError, match="is a file"):
        main(["demo", "--output_dir", str(tmp_path / "afile"), "--debug"])


def test_a_missing_local_tokenizer_path_is_a_usage_error_too(tiny_folder, text_file, capsys):
    line = run(["summarize", "--model", str(tiny_folder), "--tokenizer", "./no-such-tokenizer", str(text_file)],
               capsys, 2)
    assert "--tokenizer './no-such-tokenizer': no such file or folder" in line


def test_non_utf8_standard_input_is_named_before_the_model_loads(tiny_folder, capsys, monkeypatch):
    import io
    import sys

    from longreach import cli

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was read")

    monkeypatch.setattr(cli, "load_summarizer", not_loaded)
    stdin = io.TextIOWrapper(io.BytesIO("caf\u00e9 w1 w2".encode("latin-1")), encoding="utf-8",
                             errors="surrogateescape")  # as a UTF-8 locale's stdin passes bad bytes on
    monkeypatch.setattr(sys, "stdin", stdin)
    line = run(["summarize", "--model", str(tiny_folder), "-"], capsys, 1)
    assert "standard input is not UTF-8 text (byte 0xe9 at offset 3)" in line and "iconv" in line


def test_a_hub_tokenizer_found_only_in_the_cache_is_loaded_without_the_network(tiny_folder, text_file, monkeypatch,
                                                                             capsys):
    """`--tokenizer owner/name` found in the local cache while the Hub is out of reach is loaded with
    `local_files_only=True`, as `--model` is (without it, transformers retried the download for minutes)."""
    from transformers import AutoTokenizer

    original = hub.pretrained_location
    monkeypatch.setattr(hub, "pretrained_location", lambda name, what="model": {"local_files_only": True}
                        if name == "someone/tok" else original(name, what))
    calls = []
    load = AutoTokenizer.from_pretrained

    def recording(name, *args, **kwargs):
        calls.append((name, kwargs.get("local_files_only")))
        return load(str(tiny_folder), *args, **kwargs)  # the cache stand-in: the folder's own tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    assert main(["summarize", "--model", str(tiny_folder), "--tokenizer", "someone/tok", str(text_file),
                 "--max_new_tokens", "2"]) == 0
    assert calls == [("someone/tok", True)]


@pytest.mark.parametrize("argv", [["model-cards", "--output_dir", ""], ["push", "", "someone/tiny"],
                                  ["push", ".", ""]])
def test_empty_paths_and_repository_ids_are_usage_errors(argv, capsys):
    """An empty --output_dir wrote the three cards into the current folder; an empty push folder is the current one."""
    assert "expected a non-empty value, got ''" in run(argv, capsys, 2)


def test_a_hub_model_found_only_in_the_cache_checks_for_an_adapter_without_the_network(tiny_folder, text_file,
                                                                                        monkeypatch):
    """transformers' check for a PEFT adapter (`find_adapter_config_file`) does not inherit `local_files_only` and
    retried the Hub for a model id found only in the cache; it is passed to it through `adapter_kwargs`."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    original = hub.pretrained_location
    monkeypatch.setattr(hub, "pretrained_location", lambda name, what="model": {"local_files_only": True}
                        if name == "someone/model" else original(name, what))
    calls = []
    for auto in (AutoConfig, AutoModelForSeq2SeqLM):
        load = auto.from_pretrained

        def recording(name, *args, _load=load, **kwargs):
            calls.append((name, kwargs.get("local_files_only"), kwargs.get("adapter_kwargs")))
            return _load(str(tiny_folder), *args, **kwargs)  # the cache stand-in: the local folder

        monkeypatch.setattr(auto, "from_pretrained", recording)
    assert main(["summarize", "--model", "someone/model", "--tokenizer", str(tiny_folder), str(text_file),
                 "--max_new_tokens", "2"]) == 0
    calls = [call for call in calls if call[0] == "someone/model"]  # (not the stand-in's own inner loads)
    assert calls == [("someone/model", True, None), ("someone/model", True, {"local_files_only": True})]


def test_a_single_documents_output_and_paths_are_checked_before_the_model_loads(tiny_folder, text_file, tmp_path,
                                                                                 capsys, monkeypatch):
    """From an audit: a folder as --output failed after the whole generation, --model=~/m was taken for a Hub id, a
    tokenizer.json file as --tokenizer went to the Hub (46 s of retries), conflicting lengths were accepted (the minimum
    silently ignored), and a closed standard input gave an AttributeError."""
    from longreach import cli

    real_load = cli.load_summarizer
    loads = []
    monkeypatch.setattr(cli, "load_summarizer", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    (tmp_path / "outdir").mkdir()
    assert "--output " + str(tmp_path / "outdir") + " is a folder; give the path of the file" in run(
        ["summarize", "--model", str(tiny_folder), str(text_file), "--output", str(tmp_path / "outdir")], capsys, 2)
    assert "--min_new_tokens 10 is more than --max_new_tokens 3" in run(
        ["summarize", "--model", str(tiny_folder), str(text_file), "--max_new_tokens", "3", "--min_new_tokens", "10"],
        capsys, 2)
    assert loads == []  # refused before the model loaded
    assert "is a file; pass the folder that holds it" in run(  # (checked before loading, and not on the Hub)
        ["summarize", "--model", str(tiny_folder), str(text_file), "--tokenizer", str(tiny_folder / "tokenizer.json")],
        capsys, 2)
    monkeypatch.setattr("sys.stdin", None)
    assert "standard input, which is closed" in run(["summarize", "--model", str(tiny_folder), "-"], capsys, 1)
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_folder, tmp_path / "m")
    assert main(["summarize", "--model=~/m", str(text_file), "--max_new_tokens", "3", "--output=~/new/s.txt"]) == 0
    assert (tmp_path / "new" / "s.txt").read_text().strip()  # the folder is made, as for a corpus's output
    capsys.readouterr()
    assert main(["summarize", "--model", str(tiny_folder), str(text_file), "--max_new_tokens", "3",
                 "--output", "-"]) == 0
    assert capsys.readouterr().out.strip() == (tmp_path / "new" / "s.txt").read_text().strip()
    assert not (tmp_path / "-").exists() and not any(p.name == "-" for p in tmp_path.parent.iterdir())


def test_push_refuses_a_sharded_checkpoint_with_a_missing_shard(tmp_path, capsys, monkeypatch):
    from workflow_helpers import tiny_locost, word_tokenizer

    folder = tmp_path / "sharded"
    tiny_locost().save_pretrained(folder, max_shard_size="100KB")
    word_tokenizer().save_pretrained(folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()  # a folder still being written or copied
    monkeypatch.setattr("longreach.cli.push_preflight", lambda: None)
    message = run(["push", str(folder), "someone/tiny"], capsys, 2)
    assert f"names shards that are not in {folder}: {shards[-1].name}" in message


def test_model_cards_keeps_hand_edited_cards(tmp_path, capsys):
    assert main(["model-cards", "--output_dir", str(tmp_path)]) == 0
    card = tmp_path / "locost.md"
    card.write_text(card.read_text() + "\nMY NOTES\n")
    assert "locost.md, edited by hand since they were generated" in run(
        ["model-cards", "--output_dir", str(tmp_path)], capsys, 2)
    assert card.read_text().endswith("MY NOTES\n")
    card.write_bytes(b"caf\xe9")
    assert f"{card} is not UTF-8 text" in run(["model-cards", "--output_dir", str(tmp_path)], capsys, 2)
