"""The S4D convolution's inference kernel cache: reuse, invalidation, bounds, and unchanged outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from longreach.modeling import ssm
from longreach.modeling.ssm import BidirectionalS4DConvolution


def counting_conv(**kwargs) -> tuple[BidirectionalS4DConvolution, list[int]]:
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(8, 8, **kwargs).eval()
    calls = []
    compute = conv.kernel

    def kernel(length, channels=slice(None)):
        calls.append(length)
        return compute(length, channels)

    conv.kernel = kernel
    return conv, calls


def test_repeated_forwards_compute_the_kernel_once_and_match_the_uncached_path():
    conv, calls = counting_conv()
    x = torch.randn(2, 12, 8)
    with torch.no_grad():
        first = conv(x)
        second = conv(x)
        conv.kernel_cache_lengths = 0  # off: the reference path
        reference = conv(x)
    assert calls == [12, 12]
    assert torch.equal(first, reference) and torch.equal(second, reference)


def test_channel_groups_of_a_long_input_share_the_cached_kernel():
    conv, calls = counting_conv()
    x = torch.randn(2, 12, 8)
    with torch.no_grad():
        reference = conv(x)  # computes and caches the spectrum of all channels
        grouped = conv.convolve_in_channel_groups_(x.clone(), group=3)
        conv.clear_kernel_cache()
        conv.kernel_cache_bytes = 0  # off: each group computes its own channels' kernel
        uncached = conv.convolve_in_channel_groups_(x.clone(), group=3)
    assert calls == [12, 12, 12, 12]  # 1 for the cached spectrum, then 3 groups of 3, 3, 2 channels
    torch.testing.assert_close(grouped, reference, atol=1e-6, rtol=0)
    torch.testing.assert_close(uncached, reference, atol=1e-6, rtol=0)


def test_other_lengths_recompute_and_the_lru_keeps_the_most_recent():
    conv, calls = counting_conv(kernel_cache_lengths=2)
    with torch.no_grad():
        for length in (5, 6, 5, 7, 6, 5):
            conv(torch.randn(1, length, 8))
    # 5, 6 computed; 5 hit; 7 evicts 6; 6 evicts 5; 5 recomputed
    assert calls == [5, 6, 7, 6, 5]
    assert sorted(key[0] for key in conv._kernel_cache) == [5, 6]


def test_byte_cap_bounds_the_cache():
    one_spectrum = 8 * (2 * 16 // 2 + 1) * 8  # H · (L+1) complex64 at L = 16
    conv, calls = counting_conv(kernel_cache_lengths=10, kernel_cache_bytes=one_spectrum)
    with torch.no_grad():
        conv(torch.randn(1, 16, 8))
        conv(torch.randn(1, 15, 8))
        assert conv.kernel_cache_nbytes() <= one_spectrum and len(conv._kernel_cache) == 1
        conv(torch.randn(1, 40, 8))  # larger than the cap: never kept
        conv(torch.randn(1, 40, 8))
    assert calls == [16, 15, 40, 40]
    assert conv.kernel_cache_nbytes() <= one_spectrum


@pytest.mark.parametrize("edit", ["in_place", "load_state_dict", "train", "grad_enabled"])
def test_parameter_changes_and_training_invalidate(edit):
    conv, calls = counting_conv()
    x = torch.randn(1, 10, 8)
    with torch.no_grad():
        conv(x)
    if edit == "in_place":
        with torch.no_grad():
            conv.log_dt.add_(0.1)
    elif edit == "load_state_dict":
        state = {name: value.clone() for name, value in conv.state_dict().items()}
        state["A_imag"] += 0.5
        conv.load_state_dict(state)
    elif edit == "train":
        conv.train()
    if edit == "grad_enabled":  # eval, but autograd needs the kernel's graph: computed, not cached
        out = conv(x)
        out.sum().backward()
        assert conv.log_dt.grad is not None
        with torch.no_grad():
            conv(x)
        assert calls == [10, 10]  # cached, then computed for autograd (whose backward pass has its own function)
        return
    with torch.no_grad():
        out = conv(x)
    assert calls == [10, 10]
    conv.kernel_cache_lengths = 0
    with torch.no_grad():
        assert torch.equal(out, conv(x))  # the fresh kernel, not the stale one
    if edit == "train":
        assert conv._cacheable() is False


@pytest.mark.parametrize("edit", ["data_copy", "ema"])
def test_parameter_changes_through_data_invalidate(edit):
    """``p.data`` shares the storage but not the version counter: such edits (``p.data.copy_``, EMA's
    ``p.data.mul_(d).add_(q.data)``) are caught by comparing the parameters with the cache's copy of them."""
    conv, calls = counting_conv()
    other = BidirectionalS4DConvolution(8, 8).eval()
    x = torch.randn(1, 10, 8)
    with torch.no_grad():
        conv(x)
        for parameter, new in zip(conv.parameters(), other.parameters()):
            if edit == "data_copy":
                parameter.data.copy_(new.data)
            else:
                parameter.data.mul_(0.0).add_(new.data)
        out = conv(x)
        assert calls == [10, 10]
        assert torch.equal(out, other(x))


