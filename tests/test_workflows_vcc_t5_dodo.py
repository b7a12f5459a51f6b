"""The users' workflows for VCC-T5 and Dodo (issue 5): the summarization pipeline (VIP prefix, the paper's Dodo prompt
with nuggets, dropped-token warnings, batches, and a process where longreach cannot be imported), the CLI (the model
cards' own conversion commands run on the fixtures; `longreach summarize`), Hub uploads (recorder, hf-integration §6)
and the model cards (parity figures, claims, usage code that runs).

`examples/finetune_dodo.py` is tested in test_examples.py.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import warnings

import pytest
import torch
from huggingface_hub import ModelCard
from remote_code_helpers import run_without_longreach
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from hub_recorder import RecordingHubApi
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline
from workflow_helpers import WORDS, document, word_tokenizer

from longreach import DodoLlamaConfig, DodoLlamaForCausalLM, VCCT5Config, VCCT5ForConditionalGeneration, hub
from longreach.cli import main as cli_main
from longreach import prepare_vip_inputs
from longreach.modeling.modeling_dodo import QUESTION_PROMPT, SUMMARIZATION_CONTEXT_PREFIX, SUMMARIZATION_PROMPT

NAMES = ("vcc_t5", "dodo_llama")
VCC_CODE_FILES = {"configuration_vcc_t5.py", "config_overrides.py", "modeling_vcc_t5.py", "input_checks.py",
                  "remote_code.py", "t5_blocks.py", "pipeline_summarization.py"}
DODO_CODE_FILES = {"configuration_dodo.py", "config_overrides.py", "modeling_dodo.py", "input_checks.py",
                   "remote_code.py", "pipeline_summarization.py"}
CODE_FILES = {"vcc_t5": VCC_CODE_FILES, "dodo_llama": DODO_CODE_FILES}
#: What a Hub user needs besides the code: config, generation config, weights, tokenizer, our card.
OTHER_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "README.md"}
PROMPT_WORDS = ["[INST]", "[/INST]", "Please", "summarize", "the", "above", "document", "in", "one", "sentence."]


# ---------------------------------------------------------------------------------------------------------------------
# Tiny models and tokenizers built locally
# ---------------------------------------------------------------------------------------------------------------------


def llama_word_tokenizer(vocab_size: int = 4 + len(PROMPT_WORDS) + len(WORDS)) -> PreTrainedTokenizerFast:
    """Word-level tokenizer with Llama's ids (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3), the words of the Dodo
    prompt and ``w0``...; filler words up to ``vocab_size``."""
    words = ["<pad>", "<s>", "</s>", "<unk>"] + PROMPT_WORDS + WORDS
    words += [f"x{i}" for i in range(vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel(vocab={token: i for i, token in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def t5_word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """workflow_helpers' T5-style tokenizer (``</s>`` appended) with filler words up to ``vocab_size``."""
    from tokenizers import processors

    words = ["<pad>", "</s>", "<unk>"] + WORDS
    words += [f"x{i}" for i in range(vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel(vocab={token: i for i, token in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def tiny_vcc(seed: int = 0) -> VCCT5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = VCCT5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4,
                         decoder_start_token_id=0, dropout_rate=0.0, num_vanilla_layers=1, segment_length=32,
                         num_vip_slots=8, block_size=4, num_refined_blocks=3)
    model = VCCT5ForConditionalGeneration(config).eval()
    model.generation_config.max_new_tokens = 8
    return model


def tiny_dodo(seed: int = 0) -> DodoLlamaForCausalLM:
    torch.manual_seed(seed)
    config = DodoLlamaConfig(vocab_size=len(llama_word_tokenizer()), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, nugget_layer=2,
                             nugget_ratio=0.2, lora_r=4, lora_alpha=8.0, lora_dropout=0.0, soft_prompt_length=1,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = DodoLlamaForCausalLM(config).eval()
    with torch.no_grad():  # fresh LoRA B is zero (φ = θ = base): make both adapters matter
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.3)
    model.generation_config.max_new_tokens = 8
    return model


@pytest.fixture(scope="module")
def tiny():
    """name -> (model, tokenizer)."""
    return {"vcc_t5": (tiny_vcc(), word_tokenizer()), "dodo_llama": (tiny_dodo(), llama_word_tokenizer())}


def _summarizer(tiny, name, **defaults):
    model, tokenizer = tiny[name]
    return pipeline("long-summarization", model=model, tokenizer=tokenizer, **defaults)


# ---------------------------------------------------------------------------------------------------------------------
# Pipeline, in process
# ---------------------------------------------------------------------------------------------------------------------


def test_vcc_pipeline_marks_the_task_prefix_as_vip_tokens(tiny):
    model, tokenizer = tiny["vcc_t5"]
    doc = document(200, offset=3)
    received = []
    encoder_forward = model.encoder.forward
    model.encoder.forward = lambda *args, **kwargs: received.append(kwargs) or encoder_forward(*args, **kwargs)
    try:
        record = _summarizer(tiny, "vcc_t5")(doc, max_new_tokens=5, return_tensors=True)[0]
    finally:
        del model.encoder.forward
    (encoder_kwargs,) = received  # generate() encodes once
    expected_ids = tokenizer("summarize\n\n\n" + doc)["input_ids"]
    assert encoder_kwargs["input_ids"][0].tolist() == expected_ids
    num_vip = len(tokenizer("summarize")["input_ids"])  # the prefix with its EOS count, as the original marks it
    assert encoder_kwargs["vip_mask"][0].tolist() == [1] * num_vip + [0] * (len(expected_ids) - num_vip)
    inputs = {"input_ids": torch.tensor([expected_ids]), "attention_mask": torch.ones(1, len(expected_ids)).long(),
              "vip_mask": encoder_kwargs["vip_mask"]}
    with torch.no_grad():
        assert record["summary_token_ids"].tolist() == model.generate(**inputs, max_new_tokens=5)[0].tolist()
        # other VIP tokens give another encoding: the prefix's mask is what steers the compression
        other_vip = torch.zeros_like(inputs["vip_mask"])
        other_vip[0, 100] = 1
        other = model.encoder(inputs["input_ids"], vip_mask=other_vip).last_hidden_state
        marked = model.encoder(inputs["input_ids"], vip_mask=inputs["vip_mask"]).last_hidden_state
    assert (other - marked).abs().max() > 1e-4


def test_dodo_pipeline_compresses_the_document_and_prompts_with_the_papers_d3_prompt(tiny):
    model, tokenizer = tiny["dodo_llama"]
    doc = document(120, offset=5)
    compressed = []
    compress = model.compress

    def spy(input_ids, attention_mask=None, **kwargs):
        compressed.append((input_ids, attention_mask, compress(input_ids, attention_mask, **kwargs)))
        return compressed[-1][2]

    model.compress = spy
    try:
        record = _summarizer(tiny, "dodo_llama")(doc, max_new_tokens=6, return_tensors=True)[0]
    finally:
        del model.compress
    ((context, context_mask, nuggets),) = compressed
    assert context_mask.all()
    words = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    assert context[0].tolist() == [tokenizer.bos_token_id] + words(SUMMARIZATION_CONTEXT_PREFIX) + words(doc)
    assert tokenizer.decode(words(SUMMARIZATION_CONTEXT_PREFIX)) == "[INST]"
    # the document is all the decoder sees of the context: k nuggets for its n tokens (10x fewer by default)
    assert int(nuggets.num_nuggets[0]) == model.config.num_nuggets_for_length(context.shape[1]) == 25
    prompt = torch.tensor([words(SUMMARIZATION_PROMPT)])
    assert tokenizer.decode(prompt[0]) == "Please summarize the above document in one sentence. [/INST]"
    with torch.no_grad():
        expected = model.generate(prompt, nuggets=model.compress(context), max_new_tokens=6, do_sample=False)
    assert record["summary_token_ids"].tolist() == expected[0, prompt.shape[1]:].tolist()  # the prompt is stripped
    assert record["summary_text"] == tokenizer.decode(expected[0, prompt.shape[1]:], skip_special_tokens=True)


def test_vcc_pipeline_asks_a_question_as_the_vip_tokens(tiny):
    """`question=` replaces the "summarize" prefix: the question's tokens (its EOS included) are the VIP tokens, as the
    authors' query-based collators mark them (`prepare_vip_inputs`)."""
    model, tokenizer = tiny["vcc_t5"]
    doc, question = document(200, offset=3), "w7 w8 w9 w10"
    received = []
    encoder_forward = model.encoder.forward
    model.encoder.forward = lambda *args, **kwargs: received.append(kwargs) or encoder_forward(*args, **kwargs)
    try:
        record = _summarizer(tiny, "vcc_t5")(doc, question=question, max_new_tokens=5, return_tensors=True)[0]
    finally:
        del model.encoder.forward
    (encoder_kwargs,) = received
    inputs = prepare_vip_inputs(tokenizer, question, [doc])
    assert encoder_kwargs["input_ids"][0].tolist() == tokenizer(question + "\n\n\n" + doc)["input_ids"]
    assert encoder_kwargs["vip_mask"][0].tolist() == inputs["vip_mask"][0].tolist()
    assert int(inputs["vip_mask"].sum()) == len(tokenizer(question)["input_ids"]) == 5
    with torch.no_grad():
        assert record["summary_token_ids"].tolist() == model.generate(**inputs, max_new_tokens=5)[0].tolist()
        asked = model.encoder(**inputs).last_hidden_state
        summary_inputs, _ = model.prepare_summarization_inputs(tokenizer, [doc])
        summarized = model.encoder(**summary_inputs).last_hidden_state
    # the question, not the task prefix, steered the compression: the document's tokens are encoded otherwise
    document_tokens = len(tokenizer(doc)["input_ids"]) - 1
    assert (asked[0, -document_tokens:] - summarized[0, -document_tokens:]).abs().max() > 1e-3


def test_dodo_pipeline_asks_a_question_with_the_papers_d2_prompt(tiny):
    model, tokenizer = tiny["dodo_llama"]
    doc, question = document(120, offset=5), "w3 w4 w5"
    record = _summarizer(tiny, "dodo_llama")(doc, question=question, max_new_tokens=6, return_tensors=True)[0]
    words = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    assert QUESTION_PROMPT == "\nBased on the provided document, answer the following question:\n{question}\n[/INST]"
    prompt = torch.tensor([words(QUESTION_PROMPT.format(question=question))])
    assert tokenizer.decode(prompt[0]).endswith("w3 w4 w5 [/INST]")
    context = torch.tensor([[tokenizer.bos_token_id] + words(SUMMARIZATION_CONTEXT_PREFIX) + words(doc)])
    with torch.no_grad():
        expected = model.generate(prompt, nuggets=model.compress(context), max_new_tokens=6, do_sample=False)
    assert record["summary_token_ids"].tolist() == expected[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_one_question_per_document_batched_equals_one_by_one(tiny, name):
    """Questions of different lengths in one batch (Dodo left-pads its prompts; VCC-T5 marks each row's VIP tokens)
    give each document the answer it gets alone; a string is asked of every document."""
    model, _ = tiny[name]
    summarizer = _summarizer(tiny, name, max_new_tokens=5, return_tensors=True)
    documents = [document(150), document(60, offset=4), document(90, offset=8)]
    questions = ["w3 w4 w5 w6", "w7", "w9 w2"]
    encoded = []  # VCC-T5: (encoder output, mask) of each call; its tiny random model's greedy tokens are all pads
    if name == "vcc_t5":
        encoder_forward = model.encoder.forward
        model.encoder.forward = lambda *args, **kwargs: encoded.append(
            (encoder_forward(*args, **kwargs), kwargs["attention_mask"])) or encoded[-1][0]
    try:
        batched = summarizer(documents, question=questions, batch_size=3)
        alone = [summarizer(doc, question=question)[0] for doc, question in zip(documents, questions)]
    finally:
        if name == "vcc_t5":
            del model.encoder.forward
    ids = lambda records: [record["summary_token_ids"].tolist() for record in records]
    assert ids(batched) == ids(alone)
    if name == "vcc_t5":
        (batch_output, batch_mask), *single = encoded
        for row, (output, _) in enumerate(single):
            real = batch_output.last_hidden_state[row][batch_mask[row].bool()]
            assert real.shape == output.last_hidden_state[0].shape
            assert (real - output.last_hidden_state[0]).abs().max() < 1e-5
    else:
        assert len(set(map(str, ids(alone)))) == 3  # three different answers: a real comparison
    assert ids(summarizer(documents, question="w7", batch_size=2)) == ids([summarizer(doc, question="w7")[0]
                                                                           for doc in documents])
    assert ids(summarizer(documents, question=questions)) == ids(alone)  # no batch_size: one document at a time
    if name == "dodo_llama":
        assert ids(batched) != ids(summarizer(documents, batch_size=3))  # not the summaries


@pytest.mark.parametrize("call, message", [
    (dict(question=""), "`question` must be non-empty text"),
    (dict(question=["w1", "  "]), "`question` must be non-empty text, got '  ' for document 1"),
    (dict(question=["w1"]), "`question` is a list of 1 questions for 2 documents"),
    (dict(question=7), "`question` must be non-empty text (or, in a call, a list of one question per document), got 7"),
])
def test_bad_questions_are_refused(tiny, call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _summarizer(tiny, "dodo_llama")([document(30), document(20)], **call)
    with pytest.raises(ValueError, match=re.escape("`question` is a list of 2 questions for a single document")):
        _summarizer(tiny, "vcc_t5")(document(30), question=["w1", "w2"])
    with pytest.raises(ValueError, match=re.escape("`question` is a list of 1 questions for a generator of documents")):
        _summarizer(tiny, "vcc_t5")((doc for doc in [document(30)]), question=["w1"])


def test_questions_from_a_dataset_column_and_questions_longer_than_the_vip_slots(tiny):
    """From an audit: `question=dataset["question"]` (a 🤗 datasets Column, as `documents` may be) was refused; and a
    VCC-T5 question longer than the model's VIP slots was compressed in part without a word."""
    import datasets

    rows = datasets.Dataset.from_dict({"context": [document(50), document(30, offset=2)], "question": ["w1", "w2 w3"]})
    summarizer = _summarizer(tiny, "dodo_llama", max_new_tokens=3, return_tensors=True)
    from_columns = summarizer(rows["context"], question=rows["question"], batch_size=2)
    from_lists = summarizer(list(rows["context"]), question=["w1", "w2 w3"])
    assert [r["summary_token_ids"].tolist() for r in from_columns] == [r["summary_token_ids"].tolist()
                                                                       for r in from_lists]
    model, tokenizer = tiny["vcc_t5"]
    long_question = " ".join(f"w{i}" for i in range(3, 15))  # 12 words and EOS: 13 tokens for 8 slots
    assert model.config.num_vip_slots == 8
    with pytest.warns(UserWarning, match=re.escape("A question is longer than the 8 tokens this model keeps "
                                                   "uncompressed (config.num_vip_slots, its EOS included): its tokens "
                                                   "beyond them are compressed like the document's")):
        _summarizer(tiny, "vcc_t5", max_new_tokens=2)(document(40), question=long_question)
    with warnings.catch_warnings(record=True) as caught:  # one text for every question: the default filter shows it once
        warnings.simplefilter("default")
        for row in range(3):
            model.prepare_question_inputs(tokenizer, long_question + f" w{20 + row}", [document(30)])
    assert len([w for w in caught if "config.num_vip_slots" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _summarizer(tiny, "vcc_t5", max_new_tokens=2)(document(40), question="w3 w4 w5 w6 w7 w8 w9")  # 8 tokens: fits
    with pytest.raises(ValueError, match=re.escape("its question ('w3 w4 w5') takes 4 tokens (its EOS included); give "
                                                   "a `max_input_length` above 4 or a shorter question")):
        model.prepare_question_inputs(tokenizer, "w3 w4 w5", [document(10)], max_input_length=4)
    with pytest.raises(ValueError, match=re.escape("Every document must be a string, got int 3 for document 1")):
        model.prepare_question_inputs(tokenizer, "w3", [document(10), 3])


@pytest.mark.parametrize("name", NAMES)
def test_dropped_tokens_are_reported_never_silent(tiny, name):
    model, _ = tiny[name]
    summarizer = _summarizer(tiny, name, max_new_tokens=3)
    long_doc, short_doc = document(300), document(40, offset=1)
    lengths = []  # tokens the model reads from the longest document of each call
    generate = model.generate

    def spy(**kwargs):
        mask = kwargs["attention_mask"] if name == "vcc_t5" else kwargs["context_attention_mask"]
        lengths.append(int(mask.sum(dim=1).max()))
        return generate(**kwargs)

    model.generate = spy
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summarizer(long_doc)
            summarizer([long_doc, short_doc], max_input_length=100)
    finally:
        del model.generate
    dropped = [str(w.message) for w in caught if "dropped" in str(w.message)]
    # VCC: "summarize" (<unk>) + 300 words + </s> = 302 tokens; Dodo: <s> [INST] + 300 words = 302 context tokens
    assert dropped == [(f"The document ({len(long_doc)} characters) is longer than the model may read: its last 202 "
                        "tokens were dropped (max_input_length=100).")]
    assert lengths == [302, 100, 42]  # the list is summarized one document at a time (no batch_size)


@pytest.mark.parametrize("name", NAMES)
def test_batched_documents_equal_one_by_one(tiny, name):
    """Right-padded batches (VCC rows; Dodo contexts with different numbers of nuggets) summarize each row as alone."""
    summarizer = _summarizer(tiny, name, max_new_tokens=6, return_tensors=True)
    docs = [document(120, offset=1), document(45, offset=2)]
    batched = summarizer(docs, batch_size=2)
    for record, doc in zip(batched, docs):
        assert record["summary_token_ids"].tolist() == summarizer(doc)[0]["summary_token_ids"].tolist()


def test_vcc_card_padding_claims():
    """The card: extra padding, on the right or the left, changes real tokens' outputs by float rounding only (here it
    also changes the internal length, 96 -> 160)."""
    model = tiny_vcc()
    ids = torch.randint(3, 99, (1, 70))
    vip = torch.zeros_like(ids)
    vip[:, :2] = 1
    zeros, ones = torch.zeros(1, 60, dtype=torch.long), torch.ones_like(ids)
    assert (model.config.padded_length(70), model.config.padded_length(130)) == (96, 160)
    with torch.no_grad():
        alone = model.encoder(ids, vip_mask=vip).last_hidden_state
        right = model.encoder(torch.cat([ids, zeros], 1), attention_mask=torch.cat([ones, zeros], 1),
                              vip_mask=torch.cat([vip, zeros], 1)).last_hidden_state
        left = model.encoder(torch.cat([zeros, ids], 1), attention_mask=torch.cat([zeros, ones], 1),
                             vip_mask=torch.cat([zeros, vip], 1)).last_hidden_state
    assert (right[:, :70] - alone).abs().max() < 1e-5
    assert (left[:, 60:] - alone).abs().max() < 1e-5
    assert torch.all(left[:, :60] == 0)


# ---------------------------------------------------------------------------------------------------------------------
# Hub uploads (recorder) and what Hub users then run, in a process where longreach cannot be imported
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uploads(tiny, tmp_path_factory):
    """``model.push_to_hub(repo, tokenizer=...)`` for both models through the recorder; the uploaded files are written
    to a folder each, as a Hub user downloads them. name -> (commit, folder)."""
    root = tmp_path_factory.mktemp("hub")
    result = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hub, "HfApi", RecordingHubApi)
        for name in NAMES:
            RecordingHubApi.instances = []
            model, tokenizer = tiny[name]
            model.push_to_hub(f"someone/{name}-tiny", tokenizer=tokenizer, commit_message=f"upload {name}")
            (commit,) = [commit for api in RecordingHubApi.instances for commit in api.commits]
            folder = root / name
            folder.mkdir()
            for path, content in commit["files"].items():
                (folder / path).write_bytes(content)
            result[name] = (commit, folder)
    return result


@pytest.mark.parametrize("name", NAMES)
def test_push_uploads_exactly_what_hub_users_need(uploads, name):
    commit, _ = uploads[name]
    files = commit["files"]
    assert commit["repo_id"] == f"someone/{name}-tiny" and commit["message"] == f"upload {name}"
    assert set(files) == CODE_FILES[name] | OTHER_FILES
    config = json.loads(files["config.json"])
    auto_class = "AutoModelForSeq2SeqLM" if name == "vcc_t5" else "AutoModelForCausalLM"
    model_class = "modeling_vcc_t5.VCCT5ForConditionalGeneration" if name == "vcc_t5" else \
        "modeling_dodo.DodoLlamaForCausalLM"
    assert config["auto_map"][auto_class] == model_class and "AutoConfig" in config["auto_map"]
    assert config["custom_pipelines"]["summarization"] == {
        "impl": "pipeline_summarization.LongSummarizationPipeline", "pt": [auto_class], "type": "text"}
    for code in CODE_FILES[name]:
        assert re.search(rb"^\s*(from|import)\s+longreach", files[code], re.M) is None, code  # flat, sibling imports
    card = ModelCard(files["README.md"].decode())
    assert card.data.tags and "custom_code" in card.data.tags and "automatically generated" not in card.text
    assert f'model="someone/{name}-tiny"' in card.text
    weights = load_safetensors(files["model.safetensors"])
    if name == "dodo_llama":
        assert re.search(rb"^from peft", files["modeling_dodo.py"], re.M)  # the adapters need peft on the Hub side
        assert card.data.pipeline_tag == "text-generation" and "\n# Dodo: Llama that compresses" in card.text
        # one checkpoint: frozen base (LoRA-wrapped names), both adapters, scorer, soft prompt
        for pattern in (r"\.base_layer\.weight$", r"\.lora_B\.encoder\.weight$", r"\.lora_B\.decoder\.weight$",
                        r"^nugget_scorer\.0\.weight$", r"^soft_prompt\.weight$"):
            assert any(re.search(pattern, key) for key in weights), pattern
    else:
        assert card.data.pipeline_tag == "summarization" and "\n# VCC-T5: T5 with VIP-token" in card.text
        assert "shared.weight" in weights


def _card_usage_code(name: str, repo_id: str) -> list[str]:
    text = hub.build_model_card(name, repo_id=repo_id).text
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2, name
    return [block.replace("max_new_tokens=64", "max_new_tokens=4").replace("print(", "outputs.append(")
            for block in blocks]


@pytest.fixture(scope="module")
def remote(uploads, tmp_path_factory):
    """One fresh process without longreach: the pipeline from each uploaded folder, and each card's usage code
    (the repository id replaced by that folder) in its own namespace."""
    workdir = tmp_path_factory.mktemp("remote")
    doc = document(400, offset=4)
    jobs = {name: {"folder": str(uploads[name][1]),
                   "usage": [code.replace(f'"someone/{name}"', repr(str(uploads[name][1])))
                             for code in _card_usage_code(name, f"someone/{name}")]} for name in NAMES}
    return run_without_longreach(
        f"""
        import json, warnings
        from transformers import pipeline
        results = {{}}
        for name, job in {jobs!r}.items():
            summarizer = pipeline("summarization", model=job["folder"], trust_remote_code=True)
            record = summarizer({doc!r}, max_new_tokens=6, return_tensors=True)[0]
            answer = summarizer({doc!r}, question="w4 w5", max_new_tokens=6, return_tensors=True)[0]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                summarizer({doc!r}, max_new_tokens=2, max_input_length=50)
            usage_outputs = []
            for code in job["usage"]:
                namespace = {{"outputs": []}}
                exec(code, namespace)
                usage_outputs += namespace["outputs"]
            results[name] = {{
                "summary": record["summary_text"], "ids": record["summary_token_ids"].tolist(),
                "answer_ids": answer["summary_token_ids"].tolist(),
                "pipeline_class": type(summarizer).__module__ + "." + type(summarizer).__name__,
                "model_module": type(summarizer.model).__module__,
                "warnings": [str(w.message) for w in caught if "dropped" in str(w.message)],
                "usage_outputs": usage_outputs,
            }}
        print(json.dumps(results))
        """,
        workdir,
    ) | {"doc": doc}


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_from_the_uploaded_files_works_where_longreach_cannot_be_imported(remote, tiny, uploads, name):
    result, doc = remote[name], remote["doc"]
    assert result["pipeline_class"].startswith("transformers_modules.")
    assert result["pipeline_class"].endswith("pipeline_summarization.LongSummarizationPipeline")
    assert result["model_module"].startswith("transformers_modules.")
    # identical to the in-process pipelines: on the model that was pushed, and on the downloaded folder
    expected = _summarizer(tiny, name)(doc, max_new_tokens=6, return_tensors=True)[0]
    assert result["ids"] == expected["summary_token_ids"].tolist() and result["summary"] == expected["summary_text"]
    assert len(result["ids"]) > 1
    answer = _summarizer(tiny, name)(doc, question="w4 w5", max_new_tokens=6, return_tensors=True)[0]
    assert result["answer_ids"] == answer["summary_token_ids"].tolist()  # questions work from the Hub files too
    from_folder = pipeline("summarization", model=str(uploads[name][1]), trust_remote_code=True)
    assert from_folder(doc, max_new_tokens=6)[0]["summary_text"] == expected["summary_text"]
    dropped = 400 + 2 - 50  # VCC: <unk> + words + </s>; Dodo: <s> [INST] + words
    assert result["warnings"] == [(f"The document ({len(doc)} characters) is longer than the model may read: its last "
                                   f"{dropped} tokens were dropped (max_input_length=50).")]


@pytest.mark.parametrize("name", NAMES)
def test_card_usage_code_runs_where_longreach_cannot_be_imported(remote, name):
    outputs = remote[name]["usage_outputs"]
    assert len(outputs) == 2 and all(isinstance(summary, str) for summary in outputs)


# ---------------------------------------------------------------------------------------------------------------------
# CLI: the cards' conversion commands on the fixtures; `longreach summarize`
# ---------------------------------------------------------------------------------------------------------------------


def _substitute(argument: str, stand_ins: dict) -> str:
    """``argument`` with a name used in a card (a path or a path prefix) replaced by its stand-in."""
    for old, new in stand_ins.items():
        if argument == old or argument.startswith(old + "/"):
            return str(new) + argument[len(old):]
    return argument


def _card_commands(name: str) -> list[list[str]]:
    """The `longreach convert ...` commands of a card's Conversion section, as argument lists."""
    text = hub.build_model_card(name).text
    script = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S)).replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in script.splitlines() if line.startswith("longreach convert ")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, fixtures_dir):
    """Run each card's conversion commands with the fixtures in place of the names they use (the first command of
    each also with `--push_to_hub`, through the recorder). name -> {"outputs", "sources", "commit"}."""
    root = tmp_path_factory.mktemp("convert")
    t5_word_tokenizer(128).save_pretrained(root / "t5-base")
    shutil.copytree(fixtures_dir / "dodo" / "base", root / "Llama-2-7b-hf")  # the base Llama, with a tokenizer
    llama_word_tokenizer(128).save_pretrained(root / "Llama-2-7b-hf")
    vcc, dodo = fixtures_dir / "vcc", fixtures_dir / "dodo"
    stand_ins = {
        "vcc_t5": {"hf_ckpts/epoch=00004-step=00050000": vcc / "hf_ckpt",
                   "last.ckpt": vcc / "lightning" / "epoch=00000-step=00000001.ckpt", "t5-base": root / "t5-base"},
        "dodo_llama": {"dodo_ckpt": dodo / "dodo_ckpt", "adapters": dodo / "adapters", "scorer.pt": dodo / "scorer.pt",
                       "Llama-2-7b-hf": root / "Llama-2-7b-hf"},
    }
    outputs_named = {"vcc_t5": "vcc-t5-hf", "dodo_llama": "dodo-llama-hf"}
    result = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hub, "HfApi", RecordingHubApi)
        patch.setenv("HF_HUB_OFFLINE", "1")
        # the converters' check before converting (online, reachable, logged in), as the recorder stands in for the Hub
        patch.setattr(hub, "hub_is_offline", lambda: False)
        patch.setattr(hub, "hub_reachable", lambda timeout=3.0: True)
        patch.setattr("huggingface_hub.get_token", lambda: "recorded")
        for name in NAMES:
            RecordingHubApi.instances = []
            outputs, sources = [], []
            for index, argv in enumerate(_card_commands(name)):
                output = root / f"{outputs_named[name]}-{index}"
                argv = [_substitute(argument, {**stand_ins[name], outputs_named[name]: output}) for argument in argv]
                if index == 0:
                    argv += ["--push_to_hub", f"someone/{name}-converted"]
                assert cli_main(argv) == 0, argv  # argv: ["convert", NAME, ...]
                outputs.append(output)
                if "--checkpoint_path" in argv:
                    sources.append(argv[argv.index("--checkpoint_path") + 1])
                else:  # the PEFT route records its three inputs
                    sources.append(" + ".join(argv[argv.index(option) + 1] for option in (
                        "--encoder_adapter_path", "--decoder_adapter_path", "--scorer_path")))
            commits = [commit for api in RecordingHubApi.instances for commit in api.commits]
            result[name] = {"outputs": outputs, "sources": sources, "commits": commits}
    return result


@pytest.mark.parametrize("name", NAMES)
def test_card_conversion_commands_run_on_the_fixtures_and_write_the_card(converted, name):
    outputs, sources = converted[name]["outputs"], converted[name]["sources"]
    assert len(outputs) == 2  # each card documents two source formats
    for output, source in zip(outputs, sources):
        assert set(CODE_FILES[name]) | {"config.json", "model.safetensors"} <= set(hub.hub_files(output))
        assert hub.read_card_state(output / "README.md") == {"model": name, "repo_id": None, "converted_from": source,
                                                             "training_note": None, "tags": []}
        card = ModelCard.load(output / "README.md")
        assert f"`{source}`" in card.text and "PLACEHOLDER" not in card.text
    # both documented formats give the same model
    first, second = (load_file(str(output / "model.safetensors")) for output in outputs)
    assert first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)
    assert (outputs[0] / "tokenizer.json").is_file()  # --tokenizer_name_or_path (Dodo: the base folder's)


@pytest.mark.parametrize("name", NAMES)
def test_converter_push_uploads_one_commit_with_tokenizer_and_card(converted, name):
    (commit,) = converted[name]["commits"]
    assert commit["repo_id"] == f"someone/{name}-converted"
    assert set(commit["files"]) == CODE_FILES[name] | OTHER_FILES
    readme = commit["files"]["README.md"].decode()
    assert f"`{converted[name]['sources'][0]}`" in readme and f'model="someone/{name}-converted"' in readme


@pytest.mark.parametrize("name", NAMES)
def test_summarize_command_on_converted_checkpoints(converted, name, tmp_path, capsys):
    folder = converted[name]["outputs"][0]
    doc = document(1000, offset=2)  # a long file
    (tmp_path / "doc.txt").write_text(doc)
    assert cli_main(["summarize", "--model", str(folder), str(tmp_path / "doc.txt"), "--max_new_tokens", "5",
                     "--max_input_length", "600"]) == 0
    captured = capsys.readouterr()
    with pytest.warns(UserWarning, match="tokens were dropped"):
        expected = pipeline("summarization", model=str(folder), trust_remote_code=True)(
            doc, max_new_tokens=5, max_input_length=600)
    assert captured.out == expected[0]["summary_text"] + "\n"
    assert f"({name}," in captured.err and "generating:" in captured.err and "done in" in captured.err
    num_tokens = 1001 if name == "vcc_t5" else 1000  # the whole file is read (the T5-style tokenizer adds </s>)
    assert f"{num_tokens} tokens" in captured.err
    assert "its last 402 tokens were dropped (max_input_length=600)" in captured.err  # 2 prefix tokens + 1000 - 600


# ---------------------------------------------------------------------------------------------------------------------
# The summarize command: corpus records, questions
# ---------------------------------------------------------------------------------------------------------------------


def _read_records(path) -> dict[str, dict]:
    return {record["id"]: record for record in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


@pytest.mark.parametrize("name", NAMES)
def test_corpus_records_count_the_tokens_read_of_each_document(uploads, tiny, name, tmp_path):
    """`input_tokens` is what the model reads of the document: Dodo's compressed context (BOS, `[INST]`, the document),
    not its decoder prompt (every record used to say the prompt's length); VCC-T5's encoder input."""
    _, tokenizer = tiny[name]
    texts = {"a": document(50), "b": document(20, offset=3)}
    source, output = tmp_path / "corpus.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": key, "text": text}) + "\n" for key, text in texts.items()))
    assert cli_main(["summarize", "--model", str(uploads[name][1]), "--input", str(source), "--output", str(output),
                     "--id_column", "id", "--max_new_tokens", "3"]) == 0
    records = _read_records(output)
    for key, text in texts.items():
        if name == "dodo_llama":
            read = 1 + len(tokenizer(SUMMARIZATION_CONTEXT_PREFIX + text, add_special_tokens=False)["input_ids"])
            assert read == len(text.split()) + 2
        else:
            read = len(tokenizer("summarize\n\n\n" + text)["input_ids"])
        assert records[key]["input_tokens"] == read and records[key]["truncated"] is False
        assert "question" not in records[key]


