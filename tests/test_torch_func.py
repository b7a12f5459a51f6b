"""``torch.func`` on LOCOST and VCC-T5, as on transformers' T5: ``functional_call`` + ``grad`` (a loss as a function
of a parameter dict), ``vmap`` over a batch of inputs and per-sample gradients (``vmap(grad(...))``).

The encoder's and decoder's ``embed_tokens`` are ``shared``: with ``tie_weights=True`` torch swaps that one module under
its three names and restores it in the wrong order (pytorch/pytorch#164759), so a model serves one such call; calls
that pass the LM head's name too (``with_tied_head``) with ``tie_weights=False`` serve any number, as the README says.
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


def with_tied_head(params: dict) -> dict:
    """``params`` and the tied LM head's name for the shared embedding's value: with ``tie_weights=False`` each of the
    two modules is swapped once and restored (the README's way to call a model more than once)."""
    return {**params, "lm_head.weight": params["shared.weight"]}


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
        return functional_call(base, (with_tied_head(params), buffers), (), {"input_ids": input_ids, "labels": labels},
                               tie_weights=False).logits

    with torch.no_grad():
        expected = torch.stack([model(input_ids=input_ids, labels=labels).logits for model in models])
        for _ in range(2):  # the second call on the same base model too
            torch.testing.assert_close(vmap(logits)(params, buffers), expected, atol=1e-5, rtol=1e-5)
    conv = next(module for module in base.modules() if isinstance(module, ssm.BidirectionalS4DConvolution)
                ) if name == "locost" else None
    assert conv is None or conv.kernel_cache_nbytes() == 0


@pytest.mark.parametrize("head", ["with_tied_head", "embedding_only"])
@pytest.mark.parametrize("name", list(MODELS))
def test_functional_call_without_tie_weights_leaves_the_model_as_it_was(name, head):
    """``tie_weights=False``: each name given is swapped once and restored, call after call. With the LM head's name
    too, the replacement is read everywhere the embedding is (encoder, decoder, head); with ``shared.weight`` alone,
    the head keeps its own weight."""
    input_ids, labels = batch()
    model = fresh(name, training=False)
    embedding = model.shared.weight
    replacement = torch.randn_like(embedding)
    params = {"shared.weight": replacement}
    with torch.no_grad():
        before = model(input_ids=input_ids, labels=labels).logits
        replaced = fresh(name, False, model.state_dict())
        if head == "embedding_only":
            replaced.config.tie_word_embeddings = False
            replaced.lm_head.weight = torch.nn.Parameter(embedding.clone())
        replaced.shared.weight.copy_(replacement)  # the encoder, the decoder (and the tied head) read it
        expected = replaced(input_ids=input_ids, labels=labels).logits
        for _ in range(2):  # the second call on the same model too
            logits = functional_call(model, with_tied_head(params) if head == "with_tied_head" else params, (),
                                     {"input_ids": input_ids, "labels": labels}, tie_weights=False).logits
            torch.testing.assert_close(logits, expected)
        after = model(input_ids=input_ids, labels=labels).logits
    for module in (model.shared, model.encoder.embed_tokens, model.decoder.embed_tokens, model.lm_head):
        assert module.weight is embedding
    assert torch.equal(after, before)


def test_per_sample_gradients_are_the_same_from_one_call_to_the_next():
    """A per-sample-gradient loop (as DP-SGD runs one per batch) on one LOCOST model, called as the README says: the
    second call's gradients equal the first's, and the first's equal those of ``tie_weights=True`` on a fresh model."""
    input_ids, labels = batch()
    model = fresh("locost", training=False)
    params = detached_parameters(model)

    def loss(params, input_ids, labels):
        return functional_call(model, with_tied_head(params), (), {"input_ids": input_ids, "labels": labels},
                               tie_weights=False).loss

    gradients = [grad(loss)(params, input_ids, labels) for _ in range(2)]
    reference = grad(loss_of(fresh("locost", training=False)))(params, input_ids, labels)
    for key in gradients[0]:
        assert torch.equal(gradients[1][key], gradients[0][key]), key
        torch.testing.assert_close(gradients[0][key], reference[key], rtol=1e-6, atol=1e-8)


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