def test_off_the_cpu_the_cache_is_checked_without_reading_values_back():
    """On an accelerator a value comparison would make the host wait for the device at every layer: there the cache is
    checked against the parameters' storage and version counter (the meta device stands for one here)."""
    conv = BidirectionalS4DConvolution(8, 8).to("meta")
    snapshot = conv._kernel_snapshot()
    assert all(isinstance(entry, tuple) for entry in snapshot)
    conv._kernel_cache_parameters = snapshot
    assert conv._kernel_cache_matches(slice(None))
    with torch.no_grad():
        conv.log_dt.add_(1.0)  # an in-place edit moves the version counter
    assert not conv._kernel_cache_matches(slice(None))
    cpu_conv = BidirectionalS4DConvolution(8, 8)
    assert all(isinstance(entry, torch.Tensor) for entry in cpu_conv._kernel_snapshot())


def test_off_the_cpu_a_new_tensor_at_the_cached_address_misses_the_cache():
    """From an audit: on CUDA, ``functional_call`` in a loop with a parameter dict built anew for each call (a model
    soup's mixing weights) got the first call's kernel: the caching allocator gave the new tensors the freed ones'
    addresses, and they start at version 0. The meta device (every address 0) stands for that reuse here."""
    conv = BidirectionalS4DConvolution(8, 8).to("meta")
    conv._kernel_cache_parameters = conv._kernel_snapshot()
    assert conv._kernel_cache_matches(slice(None))
    new = nn.Parameter(torch.empty_like(conv.log_dt))
    assert (new.data_ptr(), new._version) == (conv.log_dt.data_ptr(), conv.log_dt._version)
    conv.log_dt = new
    assert not conv._kernel_cache_matches(slice(None))


def test_channel_groups_compare_only_their_channels_with_the_cache():
    conv, calls = counting_conv()
    x = torch.randn(1, 10, 8)
    with torch.no_grad():
        conv(x)
        conv.log_dt.data[5] += 0.1  # only channel 5's kernel changes
        conv.kernel_spectrum(10, 20, slice(0, 4))
        assert calls == [10]  # channels 0-3: still the cached rows
        conv.kernel_spectrum(10, 20, slice(4, 8))
        assert calls == [10, 10]  # channels 4-7: recomputed, for all channels
        grouped = conv.convolve_in_channel_groups_(x.clone(), group=4)
        assert calls == [10, 10]
        conv.kernel_cache_lengths = 0  # off: the reference path
        torch.testing.assert_close(grouped, conv(x), atol=1e-6, rtol=0)


def direct_kernel(conv: BidirectionalS4DConvolution, length: int) -> torch.Tensor:
    """K_c[h, l] = 2·Re Σ_n Ĉ_chn exp(ΔA_hn·l), every power taken directly, in complex128."""
    dtA, C_hat = conv.discretized()
    lags = torch.arange(length, dtype=torch.float64)
    powers = torch.exp(dtA.to(torch.complex128)[:, :, None] * lags)
    return 2 * (C_hat.to(torch.complex128)[:, :, :, None] * powers).sum(2).real


