"""The three models on a CUDA device (skipped where there is none, as transformers' `@require_torch_accelerator` tests
are): float32 outputs equal the CPU's, a training step and `generate()` run in float32 and bfloat16 with no operation on
a CPU tensor, a decoding step after the first never waits for the device, and `from_pretrained(device_map="cuda",
dtype=torch.bfloat16)` keeps LOCOST's SSM parameters in float32.

"Waits for the device" is what `torch.cuda.set_sync_debug_mode` reports: reading a value back (`.item()`, `bool()`,
`nonzero`), and any copy between host and device that is not `non_blocking`. The CPU suite counts the first kind on a
CPU (`test_model_contract.py`); only a GPU shows the second.
"""

from __future__ import annotations

import os
import traceback
import warnings

import pytest
import torch
import transformers.generation
from test_model_contract import KINDS, ModelTester, transformers_peer
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16]


# Frames are told apart by the packages' own folders, not by a folder name in their path: in a virtual environment at
# /opt/torch/.venv every installed package's path holds "/torch/".
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
GENERATION_DIR = os.path.dirname(transformers.generation.__file__) + os.sep


class CPUTensorOps(TorchDispatchMode):
    """The ops that read or write a CPU tensor holding data (a 0-d CPU tensor is a scalar that CUDA kernels take by
    value; an empty one moves nothing), each as ``"op at file:line"`` of the innermost caller outside torch.
    ``ours()``: all but those of transformers' generation loop itself (its beam search builds a mask on the CPU)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" and t.dim() > 0 and t.numel() > 0 for t in tensors):
            callers = [frame for frame in traceback.extract_stack()[:-1]
                       if not frame.filename.startswith(TORCH_DIR) and frame.filename != __file__]
            where = f"{callers[-1].filename}:{callers[-1].lineno}" if callers else "?"
            self.ops.append(f"{func._overloadpacket.__name__} at {where}")
        return out

    def ours(self) -> list[str]:
        return [op for op in self.ops if f" at {GENERATION_DIR}" not in op]


def on_cuda(tester: ModelTester, dtype=torch.float32):
    model = tester.model.to(device="cuda", dtype=dtype)
    inputs = {name: tensor.cuda() for name, tensor in tester.inputs().items()}
    return model, inputs


def training_inputs(tester: ModelTester, inputs: dict) -> dict:
    inputs = dict(inputs)
    if tester.is_seq2seq:
        inputs["labels"] = torch.randint(3, tester.vocab_size, (2, 4), device="cuda")
    else:
        inputs["labels"] = inputs["input_ids"]
    return inputs


@pytest.fixture(params=KINDS)
def tester(request) -> ModelTester:
    return ModelTester(request.param)


def test_float32_outputs_equal_the_cpu(tester):
    inputs = training_inputs(tester, {k: v.cuda() for k, v in tester.inputs().items()})
    with torch.no_grad():
        cpu = tester.model(**{k: v.cpu() for k, v in inputs.items()})
        model, _ = on_cuda(tester)
        cuda = model(**inputs)
    assert cuda.logits.device.type == "cuda"
    torch.testing.assert_close(cuda.logits.cpu(), cpu.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cuda.loss.cpu(), cpu.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_step_runs_no_op_on_the_cpu(tester, dtype):
    model, inputs = on_cuda(tester, dtype)
    model.train()
    inputs = training_inputs(tester, inputs)
    with CPUTensorOps() as recorder:
        loss = model(**inputs).loss
        loss.backward()
    assert recorder.ops == [], f"{tester.kind}: ops on CPU tensors in a training step: {sorted(set(recorder.ops))}"
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # Dodo: the adapters of the roles that ran
    assert grads and all(g.device.type == "cuda" and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("num_beams", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decoding_steps_run_on_the_device_without_waiting_for_it(tester, dtype, num_beams):
    # Every model call of generate() after the first (the prefill / encoder / compression) runs with the sync debug
    # mode on "error": a read-back or a blocking host<->device copy inside it raises.
    model, inputs = on_cuda(tester, dtype)
    calls = []

    def before(module, args, kwargs):
        calls.append(1)
        if len(calls) > 1:
            torch.cuda.set_sync_debug_mode("error")

    def after(module, args, kwargs, output):
        torch.cuda.set_sync_debug_mode("default")

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad(), CPUTensorOps() as recorder:
            out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=num_beams)
    finally:
        for hook in hooks:
            hook.remove()
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) >= 6 and out.device.type == "cuda"
    assert recorder.ours() == [], f"{tester.kind}: ops on CPU tensors in generate(): {sorted(set(recorder.ours()))}"


def test_generate_syncs_per_step_no_more_than_transformers_models(tester):
    """All of generate()'s syncs (its own per-step check included), per new token, as sync debug warnings."""

    def syncs_per_new_token(model, inputs):
        counts = []
        for new_tokens in (4, 12):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        return (counts[1] - counts[0]) / 8

    model, inputs = on_cuda(tester)
    peer = transformers_peer(tester).cuda()
    ours = syncs_per_new_token(model, inputs)
    theirs = syncs_per_new_token(peer, {"input_ids": inputs["input_ids"]})
    print(f"{tester.kind}: {ours} syncs per decoding step; transformers' {type(peer).__name__}: {theirs}")
    assert theirs >= 1  # generate()'s own check is seen
    assert ours <= theirs


