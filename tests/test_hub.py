"""Model cards and Hub uploads.

The Hub client is replaced by a recorder (spec hf-integration §6): every upload is checked file by file, offline.
The one real upload test runs only with HF_TOKEN and network access, and skips with that reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from remote_code_helpers import run_without_longreach
from transformers import pipeline
from hub_recorder import single_commit
from workflow_helpers import document, save_tiny_locost, tiny_locost, word_tokenizer

import longreach  # noqa: F401
from longreach import hub

REPO_ROOT = Path(__file__).resolve().parents[1]
CODE_FILES = {"configuration_locost.py", "config_overrides.py", "modeling_locost.py", "input_checks.py", "remote_code.py",
              "ssm.py", "ssm_cpu_kernel.py", "t5_blocks.py", "pipeline_summarization.py"}
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors"} | CODE_FILES
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}

PAPERS = {
    "locost": ("https://arxiv.org/abs/2401.17919", "https://github.com/flbbb/locost-summarization"),
    "vcc_t5": ("https://arxiv.org/abs/2305.04241", "https://github.com/awslabs/vip-token-centric-compression"),
    "dodo_llama": ("https://arxiv.org/abs/2310.02409", "https://github.com/jeongseokO/dodo_nugget"),
}
#: What each card must say about the originals' bugs and what longreach does instead.
LIMITATIONS = {
    "locost": ["use_fast_fft_conv", "power of two", "exact convolution", "ssm_authors_fft_size"],
    "vcc_t5": ["without any VIP", "undefined", "pads internally to the smallest valid length"],
    "dodo_llama": ["mask order", "legacy_decoder_mask_order", "Batched generation", "pad token"],
}


# ---------------------------------------------------------------------------------------------------------------------
# Model cards
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, pipeline_tag", [("locost", "summarization"), ("vcc_t5", "summarization"),
                                                ("dodo_llama", "text-generation")])
def test_model_card_metadata_and_sections(name, pipeline_tag, tmp_path):
    path = hub.write_model_card(tmp_path, name, converted_from="/data/original", repo_id="someone/model")
    card = ModelCard.load(path)  # round trip through huggingface_hub (offline)
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == pipeline_tag
    assert data["license"] == hub.MODEL_CARDS[name].license
    assert "custom_code" in data["tags"] and "longreach" in data["tags"]
    text = card.text
    for url in PAPERS[name]:
        assert url in text
    for section in ("## Usage", "## Conversion", "## Parity with the authors' implementation", "## Limitations",
                    "## Citation"):
        assert section in text
    assert f"longreach convert {name.split('_')[0]}" in text
    assert '"someone/model"' in text and "`/data/original`" in text
    flat = " ".join(text.split())
    for phrase in LIMITATIONS[name]:
        assert phrase in flat, phrase
    assert hub.read_card_state(path) == {"model": name, "repo_id": "someone/model", "converted_from": "/data/original",
                                         "training_note": None, "tags": []}


def test_locost_card_reports_the_measured_parity():
    text = hub.build_model_card("locost").text
    for figure in ("2.4e-7", "3.3e-6", "7.7e-6", "6.1e-7", "identical"):  # measured: see tests/test_convert_locost.py
        assert figure in text
    assert "PLACEHOLDER" not in text


def test_card_names_and_aliases():
    assert hub.card_key("vcc") == "vcc_t5" and hub.card_key("dodo") == "dodo_llama"
    assert hub.build_model_card("dodo").data.pipeline_tag == "text-generation"
    with pytest.raises(ValueError, match="`model_name` must be one of"):
        hub.build_model_card("bert")


def test_reference_model_cards_are_generated_from_the_templates(tmp_path):
    written = hub.write_reference_model_cards(tmp_path)
    assert [p.name for p in written] == ["locost.md", "vcc_t5.md", "dodo_llama.md"]
    for path in written:
        committed = REPO_ROOT / "model_cards" / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is out of date: run `longreach model-cards` after editing the templates")


def test_locost_card_usage_code_runs_where_longreach_cannot_be_imported(tmp_path):
    folder = save_tiny_locost(tmp_path / "tiny-locost")
    text = hub.build_model_card("locost", repo_id="someone/locost-tiny").text
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    code = "\n".join(blocks).replace('"someone/locost-tiny"', repr(str(folder)))
    code = code.replace("max_new_tokens=64", "max_new_tokens=4")  # a tiny random model: keep it short
    code = code.replace("print(", "outputs.append(")
    result = run_without_longreach("outputs = []\n" + code + "\nimport json\nprint(json.dumps(outputs))", tmp_path)
    assert len(result) == 2 and all(isinstance(summary, str) for summary in result)


# ---------------------------------------------------------------------------------------------------------------------
# Uploads (recorder)
# ---------------------------------------------------------------------------------------------------------------------


def test_model_push_uploads_exactly_what_hub_users_need(recorder):
    model, tokenizer = tiny_locost(), word_tokenizer()
    model.push_to_hub("someone/locost-tiny", tokenizer=tokenizer, private=True, commit_message="first", tags=["demo"])
    (api,) = recorder.instances
    assert api.repos == [{"repo_id": "someone/locost-tiny", "private": True, "exist_ok": True}]
    commit = single_commit(recorder)
    assert commit["message"] == "first"
    assert set(commit["files"]) == MODEL_FILES | TOKENIZER_FILES | {"README.md"}
    config = json.loads(commit["files"]["config.json"])
    assert config["auto_map"] == {
        "AutoConfig": "configuration_locost.LocostConfig", "AutoModel": "modeling_locost.LocostModel",
        "AutoModelForSeq2SeqLM": "modeling_locost.LocostForConditionalGeneration"}
    assert config["custom_pipelines"]["summarization"]["impl"] == "pipeline_summarization.LongSummarizationPipeline"
    readme = commit["files"]["README.md"].decode()
    assert "automatically generated" not in readme  # not transformers' generic card
    assert "# LOCOST" in readme and 'model="someone/locost-tiny"' in readme
    assert {"demo", "custom_code"} <= set(ModelCard(readme).data.tags)


def test_a_push_names_the_full_repository_and_passes_every_upload_option_on(recorder, tmp_path):
    """The card's code named "my-locost" where the Hub made "someone/my-locost"; `save_pretrained(push_to_hub=True)`
    dropped `create_pr`, `commit_description` and `revision` (a commit straight to main); and a push to a branch that
    did not exist yet failed (transformers creates it first)."""
    tiny_locost().save_pretrained(tmp_path / "m", push_to_hub=True, repo_id="my-locost", create_pr=True,
                                  commit_description="why", revision="dev")
    (api,) = recorder.instances
    commit = single_commit(recorder)
    assert (commit["repo_id"], commit["create_pr"], commit["commit_description"], commit["revision"]) == (
        "someone/my-locost", True, "why", "dev")
    assert api.branches == [{"repo_id": "someone/my-locost", "branch": "dev", "exist_ok": True}]
    readme = commit["files"]["README.md"].decode()
    assert 'model="someone/my-locost"' in readme and 'model="my-locost"' not in readme
    recorder.instances.clear()
    tiny_locost().push_to_hub("someone/x", revision="refs/pr/3")  # a pull request's ref is not a branch to make
    assert recorder.instances[0].branches == [] and single_commit(recorder)["revision"] == "refs/pr/3"


def test_pipeline_push_includes_the_tokenizer(recorder):
    summarizer = pipeline("long-summarization", model=tiny_locost(), tokenizer=word_tokenizer())
    summarizer.push_to_hub("someone/locost-pipeline")
    assert set(single_commit(recorder)["files"]) == MODEL_FILES | TOKENIZER_FILES | {"README.md"}


def test_push_uploads_every_chat_template_of_the_tokenizer(recorder):
    """A tokenizer with named chat templates saves the extra ones in `additional_chat_templates/`; they were left out
    of the upload, so the Hub repository's tokenizer had its default template only."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "{{ tools }}"}
    summarizer = pipeline("long-summarization", model=tiny_locost(), tokenizer=tokenizer)
    summarizer.push_to_hub("someone/locost-chat")
    files = single_commit(recorder)["files"]
    assert set(files) == MODEL_FILES | TOKENIZER_FILES | {
        "README.md", "chat_template.jinja", "additional_chat_templates/tool_use.jinja"}
    assert files["additional_chat_templates/tool_use.jinja"].decode() == "{{ tools }}"


