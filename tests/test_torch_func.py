"""``torch.func`` on LOCOST and VCC-T5, as on transformers' T5: ``functional_call`` + ``grad`` (a loss as a function
of a parameter dict), ``vmap`` over a batch of inputs and per-sample gradients (``vmap(grad(...))``).

A dict that replaces ``shared.weight`` replaces it for the call only, everywhere the embedding is read (encoder, decoder
and tied LM head), and leaves the model's own embedding in place, as for T5: a model serves any number of calls.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

from longreach import LocostConfig, LocostForConditionalGeneration, VCCT5Config, VCCT5ForConditionalGeneration
from longreach.modeling import ssm
from longreach.modeling.input_checks import check_token_ids

VOCAB = 99


def tiny_locost() -> LocostForConditionalGeneration:
    return LocostForConditionalGeneration(LocostConfig(
        vocab_size=VOCAB, d_model=32, d_state=8, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0))


def tiny_vcc_t5() -> VCCT5ForConditionalGeneration:
    # no random exploration in training (a random op: vmap would need `randomness=`), every token a VIP token
    return VCCT5ForConditionalGeneration(VCCT5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.0, num_vanilla_layers=1, segment_length=8, num_vip_slots=4,
        block_size=2, num_refined_blocks=2, exploration_probability=0.0))


MODELS = {"locost": tiny_locost, "vcc_t5": tiny_vcc_t5}


def fresh(name: str, training: bool, state: dict | None = None):
    torch.manual_seed(0)
    model = MODELS[name]()
    if state is not None:
        model.load_state_dict(state)
    return model.train(training)


def batch(size: int = 3, length: int = 24):
    torch.manual_seed(1)
    return torch.randint(3, VOCAB, (size, length)), torch.randint(3, VOCAB, (size, 5))


def loss_of(model):
    """The loss as a function of a parameter dict and one batch (``tie_weights=True``, as for T5)."""
    def loss(params, input_ids, labels):
        return functional_call(model, params, (), {"input_ids": input_ids, "labels": labels}, tie_weights=True).loss
    return loss


def detached_parameters(model) -> dict:
    return {name: parameter.detach() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_grad_of_functional_call_equals_backward(name, training):
    input_ids, labels = batch()
    model = fresh(name, training)
    model(input_ids=input_ids, labels=labels).loss.backward()
    expected = {key: parameter.grad for key, parameter in model.named_parameters()}
    model = fresh(name, training, model.state_dict())
    gradients = grad(loss_of(model))(detached_parameters(model), input_ids, labels)
    assert gradients.keys() == expected.keys()
    for key, value in gradients.items():
        torch.testing.assert_close(value, expected[key], atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_with_vmap_of_grad_equal_a_loop(name, training):
    input_ids, labels = batch()
    model = fresh(name, training)
    expected = []
    for row in range(input_ids.shape[0]):
        model.zero_grad(set_to_none=True)
        model(input_ids=input_ids[row:row + 1], labels=labels[row:row + 1]).loss.backward()
        expected.append({key: parameter.grad.clone() for key, parameter in model.named_parameters()})
    model = fresh(name, training, model.state_dict())
    loss = loss_of(model)
    per_sample = vmap(grad(lambda params, ids, target: loss(params, ids[None], target[None])),
                      in_dims=(None, 0, 0))(detached_parameters(model), input_ids, labels)
    for row, row_expected in enumerate(expected):
        for key, value in per_sample.items():
            torch.testing.assert_close(value[row], row_expected[key], atol=1e-5, rtol=1e-5, msg=f"{key}, row {row}")


@pytest.mark.parametrize("name", list(MODELS))
def test_vmap_over_a_batch_of_inputs_equals_a_loop(name):
    input_ids, labels = batch()
    model = fresh(name, training=False)
    with torch.no_grad():
        expected = torch.stack([model(input_ids=input_ids[row:row + 1], labels=labels[row:row + 1]).logits[0]
                                for row in range(input_ids.shape[0])])
    model = fresh(name, False, model.state_dict())
    params = detached_parameters(model)

    def logits(ids, target):
        return functional_call(model, params, (), {"input_ids": ids[None], "labels": target[None]},
                               tie_weights=True).logits[0]

    torch.testing.assert_close(vmap(logits)(input_ids, labels), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_vmap_over_an_ensemble_of_stacked_models_equals_a_loop(name, training):
    """``stack_module_state`` + ``vmap`` over the parameters (a model ensemble): LOCOST's SSM kernel wrote its powers
    into buffers (``out=``, which ``vmap`` cannot batch), and in eval mode its kernel cache would keep a spectrum made
    from the stacked parameters, which escapes the transform."""
    input_ids, labels = batch()
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(MODELS[name]().train(training))
    params, buffers = stack_module_state(models)
    params = {key: value.detach() for key, value in params.items()}
    base = MODELS[name]().train(training)

    def logits(params, buffers):
        return functional_call(base, (params, buffers), (), {"input_ids": input_ids, "labels": labels}).logits

    with torch.no_grad():
        expected = torch.stack([model(input_ids=input_ids, labels=labels).logits for model in models])
        for _ in range(2):  # the second call on the same base model too (it was 5 off)
            torch.testing.assert_close(vmap(logits)(params, buffers), expected, atol=1e-5, rtol=1e-5)
    conv = next(module for module in base.modules() if isinstance(module, ssm.BidirectionalS4DConvolution)
                ) if name == "locost" else None
    assert conv is None or conv.kernel_cache_nbytes() == 0


@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", list(MODELS))
def test_functional_call_replacing_the_shared_embedding_leaves_the_model_as_it_was(name, tie_weights):
    """The encoder's and decoder's ``embed_tokens`` are ``shared``: listed under three names, that one module was
    swapped three times by ``functional_call`` and restored in the wrong order (pytorch/pytorch#164759), which left the
    replacement in the model for good, untied from its LM head, so that the next call computed with the old head
    (`T5Seq2SeqLMMixin.named_modules` lists it once). ``shared.weight`` replaces the embedding everywhere it is read;
    with ``tie_weights=False`` the LM head keeps its own weight."""
    input_ids, labels = batch()
    model = fresh(name, training=False)
    embedding = model.shared.weight
    replacement = torch.randn_like(embedding)
    with torch.no_grad():
        before = model(input_ids=input_ids, labels=labels).logits
        replaced = fresh(name, False, model.state_dict())
        if not tie_weights:
            replaced.config.tie_word_embeddings = False
            replaced.lm_head.weight = torch.nn.Parameter(embedding.clone())
        replaced.shared.weight.copy_(replacement)  # the encoder, the decoder (and the tied head) read it
        expected = replaced(input_ids=input_ids, labels=labels).logits
        for _ in range(2):  # the second call on the same model too
            logits = functional_call(model, {"shared.weight": replacement}, (),
                                     {"input_ids": input_ids, "labels": labels}, tie_weights=tie_weights).logits
            torch.testing.assert_close(logits, expected)
        after = model(input_ids=input_ids, labels=labels).logits
    for module in (model.shared, model.encoder.embed_tokens, model.decoder.embed_tokens, model.lm_head):
        assert module.weight is embedding
    assert torch.equal(after, before)


def test_per_sample_gradients_are_the_same_from_one_call_to_the_next():
    """A per-sample-gradient loop (as DP-SGD runs one per batch) on one LOCOST model: the second call's gradients
    equal the first's (the embedding's were 0.035 off)."""
    input_ids, labels = batch()
    model = fresh("locost", training=False)
    params = detached_parameters(model)
    gradients = [grad(loss_of(model))(params, input_ids, labels) for _ in range(2)]
    for key in gradients[0]:
        assert torch.equal(gradients[1][key], gradients[0][key]), key


def test_the_token_range_check_is_skipped_under_vmap_and_kept_outside():
    ids = torch.tensor([[3, 4], [5, 6]])
    # under vmap the ids are batched: their values cannot be read (the check used to fail inside vmap)
    sums = vmap(lambda row: (check_token_ids("input_ids", row[None], vocab_size=VOCAB), row.sum())[1])(ids)
    assert sums.tolist() == [7, 11]
    # under grad alone the values are readable, and checked
    with pytest.raises(ValueError, match=r"`input_ids` holds the token id 100"):
        grad(lambda x: (check_token_ids("input_ids", torch.tensor([[100]]), vocab_size=VOCAB), x.sum())[1])(
            torch.ones(2))


def test_second_order_through_the_ssm_is_still_refused_under_torch_func():
    """``torch.func.grad`` runs backward passes with ``create_graph=True``: one ``grad`` works (above), a ``grad`` of
    ``grad`` would drop the SSM parameters' second-order terms, and is refused as with ``create_graph=True``."""
    conv = ssm.BidirectionalS4DConvolution(3, 4)
    x = torch.randn(2, 7, 3)
    params = detached_parameters(conv)

    def energy(x):
        return functional_call(conv, params, (x,)).pow(2).sum()

    assert grad(energy)(x).shape == x.shape
    with pytest.raises(RuntimeError, match=r"Second-order gradients .* are not supported"):
        grad(lambda x: grad(energy)(x).pow(2).sum())(x)


@pytest.mark.parametrize("name", list(MODELS))
def test_functional_call_on_a_parametrized_shared_embedding_leaves_the_model_as_it_was(name):
    """With a parametrization on the shared embedding (`torch.nn.utils.parametrize`, as torch's pruning adds), its
    ``original`` was still listed under the encoder's and decoder's names (the submodules of ``embed_tokens``), so that
    ``functional_call`` left the replacement in the model: the second call and later ones computed with it."""
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    input_ids, labels = batch()
    model = fresh(name, training=False)
    parametrize.register_parametrization(model.shared, "weight", Doubled())
    original = model.shared.parametrizations.weight.original
    replacement = torch.randn_like(original)
    with torch.no_grad():
        before = model(input_ids=input_ids, labels=labels).logits
        calls = [functional_call(model, {"shared.parametrizations.weight.original": replacement}, (),
                                 {"input_ids": input_ids, "labels": labels}).logits for _ in range(2)]
        after = model(input_ids=input_ids, labels=labels).logits
    assert not torch.allclose(calls[0], before)
    torch.testing.assert_close(calls[1], calls[0])
    assert model.encoder.embed_tokens.parametrizations.weight.original is original
    assert torch.equal(after, before)