@pytest.mark.parametrize("length", [1, 5, 64, 300])
def test_kernel_by_doubling_matches_direct_powers_with_and_without_autograd(length):
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(6, 16, kernel_chunk_size=16)
    weights = torch.randn(2, 6, length, dtype=torch.float64)
    reference = direct_kernel(conv, length)
    (reference * weights).sum().backward()
    reference_grads = [p.grad.clone() for p in (conv.C, conv.log_dt, conv.A_imag)]
    conv.zero_grad()
    kernel = conv.kernel(length)  # autograd: through the kernel's own backward pass (s4d_kernel_vjp)
    (kernel.double() * weights).sum().backward()
    with torch.no_grad():
        in_place = conv.kernel(length)  # no autograd: in place, channel blocks
    torch.testing.assert_close(kernel.double(), reference, atol=2e-6, rtol=0)
    torch.testing.assert_close(in_place, kernel.detach(), atol=1e-6, rtol=0)
    for parameter, expected in zip((conv.C, conv.log_dt, conv.A_imag), reference_grads):
        torch.testing.assert_close(parameter.grad, expected.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("channel_block, chunk_size, length", [(3, 16, 300), (8, 12, 100), (64, 256, 64)])
def test_the_kernels_own_backward_gives_the_gradients_of_direct_powers(monkeypatch, channel_block, chunk_size, length):
    """``s4d_kernel_vjp`` (the kernel's backward pass) against autograd through every power taken directly in
    complex128, for every SSM parameter: several channel blocks, a chunk that is not a power of two, one block."""
    monkeypatch.setattr(ssm, "KERNEL_CHANNEL_BLOCK", channel_block)
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(8, 8, kernel_chunk_size=chunk_size).train()
    weights = torch.randn(2, 8, length, dtype=torch.float64)
    (direct_kernel(conv, length) * weights).sum().backward()
    expected = [p.grad.clone() for p in conv.parameters() if p.grad is not None]
    conv.zero_grad()
    (conv.kernel(length).double() * weights).sum().backward()
    got = [p.grad for p in conv.parameters() if p.grad is not None]
    assert len(got) == len(expected) == 5  # C, B, inv_A_real, A_imag, log_dt
    for value, reference in zip(got, expected):
        torch.testing.assert_close(value, reference.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("channel_block", [3, 8])
def test_compiled_kernel_equals_eager_and_copies_no_complex_buffer(monkeypatch, channel_block):
    """Inside ``torch.compile`` the doubling concatenates its terms (``_geometric``): the kernel and its backward pass
    give eager mode's values bit for bit, and the traced graphs write no slice of a complex tensor. Such a write
    becomes a ``slice_scatter`` of the whole buffer, which inductor cannot do in place for complex tensors: on an H100
    those copies made LOCOST's compiled training step slower than its eager one."""
    monkeypatch.setattr(ssm, "KERNEL_CHANNEL_BLOCK", channel_block)  # several blocks on the CPU, one at 8 channels
    monkeypatch.setattr(ssm, "compiled_kernel_usable", lambda *args: False)  # eager: torch's ops, not the C kernel
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(8, 16, kernel_chunk_size=16).train()
    weights = torch.randn(2, 8, 300)

    def loss_and_grads(kernel_of):
        conv.zero_grad()
        kernel = kernel_of(300)
        (kernel * weights).sum().backward()
        return kernel.detach(), [p.grad.clone() for p in conv.parameters() if p.grad is not None]

    graphs = []

    def capture(graph, example_inputs):
        graphs.append(graph)
        return make_boxed_func(graph)

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    expected_kernel, expected_grads = loss_and_grads(conv.kernel)
    torch._dynamo.reset()
    kernel, grads = loss_and_grads(torch.compile(conv.kernel, backend=backend, fullgraph=True))
    assert torch.equal(kernel, expected_kernel)
    assert len(grads) == len(expected_grads) == 5
    assert all(torch.equal(got, want) for got, want in zip(grads, expected_grads))
    assert len(graphs) == 2  # forward and backward
    complex_writes = [node for graph in graphs for node in graph.graph.nodes
                      if node.target in (torch.ops.aten.slice_scatter.default, torch.ops.aten.copy_.default)
                      and node.meta["val"].is_complex()]
    assert not complex_writes, [node.format_node() for node in complex_writes]


@pytest.mark.parametrize("channels_per_block", [None, 1, 3])
@pytest.mark.parametrize("length, fft_size, kernel_length", [(7, 14, 7), (7, 16, 8), (12, 24, 12)])
def test_fft_convolution_backward_is_the_exact_adjoint(monkeypatch, length, fft_size, kernel_length,
                                                       channels_per_block):
    """The FFT convolution's own backward (x and the kernel spectrum kept) against finite differences, for the exact
    2L size and the authors' power-of-two size, with a batch sharing one kernel, in one block of channels or several
    (uneven); and its forward against the plain FFT product."""
    if channels_per_block is not None:
        monkeypatch.setattr(ssm, "FFT_BLOCK_ELEMENTS", 3 * fft_size * channels_per_block)  # batch 3
    torch.manual_seed(0)
    signal = torch.randn(3, 4, length, dtype=torch.float64, requires_grad=True)
    kernel = torch.randn(4, kernel_length, dtype=torch.float64, requires_grad=True)
    convolve = lambda x, k: ssm.fft_convolution(x, k, None, fft_size)  # noqa: E731
    assert torch.autograd.gradcheck(convolve, (signal, kernel))
    assert torch.autograd.gradcheck(lambda x: convolve(x, kernel.detach()), (signal,))
    assert torch.autograd.gradcheck(lambda k: convolve(signal.detach(), k), (kernel,))
    spectrum = torch.fft.rfft(kernel.detach(), n=fft_size)
    assert torch.autograd.gradcheck(lambda x: ssm.fft_convolution(x, None, spectrum, fft_size), (signal,))
    plain = torch.fft.irfft(torch.fft.rfft(signal, n=fft_size) * torch.fft.rfft(kernel, n=fft_size), n=fft_size)
    torch.testing.assert_close(convolve(signal, kernel), plain[..., :length], atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(convolve, (signal[0].detach().requires_grad_(), kernel))  # no batch dim


def test_a_training_forward_keeps_only_the_input_and_the_kernel_spectrum():
    """What autograd keeps for one convolution in training: its input, the kernel's spectrum, D, and ΔA [H, N/2] and
    Ĉ [2, H, N/2] for the kernel's own backward pass; not the padded input, the input's spectrum, the [H, 2L] kernel,
    the kernel's intermediates or the discretisation's (recomputed in the backward pass)."""
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(16, 8).train()
    extra = set()
    for batch, length in [(2, 64), (3, 256)]:
        x = torch.randn(batch, length, 16, requires_grad=True)
        kept = {}

        def pack(tensor):
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            conv(x)
        spectrum_bytes = 16 * (length + 1) * 8  # [H, L + 1] complex64
        extra.add(sum(kept.values()) - (x.numel() * 4 + spectrum_bytes + 16 * 4))
    mode_tensor_bytes = 16 * 4 * 8  # one [H, N/2] complex64
    assert extra == {3 * mode_tensor_bytes}  # ΔA and the two directions of Ĉ, whatever the length and batch


@pytest.mark.parametrize("bidirectional", [True, False])
def test_double_makes_the_convolution_float64_and_gradcheck_passes(bidirectional):
    """`.double()` is not blocked like `.half()`: parameters, kernel and FFT in float64 (the compiled CPU kernel is
    complex64 only: torch ops), exact enough for `torch.autograd.gradcheck` of the input and the parameters."""
    from torch.func import functional_call

    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(3, 4, bidirectional=bidirectional, kernel_chunk_size=2).double()
    assert {p.dtype for p in conv.parameters()} == {torch.float64} and conv.compute_dtype == torch.float64
    x = torch.randn(2, 7, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(conv, (x,))
    names = [name for name, _ in conv.named_parameters()]
    values = tuple(p.detach().clone().requires_grad_(True) for p in conv.parameters())
    assert torch.autograd.gradcheck(lambda *v: functional_call(conv, dict(zip(names, v)), (x.detach(),)), values)
    conv.eval()
    with torch.no_grad():  # the cached kernel and the channel groups of the long-input path
        torch.testing.assert_close(conv.convolve_in_channel_groups_(x.detach().clone(), group=2), conv(x))


def test_locost_runs_in_float64_and_float_returns_the_float32_model():
    from workflow_helpers import tiny_locost

    model = tiny_locost()
    input_ids = torch.randint(3, 99, (2, 40))
    decoder_input_ids = input_ids[:, :3]
    with torch.no_grad():
        expected = model(input_ids, decoder_input_ids=decoder_input_ids).logits
        model.double()
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        logits = model(input_ids, decoder_input_ids=decoder_input_ids).logits
        assert logits.dtype == torch.float64
        torch.testing.assert_close(logits, expected.double(), atol=1e-5, rtol=0)
        model.encoder.chunk_length = 16  # the chunked encoder too
        torch.testing.assert_close(model(input_ids, decoder_input_ids=decoder_input_ids).logits, logits)
        model.encoder.chunk_length = None
        model.float()
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert torch.equal(model(input_ids, decoder_input_ids=decoder_input_ids).logits, expected)
    model.double().half()  # from float64 too, half precision keeps the SSM parameters float32
    assert {p.dtype for name, p in model.named_parameters() if ".ssm.conv." in name} == {torch.float32}


def test_second_order_gradients_are_refused_not_silently_wrong():
    """The FFT convolution's and the kernel's backward passes are not differentiable themselves (the convolution's
    reads the kernel's spectrum outside the graph): a gradient penalty through the layer (`create_graph=True`, then a
    backward of the gradient) used to give the SSM parameters a zero or partial gradient without a word. A backward
    pass that would build such a graph is refused; first-order gradients are unchanged."""
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(3, 4).double().train()
    x = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 9, 3, dtype=torch.float64)
    message = r"Second-order gradients \(backward with create_graph=True\) .* are not supported"
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad((conv(x) * weights).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=message):  # the kernel's own backward too
        torch.autograd.grad(conv(x).sum(), [conv.log_dt], create_graph=True)
    (input_grad,) = torch.autograd.grad((conv(x) * weights).sum(), x)
    assert torch.isfinite(input_grad).all()


def test_the_kernel_cache_serves_several_threads():
    """From an audit: one model in eval mode serving four threads raised KeyError in the kernel cache (a lookup in
    one thread, an eviction in another); each thread now gets the single-threaded result."""
    import random
    import threading

    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(16, 8).eval()
    inputs = {length: torch.randn(1, length, 16) for length in (50, 60, 70, 80)}
    with torch.no_grad():
        expected = {length: conv(x) for length, x in inputs.items()}
    conv.kernel_cache_lengths = 2  # fewer than the lengths in use: lookups and evictions interleave
    failures = []

    def serve(seed: int) -> None:
        draw = random.Random(seed)
        try:
            with torch.no_grad():
                for _ in range(1500):
                    length = draw.choice(list(inputs))
                    if not torch.allclose(conv(inputs[length]), expected[length], atol=1e-5):
                        failures.append(f"wrong output at length {length}")
                        return
        except Exception as error:  # noqa: BLE001  reported below
            failures.append(repr(error))

    threads = [threading.Thread(target=serve, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.parametrize("bidirectional", [True, False])
def test_a_smooth_fft_size_gives_the_exact_convolution(monkeypatch, bidirectional):
    """From an audit: the FFT had exactly 2L points, several times slower where 2L has a large prime factor (65,537
    tokens: 2.3x on an H200). From `SMOOTH_FFT_FROM_LENGTH` on it has the next 5-smooth size >= 2L - 1, the anti-causal
    lags at its end: the same convolution, checked against a direct sum in float64 (outputs and gradients, cached
    and in channel groups), at lengths where the two sizes differ."""
    assert [ssm.exact_fft_size(n) for n in (8192, 8193, 65536, 65537)] == [16384, 16875, 131072, 131220]
    monkeypatch.setattr(ssm, "SMOOTH_FFT_FROM_LENGTH", 1)  # every length here takes the smooth size
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(3, 4, bidirectional=bidirectional, kernel_chunk_size=2).double()
    for length in (1, 2, 7, 13, 37):
        assert ssm.exact_fft_size(length) != 2 * length or length in (1, 2)
        x = torch.randn(2, length, 3, dtype=torch.float64, requires_grad=True)
        kernels = conv.kernel(length)  # [direction, H, L]: y[t] = Σ_s K0[t - s] x[s] + K1[s - t] x[s], and D x[t]
        lags = torch.arange(length)[:, None] - torch.arange(length)[None, :]  # t - s
        causal = torch.where(lags >= 0, kernels[0][:, lags.clamp(min=0)], 0)
        anti = torch.where(lags <= 0, kernels[1][:, (-lags).clamp(min=0)], 0) if bidirectional else 0
        expected = torch.einsum("hts,bsh->bth", causal + anti, x) + x * conv.D
        output = conv(x)
        assert (output - expected).abs().max() < 1e-10
        gradients = torch.autograd.grad(output.square().sum(), [x, conv.log_dt])
        wanted = torch.autograd.grad(expected.square().sum(), [x, conv.log_dt])
        assert all((got - want).abs().max() < 1e-8 for got, want in zip(gradients, wanted))
        conv.eval()
        with torch.no_grad():
            assert (conv(x) - expected).abs().max() < 1e-10  # from the cached spectrum
            grouped = conv.convolve_in_channel_groups_(x.detach().clone(), group=2)
            assert (grouped - expected).abs().max() < 1e-10
        conv.train()


@pytest.mark.parametrize("chunk_size", [256, 12])  # the chunk a power of two (one chain of powers), and not
def test_without_float64_the_convolution_and_its_gradients_stay_close_to_the_float64_path(monkeypatch, chunk_size):
    """On a device without float64 (Apple's ``mps``; forced here on the CPU, where every float64 result raises) z =
    exp(ΔA) and its powers are float32 exponentials (`_exponential_powers`), not float64 squarings: forward, gradients
    and the cached and grouped inference paths compute, close to the float64 path (measured: about 1e-6 apart at
    unit-size values, as far as 128K lags)."""
    from device_helpers import without_float64

    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(8, 16, kernel_chunk_size=chunk_size)
    x = torch.randn(2, 300, 8, requires_grad=True)
    weights = torch.randn(2, 300, 8)

    def run():
        conv.train().zero_grad()
        x.grad = None
        (conv(x) * weights).sum().backward()
        conv.eval()
        with torch.no_grad():
            outputs = [conv(x), conv(x), conv.convolve_in_channel_groups_(x.detach().clone(), group=3)]
        return outputs + [x.grad.clone()] + [p.grad.clone() for p in conv.parameters()]

    expected = run()
    with without_float64(monkeypatch, ssm):
        got = run()
    assert len(got) == len(expected) == 10 and not torch.equal(got[0], expected[0])  # (the float32 path ran)
    for value, reference in zip(got, expected):  # about 3e-7 of the largest value apart (measured), 3e-6 allowed
        torch.testing.assert_close(value, reference, rtol=0, atol=3e-6 * reference.abs().max().item())


def test_without_float64_the_locost_encoder_computes_close_to_the_float64_path(monkeypatch):
    """The tiny LOCOST encoder on a (forced) device without float64: its output, within 3e-6 of its largest value of
    the float64 path's (the decoder's softmax takes float64 on the CPU only: on ``mps`` it is ``torch.softmax``)."""
    from device_helpers import without_float64
    from workflow_helpers import tiny_locost

    encoder = tiny_locost().encoder
    input_ids = torch.randint(3, 99, (2, 600))
    with torch.no_grad():
        expected = encoder(input_ids=input_ids).last_hidden_state
        with without_float64(monkeypatch, ssm):
            encoder.apply(lambda module: getattr(module, "clear_kernel_cache", lambda: None)())
            hidden = encoder(input_ids=input_ids).last_hidden_state
    assert not torch.equal(hidden, expected)  # (the float32 path ran)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=3e-6 * expected.abs().max().item())
