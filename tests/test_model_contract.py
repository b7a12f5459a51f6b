"""transformers' model contract, checked the way its own model tests check T5, LongT5 and Llama (our code, one test per
behaviour, tiny configs), for LOCOST, VCC-T5 and Dodo: generation outputs, assisted decoding, streamers, generation
config round trip, resized embeddings, hidden states in the autograd graph, tied weights through save/load, the base
model prefix, `device_map="auto"` and `torch.compile`.
"""

from __future__ import annotations

import os
import threading
import traceback

import pytest
import torch
from test_modeling_dodo import tiny_model as tiny_dodo
from test_modeling_vcc_t5 import tiny_model as tiny_vcc
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModel, AutoModelForSeq2SeqLM, GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList,
    StoppingCriteria, StoppingCriteriaList, T5Config, T5ForConditionalGeneration,
)
from transformers.generation.streamers import BaseStreamer
from workflow_helpers import tiny_locost

import longreach  # noqa: F401  (Auto classes)

KINDS = ["locost", "vcc", "dodo"]


class ModelTester:
    """A tiny model of one kind and matching inputs (the ModelTester of transformers' tests)."""

    def __init__(self, kind: str):
        self.kind = kind
        torch.manual_seed(0)
        self.model = {"locost": tiny_locost, "vcc": tiny_vcc, "dodo": tiny_dodo}[kind]().eval()
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.is_seq2seq = self.model.config.is_encoder_decoder

    def inputs(self, batch: int = 2) -> dict:
        generator = torch.Generator().manual_seed(1)
        if self.kind == "dodo":
            return {"input_ids": torch.randint(3, self.vocab_size, (batch, 6), generator=generator),
                    "context_input_ids": torch.randint(3, self.vocab_size, (batch, 20), generator=generator)}
        length = 40 if self.kind == "vcc" else 12
        input_ids = torch.randint(3, self.vocab_size, (batch, length), generator=generator)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[-1, -3:] = 0  # one padded row
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def new_tokens(self, sequences: torch.Tensor, inputs: dict) -> torch.Tensor:
        return sequences[:, 1:] if self.is_seq2seq else sequences[:, inputs["input_ids"].shape[1]:]


@pytest.fixture(params=KINDS)
def tester(request) -> ModelTester:
    return ModelTester(request.param)


def greedy(tester: ModelTester, batch: int = 2, **kwargs) -> torch.Tensor:
    inputs = {key: value[:batch] for key, value in tester.inputs().items()}
    with torch.no_grad():
        return tester.model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False, **kwargs)