def test_from_pretrained_to_cuda_in_bfloat16(tester, tmp_path):
    tester.model.save_pretrained(tmp_path)
    auto = AutoModelForSeq2SeqLM if tester.is_seq2seq else AutoModelForCausalLM
    model = auto.from_pretrained(tmp_path, device_map="cuda", dtype=torch.bfloat16).eval()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    ssm = [module for name, module in model.named_modules() if name.endswith("ssm.conv")]
    assert all(p.dtype == torch.float32 for module in ssm for p in module.parameters())  # kept in float32
    if tester.kind == "locost":
        assert ssm
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    inputs = {name: tensor.cuda() for name, tensor in tester.inputs().items()}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.device.type == "cuda" and out.shape[0] == 2


class MatrixProducts(TorchDispatchMode):
    """The operand dtypes of every matrix product (mm, addmm, bmm and their in-place forms) dispatched inside."""

    PRODUCTS = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}

    def __init__(self):
        super().__init__()
        self.operands: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in self.PRODUCTS:
            self.operands.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_feed_forward_weight_gradients_use_half_precision_products(monkeypatch, dtype):
    # The training path of the gated feed-forward sublayer (`_GatedFeedForwardFunction`) sums its weight gradients in
    # float32 over steps of a few positions. On CUDA every product of its backward pass takes the half-precision
    # operands (the tensor cores, with a float32 result where it is summed), none converted to float32 first, and the
    # gradients are the modules' up to rounding.
    import longreach.modeling.t5_blocks as t5_blocks
    from transformers import T5Config

    torch.manual_seed(0)
    config = T5Config(d_model=64, d_ff=128, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    layer = t5_blocks.T5LayerFF(config).to(device="cuda", dtype=dtype).train()
    x = torch.randn(2, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    monkeypatch.setattr(t5_blocks, "ACCELERATOR_FEED_FORWARD_STEP_ELEMENTS", 128 * 64)  # 64 positions a step: 10 steps

    def step(fused: bool):
        monkeypatch.setattr(t5_blocks.T5LayerFF, "_fused_dropout_p",
                            original if fused else lambda self, hidden_states: None)
        x.grad = None
        layer.zero_grad()
        out = layer(x)
        with MatrixProducts() as products:
            out.backward(grad)
        return out, [x.grad] + [p.grad for p in layer.parameters()], products.operands

    original = t5_blocks.T5LayerFF._fused_dropout_p
    assert original(layer, x) == 0.0
    out, grads, operands = step(fused=True)
    expected, expected_grads, _ = step(fused=False)
    assert len(operands) >= 10 * 3  # the three weight gradients of every step
    assert all(set(dtypes) == {dtype} for _, dtypes in operands), operands
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "dodo"])  # the T5 decoder's attention
def test_float32_decoding_steps_attend_with_matrix_products(monkeypatch, kind):
    # With sdpa, a float32 decoding step (one query) on CUDA runs the eager function (sdpa's float32 kernel is slow
    # for one query: see t5_blocks._one_float32_query_on_cuda); longer queries keep sdpa, and the logits equal those
    # of the same model with eager attention.
    import longreach.modeling.t5_blocks as t5_blocks

    tester = ModelTester(kind)
    model, inputs = on_cuda(tester, torch.float32)
    assert model.config._attn_implementation == "sdpa"
    query_lengths = []
    eager = t5_blocks.eager_attention_forward

    def spy(module, query, *args, **kwargs):
        query_lengths.append(query.shape[-2])
        return eager(module, query, *args, **kwargs)

    monkeypatch.setattr(t5_blocks, "eager_attention_forward", spy)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        start = torch.full((inputs["input_ids"].shape[0], 1), model.config.decoder_start_token_id, device="cuda")
        step = model(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"], decoder_input_ids=start)
        assert query_lengths and set(query_lengths) == {1}  # the decoder's self- and cross-attention, one query each
        query_lengths.clear()
        longer = model(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"],
                       decoder_input_ids=start.repeat(1, 3))
        assert 3 not in query_lengths  # three decoder queries: sdpa
        model.set_attn_implementation("eager")
        reference = model(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"],
                          decoder_input_ids=start)
        reference_longer = model(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"],
                                 decoder_input_ids=start.repeat(1, 3))
    torch.testing.assert_close(step.logits, reference.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(longer.logits, reference_longer.logits, atol=1e-5, rtol=1e-5)