@pytest.mark.parametrize("name", NAMES)
def test_corpus_answers_each_records_question(uploads, name, tmp_path, capsys):
    folder = str(uploads[name][1])
    rows = [{"id": "a", "text": document(60), "q": "w3 w4 w5"}, {"id": "b", "text": document(30, offset=2), "q": "w9"},
            {"id": "c", "text": document(40, offset=4), "q": " "}]
    source, output = tmp_path / "corpus.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = ["summarize", "--model", folder, "--input", str(source), "--id_column", "id", "--max_new_tokens", "4"]
    assert cli_main([*command, "--output", str(output), "--question_column", "q"]) == 3  # "c" has no question
    records = _read_records(output)
    assert list(records) == ["a", "b"]
    answerer = pipeline("summarization", model=folder, trust_remote_code=True)
    for row in rows[:2]:
        assert records[row["id"]]["question"] == row["q"]
        assert records[row["id"]]["summary"] == answerer(row["text"], question=row["q"],
                                                         max_new_tokens=4)[0]["summary_text"]
    (error,) = map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())
    assert error["id"] == "c" and error["error"].startswith("no question")
    assert f"2 documents in {source} (1 unreadable or without a question)" in capsys.readouterr().err
    # the output holds answers to the records' questions: another question, or none, is another run
    assert cli_main([*command, "--output", str(output), "--question", "w7"]) == 2
    assert "holds summaries made with other settings" in capsys.readouterr().err
    assert cli_main([*command, "--output", str(tmp_path / "all.jsonl"), "--question", "w7"]) == 0
    asked = _read_records(tmp_path / "all.jsonl")
    assert list(asked) == ["a", "b", "c"] and {record["question"] for record in asked.values()} == {"w7"}
    assert asked["c"]["summary"] == answerer(rows[2]["text"], question="w7", max_new_tokens=4)[0]["summary_text"]