@pytest.mark.parametrize("mode", [dict(num_beams=1), dict(num_beams=1, do_sample=True),
                                  dict(num_beams=2), dict(num_beams=2, do_sample=True)],
                         ids=["greedy", "sample", "beam_search", "beam_sample"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_dict_outputs(tester, mode, use_cache):
    torch.manual_seed(0)
    with torch.no_grad():
        out = tester.model.generate(**tester.inputs(), max_new_tokens=4, min_new_tokens=4, use_cache=use_cache,
                                    return_dict_in_generate=True, output_scores=True, output_logits=True,
                                    output_attentions=True, output_hidden_states=True, **mode)
    rows = 2 * mode["num_beams"]
    assert len(out.scores) == len(out.logits) == 4
    assert all(score.shape == (rows, tester.vocab_size) for score in out.scores)
    layers = tester.model.config.num_decoder_layers if tester.is_seq2seq else tester.model.config.num_hidden_layers
    if tester.is_seq2seq:
        steps = [out.decoder_attentions, out.cross_attentions, out.decoder_hidden_states]
        assert all(len(step) == 4 for step in steps)
        for step, attentions in enumerate(out.decoder_attentions):
            assert len(attentions) == layers
            query = 1 if use_cache or step == 0 else step + 1
            assert attentions[0].shape[:3] == (rows, tester.model.config.num_heads, query)
        assert len(out.decoder_hidden_states[0]) == layers + 1
        assert out.encoder_hidden_states is not None and out.encoder_hidden_states[0].shape[0] in (2, rows)
    else:
        assert len(out.attentions) == len(out.hidden_states) == 4
        assert len(out.hidden_states[0]) == layers + 1
        assert out.hidden_states[-1][-1].shape[:2] == (rows, 1 if use_cache else out.sequences.shape[1] - 1)


def test_assisted_decoding_equals_greedy(tester):
    """Dodo generates with nuggets here (a context is compressed first); rejected candidates are cropped from its
    cache, behind the nugget slots and the soft prompt."""
    expected = greedy(tester, batch=1)  # transformers' assisted generation takes one sequence
    assert torch.equal(greedy(tester, batch=1, assistant_model=tester.model), expected)
    assert torch.equal(greedy(tester, batch=1, prompt_lookup_num_tokens=2), expected)


def test_dodo_assisted_decoding_with_a_longer_context_and_a_separate_assistant():
    """The assistant's cache is cropped by transformers from its `get_seq_length()`, which must count tokens only (the
    nugget slots and the soft prompt before them are not tokens): before, a 30-token context failed in the second
    round."""
    import copy

    model = ModelTester("dodo").model
    generator = torch.Generator().manual_seed(1)
    context = torch.randint(3, model.config.vocab_size, (1, 30), generator=generator)
    prompt = torch.randint(3, model.config.vocab_size, (1, 6), generator=generator)
    assistant = copy.deepcopy(model)
    with torch.no_grad():
        for new_tokens in (6, 12):
            options = dict(context_input_ids=context, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            expected = model.generate(prompt, **options)
            assert torch.equal(model.generate(prompt, assistant_model=assistant, **options), expected)


def test_dodo_assisted_decoding_with_a_smaller_dodo_assistant():
    """A smaller Dodo (another configuration) cannot read the target's nuggets: it compresses the context itself and
    drafts from its own nuggets. Before, its generate() refused the target's nuggets in the first round ("`nuggets`
    were produced by a model with another configuration"). Nuggets alone (no context to compress) are refused up
    front."""
    model = ModelTester("dodo").model
    small = tiny_dodo(hidden_size=16, intermediate_size=32, num_hidden_layers=2, nugget_layer=1)
    generator = torch.Generator().manual_seed(1)
    context = torch.randint(3, model.config.vocab_size, (1, 30), generator=generator)
    prompt = torch.randint(3, model.config.vocab_size, (1, 6), generator=generator)
    drafted_from = []
    hook = small.register_forward_pre_hook(
        lambda module, args, kwargs: drafted_from.append(kwargs["nuggets"].config_fingerprint)
        if kwargs.get("nuggets") is not None else None, with_kwargs=True)
    options = dict(context_input_ids=context, max_new_tokens=8, min_new_tokens=8)
    with torch.no_grad():
        expected = model.generate(prompt, **options)
        assert torch.equal(model.generate(prompt, assistant_model=small, **options), expected)
        hook.remove()
        torch.manual_seed(0)
        sampled = model.generate(prompt, assistant_model=small, do_sample=True, **options)
        with pytest.raises(ValueError, match="`assistant_model` has another configuration.*`context_input_ids`"):
            model.generate(prompt, nuggets=model.compress(context), assistant_model=small, max_new_tokens=4)
    assert drafted_from and set(drafted_from) == {small.config_fingerprint}
    assert sampled.shape == expected.shape and torch.equal(sampled[:, :6], prompt)


@pytest.mark.parametrize("assisted", ["assistant_model", "prompt_lookup_num_tokens", "autoregressive_assistant"])
def test_dodo_assisted_decoding_in_autoregressive_mode_is_refused_before_the_first_step(assisted):
    """The autoregressive mode (`config.recent_window`) cannot crop its cache, which assisted decoding needs to drop
    rejected drafts: refused before any forward pass, naming the arguments (it failed in the first round with "A
    DodoCache in autoregressive mode cannot drop tokens"). An assistant given a context to compress is not in it."""
    window_model = tiny_dodo(recent_window=8)
    model = tiny_dodo() if assisted == "autoregressive_assistant" else window_model
    options = {"assistant_model": window_model if assisted != "prompt_lookup_num_tokens" else None,
               "prompt_lookup_num_tokens": 2 if assisted == "prompt_lookup_num_tokens" else None}
    prompt = torch.randint(3, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *args: calls.append(1)) for m in (model, window_model)]
    with torch.no_grad(), pytest.raises(ValueError, match=r"`assistant_model`, `prompt_lookup_num_tokens`.*"
                                        r"autoregressive mode \(`config.recent_window`=8\)"):
        model.generate(prompt, max_new_tokens=12, **options)
    assert calls == []
    for hook in hooks:
        hook.remove()
    if assisted == "autoregressive_assistant":  # with a context, the assistant compresses it: compressor mode
        with torch.no_grad():
            expected = model.generate(prompt[:, :6], context_input_ids=prompt, max_new_tokens=6, min_new_tokens=6)
            assert torch.equal(model.generate(prompt[:, :6], context_input_ids=prompt, max_new_tokens=6,
                                              min_new_tokens=6, **options), expected)


def test_dodo_cache_crop_keeps_nuggets_and_counts_tokens():
    from longreach.modeling.input_checks import cache_of
    from longreach.modeling.modeling_dodo import DodoCache

    tester = ModelTester("dodo")
    inputs = tester.inputs(batch=1)
    with torch.no_grad():
        cache = cache_of(tester.model(**inputs, use_cache=True))  # `.cache` from transformers 5.24 on
    assert isinstance(cache, DodoCache) and cache.seen_tokens == 6
    assert cache.get_seq_length() == 6  # tokens, as generate()'s bookkeeping counts them
    columns = cache.layers[0].get_seq_length()  # nugget slots + soft prompt + 6 tokens
    cache.crop(4)  # DynamicCache semantics: keep 4 tokens
    assert cache.seen_tokens == 4 == cache.get_seq_length() and cache.layers[0].get_seq_length() == columns - 2
    assert cache.decoder_mask.shape[1] == columns - 2 - cache.num_nugget_slots
    cache.crop(-1)  # negative: remove one token
    assert cache.seen_tokens == 3 == cache.get_seq_length() and cache.layers[0].get_seq_length() == columns - 3
    cache.crop(10)  # more than it holds: nothing to remove
    assert cache.seen_tokens == 3
    cache.autoregressive = True
    with pytest.raises(ValueError, match="autoregressive mode cannot drop tokens"):
        cache.crop(1)


def test_num_return_sequences(tester):
    with torch.no_grad():
        out = tester.model.generate(**tester.inputs(), max_new_tokens=3, num_beams=3, num_return_sequences=2)
    assert out.shape[0] == 4


class HostSyncCounter(TorchDispatchMode):
    """Counts the ops that make the host wait for the device on an accelerator: reading a value back
    (``.item()``, ``bool(tensor)``, ``.tolist()`` all run ``aten::_local_scalar_dense``) and ``nonzero`` (its output
    size depends on the data). On CPU they run as usual; counting them needs no GPU."""

    SYNCING_OPS = ("_local_scalar_dense", "nonzero")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._overloadpacket.__name__ in self.SYNCING_OPS
        return func(*args, **(kwargs or {}))


def host_syncs_per_new_token(model, inputs: dict, **generate_kwargs) -> float:
    """Host syncs of one more decoding step of ``generate()``: the difference between 12 and 4 new tokens, over 8."""
    counts = []
    for new_tokens in (4, 12):
        with torch.no_grad(), HostSyncCounter() as counter:
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           **generate_kwargs)
        counts.append(counter.count)
    return (counts[1] - counts[0]) / 8


def transformers_peer(tester: ModelTester):
    """transformers' own model of the tester's kind at its tiny size (T5 for the seq2seq models, Llama for Dodo), in
    eval mode on CPU: the yardstick for host syncs per decoding step."""
    torch.manual_seed(0)
    if tester.is_seq2seq:
        peer = T5ForConditionalGeneration(T5Config(vocab_size=tester.vocab_size, d_model=32, d_kv=8, d_ff=64,
                                                   num_layers=2, num_heads=4, decoder_start_token_id=0))
    else:
        peer = LlamaForCausalLM(LlamaConfig(vocab_size=tester.vocab_size, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4))
    return peer.eval()


@pytest.mark.parametrize("num_beams", [1, 2])
def test_decoding_steps_sync_with_the_host_no_more_than_transformers_models(tester, num_beams):
    # A decoding step on a GPU should queue its kernels and not wait for them. generate() itself reads one flag back
    # per step (have all rows finished?); input checks (and Dodo's nugget checks and copies) belong to the first step.
    # Dodo made three per greedy step (four per beam-search step) before its checks moved there.
    peer = transformers_peer(tester)
    peer_inputs = {"input_ids": tester.inputs()["input_ids"]}
    ours = host_syncs_per_new_token(tester.model, tester.inputs(), num_beams=num_beams)
    theirs = host_syncs_per_new_token(peer, peer_inputs, num_beams=num_beams)
    assert theirs >= 1  # the counter sees generate()'s own per-step check
    assert ours <= theirs, f"{tester.kind}: {ours} host syncs per decoding step, transformers' model {theirs}"


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_static_cache_decoding_steps_sync_with_the_host_no_more_than_t5(kind):
    """With a static cache the filled length is a 0-d tensor: the decoder builds its positions and masks from it
    without reading it back, so a step syncs no more often than transformers' T5 with the same cache."""
    tester = ModelTester(kind)
    peer = transformers_peer(tester)
    ours = host_syncs_per_new_token(tester.model, tester.inputs(), cache_implementation="static")
    theirs = host_syncs_per_new_token(peer, {"input_ids": tester.inputs()["input_ids"]}, cache_implementation="static")
    assert ours <= theirs, f"{kind}: {ours} host syncs per static-cache decoding step, T5 {theirs}"


class TensorsFromPythonValues(TorchDispatchMode):
    """Where our code makes a tensor from Python values (``torch.tensor(...)``, dispatched as ``lift_fresh``): on a GPU
    that is a host-to-device copy from pageable memory, which waits for the device. Callers outside longreach (e.g.
    transformers' cache creating its empty tensors) are not counted."""

    def __init__(self):
        super().__init__()
        self.callers: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in ("lift_fresh", "lift_fresh_copy"):
            ours = [frame for frame in traceback.extract_stack()[:-1]
                    if f"{os.sep}longreach{os.sep}" in frame.filename]
            if ours:
                self.callers.append(f"{ours[-1].filename}:{ours[-1].lineno}: {ours[-1].line}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("num_beams", [1, 2])
def test_decoding_steps_make_no_tensors_from_python_values(tester, num_beams):
    # Found on a GPU (tests/test_cuda.py): Dodo built its nugget bias with torch.tensor(minimum, device=...) in every
    # decoding step, a blocking copy that the read-back counter above does not see. This catches the pattern on a CPU:
    # model calls after the first (prefill / compression) must not make tensors from Python values.
    calls, recorder = [], TensorsFromPythonValues()

    def before(module, args, kwargs):
        calls.append(1)
        if len(calls) == 2:
            recorder.__enter__()

    hook = tester.model.register_forward_pre_hook(before, with_kwargs=True)
    try:
        with torch.no_grad():
            tester.model.generate(**tester.inputs(), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                  num_beams=num_beams)
    finally:
        hook.remove()
        if len(calls) >= 2:
            recorder.__exit__(None, None, None)
    assert len(calls) >= 4
    assert recorder.callers == [], f"{tester.kind}: tensors from Python values in decoding steps: {recorder.callers}"


def test_streamer_receives_every_generated_token(tester):
    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1))

        def end(self):
            self.ended = True

    streamer = Collect()
    inputs = {key: value[:1] for key, value in tester.inputs().items()}  # streamers take one sequence
    with torch.no_grad():
        out = tester.model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, streamer=streamer)
    streamed = torch.cat(streamer.chunks)
    assert streamer.ended and torch.equal(streamed[-4:], out[0, -4:])