def test_folder_push_leaves_training_leftovers_and_keeps_provenance(recorder, tmp_path):
    folder = save_tiny_locost(tmp_path / "run")
    hub.write_model_card(folder, "locost", converted_from="/data/locost-gsg")
    for leftover in ("training_args.bin", "trainer_state.json", "optimizer.pt", "pytorch_model.bin"):
        (folder / leftover).write_bytes(b"x")
    (folder / "checkpoint-10").mkdir()
    (folder / "checkpoint-10" / "model.safetensors").write_bytes(b"x")
    hub.push_folder_to_hub(folder, "someone/locost-run")
    commit = single_commit(recorder)
    assert set(commit["files"]) == MODEL_FILES | TOKENIZER_FILES | {"README.md"}
    readme = commit["files"]["README.md"].decode()
    assert "`/data/locost-gsg`" in readme and 'model="someone/locost-run"' in readme  # re-rendered for the repo
    assert hub.read_card_state(folder / "README.md")["repo_id"] is None  # the local card is left as it was


def test_hand_edited_card_is_uploaded_unchanged(recorder, tmp_path):
    folder = save_tiny_locost(tmp_path / "edited")
    card_path = hub.write_model_card(folder, "locost")
    card_path.write_text(card_path.read_text() + "\nMy own evaluation notes.\n")
    hub.push_folder_to_hub(folder, "someone/edited")
    assert single_commit(recorder)["files"]["README.md"].decode() == card_path.read_text()