def test_corpus_answers_are_scored_with_squads_exact_match_and_f1(uploads, tmp_path, capsys):
    from longreach.metrics import answer_scores, rouge_scores

    folder = str(uploads["vcc_t5"][1])
    rows = [{"id": f"r{k}", "text": document(30 + 5 * k, offset=k), "q": f"w{k + 3}", "answer": f"w{k + 4} w{k}"}
            for k in range(3)]
    source, output = tmp_path / "qa.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = ["summarize", "--model", folder, "--input", str(source), "--id_column", "id", "--max_new_tokens", "4",
               "--reference_column", "answer"]
    assert cli_main([*command, "--output", str(output), "--question_column", "q"]) == 0
    records = _read_records(output)
    answers, references = [records[row["id"]]["summary"] for row in rows], [row["answer"] for row in rows]
    metrics = json.loads((tmp_path / "out.metrics.json").read_text())
    assert metrics == {**rouge_scores(answers, references), **answer_scores(answers, references), "documents": 3}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == metrics
    # summaries are not answers: ROUGE alone
    assert cli_main([*command, "--output", str(tmp_path / "summaries.jsonl")]) == 0
    assert set(json.loads((tmp_path / "summaries.metrics.json").read_text())) == {"rouge1", "rouge2", "rougeLsum",
                                                                                   "documents"}