def test_dodo_refuses_a_streamer_with_beam_search_before_compressing_the_context():
    """transformers refuses a streamer with beam search; Dodo compressed the whole context first (T5 refuses before
    running its encoder). Beams from the arguments or from a GenerationConfig; greedy still streams."""
    class Ignore(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    tester = ModelTester("dodo")
    inputs = {key: value[:1] for key, value in tester.inputs().items()}
    compressed = []
    tester.model.compress = lambda *args, **kwargs: compressed.append(args) or type(tester.model).compress(
        tester.model, *args, **kwargs)
    with torch.no_grad():
        for beams in (dict(num_beams=2), dict(generation_config=GenerationConfig(num_beams=2, max_new_tokens=2))):
            with pytest.raises(ValueError, match="`streamer` cannot be used with beam search"):
                tester.model.generate(**inputs, streamer=Ignore(), **beams)
            assert compressed == []
        tester.model.generate(**inputs, streamer=Ignore(), max_new_tokens=2)
    assert len(compressed) == 1


def test_generate_takes_transformers_positional_arguments(tester):
    """`generate(inputs, generation_config, logits_processor, stopping_criteria, ...)` positionally, as transformers'
    `GenerationMixin.generate` takes them (T5 and Llama do): Dodo's generate() refused them ("takes from 1 to 3
    positional arguments but 5 were given"). An Event-watching StoppingCriteria stops the stream after 2 tokens."""
    stop = threading.Event()

    class StopOnEvent(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

    class SetAfterTwo(BaseStreamer):
        def __init__(self):
            self.tokens = 0

        def put(self, value):
            self.tokens += 1
            if self.tokens == 2:  # the prompt, then the first token: the criteria stop after the second
                stop.set()

        def end(self):
            pass

    inputs = {key: value[:1] for key, value in tester.inputs().items()}
    prompt = inputs.pop("input_ids")
    with torch.no_grad():
        expected = tester.model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False, **inputs)
        out = tester.model.generate(prompt, None, LogitsProcessorList(), StoppingCriteriaList([StopOnEvent()]), None,
                                    None, None, SetAfterTwo(), max_new_tokens=8, do_sample=False, **inputs)
    assert torch.equal(out, expected)
    with pytest.raises(TypeError, match="multiple values for argument 'streamer'"):
        tester.model.generate(prompt, None, None, None, None, None, None, SetAfterTwo(), streamer=SetAfterTwo(),
                              **inputs)


def test_generation_config_round_trip(tester, tmp_path):
    tester.model.generation_config.max_new_tokens = 7
    tester.model.generation_config.num_beams = 2
    tester.model.generation_config.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.to_diff_dict() == tester.model.generation_config.to_diff_dict()


def test_resize_token_embeddings_then_generate(tester):
    model = tester.model
    model.resize_token_embeddings(tester.vocab_size + 9)
    assert model.get_input_embeddings().num_embeddings == tester.vocab_size + 9
    assert model.get_output_embeddings().weight.shape[0] == tester.vocab_size + 9
    inputs = tester.inputs()
    inputs["input_ids"][0, 0] = tester.vocab_size + 8  # a new token is accepted
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, return_dict_in_generate=True, output_scores=True)
    assert out.scores[0].shape[-1] == tester.vocab_size + 9


def test_hidden_states_are_in_the_autograd_graph(tester):
    model = tester.model.train()
    model.set_attn_implementation("eager")  # attention weights are returned by eager attention (sdpa fuses them)
    inputs = tester.inputs()
    if tester.is_seq2seq:
        inputs["labels"] = torch.randint(3, tester.vocab_size, (2, 4))
    else:
        inputs["labels"] = inputs["input_ids"]
    out = model(**inputs, output_hidden_states=True, output_attentions=True)
    # Dodo's hidden states are those of the tokens only (its soft prompt is dropped), still the tensors in the graph
    if tester.is_seq2seq:
        states = [out.decoder_hidden_states[0], out.encoder_hidden_states[0]]
    else:
        states = list(out.hidden_states)
        assert len(states) == model.config.num_hidden_layers + 1
        assert all(state.shape == (2, 6, model.config.hidden_size) for state in states)
        assert not states[0].requires_grad  # the embeddings of Dodo's frozen base; the layers train adapters
        states = states[1:]
    attentions = out.decoder_attentions[0] if tester.is_seq2seq else out.attentions[0]
    for tensor in states + [attentions]:
        tensor.retain_grad()
    out.loss.backward()
    assert all(tensor.grad is not None for tensor in states + [attentions])