def test_unedited_card_of_another_longreach_version_is_re_rendered_for_the_repo(recorder, tmp_path, monkeypatch):
    """A card written by another longreach version (its text names that version) is still unedited: it is re-rendered
    for the target repository, whose id its usage code must load, not kept as if edited by hand. A card written before
    cards recorded their digest is judged by a fresh rendering, as before."""
    folder = save_tiny_locost(tmp_path / "older")
    monkeypatch.setattr(hub, "_longreach_version", lambda: "0.1.0")
    card_path = hub.write_model_card(folder, "locost", converted_from="flbbb/locost-gsg-pretrained")
    monkeypatch.setattr(hub, "_longreach_version", lambda: "0.2.0")
    hub.push_folder_to_hub(folder, "someone/my-locost")
    readme = single_commit(recorder)["files"]["README.md"].decode()
    assert 'model="someone/my-locost"' in readme and "longreach 0.2.0" in readme
    assert hub.card_is_unedited(card_path)
    card_path.write_text(card_path.read_text().replace("## Limitations", "## What it cannot do", 1))
    assert not hub.card_is_unedited(card_path)
    without_digest = re.sub(r', "sha256": "[0-9a-f]{64}"', "", str(hub.build_model_card("locost")))
    card_path.write_text(without_digest)  # a card of an earlier release: no digest in its marker
    assert "sha256" not in card_path.read_text() and hub.card_is_unedited(card_path)
    card_path.write_text(without_digest + "\nMy own evaluation notes.\n")
    assert not hub.card_is_unedited(card_path)



def test_a_push_keeps_the_card_edited_on_the_hub(recorder, tmp_path):
    """A card edited on the Hub after a first push was replaced by the next `push_to_hub` of the model, silently
    (transformers' push_to_hub keeps the repository's card); an unedited one is rendered again, and a card edited
    locally is the one uploaded."""
    model = tiny_locost()
    model.push_to_hub("someone/x")
    first = recorder.instances[0].commits[0]["files"]
    ours = first["README.md"].decode()
    edited = ours.replace("## Limitations", "## Our evaluation\n\nROUGE-1 41.2.\n\n## Limitations", 1)
    first["README.md"] = edited.encode()  # edited on the Hub
    model.push_to_hub("someone/x", commit_message="second")
    second = [commit for api in recorder.instances for commit in api.commits if commit["message"] == "second"]
    assert second[0]["files"]["README.md"].decode() == edited
    earlier = hub.build_model_card("locost", "someone/x", training_note="An earlier training run.")
    first["README.md"] = str(earlier).encode()
    model.push_to_hub("someone/x", commit_message="third")  # not edited: our card for what is uploaded now
    third = [commit for api in recorder.instances for commit in api.commits if commit["message"] == "third"]
    assert "An earlier training run." not in third[0]["files"]["README.md"].decode()
    folder = save_tiny_locost(tmp_path / "local")
    card_path = hub.write_model_card(folder, "locost")
    card_path.write_text(card_path.read_text() + "\nLocal notes.\n")
    first["README.md"] = edited.encode()
    hub.push_folder_to_hub(folder, "someone/x", commit_message="fourth")
    fourth = [commit for api in recorder.instances for commit in api.commits if commit["message"] == "fourth"]
    assert fourth[0]["files"]["README.md"].decode() == card_path.read_text()

