"""One model shared by the worker threads of a server (a thread pool calling `generate()`, `forward()` or one
`pipeline("long-summarization")` under `torch.inference_mode()`, each with its own inputs): every call gives what it
gives alone, as transformers' T5 and Llama do.

Dodo switches its LoRA layers between φ and θ at every pass (state shared by the threads): a call holds the model's
lock (`_call_lock`) while it runs. The stress tests interleave calls of random lengths and batch sizes; the
deterministic tests force the interleaving that corrupted a call before."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_modeling_dodo import tiny_model as tiny_dodo

PAUSE_S = 2.0  # how long a paused call waits for the other thread (the whole wait only where the other thread is held)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    torch.set_num_threads(1)  # (restored by conftest's `_deterministic`)


def _paused_at_first_layer(model, decoder_layers, paused_thread: threading.Event, resume: threading.Event):
    """A pre-hook on the first decoder layer that, once and in the calling thread only, says so and waits for
    ``resume`` (at most `PAUSE_S`)."""
    owner, done = threading.get_ident(), []

    def pause(module, args, kwargs):
        if threading.get_ident() == owner and not done:
            done.append(True)
            paused_thread.set()
            resume.wait(PAUSE_S)

    return decoder_layers[0].register_forward_pre_hook(pause, with_kwargs=True)


def _second_while_first_is_paused(first, second, paused: threading.Event, resume: threading.Event) -> None:
    """``first`` in one thread and ``second`` in another: ``second`` runs once ``first`` says it is ``paused``, then
    sets ``resume`` to let it finish (each wait at most `PAUSE_S`)."""

    def run_second():
        paused.wait(PAUSE_S)
        second()
        resume.set()

    threads = [threading.Thread(target=first), threading.Thread(target=run_second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_dodo_compression_is_not_switched_to_theta_by_a_call_in_another_thread():
    """Thread 1 compresses (φ pass) and is paused inside it; thread 2 decodes with θ meanwhile. Before, thread 2's
    switch to θ was left active and thread 1's φ pass finished with θ: other nuggets, silently."""
    model = tiny_dodo()
    torch.manual_seed(1)
    context, prompt = torch.randint(3, 100, (2, 40)), torch.randint(3, 100, (1, 6))
    with torch.inference_mode():
        alone = model.compress(context)
        alone_logits = model(prompt).logits
    paused, resume, results = threading.Event(), threading.Event(), {}

    def compress():
        handle = _paused_at_first_layer(model, model.model.layers, paused, resume)
        try:
            with torch.inference_mode():
                results["nuggets"] = model.compress(context)
        finally:
            handle.remove()

    def decode():
        with torch.inference_mode():
            results["logits"] = model(prompt).logits

    _second_while_first_is_paused(compress, decode, paused, resume)
    for got, expected in zip(results["nuggets"].key_values, alone.key_values):
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    torch.testing.assert_close(results["nuggets"].all_scores, alone.all_scores, rtol=0, atol=0)
    torch.testing.assert_close(results["logits"], alone_logits, rtol=0, atol=0)


def test_vcc_t5_compression_info_of_generate_is_the_calls_own():
    """`generate(output_compression_info=True)` hooks the shared encoder for the duration of the call: before, an
    encoder run by another thread meanwhile was recorded too, and its compression info (another input's) returned."""
    from test_modeling_vcc_t5 import tiny_model as tiny_vcc

    torch.manual_seed(0)
    model = tiny_vcc()
    mine, other = torch.randint(3, 200, (1, 100)), torch.randint(3, 200, (2, 60))
    options = dict(max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_compression_info=True)
    with torch.inference_mode():
        alone = model.generate(mine, **options).encoder_compression_info
    paused, resume, results = threading.Event(), threading.Event(), {}

    def generate_with_info():
        handle = _paused_at_first_layer(model, model.encoder.block, paused, resume)
        try:
            with torch.inference_mode():
                results["info"] = model.generate(mine, **options).encoder_compression_info
        finally:
            handle.remove()

    def generate_other():
        with torch.inference_mode():
            model.generate(other, max_new_tokens=2, do_sample=False)

    _second_while_first_is_paused(generate_with_info, generate_other, paused, resume)
    assert results["info"].padded_length == alone.padded_length
    torch.testing.assert_close(results["info"].vip_sort_order, alone.vip_sort_order, rtol=0, atol=0)
    for got, expected in zip(results["info"].selection_scores, alone.selection_scores):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_dodo_assistant_of_another_configuration_drafts_from_its_own_nuggets_while_another_thread_generates():
    """generate() hands an assistant of another configuration the nuggets it compressed itself. Before, they were
    kept on the model for the call: a generate() of another thread meanwhile reset them, and the assistant got the
    main model's nuggets ("`nuggets` were produced by a model with another configuration")."""
    model = tiny_dodo()
    small = tiny_dodo(hidden_size=16, intermediate_size=32, num_hidden_layers=2, nugget_layer=1)
    torch.manual_seed(1)
    context, prompt = torch.randint(3, 100, (1, 30)), torch.randint(3, 100, (1, 6))
    options = dict(context_input_ids=context, max_new_tokens=6)
    with torch.inference_mode():
        alone = model.generate(prompt, assistant_model=small, **options)
    paused, resume, results, owner = threading.Event(), threading.Event(), {}, []

    def pausing_candidate_generator(*args, **kwargs):  # between generate()'s start and its assistant's setup
        if threading.get_ident() in owner:
            paused.set()
            resume.wait(PAUSE_S)
        return type(model)._get_candidate_generator(model, *args, **kwargs)

    def assisted():
        owner.append(threading.get_ident())
        try:
            with torch.inference_mode():
                results["assisted"] = model.generate(prompt, assistant_model=small, **options)
        except ValueError as error:
            results["assisted"] = error

    def other():
        with torch.inference_mode():
            model.generate(prompt, max_new_tokens=2)

    model._get_candidate_generator = pausing_candidate_generator
    _second_while_first_is_paused(assisted, other, paused, resume)
    assert not isinstance(results["assisted"], ValueError), results["assisted"]
    assert torch.equal(results["assisted"], alone)