def test_tied_weights_survive_save_and_load(tester, tmp_path):
    model = tester.model
    model.save_pretrained(tmp_path)
    reloaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == [] or not info["missing_keys"]
    assert not info["unexpected_keys"]
    if model.config.tie_word_embeddings:
        assert reloaded.get_output_embeddings().weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()
    for key, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], tensor), key


def test_base_model_prefix_loads_both_ways(tester, tmp_path):
    model = tester.model
    # as in T5: the seq2seq head model holds shared/encoder/decoder itself, so its base model is itself
    assert model.base_model is getattr(model, model.base_model_prefix, model)
    model.save_pretrained(tmp_path / "head")
    base, info = AutoModel.from_pretrained(tmp_path / "head", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    base.save_pretrained(tmp_path / "base")
    head, info = type(model).from_pretrained(tmp_path / "base", output_loading_info=True)
    assert not info["unexpected_keys"]
    assert set(info["missing_keys"]) <= {"lm_head.weight"}


def test_device_map_auto_loads_the_same_model(tester, tmp_path):
    tester.model.save_pretrained(tmp_path)
    mapped = type(tester.model).from_pretrained(tmp_path, device_map="auto").eval()
    assert torch.equal(greedy(ModelTesterWith(tester, mapped)), greedy(tester))


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_peft_lora_trains_saves_reloads_and_merges_as_on_t5(kind, tmp_path):
    """PEFT's LoRA on the decoder's attention and, for LOCOST, the encoder's SSM projections: a training step, the
    adapter saved and reloaded (`PeftModel`, `AutoPeftModelForSeq2SeqLM`), and `merge_and_unload` give one model."""
    from peft import AutoPeftModelForSeq2SeqLM, LoraConfig, PeftModel, get_peft_model

    tester = ModelTester(kind)
    tester.model.save_pretrained(tmp_path / "base")
    targets = ["q", "v"] + (["k_proj", "out_proj"] if kind == "locost" else [])
    base = type(tester.model).from_pretrained(tmp_path / "base")  # (so the adapter names its base folder)
    peft_model = get_peft_model(base.train(), LoraConfig(task_type="SEQ_2_SEQ_LM", r=4, target_modules=targets,
                                                         lora_dropout=0.0))
    inputs = tester.inputs()
    labels = torch.randint(3, tester.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model(**inputs, labels=labels).loss.backward()
    optimizer.step()
    assert {n for n, p in peft_model.named_parameters() if p.requires_grad} == {
        n for n in dict(peft_model.named_parameters()) if ".lora_" in n}
    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = peft_model(**inputs, labels=labels).logits
        base = type(tester.model).from_pretrained(tmp_path / "base").eval()
        reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(**inputs, labels=labels).logits, expected, rtol=0, atol=0)
        auto = AutoPeftModelForSeq2SeqLM.from_pretrained(tmp_path / "adapter").eval()
        torch.testing.assert_close(auto(**inputs, labels=labels).logits, expected, rtol=0, atol=0)
        merged = reloaded.merge_and_unload()
        torch.testing.assert_close(merged(**inputs, labels=labels).logits, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(merged.generate(**inputs, max_new_tokens=4, num_beams=2),
                           reloaded.generate(**inputs, max_new_tokens=4, num_beams=2))


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_peft_default_target_modules_as_on_t5(kind):
    """No ``target_modules``, as one writes for T5: LoRA adapts the attention's q and v (and LOCOST's SSM gate and
    input), IA3 T5's k, v and wo, and LoRA's adapter trains."""
    from peft import IA3Config, LoraConfig, get_peft_model

    expected_lora = {"q", "v"} | ({"q_proj", "k_proj"} if kind == "locost" else set())
    for peft_config, expected in ((LoraConfig(task_type="SEQ_2_SEQ_LM", r=2), expected_lora),
                                  (IA3Config(task_type="SEQ_2_SEQ_LM"), {"k", "v", "wo"})):
        model = get_peft_model(ModelTester(kind).model, peft_config)
        adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if hasattr(module, "base_layer") and not name.endswith("base_layer")}
        assert adapted == expected, (type(peft_config).__name__, adapted)
    tester = ModelTester(kind)
    lora = get_peft_model(tester.model.train(), LoraConfig(task_type="SEQ_2_SEQ_LM", r=2, lora_dropout=0.0))
    labels = torch.randint(3, tester.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    lora(**tester.inputs(), labels=labels).loss.backward()
    trained = [name for name, parameter in lora.named_parameters() if parameter.grad is not None]
    assert trained and all(".lora_" in name for name in trained)


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_peft_modules_to_save_finds_the_embedding_under_the_encoders_and_decoders_names_as_on_t5(kind):
    """``modules_to_save=["embed_tokens"]``: PEFT lists modules with ``named_modules(remove_duplicate=False)`` to find
    tied ones, and wraps the encoder's and the decoder's embedding, trainable, as on T5 (a listing that named ``shared``
    once, tried against pytorch/pytorch#164759, made this match nothing, without an error)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(ModelTester(kind).model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=2,
                                                               modules_to_save=["embed_tokens"]))
    base = model.base_model.model
    assert all(type(stack.embed_tokens).__name__ == "ModulesToSaveWrapper" for stack in (base.encoder, base.decoder))
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad and "embed" in name}
    assert {name.split(".")[2] for name in trainable} == {"encoder", "decoder"}


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_peft_trainable_token_indices_train_and_generate_as_on_t5(kind):
    """`trainable_token_indices` wraps the shared embedding and the tied head in PEFT wrappers that forward neither
    `num_embeddings` nor `out_features`: the input checks failed with an AttributeError where T5 trains. They now read
    the wrapped layer's size."""
    from peft import LoraConfig, get_peft_model

    tester = ModelTester(kind)
    peft_model = get_peft_model(tester.model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=2, lora_dropout=0.0,
                                                         trainable_token_indices={"shared": [5, 6]}))
    inputs = tester.inputs()
    labels = torch.randint(3, tester.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    peft_model.train()
    peft_model(**inputs, labels=labels).loss.backward()
    trained = {name for name, parameter in peft_model.named_parameters() if parameter.grad is not None}
    assert any("token_adapter" in name for name in trained) and all(
        "token_adapter" in name or ".lora_" in name for name in trained)
    with torch.no_grad():
        assert peft_model.eval().generate(**inputs, max_new_tokens=3).shape[0] == 2
    with pytest.raises(ValueError, match="outside this model's vocabulary"):  # the checks still run, wrapped
        peft_model(input_ids=torch.full((1, 4), tester.vocab_size), labels=labels[:1])


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_peft_on_the_shared_embedding_reaches_the_encoder_and_the_decoder(kind, tmp_path):
    """``target_modules=["shared"]`` (LoRA) and ``modules_to_save=["shared"]``: PEFT replaces ``model.shared`` by its
    wrapper, and the stacks went on reading the unwrapped embedding (their ``embed_tokens`` is the same module under
    other names): the adapter was trained by nothing and changed nothing, without an error (T5 has the same dead
    adapter). Replacing ``shared`` now replaces it in both stacks, so the adapter is read, trains, saves, reloads and
    merges; ``merge_and_unload`` gives the three names one plain embedding again."""
    from peft import LoraConfig, PeftModel, get_peft_model

    tester = ModelTester(kind)
    tester.model.save_pretrained(tmp_path / "base")
    inputs = tester.inputs()
    inputs["decoder_input_ids"] = torch.randint(3, tester.vocab_size, (2, 4),
                                                generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = tester.model.eval()(**inputs).logits
    peft_model = get_peft_model(tester.model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=2, target_modules=["shared"],
                                                         init_lora_weights=False))
    model = peft_model.base_model.model
    assert model.encoder.embed_tokens is model.shared and model.decoder.embed_tokens is model.shared
    peft_model.train()(**inputs).logits.sum().backward()
    trained = {name.split(".")[-2] for name, parameter in peft_model.named_parameters()
               if parameter.grad is not None and parameter.grad.abs().sum() > 0}
    assert trained == {"lora_embedding_A", "lora_embedding_B"}, trained
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(**inputs).logits
        assert not torch.allclose(expected, base_logits, atol=1e-3)  # the adapter changes the output
        encoder_input = model.encoder(input_ids=inputs["input_ids"]).last_hidden_state
        with peft_model.disable_adapter():
            torch.testing.assert_close(peft_model(**inputs).logits, base_logits)
            assert not torch.allclose(model.encoder(input_ids=inputs["input_ids"]).last_hidden_state, encoder_input,
                                      atol=1e-4)  # the encoder reads the adapter
        peft_model.save_pretrained(tmp_path / "adapter")
        base = type(tester.model).from_pretrained(tmp_path / "base")
        reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(reloaded(**inputs).logits, expected, rtol=0, atol=0)
        merged = reloaded.merge_and_unload()
        assert type(merged.shared) is torch.nn.Embedding and merged.encoder.embed_tokens is merged.shared
        assert merged.decoder.embed_tokens is merged.shared
        # the encoder reads the merged embedding as it read the adapter (a tied LM head takes the merged embedding
        # too, so the logits change: PEFT's known limit for tied embeddings, huggingface/peft#2777)
        torch.testing.assert_close(merged.encoder(input_ids=inputs["input_ids"]).last_hidden_state, encoder_input,
                                   rtol=1e-5, atol=1e-5)

    saved = get_peft_model(ModelTester(kind).model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=2, target_modules=["q"],
                                                               modules_to_save=["shared"]))
    saved.train()(**inputs).logits.sum().backward()
    trained_copy = saved.base_model.model.shared.modules_to_save["default"].weight
    assert trained_copy.grad is not None and trained_copy.grad.abs().sum() > 0  # the copy is what the stacks read


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_peft_merge_of_a_trained_lm_head_keeps_t5s_rescaling(kind, tmp_path):
    """`modules_to_save=["lm_head"]` trains a copy of the tied head; `merge_and_unload` unties it and sets
    `tie_word_embeddings=False`, which also turned off T5's d_model**-0.5 rescaling of the decoder output (logits 5.7
    times too large, in memory and after saving). As in transformers v5's T5, the rescaling is now fixed when the
    config is made."""
    from peft import LoraConfig, get_peft_model

    tester = ModelTester(kind)
    peft_model = get_peft_model(tester.model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=2, modules_to_save=["lm_head"]))
    inputs, decoder_input_ids = tester.inputs(), torch.zeros(2, 3, dtype=torch.long)
    with torch.no_grad():
        peft_model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.01)  # a trained head
        expected = peft_model(**inputs, decoder_input_ids=decoder_input_ids).logits
        merged = peft_model.merge_and_unload()
        assert merged.config.tie_word_embeddings is False and merged.lm_head.weight is not merged.shared.weight
        torch.testing.assert_close(merged(**inputs, decoder_input_ids=decoder_input_ids).logits, expected)
        merged.save_pretrained(tmp_path)
        reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(reloaded(**inputs, decoder_input_ids=decoder_input_ids).logits, expected)