def test_model_loaded_from_a_converted_folder_pushes_its_card(recorder, tmp_path):
    folder = save_tiny_locost(tmp_path / "converted")
    hub.write_model_card(folder, "locost", converted_from="flbbb/locost-gsg-pretrained")
    from longreach import LocostForConditionalGeneration

    LocostForConditionalGeneration.from_pretrained(folder).push_to_hub("someone/converted")
    readme = single_commit(recorder)["files"]["README.md"].decode()
    assert "`flbbb/locost-gsg-pretrained`" in readme and 'model="someone/converted"' in readme



def test_a_fine_tuned_card_names_its_base_model_for_the_hub(recorder, tmp_path):
    """The fine-tuning examples' cards had no `base_model`, so the Hub showed no model tree for them (the Trainer's
    own card for a fine-tuned T5 names it); a local path is not a Hub id and stays out of the metadata."""
    folder = save_tiny_locost(tmp_path / "ft")
    card_path = hub.write_model_card(folder, "locost", training_note="Fine-tuned.",
                                     base_model="longreach/locost-gsg-pretrained")
    data = ModelCard.load(card_path).data.to_dict()
    assert (data["base_model"], data["base_model_relation"]) == ("longreach/locost-gsg-pretrained", "finetune")
    assert hub.card_is_unedited(card_path)
    hub.push_folder_to_hub(folder, "someone/ft")  # re-rendered for the repository, base model kept
    pushed = ModelCard(single_commit(recorder)["files"]["README.md"].decode())
    assert pushed.data.base_model == "longreach/locost-gsg-pretrained" and 'model="someone/ft"' in pushed.text
    local = ModelCard(str(hub.build_model_card("locost", base_model=str(tmp_path / "run")))).data.to_dict()
    assert "base_model" not in local and "base_model_relation" not in local
    assert "base_model" not in hub.build_model_card("locost").data.to_dict()

@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"), "no safetensors weights"),
    (lambda f: (f / "ssm.py").unlink(), "lacks the code file 'ssm.py'"),
    (lambda f: (f / "config.json").write_text(json.dumps({
        k: v for k, v in json.loads((f / "config.json").read_text()).items() if k != "auto_map"})), "no `auto_map`"),
])
def test_incomplete_folders_are_refused(recorder, tmp_path, damage, message):
    folder = save_tiny_locost(tmp_path / "broken")
    damage(folder)
    with pytest.raises(ValueError, match=message):
        hub.push_folder_to_hub(folder, "someone/broken")
    assert not any(api.commits for api in recorder.instances)


# ---------------------------------------------------------------------------------------------------------------------
# Real Hub (opt-in)
# ---------------------------------------------------------------------------------------------------------------------


def _hub_reachable() -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.network
def test_real_push_and_remote_load(tmp_path):
    if not os.environ.get("HF_TOKEN"):
        pytest.skip("needs HF_TOKEN (and network access) to push to the real Hub")
    if not _hub_reachable():
        pytest.skip("needs network access to huggingface.co (HF_TOKEN is set)")
    from huggingface_hub import HfApi

    api = HfApi()
    repo_id = f"{api.whoami()['name']}/longreach-test-{uuid.uuid4().hex[:8]}"
    folder = save_tiny_locost(tmp_path / "tiny")
    doc = document(200)
    expected = pipeline("summarization", model=str(folder), trust_remote_code=True)(doc)[0]["summary_text"]
    try:
        hub.push_folder_to_hub(folder, repo_id, private=True)
        result = run_without_longreach(
            f"""
            import json, os
            os.environ.pop("HF_HUB_OFFLINE", None)
            from transformers import pipeline
            summarizer = pipeline("summarization", model={repo_id!r}, trust_remote_code=True)
            print(json.dumps({{"summary": summarizer({doc!r})[0]["summary_text"]}}))
            """,
            tmp_path,
        )
    finally:
        api.delete_repo(repo_id)
    assert result["summary"] == expected