def test_torchrun_shards_answer_each_records_question_as_one_process(uploads, tmp_path):
    """Two processes (gloo) split the records with their questions, and the merged answers are one process's."""
    import os
    import subprocess
    import sys

    source = tmp_path / "qa.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{k}", "text": document(20 + 9 * k, offset=k), "q": f"w{k + 3}"})
                              + "\n" for k in range(6)))
    arguments = ["summarize", "--model", str(uploads["dodo_llama"][1]), "--input", str(source), "--id_column", "id",
                 "--question_column", "q", "--max_new_tokens", "3"]
    assert cli_main([*arguments, "--output", str(tmp_path / "one.jsonl")]) == 0
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "longreach.cli",
         *arguments, "--output", str(tmp_path / "two.jsonl")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = _read_records(tmp_path / "one.jsonl"), _read_records(tmp_path / "two.jsonl")
    assert two == one and list(one) == [f"r{k}" for k in range(6)]
    assert [record["question"] for record in one.values()] == [f"w{k + 3}" for k in range(6)]
    assert len({record["summary"] for record in one.values()}) > 1


def test_summarize_command_answers_a_question_about_one_file(uploads, tmp_path, capsys):
    folder = str(uploads["dodo_llama"][1])
    doc = document(80, offset=6)
    (tmp_path / "doc.txt").write_text(doc)
    assert cli_main(["summarize", "--model", folder, str(tmp_path / "doc.txt"), "--question", "w5 w6",
                     "--max_new_tokens", "5"]) == 0
    answer = pipeline("summarization", model=folder, trust_remote_code=True)(doc, question="w5 w6", max_new_tokens=5)
    summary = pipeline("summarization", model=folder, trust_remote_code=True)(doc, max_new_tokens=5)
    assert capsys.readouterr().out == answer[0]["summary_text"] + "\n" != summary[0]["summary_text"] + "\n"