class ModelTesterWith(ModelTester):
    def __init__(self, tester: ModelTester, model):  # noqa: D107  same inputs, another model
        self.__dict__.update(tester.__dict__)
        self.model = model


@pytest.mark.parametrize("kind", KINDS)
def test_torch_compile_of_the_forward_gives_the_same_logits(kind):
    """Compiled with the aot_eager backend (the graph capture and autograd tracing; no C++ compiler needed): LOCOST
    and VCC-T5 as one graph (``fullgraph=True``; LOCOST's kernel cache is bypassed inside a compiled graph), Dodo,
    which compresses its context in the same compiled call, in pieces."""
    tester = ModelTester(kind)
    inputs = tester.inputs()
    if tester.is_seq2seq:
        inputs["decoder_input_ids"] = torch.zeros(2, 3, dtype=torch.long)
    with torch.no_grad():
        expected = tester.model(**inputs).logits
        torch._dynamo.reset()
        compiled = torch.compile(tester.model.forward, backend="aot_eager", fullgraph=kind != "dodo")(**inputs).logits
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)


def test_locost_long_input_path_compiles_as_one_graph():
    """Without autograd, inputs longer than `encoder_chunk_length` (2048 on the CPU, 32768 on accelerators by default)
    run the encoder in pieces; `torch.compile(fullgraph=True)` of that path failed ("torch.* op returned non-Tensor":
    `torch.result_type`). Here 12 tokens in pieces of 4, with the eager logits."""
    tester = ModelTester("locost")
    tester.model.config.encoder_chunk_length = 4
    inputs = {**tester.inputs(), "decoder_input_ids": torch.zeros(2, 3, dtype=torch.long)}
    with torch.no_grad():
        expected = tester.model(**inputs).logits  # (applies the edited config)
        torch._dynamo.reset()
        compiled = torch.compile(tester.model.forward, backend="aot_eager", fullgraph=True)(**inputs).logits
    assert tester.model.get_encoder().piece_length(torch.device("cpu")) == 4
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)