def test_a_model_loaded_as_remote_code_saves_a_complete_folder(tmp_path):
    """Where longreach is not installed (a Hub user fine-tuning with Trainer), a model loaded with trust_remote_code
    saves the same files, auto_map and custom_pipelines as ours, and the saved folder loads and summarizes alike."""
    from test_modeling_dodo import tiny_model as tiny_dodo
    from test_modeling_vcc_t5 import tiny_model as tiny_vcc

    save_tiny_locost(tmp_path / "locost")
    tiny_vcc().save_pretrained(tmp_path / "vcc")
    tiny_dodo().save_pretrained(tmp_path / "dodo")
    doc = document(30)
    result = run_without_longreach(
        f"""
        import json, os
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, pipeline
        report = {{}}
        for name, auto in (("locost", AutoModelForSeq2SeqLM), ("vcc", AutoModelForSeq2SeqLM),
                           ("dodo", AutoModelForCausalLM)):
            model = auto.from_pretrained(name, trust_remote_code=True)
            model.save_pretrained(name + "-resaved")
            with open(name + "-resaved/config.json") as handle:
                config = json.load(handle)
            reloaded = auto.from_pretrained(name + "-resaved", trust_remote_code=True)
            same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
            report[name] = {{"files": sorted(os.listdir(name + "-resaved")), "auto_map": config["auto_map"],
                            "custom_pipelines": config.get("custom_pipelines"), "same_weights": same}}
        os.link("locost/tokenizer.json", "locost-resaved/tokenizer.json")
        os.link("locost/tokenizer_config.json", "locost-resaved/tokenizer_config.json")
        report["summaries"] = [pipeline("summarization", model=folder, trust_remote_code=True)({doc!r},
                               max_new_tokens=4)[0]["summary_text"] for folder in ("locost", "locost-resaved")]
        print(json.dumps(report))
        """,
        tmp_path,
    )
    for name in ("locost", "vcc", "dodo"):
        original = tmp_path / name
        config = json.loads((original / "config.json").read_text())
        saved_files = sorted(p.name for p in original.iterdir() if p.name not in TOKENIZER_FILES)
        assert result[name]["files"] == saved_files, name
        assert result[name]["auto_map"] == config["auto_map"], name
        assert result[name]["custom_pipelines"] == config.get("custom_pipelines"), name
        assert result[name]["same_weights"], name
    assert "pipeline_summarization.py" in result["locost"]["files"]
    assert result["summaries"][0] == result["summaries"][1]


def test_write_model_card_keeps_a_readme_that_is_not_ours(tmp_path):
    (tmp_path / "README.md").write_text("my notes")
    with pytest.raises(ValueError, match="exists and is not a longreach model card"):
        hub.write_model_card(tmp_path, "locost")
    assert (tmp_path / "README.md").read_text() == "my notes"
    (tmp_path / "README.md").unlink()
    hub.write_model_card(tmp_path, "locost")
    hub.write_model_card(tmp_path, "locost", training_note="again")  # our own card is replaced
    assert "again" in (tmp_path / "README.md").read_text() and sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]



def test_write_model_card_refuses_a_card_edited_by_hand(tmp_path):
    """A fine-tuning run resumed in its --output_dir (or a second conversion's card) replaced the card the user had
    edited since it was written, silently; a push keeps such a card and `longreach model-cards` refuses it."""
    from longreach.finetuning import check_output_dir

    path = hub.write_model_card(tmp_path, "locost", training_note="Fine-tuned on X.")
    check_output_dir(tmp_path)  # an unedited card may be replaced
    edited = path.read_text() + "\nMy evaluation: ROUGE-1 41.2 on my own test set.\n"
    path.write_text(edited)
    with pytest.raises(ValueError, match="edited by hand since it was generated"):
        check_output_dir(tmp_path)  # before training, not after it
    with pytest.raises(ValueError, match="README.md is a longreach model card edited by hand"):
        hub.write_model_card(tmp_path, "locost", training_note="Fine-tuned on X, resumed.")
    assert path.read_text() == edited and sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]

