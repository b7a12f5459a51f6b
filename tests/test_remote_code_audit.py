"""Hub-ready folders in situations the other tests do not cover: models subclassed in the user's own code, uploads from
``save_pretrained(push_to_hub=True)``."""

from __future__ import annotations

import json
import sys
import types

import torch
from remote_code_helpers import run_without_longreach
from workflow_helpers import tiny_locost

from longreach import LocostConfig, LocostForConditionalGeneration


def _subclass_in(module_name: str, monkeypatch, with_file: str | None = None) -> type:
    """A subclass of LocostForConditionalGeneration (and of its config) defined in the user's module ``module_name``
    (``with_file``: its source file; ``None``: a notebook's cell, which has none)."""
    module = types.ModuleType(module_name)
    if with_file is not None:
        module.__file__ = with_file
    monkeypatch.setitem(sys.modules, module_name, module)
    config_class = types.new_class("MyLocostConfig", (LocostConfig,))
    model_class = types.new_class("MyLocost", (LocostForConditionalGeneration,))
    model_class.config_class = config_class
    for cls in (config_class, model_class):
        cls.__module__ = module_name
        setattr(module, cls.__name__, cls)
    return model_class


def test_a_subclass_from_a_notebook_saves_our_code(tmp_path, monkeypatch):
    """A model class subclassed in a notebook (its module has no file): save_pretrained raised "Cannot export module
    '__main__' as remote code: it has no source file" (Trainer's checkpoints too), where a subclass of T5 saves."""
    model_class = _subclass_in("__notebook_cell__", monkeypatch)
    reference = tiny_locost()
    model = model_class(model_class.config_class(**reference.config.to_diff_dict())).eval()
    model.load_state_dict(reference.state_dict())
    model.save_pretrained(tmp_path / "mine")
    reference.save_pretrained(tmp_path / "reference")
    code = sorted(path.name for path in (tmp_path / "mine").glob("*.py"))
    assert code == sorted(path.name for path in (tmp_path / "reference").glob("*.py"))
    config = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert config["auto_map"] == json.loads((tmp_path / "reference" / "config.json").read_text())["auto_map"]
    assert config["architectures"] == ["MyLocost"]  # as transformers writes it for a subclass of T5


def test_a_subclass_from_a_script_loads_where_longreach_cannot_be_imported(tmp_path, monkeypatch):
    """A subclass defined in the user's script: the script itself was copied into the checkpoint (it may hold anything,
    and it imports longreach), in place of our modeling files, and auto_map named `train.LocostModel`, which does not
    exist: the folder did not load with trust_remote_code=True."""
    script = tmp_path / "train.py"
    script.write_text("from longreach import LocostForConditionalGeneration\nHF_TOKEN = 'hf_secret'\n")
    model_class = _subclass_in("train", monkeypatch, with_file=str(script))
    reference = tiny_locost()
    model = model_class(model_class.config_class(**reference.config.to_diff_dict())).eval()
    model.load_state_dict(reference.state_dict())
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    assert not (folder / "train.py").exists()
    input_ids = torch.randint(3, 90, (2, 30))
    decoder_input_ids = torch.randint(3, 90, (2, 4))
    with torch.no_grad():
        expected = model(input_ids, decoder_input_ids=decoder_input_ids).logits
    result = run_without_longreach(
        f"""
        import json, torch
        from transformers import AutoModelForSeq2SeqLM
        model = AutoModelForSeq2SeqLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            logits = model(torch.tensor({input_ids.tolist()}),
                           decoder_input_ids=torch.tensor({decoder_input_ids.tolist()})).logits
        print(json.dumps({{"cls": type(model).__name__, "logits": logits.tolist()}}))
        """,
        tmp_path,
    )
    assert result["cls"] == "LocostForConditionalGeneration"
    assert torch.equal(torch.tensor(result["logits"]), expected)


def test_save_pretrained_with_push_to_hub_uploads_the_shards_it_saved(recorder, tmp_path):
    """`save_pretrained(folder, push_to_hub=True, max_shard_size=...)` saved shards locally but uploaded one file of up
    to 50GB: the upload re-saves the model without the shard size (transformers uploads the shards it saved)."""
    from hub_recorder import single_commit

    tiny_locost().save_pretrained(tmp_path / "m", push_to_hub=True, repo_id="someone/sharded", max_shard_size="20KB")
    local = {path.name for path in (tmp_path / "m").iterdir() if path.name.startswith("model")}
    assert "model.safetensors.index.json" in local and len(local) > 2
    uploaded = {name for name in single_commit(recorder)["files"] if name.startswith("model")}
    assert uploaded == local


def test_a_process_that_does_not_save_writes_and_uploads_nothing(recorder, tmp_path):
    """`save_pretrained(..., is_main_process=False)` (accelerate's pattern: every process calls it) wrote the code files
    and, with push_to_hub=True, uploaded the model from every process; transformers writes and uploads nothing there."""
    tiny_locost().save_pretrained(tmp_path / "m", is_main_process=False, push_to_hub=True, repo_id="someone/x")
    assert list((tmp_path / "m").iterdir()) == []
    assert not any(api.commits for api in recorder.instances)


def test_pushing_a_folder_saved_by_another_version_names_its_code_files(recorder, tmp_path, caplog):
    """`longreach push` / push_folder_to_hub of a folder saved by another longreach version uploaded that version's
    code files without a word: Hub users run that code, not the installed version's (the README says to re-save)."""
    from workflow_helpers import save_tiny_locost

    from longreach import hub

    folder = save_tiny_locost(tmp_path / "current")
    with caplog.at_level("WARNING", logger="longreach.hub"):
        hub.push_folder_to_hub(folder, "someone/current")
    assert "differ from those longreach" not in caplog.text
    ssm = folder / "ssm.py"
    ssm.write_text(ssm.read_text() + "\n# an older version's code\n")
    with caplog.at_level("WARNING", logger="longreach.hub"):
        hub.push_folder_to_hub(folder, "someone/older")
    assert "the code files ssm.py differ from those longreach" in caplog.text
    assert "save_pretrained it again" in caplog.text