def test_locost_settings_edited_after_compiling_apply_to_the_compiled_model():
    """An encoder setting assigned to `model.config` after `torch.compile` applies from the next call, as in eager mode
    (the compiled code kept the old one: `ssm_authors_fft_size` is another function); with `fullgraph=True` the
    change is refused (a graph break) rather than ignored."""
    tester = ModelTester("locost")
    model = tester.model
    inputs = {**tester.inputs(), "decoder_input_ids": torch.zeros(2, 3, dtype=torch.long)}
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="aot_eager")
    fullgraph = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        before = compiled(**inputs).logits
        fullgraph(**inputs)  # (compiled with the settings unchanged: one graph)
        model.config.ssm_authors_fft_size = not model.config.ssm_authors_fft_size
        with pytest.raises(Exception, match="_apply_changed_settings"):
            fullgraph(**inputs)
        after = compiled(**inputs).logits
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for _ in range(3):  # the traced comparison costs no recompilation while nothing changes
            compiled(**inputs)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        expected = model(**inputs).logits
    assert not torch.allclose(after, before, atol=1e-6)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_training_step_compiles_as_one_graph_with_the_eager_gradients(kind):
    """``torch.compile(fullgraph=True)`` of the training forward (loss included; aot_eager backend, so its backward is
    traced too): no graph break, so an accelerator runs the step without returning to Python between ops (the
    host-bound GPU step of `benchmarks/results/cuda.md`), and the loss and every gradient equal eager mode's. VCC-T5
    gets a left-padded row and a `vip_mask` with a row that marks no real token, the inputs whose eager handling asks
    the data (realigning the row, the first tokens as VIPs), and LOCOST's SSM parameters get gradients too (Dodo
    selects a data-dependent number of nuggets: `_can_compile_fullgraph = False`)."""
    tester = ModelTester(kind)
    torch.manual_seed(0)  # no random draw (dropout, VCC's exploration): a compiled graph makes them in another order
    overrides = {"dropout_rate": 0.0, **({"exploration_probability": 0.0} if kind == "vcc" else {})}
    config = tester.model.config.__class__(**{**tester.model.config.to_dict(), **overrides})
    model = type(tester.model)(config).train()
    inputs = dict(tester.inputs(), labels=torch.randint(3, tester.vocab_size, (2, 4), generator=torch.Generator()
                                                        .manual_seed(2)))
    if kind == "vcc":
        inputs["attention_mask"][-1] = inputs["attention_mask"][-1].flip(0)  # left padding
        vip_mask = torch.zeros_like(inputs["input_ids"])
        vip_mask[0, 5:8] = 1  # row 1 has none
        inputs["vip_mask"] = vip_mask

    def step(forward):
        model.zero_grad(set_to_none=True)
        loss = forward(**inputs).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected_loss, expected_grads = step(model.forward)
    torch._dynamo.reset()
    loss, grads = step(torch.compile(model.forward, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == expected_grads.keys()
    assert kind != "locost" or any(name.endswith("ssm.conv.log_dt") for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["locost", "vcc"])
@pytest.mark.parametrize("mode", [dict(num_beams=1), dict(num_beams=2), dict(num_beams=2, num_return_sequences=2),
                                  dict(num_beams=1, do_sample=True)],
                         ids=["greedy", "beam_search", "two_sequences", "sample"])
def test_a_static_cache_generates_what_the_dynamic_cache_does(kind, mode):
    """`cache_implementation="static"` preallocates the self-attention cache (and the cross-attention one at the
    encoder's length): the decoder then sees every slot, and its causal mask hides the unfilled ones, so the tokens
    are those of the default dynamic cache, with a padded encoder row, in every decoding mode."""
    from transformers.cache_utils import StaticCache

    from longreach.modeling.input_checks import cache_of

    tester = ModelTester(kind)
    outputs = []
    for cache_implementation in (None, "static"):
        torch.manual_seed(0)
        with torch.no_grad():
            outputs.append(tester.model.generate(**tester.inputs(), max_new_tokens=6, min_new_tokens=6,
                                                 cache_implementation=cache_implementation,
                                                 return_dict_in_generate=True, **mode))
    assert isinstance(cache_of(outputs[1]).self_attention_cache, StaticCache)  # the static path ran
    assert torch.equal(outputs[1].sequences, outputs[0].sequences)


def static_cache(config, max_cache_len: int, encoder_length: int):
    from transformers.cache_utils import EncoderDecoderCache, StaticCache

    return EncoderDecoderCache(StaticCache(config=config, max_cache_len=max_cache_len),
                               StaticCache(config=config, max_cache_len=encoder_length))


def test_static_cache_steps_match_the_dynamic_cache_with_a_decoder_mask_and_compile_as_one_graph():
    """Decoding step by step as `generate()` does with a static cache: a prefill of three decoder tokens with a padded
    decoder position (the 2D `decoder_attention_mask` is widened to the cache's slots), then two steps through
    `torch.compile(fullgraph=True)`, which the static cache exists for: the logits of every step equal those of the
    dynamic cache in eager mode. (The decoder is the one VCC-T5 uses too.)"""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    tester = ModelTester("locost")
    model, inputs = tester.model, tester.inputs()
    decoder_ids = torch.randint(3, tester.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    decoder_mask = torch.ones_like(decoder_ids)
    decoder_mask[1, 1] = 0
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
        caches = [EncoderDecoderCache(DynamicCache(), DynamicCache()),
                  static_cache(model.config, 8, encoder_outputs.last_hidden_state.shape[1])]
        torch._dynamo.reset()
        steps = [(model.forward, model.forward), (model.forward, torch.compile(model.forward, fullgraph=True,
                                                                              backend="eager"))]
        for end in (3, 4, 5):
            logits = [
                forward(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"],
                        decoder_input_ids=decoder_ids[:, end - 1 if end > 3 else 0:end],
                        decoder_attention_mask=decoder_mask[:, :end], past_key_values=cache, use_cache=True).logits
                for cache, forward in zip(caches, steps[end > 3])
            ]
            torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5, msg=f"first {end} tokens")


def test_a_decoder_mask_of_the_wrong_shape_gets_a_clear_error():
    tester = ModelTester("locost")
    decoder_ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`decoder_attention_mask` must be a 2D \[batch, decoder positions\] mask.*"
                                         r"got shape \(2, 1, 3, 3\)"):
        tester.model(**tester.inputs(), decoder_input_ids=decoder_ids, decoder_attention_mask=torch.ones(2, 1, 3, 3))
    with pytest.raises(ValueError, match=r"must cover the cached and the new decoder positions \(3\), got shape "
                                         r"\(2, 5\)"):
        tester.model(**tester.inputs(), decoder_input_ids=decoder_ids, decoder_attention_mask=torch.ones(2, 5))
    cache = static_cache(tester.model.config, 4, tester.inputs()["input_ids"].shape[1])
    with pytest.raises(ValueError, match=r"\(at most the static cache's 4 slots\), got shape \(2, 5\)"):
        tester.model(**tester.inputs(), decoder_input_ids=decoder_ids, decoder_attention_mask=torch.ones(2, 5),
                     past_key_values=cache, use_cache=True)


def test_dodo_refuses_padding_free_batches():
    """transformers' padding-free check (`*_padding_matches_padding_free_with_position_ids`) packs sequences into one
    row with restarting position_ids; Dodo conditions each row on its own nuggets, so packing is not applicable and
    gets a clear error (padded rows work, see the tests above)."""
    tester = ModelTester("dodo")
    inputs = tester.inputs()
    packed = torch.cat([inputs["input_ids"][0], inputs["input_ids"][1]])[None]
    position_ids = torch.cat([torch.arange(6), torch.arange(6)])[None]
    with pytest.raises(ValueError, match=r"`position_ids` restart inside rows \[0\]: padding-free"):
        tester.model(input_ids=packed, position_ids=position_ids)
    with pytest.raises(ValueError, match="padding-free"):
        tester.model(input_ids=packed, position_ids=position_ids, context_input_ids=inputs["context_input_ids"][:1])


@pytest.mark.parametrize("argument", ["head_mask", "decoder_head_mask", "cross_attn_head_mask"])
def test_head_masks_are_refused_not_ignored(tester, argument):
    """transformers 5 removed head masking (its T5 and Llama accept a head mask and ignore it; `prune_heads` is gone
    too). A mask silently ignored would change a user's result without a word, so ours raise; None is accepted."""
    inputs = tester.inputs()
    if tester.is_seq2seq:
        inputs["decoder_input_ids"] = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match=rf"`{argument}` is not supported \(got a torch.float32 tensor of shape \(2, 2\)\)"):
        tester.model(**inputs, **{argument: mask})
    with torch.no_grad():
        assert tester.model(**inputs, **{argument: None}).logits.shape[0] == 2