def test_trainer_uploads_during_training_load_without_longreach(tmp_path, monkeypatch):
    """`Trainer(push_to_hub=True)` uploads its output_dir at every save after copying in only the checkpoint's config
    and weights; the code files the config's auto_map names were missing from those commits until training ended, so
    the repository did not load with trust_remote_code=True. Every commit now carries them."""
    from types import SimpleNamespace

    import transformers.trainer as trainer_module
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    commits = []

    class HubStandIn:  # what the Trainer calls: keeps the files of each upload
        def create_repo(self, repo_id, **kwargs):
            return SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, repo_id, folder_path, **kwargs):
            folder = Path(folder_path)
            commits.append({path.name: path.read_bytes() for path in folder.iterdir()
                            if path.is_file() and not path.name.startswith(("_", "checkpoint-"))})
            return SimpleNamespace(done=lambda: True, result=lambda: None)

    monkeypatch.setattr(trainer_module, "hf_api", lambda *args, **kwargs: HubStandIn())
    model, tokenizer = tiny_locost(), word_tokenizer()
    rows = [{"input_ids": list(range(3, 30)), "labels": [5, 6, 1]}] * 4
    args = Seq2SeqTrainingArguments(str(tmp_path / "run"), use_cpu=True, report_to="none", max_steps=2,
                                    per_device_train_batch_size=2, save_strategy="steps", save_steps=1,
                                    push_to_hub=True, hub_model_id="someone/locost-ft")
    Seq2SeqTrainer(model=model.train(), args=args, train_dataset=Dataset.from_list(rows),
                   data_collator=DataCollatorForSeq2Seq(tokenizer, model=model)).train()
    during = [commit for commit in commits if "model.safetensors" in commit]
    assert during and all("modeling_locost.py" in commit and "configuration_locost.py" in commit for commit in during)
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, data in during[0].items():
        (repo / name).write_bytes(data)
    result = run_without_longreach(f"""
        import json
        from transformers import AutoModelForSeq2SeqLM
        model = AutoModelForSeq2SeqLM.from_pretrained({str(repo)!r}, trust_remote_code=True)
        print(json.dumps({{"cls": type(model).__name__}}))
    """, tmp_path)
    assert result["cls"] == "LocostForConditionalGeneration"
    # a file of that name that is not ours is left as it is, with a warning
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "ssm.py").write_text("# the user's own module\n")
    args.output_dir, args.push_to_hub = str(mine), False
    trainer = Seq2SeqTrainer(model=model.train(), args=args, train_dataset=Dataset.from_list(rows),
                             data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))
    with pytest.warns(UserWarning, match="ssm.py, not written by longreach: left as they are"):
        trainer.train()
    assert (mine / "ssm.py").read_text() == "# the user's own module\n" and (mine / "modeling_locost.py").is_file()
    # a folder named checkpoint-N saved by the user, not by a Trainer: nothing is written beside it
    model.save_pretrained(tmp_path / "own" / "checkpoint-1")
    assert sorted(path.name for path in (tmp_path / "own").iterdir()) == ["checkpoint-1"]


def test_a_checkpoint_in_a_subfolder_loads_with_longreach_and_names_the_fix_without(tmp_path):
    """`subfolder=`: with longreach installed, the registered classes load it (pipeline and corpus command included);
    without it, transformers 5.24 looks for the code files at the repository's root, not in the subfolder (its
    limitation, said in the README)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    from workflow_helpers import save_tiny_locost

    from longreach import LocostForConditionalGeneration

    save_tiny_locost(tmp_path / "repo" / "locost")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "repo", subfolder="locost")
    assert isinstance(model, LocostForConditionalGeneration)
    assert AutoTokenizer.from_pretrained(tmp_path / "repo", subfolder="locost") is not None
    outcome = run_without_longreach(
        f"""
        import json
        from transformers import AutoModelForSeq2SeqLM
        try:
            AutoModelForSeq2SeqLM.from_pretrained({str(tmp_path / "repo")!r}, subfolder="locost", trust_remote_code=True)
            print(json.dumps({{"error": None}}))
        except OSError as error:
            print(json.dumps({{"error": str(error)}}))
        """, tmp_path)
    assert "does not appear to have a file named configuration_locost.py" in outcome["error"]
