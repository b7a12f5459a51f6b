"""`longreach demo`: a fast smoke run of the real code path (the full run takes minutes; see the demo's docstring),
and the data set it builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from huggingface_hub import ModelCard

from longreach import hub
from longreach.cli import main
from longreach.demo import (
    _DEMO_CARD_MARK,
    OutputDirError,
    _replaced_atomically,
    build_corpus,
    clean_text,
    check_output_dir,
    lead_baseline,
    lead_pretraining_examples,
    paired_bootstrap_interval,
    without_overlap,
)
from longreach.metrics import rouge_per_document, rouge_scores


def test_corpus_is_real_local_text_split_deterministically():
    train, held_out = build_corpus()
    again_train, again_held_out = build_corpus()
    assert (train, held_out) == (again_train, again_held_out)
    assert len(train) >= 100 and len(held_out) >= 10
    assert {e["source"] for e in train} == {"distribution", "stdlib"}
    assert not {e["document"] for e in train} & {e["document"] for e in held_out}
    transformers_entry = [e for e in train + held_out if e["name"] == "transformers"]
    assert transformers_entry and "Transformers" in transformers_entry[0]["document"]
    assert all(len(e["document"].split()) >= 80 and len(e["summary"].split()) >= 3 for e in train + held_out)
    assert all("https://" not in e["document"] and "```" not in e["document"] for e in train + held_out)  # no URLs


def test_no_held_out_text_is_trained_on():
    train, held_out = build_corpus(min_training_words=15)
    # this library's README quotes the demo's held-out documents and results: not a corpus document
    assert not [e for e in train + held_out if e["source"] == "distribution" and e["name"].lower() == "longreach"]
    training_text = [" ".join(e["document"].lower().split()) for e in train]
    for example in held_out:
        for quoted in (example["summary"], lead_baseline(example["document"])):
            quoted = " ".join(quoted.lower().split()).rstrip(".!?:;, ")
            if len(quoted.split()) >= 4:
                assert not [text for text in training_text if quoted in text], (example["name"], quoted)


def test_without_overlap_drops_training_documents_that_quote_an_evaluated_one():
    held_out = [{"document": "Return the median of data. More words follow here.", "summary": "Middle value of data."}]
    train = [
        {"document": "Unrelated text about sockets and streams."},
        {"document": "A sibling docstring: RETURN the median   of data. And more."},  # the held-out lead, other case
        {"document": "A README that says the middle value of data, quoted."},  # the held-out summary
        {"document": "Return the median."},  # fewer than 4 words shared: kept
    ]
    assert without_overlap(train, held_out) == [train[0], train[3]]


def test_shorter_training_documents_leave_the_held_out_set_unchanged():
    train, held_out = build_corpus()
    more_train, same_held_out = build_corpus(min_training_words=15)
    assert same_held_out == held_out and len(more_train) > len(train)
    assert not {e["document"] for e in more_train} & {e["document"] for e in held_out}
    assert min(len(e["document"].split()) for e in more_train) >= 15


def test_lead_pretraining_uses_training_documents_only():
    train, held_out = build_corpus(min_training_words=15)
    pairs = lead_pretraining_examples(train, num_words=12, random_windows=2, seed=0)
    assert pairs == lead_pretraining_examples(train, num_words=12, random_windows=2, seed=0)
    assert len(pairs) > 2 * len(train)
    training_text = " ".join(e["document"] for e in train)
    assert all(p["document"] in training_text and 0 < len(p["summary"].split()) <= 12 for p in pairs[:200])
    # the target is the text's own lead, or its first words
    assert all(p["summary"] in (lead_baseline(p["document"]), " ".join(p["document"].split()[:12])) for p in pairs)


def test_rouge_and_baseline_helpers():
    assert rouge_scores(["the cat sat on the mat."], ["the cat sat on the mat."]) == {
        "rouge1": 100.0, "rouge2": 100.0, "rougeLsum": 100.0}
    assert rouge_scores(["dogs bark"], ["the cat sat"])["rouge1"] == 0.0
    # per document (0 to 1), and the corpus score is their mean
    per_document = rouge_per_document(["the cat sat", "dogs bark"], ["the cat sat", "the cat sat"])
    assert [scores["rouge1"] for scores in per_document] == [1.0, 0.0]
    assert rouge_scores(["the cat sat", "dogs bark"], ["the cat sat", "the cat sat"])["rouge1"] == 50.0
    assert lead_baseline("First sentence here. Second one.") == "First sentence here."
    # questions and headings are not leads
    assert lead_baseline("What is this? Overview. A library for fonts. More.") == "A library for fonts."
    assert lead_baseline("Why? Why not?") == "Why?"


def test_paired_bootstrap_interval_of_the_rouge1_margin():
    references = ["the cat sat on the mat", "a dog barks at night", "rain falls on the town", "birds sing at dawn"]
    # the same summaries as the baseline: no difference in any resampling
    assert paired_bootstrap_interval(references, references, references) == (0.0, 0.0)
    # every summary exact, every baseline shares nothing: +100 on every document, so in every resampling
    baseline = ["zebra", "quartz", "violin", "crater"]
    assert paired_bootstrap_interval(references, baseline, references) == (100.0, 100.0)
    # mixed: one document better, one worse; the interval contains the observed mean difference and 0, and is the
    # same for the same seed
    summaries = ["the cat sat on the mat", "zebra", "rain falls on the town", "birds sing at dawn"]
    mixed_baseline = ["zebra", "a dog barks at night", "rain falls on the town", "birds sing at dawn"]
    low, high = paired_bootstrap_interval(summaries, mixed_baseline, references)
    assert low < 0.0 < high and low >= -100.0 and high <= 100.0
    assert (low, high) == paired_bootstrap_interval(summaries, mixed_baseline, references)
    with pytest.raises(ValueError, match="`predictions`, `baseline` and `references`"):
        paired_bootstrap_interval(summaries, mixed_baseline[:3], references)
    with pytest.raises(ValueError, match="`confidence` must be between 0 and 1"):
        paired_bootstrap_interval(summaries, mixed_baseline, references, confidence=95)
    with pytest.raises(ValueError, match="`samples` must be a positive integer"):
        paired_bootstrap_interval(summaries, mixed_baseline, references, samples=0)


def test_clean_text_keeps_sections_whose_titles_are_underlined_with_tildes():
    # a reStructuredText "~~~~" underline is not a Markdown code fence: the section under it was lost
    text = "What is this?\n~~~~~~~~~~~~~\n\n| fontTools is a library.\n\nInstall\n~~~~~~~\n\n```\ncode\n```\nEnd."
    assert clean_text(text) == "What is this? fontTools is a library. Install End."


def test_demo_smoke_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the model is kept in ./longreach-demo by default
    output_dir = Path("longreach-demo")
    assert main(["demo", "--smoke", "--json"]) == 0
    out = capsys.readouterr().out
    assert "The model is kept in longreach-demo" in out and "longreach summarize --model longreach-demo" in out
    # no staging folder left beside it; the held-out set and its summaries by the corpus command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["longreach-demo", "longreach-demo-heldout"]
    for stage in range(1, 10):
        assert f"[{stage}/9]" in out  # data, tokenizer, model, lead pretraining, training, ROUGE, save, reload, corpus
    lines = (tmp_path / "longreach-demo-heldout" / "summaries.jsonl").read_text(encoding="utf-8").splitlines()
    summaries = [json.loads(line) for line in lines]
    assert len(summaries) == 4 and all(
        set(record) == {"id", "summary", "input_tokens", "truncated", "text_digest"} for record in summaries)
    assert lines[0] in out  # its first lines are shown
    assert (tmp_path / "longreach-demo-heldout" / "summaries.metrics.json").is_file()
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["rouge"]) == {"rouge1", "rouge2", "rougeLsum"}
    assert all(0.0 <= value <= 100.0 for value in result["rouge"].values())
    assert "ROUGE on 4 held-out documents" in out and "reference:" in out and "summary:" in out
    assert result["rouge1_margin"] == round(result["rouge"]["rouge1"] - result["lead_rouge"]["rouge1"], 2)
    low, high = result["rouge1_margin_interval"]
    assert -100.0 <= low <= high <= 100.0 and "95% paired bootstrap interval over the 4 documents" in out
    assert result["document_tokens"] > 128  # longer than the training inputs (cut to 128 here): read whole
    assert result["output_dir"] == str(output_dir)
    # trained on inputs of at most 128 tokens, it scales its cross-attention on the longer documents it reads
    assert json.loads((output_dir / "config.json").read_text())["cross_attention_logn_length"] == 128
    files = set(hub.hub_files(output_dir))
    assert {"model.safetensors", "config.json", "modeling_locost.py", "pipeline_summarization.py",
            "tokenizer.json"} <= files
    card = ModelCard.load(output_dir / "README.md")
    assert card.data.pipeline_tag == "summarization" and "Trained from scratch by `longreach demo`" in card.text
    assert not (output_dir / "training_args.bin").exists()


def test_models_trained_from_scratch_get_t5_initialisation():
    """The demo trains from scratch: T5's init must reach every Linear of the T5 blocks (v5 only calls `_init_weights`
    on modules that own parameters; with N(0, 1) weights the activations blew up and training stalled)."""
    from longreach import LocostConfig, LocostForConditionalGeneration

    model = LocostForConditionalGeneration(LocostConfig(vocab_size=500, d_model=128, d_state=16, d_kv=32, d_ff=256,
                                                        num_layers=2, num_heads=4))
    feed_forward = model.encoder.block[0].layer[1].DenseReluDense
    attention = model.decoder.block[0].layer[0].SelfAttention
    expected = {feed_forward.wi_0: 128**-0.5, feed_forward.wo: 256**-0.5, attention.q: (128 * 32) ** -0.5,
                attention.k: 128**-0.5, attention.o: 128**-0.5, attention.relative_attention_bias: 128**-0.5}
    for module, std in expected.items():
        assert abs(module.weight.std().item() / std - 1) < 0.15


def test_demo_refuses_a_foreign_folder_before_training(tmp_path, capsys):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "thesis.txt").write_text("mine")
    assert main(["demo", "--output_dir", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty and was not written by the demo" in err
    assert [p.name for p in foreign.iterdir()] == ["thesis.txt"]


def test_demo_save_replaces_an_earlier_demo_model_atomically(tmp_path):
    folder = tmp_path / "longreach-demo"
    folder.mkdir()
    (folder / "README.md").write_text(f"{_DEMO_CARD_MARK} (an earlier run)")
    check_output_dir(folder)  # an earlier demo model may be replaced
    with pytest.raises(OSError), _replaced_atomically(folder) as staging:
        (staging / "model.safetensors").write_text("half")
        raise OSError("disk full")  # a failed save leaves the earlier model untouched and no staging folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["longreach-demo"]
    assert [p.name for p in folder.iterdir()] == ["README.md"]
    with _replaced_atomically(folder) as staging:
        (staging / "model.safetensors").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["longreach-demo"]
    assert [p.name for p in folder.iterdir()] == ["model.safetensors"]


def test_demo_refuses_before_training_what_a_rerun_would_lose_or_cannot_write(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "longreach-demo"
    earlier.mkdir()
    (earlier / "README.md").write_text(f"{_DEMO_CARD_MARK} (an earlier run)")
    (earlier / "model.safetensors").write_text("weights")
    check_output_dir(earlier)  # an earlier demo model alone may be replaced
    (tmp_path / "afile").write_text("mine")
    beside = tmp_path / "longreach-demo-heldout"
    beside.mkdir()
    (beside / "summaries.jsonl").write_text("")  # the demo's own
    cases = [
        (earlier, "notes.txt", "files the demo did not write (notes.txt)"),
        (beside, "mine.json", "where the demo writes the held-out set, holds files the demo did not write (mine.json)"),
    ]
    for folder, name, message in cases:
        (folder / name).write_text("mine")
        assert main(["demo", "--output_dir", str(earlier)]) == 2
        assert message in capsys.readouterr().err
        (folder / name).unlink()
    for output_dir, message in ((".", "is the current folder or a root"), ("afile/model", "is a file, not a folder")):
        assert main(["demo", "--output_dir", output_dir]) == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "longreach-demo", "longreach-demo-heldout"]


def test_an_output_dir_that_is_a_symbolic_link_is_refused(tmp_path):
    """From an audit: the checks read the link's target and its neighbour, the writes replaced the link itself and
    wrote the held-out set beside the link, over a file of the user's there."""
    (tmp_path / "big" / "models").mkdir(parents=True)
    (tmp_path / "mymodel").symlink_to(tmp_path / "big" / "models")
    with pytest.raises(OutputDirError, match="is a symbolic link"):
        check_output_dir(tmp_path / "mymodel")
    (tmp_path / "plain-heldout").symlink_to(tmp_path / "big")
    with pytest.raises(OutputDirError, match="plain-heldout' is a symbolic link"):
        check_output_dir(tmp_path / "plain")
    assert (tmp_path / "mymodel").is_symlink() and not any((tmp_path / "big" / "models").iterdir())