def test_dodo_has_no_tensor_parallel_plan_and_refuses_one(tmp_path):
    """Llama's plan shards q/k/v/o_proj; in Dodo those are PEFT LoRA wrappers with two adapters, which the plan cannot
    shard (transformers' `test_tp_plan_matches_params` finds no `q_proj.weight`). Dodo declares no plan, and asking
    for tensor parallelism is a clear error rather than a wrongly sharded model."""
    model = ModelTester("dodo").model
    assert model.config.base_model_tp_plan is None and not model._tp_plan
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"`tp_plan='auto'`: tensor parallelism is not supported by Dodo"):
        AutoModel.from_pretrained(tmp_path, tp_plan="auto")


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_decoder_model_past_equals_full_forward(kind):
    """transformers' `test_decoder_model_past`: the last token's logits computed on top of the cache of the others
    equal those of one forward over all tokens. (Dodo: test_modeling_dodo's cached-continuation test.)"""
    tester = ModelTester(kind)
    inputs = tester.inputs()
    decoder_input_ids = torch.randint(3, tester.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = tester.model(**inputs, decoder_input_ids=decoder_input_ids, use_cache=False).logits[:, -1]
        first = tester.model(**inputs, decoder_input_ids=decoder_input_ids[:, :4], use_cache=True)
        cache = first.cache if hasattr(first, "cache") and first.cache is not None else first.past_key_values
        step = tester.model(encoder_outputs=(first.encoder_last_hidden_state,), attention_mask=inputs["attention_mask"],
                            decoder_input_ids=decoder_input_ids[:, 4:], cache=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_attention_outputs_are_t5_shaped_and_encoder_attentions_none(kind):
    """transformers' `test_attention_outputs`: decoder self-attentions [batch, heads, target, target] and cross
    attentions [batch, heads, target, source] per decoder layer, as T5's. LOCOST's encoder has no attention and VCC-T5's
    attends over compressed sequences whose length changes per layer, so both return `encoder_attentions=None`
    (documented in the encoders' docstrings)."""
    tester = ModelTester(kind)
    model = tester.model
    model.set_attn_implementation("eager")
    inputs = tester.inputs()
    source = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model(**inputs, decoder_input_ids=torch.zeros(2, 3, dtype=torch.long), output_attentions=True)
    heads, layers = model.config.num_heads, model.config.num_decoder_layers
    assert len(out.decoder_attentions) == len(out.cross_attentions) == layers
    assert all(a.shape == (2, heads, 3, 3) for a in out.decoder_attentions)
    assert all(a.shape == (2, heads, 3, source) for a in out.cross_attentions)
    assert out.encoder_attentions is None


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_the_configs_output_attentions_applies_when_the_call_does_not_say(kind, tmp_path):
    """As T5's (and Dodo's, and our own `output_hidden_states`): `from_pretrained(..., output_attentions=True)` returns
    the decoder and cross attentions of every call that does not pass `output_attentions`, base model included."""
    tester = ModelTester(kind)
    tester.model.save_pretrained(tmp_path)
    decoder_input_ids = torch.zeros(2, 3, dtype=torch.long)
    for auto in (type(tester.model), AutoModel):
        model = auto.from_pretrained(tmp_path, output_attentions=True, attn_implementation="eager").eval()
        with torch.no_grad():
            out = model(**tester.inputs(), decoder_input_ids=decoder_input_ids)
            told = model(**tester.inputs(), decoder_input_ids=decoder_input_ids, output_attentions=False)
        layers = model.config.num_decoder_layers
        assert len(out.decoder_attentions) == len(out.cross_attentions) == layers, type(model).__name__
        assert told.decoder_attentions is None and told.cross_attentions is None


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_the_decoder_cache_is_returned_as_t5_returns_it_with_and_without_labels(kind):
    """As transformers' T5: `use_cache` left unset follows `config.use_cache` with labels too (the cache came back
    only without labels, so a `return_dict=False` tuple with labels had one entry fewer than T5's); True and False
    return it and drop it, whether or not labels are given, as a dict and as a tuple."""
    from longreach.modeling.input_checks import cache_of

    tester = ModelTester(kind)
    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=tester.vocab_size, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                             num_heads=2, decoder_start_token_id=0)).eval()
    inputs = tester.inputs()
    labels = torch.randint(3, tester.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    for targets in ({"labels": labels}, {"decoder_input_ids": labels}):
        for use_cache in ({}, {"use_cache": True}, {"use_cache": False}):
            with torch.no_grad():
                ours, theirs = (model(**inputs, **targets, **use_cache) for model in (tester.model, t5))
                ours_tuple, theirs_tuple = (model(**inputs, **targets, **use_cache, return_dict=False)
                                            for model in (tester.model, t5))
            case = f"{list(targets)[0]}, {use_cache or 'use_cache unset'}"
            assert list(ours.keys()) == list(theirs.keys()), case
            assert (cache_of(ours) is None) == (cache_of(theirs) is None), case
            assert [type(item).__name__ for item in ours_tuple] == [type(item).__name__ for item in theirs_tuple], case


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_trainer_predict_without_labels_drops_the_cache_from_the_predictions(kind, tmp_path):
    """`Trainer.predict` on inputs without labels, with the cache on: T5 returns its logits, because the Trainer drops
    the cache output (`cache` in transformers v5) named by `config.keys_to_ignore_at_inference`; the cache kept in the
    predictions failed in `_pad_across_processes`."""
    import datasets
    from transformers import Trainer, TrainingArguments

    tester = ModelTester(kind)
    inputs = tester.inputs()
    rows = datasets.Dataset.from_dict({"input_ids": inputs["input_ids"].tolist(),
                                       "attention_mask": inputs["attention_mask"].tolist(),
                                       "decoder_input_ids": [[0, 5, 6]] * 2})
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=2, use_cpu=True, report_to="none",
                             use_cache=True)
    predictions = Trainer(model=tester.model, args=args).predict(rows).predictions
    logits = predictions[0] if isinstance(predictions, tuple) else predictions
    assert logits.shape == (2, 3, tester.vocab_size)