# ---------------------------------------------------------------------------------------------------------------------
# Stress: a thread pool shares one model; every call is compared with the same call made alone
# ---------------------------------------------------------------------------------------------------------------------

THREADS, CALLS = 4, 12


def _random_calls(vocab: int, count: int, lengths: tuple[int, int], seed: int = 0):
    """``count`` (ids, mask, prompt length) of random lengths and batch sizes 1-3, rows after the first right-padded."""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    calls = []
    for _ in range(count):
        batch, length = rng.randint(1, 3), rng.randint(*lengths)
        ids = torch.randint(3, vocab, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        for row in range(1, batch):
            mask[row, rng.randint(length // 2, length):] = 0
        calls.append((ids, mask, rng.randint(2, 6)))
    return calls


def _shared_by_threads(run, calls, rounds: int = 2):
    """Each call's result alone, then from `THREADS` threads at once (``rounds`` times): every one must be equal."""
    alone = [run(call) for call in calls]
    for _ in range(rounds):
        with ThreadPoolExecutor(THREADS) as pool:
            shared = list(pool.map(run, calls))
        for index, (expected, got) in enumerate(zip(alone, shared)):
            for name in expected:
                assert torch.equal(expected[name], got[name]), f"call {index}: `{name}` differs from the call alone"


def _seq2seq_run(model):
    def run(call):
        ids, mask, _ = call
        with torch.inference_mode():
            decoder_ids = torch.zeros(ids.shape[0], 3, dtype=torch.long)
            logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
            generated = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        return {"logits": logits, "generated": generated}

    return run


def test_locost_shared_by_threads():
    from test_modeling_locost import tiny_config

    from longreach import LocostForConditionalGeneration

    torch.manual_seed(0)
    model = LocostForConditionalGeneration(tiny_config(encoder_chunk_length=64)).eval()
    # more lengths than the kernel cache holds (2): threads fill and evict it while others read it
    _shared_by_threads(_seq2seq_run(model), _random_calls(99, CALLS, (5, 200)))


def test_vcc_t5_shared_by_threads():
    from test_modeling_vcc_t5 import tiny_model as tiny_vcc

    torch.manual_seed(0)
    _shared_by_threads(_seq2seq_run(tiny_vcc()), _random_calls(200, CALLS, (5, 120)))


def test_dodo_shared_by_threads():
    model = tiny_dodo()

    def run(call):
        ids, mask, prompt_length = call
        prompt = ids[:, :prompt_length]
        with torch.inference_mode():
            logits = model(input_ids=prompt, context_input_ids=ids, context_attention_mask=mask).logits
            generated = model.generate(prompt, context_input_ids=ids, context_attention_mask=mask, max_new_tokens=4,
                                       do_sample=False, pad_token_id=0)
            plain = model(input_ids=prompt).logits  # θ alone, no nuggets
        return {"logits": logits, "generated": generated, "plain": plain}

    _shared_by_threads(run, _random_calls(100, CALLS, (10, 60)))


@pytest.mark.parametrize("name", ["locost", "vcc_t5", "dodo_llama"])
def test_summarization_pipeline_shared_by_threads(name):
    import warnings

    from test_workflows_vcc_t5_dodo import llama_word_tokenizer, tiny_dodo as tiny_pipeline_dodo, tiny_vcc
    from transformers import pipeline
    from workflow_helpers import document, tiny_locost, word_tokenizer

    model, tokenizer = {"locost": (tiny_locost, word_tokenizer), "vcc_t5": (tiny_vcc, word_tokenizer),
                        "dodo_llama": (tiny_pipeline_dodo, llama_word_tokenizer)}[name]
    summarizer = pipeline("long-summarization", model=model(), tokenizer=tokenizer())
    rng = random.Random(0)
    calls = []
    for _ in range(8):
        documents = [document(rng.randint(20, 150), offset=rng.randint(0, 50)) for _ in range(rng.randint(1, 3))]
        options = {"max_new_tokens": rng.randint(3, 6), "num_beams": rng.choice([1, 2])}
        if len(documents) > 1 and rng.random() < 0.5:
            options["batch_size"] = 2
        calls.append((documents, options))

    def run(call):
        documents, options = call
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            records = summarizer(documents, return_tensors=True, **options)
        return {f"{row}": torch.as_tensor(record["summary_token_ids"]) for row, record in enumerate(records)}

    _shared_by_threads(run, calls)


def test_dodo_forward_still_compiles_as_one_graph():
    """The per-model lock cannot be traced by ``torch.compile``: ``fullgraph=True`` of a θ pass (which compiled as one
    graph before the lock) failed with "Unsupported context manager". Inside a compiled graph the lock is not taken."""
    model = tiny_dodo().eval()
    torch.manual_seed(1)
    prompt = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        expected = model(prompt).logits
        compiled = torch.compile(model.forward, backend="eager", fullgraph=True)(prompt).logits
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)