def test_summarize_command_refuses_questions_it_cannot_ask(tmp_path, capsys):
    from workflow_helpers import save_tiny_locost

    folder = str(save_tiny_locost(tmp_path / "locost"))
    (tmp_path / "doc.txt").write_text(document(30))
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"text": document(30), "q": "w1"}) + "\n")
    for argv, message in [
        ([str(tmp_path / "doc.txt"), "--question", "w1"],
         "--question: LocostForConditionalGeneration (locost) has no question format; it only summarizes"),
        (["--input", str(tmp_path / "corpus.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--question_column", "q"],
         "--question_column: LocostForConditionalGeneration (locost) has no question format"),
        (["--input", str(tmp_path / "corpus.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--question", "w1",
          "--question_column", "q"], "--question asks one question of every document, --question_column one per"),
        (["--input", str(tmp_path / "doc.txt"), "--output", str(tmp_path / "out.jsonl"), "--question_column", "q"],
         "--question_column applies to table files and Hub datasets"),
        ([str(tmp_path / "doc.txt"), "--question_column", "q"], "are for a corpus"),
    ]:
        assert cli_main(["summarize", "--model", folder, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Model cards
# ---------------------------------------------------------------------------------------------------------------------


def test_vcc_card_reports_the_measured_parity():
    text = " ".join(hub.build_model_card("vcc_t5").text.split())
    for row in ("| encoder output | 3.8e-6 | 0.0 | 1e-5 |", "| logits | 2.4e-5 | 0.0 | 1e-4 |",
                "| loss | 9.5e-7 | 0.0 | 1e-5 |", "| greedy `generate()` ids | identical | identical | exact |",
                "| refined blocks of every VCC layer | identical | identical | exact |"):
        assert row in text, row
    assert "PLACEHOLDER" not in text and "padded on either side" in text


def test_dodo_card_reports_the_measured_parity_and_fixed_bugs():
    text = " ".join(hub.build_model_card("dodo_llama").text.split())
    for figure in ("1.2e-6", "3.6e-7", "2.4e-7", "2.7e-7", "1.8e-7", "5.022879", "5.027080",
                   "| selected nuggets (indices) | identical | identical | exact |",
                   "| greedy generation ids (10 tokens) | identical | identical | exact |",
                   "`legacy_decoder_mask_order=True` (both rows) | logits and loss 0.0"):
        assert figure in text, figure
    assert "PLACEHOLDER" not in text
    assert "prompts of 6 and 3 tokens" in text and "right or left padding" in text
    assert "--soft_prompt_path" in text  # the PEFT route needs the soft prompt (or --soft_prompt_length 0)