def test_dodo_fills_the_cache_the_caller_passes_as_llama_does():
    """A `DodoCache(model.config)` passed in is filled in place (the caller's next call continues the sequence, as
    with Llama's `DynamicCache`) and so is one passed to `generate()`; a cache of another kind, which cannot hold the
    nuggets, is refused instead of replaced by a new one (the caller's next call lost the context)."""
    from transformers import DynamicCache

    from longreach import DodoCache

    model = ModelTester("dodo").model
    generator = torch.Generator().manual_seed(3)
    context = torch.randint(3, model.config.vocab_size, (1, 20), generator=generator)
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=generator)
    with torch.no_grad():
        full = model(ids, context_input_ids=context).logits[:, -1]
        cache = DodoCache(model.config)
        returned = model(ids[:, :7], context_input_ids=context, past_key_values=cache, use_cache=True)
        assert returned.past_key_values is cache and cache.get_seq_length() == 7
        step = model(ids[:, 7:], past_key_values=cache, use_cache=True).logits[:, -1]
        torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"The cache \(`cache`, or `past_key_values`\) must be a DodoCache .* got an empty DynamicCache"):
            model(ids, context_input_ids=context, past_key_values=DynamicCache(config=model.config))
        expected = model.generate(ids, context_input_ids=context, max_new_tokens=4, do_sample=False)
        given = DodoCache(model.config)
        sequences = model.generate(ids, context_input_ids=context, max_new_tokens=4, do_sample=False, cache=given)
    assert torch.equal(sequences, expected) and given.get_seq_length() == 8 + 4 - 1


@pytest.mark.parametrize("kind", ["locost", "vcc"])
def test_gradient_checkpointing_turns_the_decoder_cache_off_and_keeps_a_callers_prefix(kind):
    """As T5: under activation checkpointing `use_cache=True` is turned off (the backward replay would write every key
    into the cache twice), and a cache the caller passes (PEFT's prefix tuning) is read in training too."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    tester = ModelTester(kind)
    settings = {"dropout_rate": 0.0, **({"exploration_probability": 0.0} if kind == "vcc" else {})}  # no randomness
    config = type(tester.model.config).from_dict({**tester.model.config.to_dict(), **settings})
    torch.manual_seed(0)
    model = type(tester.model)(config)
    inputs = tester.inputs(batch=2)
    decoder_input_ids = torch.randint(3, tester.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    model.train()
    model.gradient_checkpointing_enable()
    logits = model(**inputs, decoder_input_ids=decoder_input_ids).logits  # use_cache left at its default
    logits.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    def prefix():
        torch.manual_seed(9)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        heads, head_dim = model.config.num_heads, model.config.d_kv
        for layer in range(model.config.num_decoder_layers):
            cache.self_attention_cache.update(torch.randn(2, heads, 3, head_dim), torch.randn(2, heads, 3, head_dim),
                                              layer)
        return cache

    model.gradient_checkpointing_disable()
    with torch.no_grad():
        trained = model(**inputs, decoder_input_ids=decoder_input_ids, past_key_values=prefix(), use_cache=False).logits
        model.eval()
        evaluated = model(**inputs, decoder_input_ids=decoder_input_ids, past_key_values=prefix(), use_cache=False).logits
        without = model(**inputs, decoder_input_ids=decoder_input_ids).logits
    assert torch.allclose(trained, evaluated, atol=1e-6) and not torch.allclose(trained, without, atol=1e-3)


@pytest.mark.parametrize("kind", ["locost", "vcc_t5"])
def test_blocks_under_torchs_checkpoint_wrapper_train_as_without_it(kind):
    """FSDP's and accelerate's `activation_checkpointing` wrap every block in torch's CheckpointWrapper. With the cache
    off (`use_cache=False`, as T5 needs there too: with it on, T5's replay fails, and so does ours) the loss and every
    gradient are those of the unwrapped model. (Dodo refuses the wrapper: test_bad_inputs.py.)"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from longreach import LocostConfig, LocostForConditionalGeneration

    torch.manual_seed(0)
    if kind == "locost":
        model = LocostForConditionalGeneration(LocostConfig(vocab_size=99, d_model=32, d_state=8, d_kv=8, d_ff=64,
                                                            num_layers=2, num_heads=4, dropout_rate=0.0))
    else:
        model = tiny_vcc(exploration_probability=0.0, dropout_rate=0.0)
    model.train()
    batch = {"input_ids": torch.randint(3, 99, (2, 40)), "labels": torch.randint(3, 99, (2, 6)), "use_cache": False}
    if kind == "vcc_t5":
        batch["vip_mask"] = torch.cat([torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 36, dtype=torch.long)], 1)

    def loss_and_gradients():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {name.replace("._checkpoint_wrapped_module", ""): parameter.grad.clone()
                               for name, parameter in model.named_parameters() if parameter.grad is not None}

    loss, gradients = loss_and_gradients()
    for stack in (model.encoder, model.decoder):
        for index, block in enumerate(stack.block):
            stack.block[index] = checkpoint_wrapper(block, preserve_rng_state=False)
    wrapped_loss, wrapped_gradients = loss_and_gradients()
    assert torch.equal(loss, wrapped_loss) and gradients.keys() == wrapped_gradients.keys() and len(gradients) > 40
    assert all(torch.equal(gradients[name], wrapped_gradients[name]) for name in gradients)
