"""Bidirectional S4D convolution (LOCOST encoder), computed exactly with an FFT of size 2L, in float32 (float64 after
``.double()``).

Notation (LOCOST paper eqs. 1-3, S4D of Gu et al. 2022): for each of the H channels h, N/2 stored complex modes n
(their conjugates are implicit), step size Δ_h = exp(log_dt[h]), diagonal A_hn = -exp(inv_A_real[h, n]) + i·A_imag[h, n],
input vector B_hn shared by both directions and one output vector C_chn per direction c (0 = causal κ←, 1 = anti-causal
κ→). Zero-order-hold discretisation folds B into C:

    Ĉ_chn    = C_chn · B_hn · (exp(Δ_h A_hn) − 1) / A_hn
    K_c[h,l] = 2 · Re Σ_n Ĉ_chn · exp(Δ_h A_hn · l),        l = 0 .. L−1                 (the SSM kernel)
    y[t]     = Σ_{s≤t} K_0[t−s] x[s] + Σ_{s≥t} K_1[s−t] x[s] + D·x[t]                    (eq. 3, lag 0 counted in both)

The two kernels are packed into one circular kernel of period 2L (K_0 at lags 0..L−1, K_1 reversed at the end) and
applied with a real FFT of exactly 2L points: this is the authors' exact path (``fftconv_ref``). Their CUDA path rounds
the FFT size to a power of two, which computes a different function for most lengths; we do not reproduce it.

Kernel cache: in inference (``eval()`` and no gradient wanted for the SSM parameters) the kernel spectra of the
last lengths used are kept per layer, so a batch of documents or repeated ``generate()`` calls at one padded length
compute them once. The cache is a small LRU bounded by ``kernel_cache_lengths`` entries and ``kernel_cache_bytes``
bytes (a spectrum larger than the byte cap is never kept). It keeps a copy of the kernel parameters its spectra were
computed from and compares it with the parameters (``torch.equal``) before every use, so any parameter edit (in place,
through ``.data`` as EMA code does, ``load_state_dict``, ``.to()``) misses it, and it is emptied by ``.train()`` and
``.eval()``. The copy (6 MiB per layer at the released size, outside the byte cap) takes 0.75 ms to compare on one CPU
thread, against 9 ms for the cached convolution of one 1K-token input. On an accelerator the comparison would make the
host wait for the device at every layer, so there the cache is keyed on the parameters' storage (held by an alias, so
that no new tensor takes its address) and version counter instead: an edit through ``.data`` there needs
``clear_kernel_cache()`` or ``.eval()``.

Memory and time: the authors materialise exp(ΔA·l) as [H, N/2, L] (51 GB at the released size and 16K tokens, and
L complex exponentials per mode). We split the lags into chunks l = l0 + j and use z^(l0 + j) = z^l0 · z^j with
z = exp(ΔA): one exponential per mode, its power-of-two powers by squaring in float64 (one float32 exponential each on
a device without float64, Apple's ``mps``), the chunk's powers by doubling (one complex multiplication each, about
(1 + directions)·√L per mode), one real batched matmul per block of 32 channels (``s4d_kernel``), and no tensor larger
than O(32·N/2·√L) besides the [directions, H, L] kernel and the squarings. That is the torch-ops path
(``LONGREACH_SSM_KERNEL=torch``, and every accelerator). With torch ops on CPU the
kernel ran at 3.5x (1 thread) to 3.8x (2 threads) the time of a plain matmul of its multiply-adds at 1K lags: the
batched matmul alone took 1.7x the plain one (per channel [32, 512] x [512, 64], about 10 FLOPs per byte read against
about 170 for a square matmul: it runs at the speed of the caches), and the elementwise powers and per-block ops
about as much again. So on CPU the same products are one compiled C function (``ssm_cpu_kernel``: each channel's
powers are made in the caches and used at once; 1.8x-2.2x at 1K over three runs and 1.6x-1.8x at 4K-8K,
discretisation included, on 2 threads; ``benchmarks/run_all.py`` measures both), up to ``ssm_cpu_kernel.MAX_LAGS``
(8K) lags, beyond which MKL's batched matmul is as fast or faster.

Training: the convolution is one autograd function (``_FFTConvolution``) that keeps its input and the kernel's
spectrum for the backward pass (autograd through the FFTs kept the padded input, both spectra and the [H, 2L]
kernel) and transforms blocks of channels at a time, and so is the kernel (``_S4DKernel``): it keeps ΔA and Ĉ and
computes its gradients with the same chunked Vandermonde products read the other way (``s4d_kernel_vjp``), so nothing
of size L·N is kept or recomputed; the discretisation (ΔA, Ĉ from the parameters) runs under activation
checkpointing. (Autograd through the doubling's complex products, recomputed in checkpointed blocks, cost a training
step at 1K tokens and the released size 9.8 s against 7.5 s with this (best of 3), same machine, 2 threads; peak
tensor memory 1,369 against 1,422 MiB.)
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import initialization as init

from .input_checks import functorch_wrapped, in_functorch_transform, supports_float64
from .ssm_cpu_kernel import compiled_kernel_usable, compiled_s4d_kernel_values

#: Guards every layer's kernel cache: one model in eval mode may serve several threads at once (a lookup and an eviction
#: in two threads raised KeyError). The spectra themselves are computed outside it. Module-level, so that layers stay
#: copyable and picklable.
_KERNEL_CACHE_LOCK = threading.RLock()


#: Channels whose kernels (and kernel gradients) are computed together on CPU (see `s4d_kernel`).
KERNEL_CHANNEL_BLOCK = 32


def _exp_wide(exponent: torch.Tensor) -> torch.Tensor:
    """exp(exponent) from real exp/cos/sin (torch's complex ``exp`` is slow on CPU): in complex128 (float64), or in
    complex64 on a device without float64 (``mps``), where `_doubling_ratios` then takes no power by squaring."""
    real_dtype = torch.float64 if supports_float64(exponent.device) else torch.float32
    real, imag = exponent.real.to(real_dtype), exponent.imag.to(real_dtype)
    magnitude = torch.exp(real)
    return torch.complex(magnitude * torch.cos(imag), magnitude * torch.sin(imag))


def _square_powers(base: torch.Tensor, count: int, dtype: torch.dtype = torch.complex64) -> torch.Tensor:
    """``[base, base², base⁴, …]`` (count of them, stacked on a new first dim) by repeated squaring of a complex128
    ``base`` (relative error about 2^i·2^-53 for the 2^i-th power), each rounded to ``dtype`` as it is made."""
    powers = [base.to(dtype)]
    for _ in range(count - 1):
        base = base * base
        powers.append(base.to(dtype))
    return torch.stack(powers)


def _exponential_powers(exponent: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``[exp(e), exp(2e), exp(4e), …]`` (count of them) for ``e = exponent``, each its own exponential in float32 (the
    scaling by 2^i is exact): the powers of `_square_powers` on a device without float64, where squaring in complex64
    would multiply z's rounding error by 2^i (kernel 4e-3 off at 128K lags, against 7e-7 this way: measured on CPU)."""
    return torch.stack([_exp_wide(exponent * float(2**i)).to(dtype) for i in range(count)])


def _geometric(first: torch.Tensor, ratio_powers, count: int, out: torch.Tensor) -> torch.Tensor:
    """``first · r^k`` for k < count along dim −2 of ``out`` (``first`` has size 1 there), ``ratio_powers[i] = r^(2^i)``.

    Doubling: the first m terms times r^m give the next m, so every term is a product of at most log2(count) + 1
    factors (relative error O(log(count)·ε)) and costs one complex multiplication, written into ``out``.

    Inside ``torch.compile`` the same products are concatenated instead, and ``out`` is not used: there a write into
    a slice of ``out`` becomes a ``slice_scatter``, which copies the whole buffer at every doubling, and inductor
    generates no code for complex tensors, so it cannot make that write in place. (On an H100, at 16K tokens and the
    released size, those copies took two thirds of a compiled training step's GPU time.) So under ``torch.func``'s
    transforms too: ``vmap`` over stacked SSM parameters (a model ensemble) has no batching rule for ``out=``.
    """
    if torch.compiler.is_compiling() or in_functorch_transform():
        terms = first
        for ratio in ratio_powers:
            filled = terms.shape[-2]
            if filled >= count:
                break
            terms = torch.cat([terms, terms[..., :min(filled, count - filled), :] * ratio], dim=-2)
        return terms
    out[..., :1, :] = first
    filled = 1
    for ratio in ratio_powers:
        if filled >= count:
            break
        size = min(filled, count - filled)
        torch.mul(out[..., :size, :], ratio, out=out[..., filled:filled + size, :])
        filled += size
    return out


def _conjugate(values: torch.Tensor) -> torch.Tensor:
    """``conj_physical(values)``; under ``torch.func`` transforms the same values through a conjugate view (``vmap``
    has no batching rule for ``conj_physical`` and warns of a slow fallback)."""
    return values.conj().resolve_conj() if in_functorch_transform() else torch.conj_physical(values)


def _lag_chunks(directions: int, length: int, max_chunk: int) -> tuple[int, int]:
    """``(chunk, number of chunks)`` of the lags: a power of two near √(directions·L), at most ``max_chunk`` and L.

    A chunk of √(directions·L) lags balances the powers P = z^j (chunk terms per mode) against the chunk starts
    z^l0 (directions·L/chunk terms); a power of two because the matmul's shapes matter as much as the balance
    (measured on CPU).
    """
    balanced = 2 ** round(math.log2(math.sqrt(directions * length)))
    chunk = max(1, min(max_chunk, balanced, length))
    return chunk, -(-length // chunk)


def _doubling_ratios(z: torch.Tensor, dtA: torch.Tensor, chunk: int, num_chunks: int):
    """``(z^(2^i) for i < log2(chunk), z^(chunk·2^i) for i < log2(num_chunks))`` of a block of channels, in ΔA's
    dtype (complex64, complex128 for a float64 module) ``[count, h, N/2]`` each, from z = exp(ΔA) in complex128 by
    squaring (one chain when the chunk is a power of two, else a second one from exp(ΔA·chunk)); from exponentials of
    their own where the device has no float64 (z in complex64: `_exponential_powers`)."""
    step_count, stride_count = (chunk - 1).bit_length(), (num_chunks - 1).bit_length()
    if z.dtype != torch.complex128:  # no float64 on this device (`_exp_wide`)
        step = _exponential_powers(dtA, max(1, step_count), dtA.dtype)[:step_count]
        return step, _exponential_powers(dtA * chunk, max(1, stride_count), dtA.dtype)
    if chunk & (chunk - 1) == 0:  # z^(chunk·2^i) = z^(2^(log2(chunk) + i)): one chain
        chain = _square_powers(z, max(1, step_count + stride_count), dtA.dtype)
        return chain[:step_count], chain[step_count:]
    step = _square_powers(z, max(1, step_count), dtA.dtype)[:step_count]
    return step, _square_powers(_exp_wide(dtA * chunk), max(1, stride_count), dtA.dtype)


def _channel_block(width: int, device: torch.device) -> int:
    """Channels per block: ``KERNEL_CHANNEL_BLOCK`` on CPU (a block's terms stay in the caches), all on accelerators."""
    return min(KERNEL_CHANNEL_BLOCK, width) if device.type == "cpu" else width


def _conjugate_powers_by_block(dtA: torch.Tensor, z: torch.Tensor, chunk: int, num_chunks: int):
    """For each block of channels: ``(rows, P̄, stride)`` with P̄ = conj(z)^j [h, chunk, N/2] (ΔA's dtype, built by
    doubling into one buffer reused by every block: use it before asking for the next) and the chunk-start ratios
    z^(chunk·2^i) [count, h, N/2] (``_doubling_ratios``). Shared by the kernel and its backward pass."""
    width, modes = z.shape
    block = _channel_block(width, z.device)
    buffer = torch.empty(block, chunk, modes, dtype=dtA.dtype, device=z.device)
    ones = torch.ones(1, dtype=dtA.dtype, device=z.device).expand(block, 1, modes)
    for first in range(0, width, block):
        rows = slice(first, first + block)
        step, stride = _doubling_ratios(z[rows], dtA[rows], chunk, num_chunks)
        size = z[rows].shape[0]
        powers = _geometric(ones[:size], _conjugate(step)[:, :, None, :].unbind(), chunk, buffer[:size])
        yield rows, powers, stride


def s4d_kernel(dtA: torch.Tensor, z: torch.Tensor, C_hat: torch.Tensor, length: int, max_chunk: int) -> torch.Tensor:
    """``K [directions, H, length]`` (float32): K_c[h, l] = 2·Re Σ_n Ĉ_chn z_hn^l, without autograd.

    With l = l0 + j (chunk starts l0 = c·chunk, offsets j < chunk): K_c[h, l0 + j] = 2·Re Σ_n W_chn[c] P_hn[j],
    W = Ĉ·z^l0 and P = z^j, one real batched matmul per block of channels over the interleaved (real, imaginary)
    parts (2·Re(W·P) = Re W·Re P + Im W·Im P̄ twice). W and P are geometric sequences, built by doubling
    (``_geometric``) into buffers reused by every block: one complex multiplication per term and no transcendental
    beyond exp(ΔA) per mode. The work besides the matmul is O(H·N/2·√L) against its O(H·N·L) multiply-adds.
    ``dtA`` [H, N/2] complex64, ``z = exp(dtA)`` complex128 (complex64 on a device without float64), ``C_hat``
    [directions, H, N/2] complex64 (complex128 and a float64 kernel for a float64 module).
    """
    directions, width, _ = C_hat.shape
    if torch.compiler.is_exporting():
        return _s4d_kernel_for_export(dtA, C_hat, length, max_chunk)
    chunk, num_chunks = _lag_chunks(directions, length, max_chunk)
    # on CPU up to 8K lags: the same products in C (complex64 only)
    if (C_hat.dtype == torch.complex64 and z.dtype == torch.complex128
            and compiled_kernel_usable(num_chunks * chunk, dtA, z, C_hat)):
        values = compiled_s4d_kernel_values(z, C_hat, chunk, num_chunks)
    else:
        values = _s4d_kernel_values(dtA, z, C_hat, chunk, num_chunks)
    return values.view(width, directions, num_chunks * chunk)[..., :length].transpose(0, 1)


def _s4d_kernel_for_export(dtA: torch.Tensor, C_hat: torch.Tensor, length: int, chunk: int) -> torch.Tensor:
    """`s4d_kernel` under ``torch.export``, where the length may be symbolic (a dynamic input length) and
    `_lag_chunks` and the doublings of `_geometric` would fix it to the example's: chunks of ``chunk`` lags
    (``max_chunk``) whatever the length, each power z^j, z^l0 its own exponential of ΔA·j in float64 (float32 on a
    device without it), by blocks of channels (`_channel_block`). The same kernel within float32 rounding."""
    directions, width, modes = C_hat.shape
    num_chunks = length // chunk + 2  # (more than L lags; never 1 chunk, whose broadcasts would fix the length)
    real, wide = (torch.float64, torch.complex128) if supports_float64(dtA.device) else (torch.float32, torch.complex64)
    offsets = torch.arange(chunk, device=dtA.device, dtype=real)[:, None]
    starts = torch.arange(num_chunks, device=dtA.device, dtype=real)[:, None] * chunk
    block, blocks = _channel_block(width, dtA.device), []
    for first in range(0, width, block):
        rows = slice(first, first + block)
        exponent = dtA[rows].to(wide)
        powers = _exp_wide(exponent[:, None, :] * offsets).to(dtA.dtype)  # z^j [h, chunk, N/2]
        weights = (2.0 * C_hat[:, rows]).transpose(0, 1)[:, :, None, :] * _exp_wide(
            exponent[:, None, None, :] * starts).to(dtA.dtype)  # 2·Ĉ·z^l0 [h, dirs, chunks, N/2]
        size = powers.shape[0]
        left = torch.view_as_real(weights).reshape(size, directions * num_chunks, 2 * modes)
        right = torch.view_as_real(_conjugate(powers)).reshape(size, chunk, 2 * modes).transpose(1, 2)
        blocks.append(torch.bmm(left, right))  # 2·Re(W·P) [h, dirs · chunks, chunk]
    values = torch.cat(blocks).view(width, directions, num_chunks * chunk)
    # the first L lags by index (a slice [:L] would need a proof that L <= num_chunks · chunk)
    return values.index_select(-1, torch.arange(length, device=values.device)).transpose(0, 1)


def _s4d_kernel_values(dtA: torch.Tensor, z: torch.Tensor, C_hat: torch.Tensor, chunk: int,
                       num_chunks: int) -> torch.Tensor:
    """The torch ops of :func:`s4d_kernel`: ``[H, directions · num_chunks, chunk]``, row d·num_chunks + i holding
    the lags i·chunk + j of direction d (the layout of ``compiled_s4d_kernel_values``)."""
    directions, width, modes = C_hat.shape
    values = dtA.real.new_empty(width, directions * num_chunks, chunk)
    weights_buffer = C_hat.new_empty(_channel_block(width, dtA.device), directions, num_chunks, modes)
    weights_first = (2.0 * C_hat).transpose(0, 1)[:, :, None, :]  # 2·Ĉ [h, dirs, 1, N/2]
    blocks = None if not in_functorch_transform() else []  # (under vmap a block is not written into `values`)
    for rows, powers, stride in _conjugate_powers_by_block(dtA, z, chunk, num_chunks):
        size = powers.shape[0]
        # P̄ [h, chunk, N/2] (conjugate, so that the matmul gives Re W·Re P − Im W·Im P); W [h, dirs, chunks, N/2]
        weights = _geometric(weights_first[rows], stride[:, :, None, None, :].unbind(), num_chunks,
                             weights_buffer[:size])
        left = torch.view_as_real(weights).reshape(size, directions * num_chunks, 2 * modes)
        right = torch.view_as_real(powers).reshape(size, chunk, 2 * modes).transpose(1, 2)
        if blocks is None:
            torch.bmm(left, right, out=values[rows])
        else:
            blocks.append(torch.bmm(left, right))
    return values if blocks is None else torch.cat(blocks)


def s4d_kernel_vjp(grad: torch.Tensor, dtA: torch.Tensor, z: torch.Tensor, C_hat: torch.Tensor, length: int,
                   max_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``s4d_kernel`` with respect to ΔA and Ĉ, given G = ∂loss/∂K [directions, H, length].

    K = 2·Re Σ_n Ĉ z^l is holomorphic in Ĉ and in z = exp(ΔA) (dz/dΔA = z), so with torch's convention for complex
    gradients (∂/∂Re + i·∂/∂Im of a real loss):

        ∂Ĉ_chn = 2 Σ_l G_c[h, l] · conj(z_hn)^l,        ∂ΔA_hn = 2 Σ_c conj(Ĉ_chn) Σ_l l·G_c[h, l] · conj(z_hn)^l.

    Both are the forward's Vandermonde products read the other way, computed the same way: with l = l0 + j,
    Σ_l w_l conj(z)^l = Σ_l0 conj(z)^l0 · Σ_j w_(l0+j) conj(z)^j, one real batched matmul of the chunked weights
    (G and l·G) with P̄ = conj(z)^j, then the chunk starts. Nothing of the forward is kept but ΔA and Ĉ.
    """
    directions, width, modes = C_hat.shape
    chunk, num_chunks = _lag_chunks(directions, length, max_chunk)
    real_dtype = dtA.real.dtype  # float32 (float64 for a float64 module)
    padded = nn.functional.pad(grad.to(real_dtype), (0, num_chunks * chunk - length))  # [dirs, H, chunks·chunk]
    lags = torch.arange(num_chunks * chunk, device=grad.device, dtype=real_dtype)
    starts_buffer = C_hat.new_empty(_channel_block(width, dtA.device), num_chunks, modes)
    ones = torch.ones(1, dtype=C_hat.dtype, device=C_hat.device).expand(width, 1, modes)
    sums = []  # per block of channels: Σ_l G conj(z)^l and Σ_l l·G conj(z)^l per direction [h, directions·2, N/2]
    for rows, powers, stride in _conjugate_powers_by_block(dtA, z, chunk, num_chunks):
        size = powers.shape[0]
        starts = _geometric(ones[rows], _conjugate(stride)[:, :, None, :].unbind(), num_chunks,
                            starts_buffer[:size])  # conj(z)^l0 [h, chunks, N/2]
        weighted = torch.stack([padded[:, rows], padded[:, rows] * lags], dim=1)  # G and l·G [dirs, 2, h, lags]
        left = weighted.permute(2, 0, 1, 3).reshape(size, directions * 2 * num_chunks, chunk)
        right = torch.view_as_real(powers).reshape(size, chunk, 2 * modes)
        partial = torch.view_as_complex(torch.bmm(left, right).view(size, directions * 2, num_chunks, modes, 2))
        sums.append((partial * starts[:, None]).sum(dim=2))
    sums = torch.cat(sums).view(width, directions, 2, modes)  # (a list, not slices of one buffer: see `_geometric`)
    grad_C_hat = 2.0 * sums[:, :, 0].transpose(0, 1)
    grad_dtA = 2.0 * (C_hat.conj().transpose(0, 1) * sums[:, :, 1]).sum(dim=1)
    return grad_dtA, grad_C_hat


def _first_order_backward():
    """The context the SSM's backward passes run in, after refusing a second-order gradient.

    Those passes are not differentiable themselves (the convolution's reads the kernel's spectrum, made outside the
    graph; the kernel's VJP writes into buffers): with ``create_graph=True`` (a gradient penalty, higher-order
    gradients) autograd would differentiate them and drop the SSM parameters' terms without a word.
    (``once_differentiable`` does not catch it: the upstream gradient need not require grad for those terms to exist.)
    ``torch.func.grad`` runs every backward pass with ``create_graph=True``: there the second order is a second
    differentiating transform around it (``grad`` of ``grad``, ``jacfwd`` of ``grad``), and a first-order pass runs
    without recording.
    """
    if in_functorch_transform():
        try:
            from torch._C._functorch import TransformType
            from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
        except ImportError:  # (private API: without it, refused as before)
            differentiating = [None, None]
        else:
            differentiating = [interpreter for interpreter in retrieve_all_functorch_interpreters()
                               if interpreter.key() in (TransformType.Grad, TransformType.Jvp)]
        if len(differentiating) <= 1:
            return torch.no_grad()
    elif not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    raise RuntimeError("Second-order gradients (backward with create_graph=True) through LOCOST's S4D convolution "
                       "are not supported: its backward pass is not differentiable.")


class _S4DKernel(torch.autograd.Function):
    """``s4d_kernel`` as an autograd function: keeps ΔA and Ĉ ([H, N/2] each) and computes its backward pass with
    ``s4d_kernel_vjp``, instead of autograd recording the doubling's complex products (several times the kernel's
    size; at 1K tokens and the released size a training step took 9.8 s with those, 7.5 s with this: measured).
    ``forward`` and ``setup_context`` are separate, so that ``torch.func`` transforms (``grad``, ``vmap``) take it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dtA, z, C_hat, length, max_chunk):
        return s4d_kernel(dtA, z, C_hat, length, max_chunk)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # z = exp(ΔA) (complex128: `_exp_wide`) comes from the discretisation; only ΔA and Ĉ are kept and z is taken
        # again in the backward pass (one exponential per mode, against keeping an [H, N/2] complex128 tensor per layer)
        dtA, _, C_hat, length, max_chunk = inputs
        ctx.save_for_backward(dtA, C_hat)
        ctx.length, ctx.max_chunk = length, max_chunk

    @staticmethod
    def backward(ctx, grad):
        with _first_order_backward():
            dtA, C_hat = ctx.saved_tensors
            grad_dtA, grad_C_hat = s4d_kernel_vjp(grad, dtA, _exp_wide(dtA), C_hat, ctx.length, ctx.max_chunk)
        return grad_dtA, None, grad_C_hat, None, None


#: `_FFTConvolution` transforms about this many signal elements (batch · channels · FFT points) at a time.
FFT_BLOCK_ELEMENTS = 2**22


#: From this input length on, the FFT convolution has the next 5-smooth number of points >= 2L − 1 instead of 2L: an FFT
#: of a size with a large prime factor is several times slower (one layer's forward, 64 channels, one CPU core: 2.6x
#: faster at 65,537 and 100,003 tokens, `benchmarks/benchmark_fft_size.py`). Up to it, 2L points as before: the same
#: numbers to the last bit where the demo and the fixtures run.
SMOOTH_FFT_FROM_LENGTH = 8193


def next_5_smooth(target: int) -> int:
    """The smallest 2^a · 3^b · 5^c >= ``target`` (what FFT libraries transform fastest)."""
    best = 1 << max(target - 1, 0).bit_length()
    power_of_5 = 1
    while power_of_5 < best:
        odd = power_of_5
        while odd < best:
            quotient = -(-target // odd)
            best = min(best, odd << max(quotient - 1, 0).bit_length())
            odd *= 3
        power_of_5 *= 5
    return best


def exact_fft_size(length: int) -> int:
    """Points of the FFT that convolves a length-L input with the packed bidirectional kernel exactly: 2L, or from
    ``SMOOTH_FFT_FROM_LENGTH`` on the next 5-smooth size >= 2L − 1 (no lag wraps onto another). A symbolic length
    (``torch.compile`` with dynamic shapes) and ``torch.export`` keep 2L, an expression of it."""
    if not isinstance(length, int) or length < SMOOTH_FFT_FROM_LENGTH or torch.compiler.is_exporting():
        return 2 * length
    return next_5_smooth(2 * length - 1)


def _fft_channel_blocks(signal: torch.Tensor, fft_size: int):
    """Slices of the channel dim (−2) of ``signal [..., h, L]`` with about ``FFT_BLOCK_ELEMENTS`` FFT elements each
    (an FFT runs along the last dim row by row: blocking the rows changes no value, bit for bit)."""
    if torch.compiler.is_exporting():  # (the length may be symbolic): one block
        return [slice(None)]
    rows_per_channel = signal[..., 0, 0].numel() * fft_size
    block = max(1, FFT_BLOCK_ELEMENTS // rows_per_channel)
    return [slice(first, first + block) for first in range(0, signal.shape[-2], block)]


class _FFTConvolution(torch.autograd.Function):
    """``y = irfft(rfft(x, n) · rfft(k, n), n)[..., :L]`` (circular convolution over n points, cut to x's L steps).

    Autograd through the FFTs would keep the zero-padded x, its spectrum, the kernel and its spectrum (8 [B, H, L]
    float tensors at n = 2L); this keeps x and the kernel's spectrum (3) and recomputes x's spectrum in the
    backward pass. The adjoints are circular cross-correlations over the same n points: with G = rfft(∂y, n),
    ∂x = irfft(G · conj(K), n)[..., :L] and ∂k = Σ_batch irfft(G · conj(X), n)[..., :len(k)].
    Both passes run over blocks of channels (`_fft_channel_blocks`), so their temporaries (spectra, products,
    n-point inverse transforms) are a block's, not the whole signal's: at 16K tokens and the released width, the
    backward pass of a checkpointed LOCOST training step held three [H, n] temporaries at once there, 288 MiB.
    Pass either the real kernel ``k [h, len(k)]`` (differentiable) or its precomputed ``spectrum`` (not); use it
    through `fft_convolution`. Given the kernel, ``forward`` returns the spectrum it computes too (``setup_context``
    keeps it: the split that ``torch.func`` transforms need); given the spectrum, the output alone (an input returned
    as an output cannot be kept). The buffers are made from the signal and the gradient (batched tensors under
    ``torch.func.vmap``, where writing a batched value into a plain buffer fails).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(signal, kernel, spectrum, fft_size):
        if spectrum is None:
            spectrum = torch.fft.rfft(kernel, n=fft_size)
        length = signal.shape[-1]
        output = signal.new_empty(torch.broadcast_shapes(signal.shape[:-1], spectrum.shape[:-1]) + (length,))
        for rows in _fft_channel_blocks(signal, fft_size):
            output[..., rows, :] = torch.fft.irfft(torch.fft.rfft(signal[..., rows, :], n=fft_size) * spectrum[rows],
                                                   n=fft_size)[..., :length]
        return output if kernel is None else (output, spectrum)

    @staticmethod
    def setup_context(ctx, inputs, output):
        signal, kernel, spectrum, fft_size = inputs
        if kernel is not None:
            spectrum = output[1]
            ctx.mark_non_differentiable(spectrum)
            ctx.set_materialize_grads(False)  # (no zeros made for the spectrum's gradient, which is never used)
        ctx.save_for_backward(signal, spectrum)
        ctx.fft_size = fft_size
        ctx.kernel_length = None if kernel is None else kernel.shape[-1]

    @staticmethod
    def backward(ctx, grad_output, _=None):
        if grad_output is None:  # (grads are not materialized: the output got no gradient)
            return None, None, None, None
        with _first_order_backward():
            signal, spectrum = ctx.saved_tensors
            fft_size, length = ctx.fft_size, signal.shape[-1]
            grad_signal = grad_output.new_empty(signal.shape) if ctx.needs_input_grad[0] else None
            grad_kernel = None
            if ctx.needs_input_grad[1]:
                grad_kernel = grad_output.new_empty(spectrum.shape[-2], ctx.kernel_length)
            batch_dims = tuple(range(signal.dim() - spectrum.dim()))  # the kernel is shared by the batch
            for rows in _fft_channel_blocks(signal, fft_size):
                grad_spectrum = torch.fft.rfft(grad_output[..., rows, :], n=fft_size)
                if grad_signal is not None:
                    grad_signal[..., rows, :] = torch.fft.irfft(grad_spectrum * spectrum[rows].conj(),
                                                                n=fft_size)[..., :length]
                if grad_kernel is not None:
                    cross = grad_spectrum * torch.fft.rfft(signal[..., rows, :], n=fft_size).conj()
                    if batch_dims:  # (sum over dim=() would sum everything)
                        cross = cross.sum(dim=batch_dims)
                    grad_kernel[rows] = torch.fft.irfft(cross, n=fft_size)[..., :ctx.kernel_length]
        return grad_signal, grad_kernel, None, None


def fft_convolution(signal: torch.Tensor, kernel: torch.Tensor | None, spectrum: torch.Tensor | None,
                    fft_size: int) -> torch.Tensor:
    """``irfft(rfft(signal, n) · rfft(kernel, n), n)[..., :L]`` (or with the given ``spectrum``), through
    `_FFTConvolution`."""
    if kernel is None:
        return _FFTConvolution.apply(signal, None, spectrum, fft_size)
    return _FFTConvolution.apply(signal, kernel, None, fft_size)[0]


def _same_memory(tensor: torch.Tensor, alias: torch.Tensor) -> bool:
    """Whether ``tensor`` views the very storage, offset, shape and dtype of ``alias`` (no value is read)."""
    return (tensor.untyped_storage()._cdata == alias.untyped_storage()._cdata and tensor.data_ptr() == alias.data_ptr()
            and (tensor.dtype, tensor.shape, tensor.stride()) == (alias.dtype, alias.shape, alias.stride()))


class Float32ParametersModule(nn.Module):
    """A module whose floating-point parameters stay float32 under ``model.half()`` / ``model.to(torch.bfloat16)``.

    Device moves still apply, and so do ``.double()`` / ``.to(torch.float64)`` (float64 work such as gradcheck) and
    ``.float()``. The SSM parameters are complex numbers stored as real pairs; bf16/fp16 complex arithmetic does not
    exist, and the kernel's exponentials need float32 anyway.
    """

    def _apply(self, fn, recurse=True):
        def keep_float32(tensor):
            moved = fn(tensor)
            if (tensor.is_floating_point() and moved.is_floating_point()
                    and moved.dtype not in (torch.float32, torch.float64)):
                return tensor.to(device=moved.device, dtype=torch.float32)
            return moved

        return super()._apply(keep_float32, recurse)


class BidirectionalS4DConvolution(Float32ParametersModule):
    """``y = BiSSMConv(x) + D ⊙ x`` over the length axis, per channel; all parameters and the math in float32 (in
    float64 after ``.double()``: `compute_dtype`).

    Parameter layout (identical to the authors' checkpoints): ``C`` [directions, H, N/2, 2] and ``B`` [H, N/2, 2]
    hold complex numbers as (real, imaginary) pairs; ``inv_A_real``, ``A_imag`` [H, N/2]; ``log_dt``, ``D`` [H].
    """

    def __init__(self, channels: int, d_state: int, bidirectional: bool = True, dt_min: float = 1e-3,
                 dt_max: float = 1e-1, kernel_chunk_size: int = 256, authors_fft_size: bool = False,
                 kernel_cache_lengths: int = 2, kernel_cache_bytes: int = 32 * 2**20):
        super().__init__()
        if d_state < 2 or d_state % 2:
            raise ValueError(f"`d_state` must be a positive even number (N/2 complex modes are stored), got {d_state}.")
        modes = d_state // 2
        directions = 2 if bidirectional else 1
        self.channels, self.modes, self.bidirectional = channels, modes, bidirectional
        self.dt_min, self.dt_max = dt_min, dt_max
        self.kernel_chunk_size = kernel_chunk_size
        self.authors_fft_size = authors_fft_size
        self.kernel_cache_lengths, self.kernel_cache_bytes = kernel_cache_lengths, kernel_cache_bytes
        self._kernel_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (length, FFT size) -> rfft
        self._kernel_cache_parameters: tuple | None = None  # what the cached spectra come from (`_kernel_snapshot`)
        self.C = nn.Parameter(torch.empty(directions, channels, modes, 2))
        self.B = nn.Parameter(torch.empty(channels, modes, 2))
        self.inv_A_real = nn.Parameter(torch.empty(channels, modes))
        self.A_imag = nn.Parameter(torch.empty(channels, modes))
        self.log_dt = nn.Parameter(torch.empty(channels))
        self.D = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """S4D-Lin initialisation, as the authors' ``ssm_init.dplr(scaling="linear")``.

        A = −½ + iπn, B = 1, C ~ complex normal (variance ½ per part, stored conjugated), log Δ ~ U(log dt_min,
        log dt_max), D ~ N(0, 1). Uses ``transformers.initialization``, which leaves tensors loaded from a checkpoint
        untouched.
        """
        device = self.C.device
        init.constant_(self.inv_A_real, math.log(0.5))
        init.copy_(self.A_imag, math.pi * torch.arange(self.modes, device=device, dtype=torch.float32).expand_as(self.A_imag))
        init.copy_(self.B, torch.stack([torch.ones_like(self.inv_A_real), torch.zeros_like(self.inv_A_real)], dim=-1))
        conjugate = torch.tensor([1.0, -1.0], device=device)
        init.copy_(self.C, torch.randn(self.C.shape, device=device) * math.sqrt(0.5) * conjugate)
        log_dt_range = math.log(self.dt_max) - math.log(self.dt_min)
        init.copy_(self.log_dt, torch.rand(self.log_dt.shape, device=device) * log_dt_range + math.log(self.dt_min))
        init.normal_(self.D, mean=0.0, std=1.0)

    def discretized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ΔA [H, N/2], Ĉ [directions, H, N/2])`` in complex64."""
        dtA, _, C_hat = self._discretized()
        return dtA, C_hat

    def _discretized(self, channels: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ΔA and Ĉ (complex64, complex128 in float64) and z = exp(ΔA) (complex128, or complex64 on a device without
        float64: `_exp_wide`) of the given channels."""
        real = self.compute_dtype
        dt = torch.exp(self.log_dt.to(real)[channels])
        A = torch.complex(-torch.exp(self.inv_A_real.to(real)[channels]), self.A_imag.to(real)[channels])
        B = torch.view_as_complex(self.B.to(real)[channels].contiguous())
        C = torch.view_as_complex(self.C.to(real)[:, channels].contiguous())
        dtA = dt[:, None] * A
        z = _exp_wide(dtA)
        C_hat = C * (B * (z.to(A.dtype) - 1.0) / A)
        return dtA, z, C_hat

    @property
    def compute_dtype(self) -> torch.dtype:
        """float32, or float64 when the parameters are float64 (``.double()``)."""
        return torch.float64 if self.log_dt.dtype == torch.float64 else torch.float32

    def _apply(self, fn, recurse=True):
        self.clear_kernel_cache()  # device or dtype moves
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True):
        self.clear_kernel_cache()  # a training step changes the parameters
        return super().train(mode)

    def _kernel_parameters(self) -> tuple[torch.Tensor, ...]:
        return self.C, self.B, self.inv_A_real, self.A_imag, self.log_dt

    def _cacheable(self) -> bool:
        """Inference only: eval mode, and no autograd graph wanted through the kernel. Not inside ``torch.compile``: the
        cache is keyed by the parameters' storage and version, which a compiled graph cannot read (it recomputes the
        kernel, a function of the parameters alone)."""
        if self.training or self.kernel_cache_lengths < 1 or self.kernel_cache_bytes < 1:
            return False
        if torch.compiler.is_compiling():
            return False
        if any(functorch_wrapped(p) for p in self._kernel_parameters()):
            return False  # parameters of a `torch.func` transform (stacked by `vmap`): a kept spectrum would escape it
        return not self._records_kernel_graph()

    def _records_kernel_graph(self) -> bool:
        """Whether autograd records the kernel (a training step of the SSM parameters)."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self._kernel_parameters())

    def kernel_spectrum(self, length: int, fft_size: int, channels: slice = slice(None)) -> torch.Tensor:
        """``rfft(circular_kernel(length), n=fft_size)[channels]`` [h, fft_size//2 + 1], from the kernel cache when
        allowed."""
        period = None if self.authors_fft_size else fft_size  # (the authors' path keeps its own period, 2L)
        if not self._cacheable():
            return torch.fft.rfft(self.circular_kernel(length, period=period), n=fft_size)[channels]
        key = (length, fft_size)
        with _KERNEL_CACHE_LOCK:
            spectrum = self._kernel_cache.get(key) if self._kernel_cache_matches(channels) else None
            # an inference-mode tensor cannot be saved for backward: recompute it when autograd records
            if spectrum is not None and not (spectrum.is_inference() and torch.is_grad_enabled()
                                             and not torch.is_inference_mode_enabled()):
                self._kernel_cache.move_to_end(key)
                return spectrum[channels]
        spectrum = torch.fft.rfft(self.circular_kernel(length, period=period), n=fft_size)
        with _KERNEL_CACHE_LOCK:
            self._kernel_cache.pop(key, None)
            if not self._kernel_cache_matches(slice(None)):
                self.clear_kernel_cache()  # parameters changed: the old spectra are wrong now
            size = spectrum.numel() * spectrum.element_size()
            if size <= self.kernel_cache_bytes:
                if self._kernel_cache_parameters is None:
                    self._kernel_cache_parameters = self._kernel_snapshot()
                self._kernel_cache[key] = spectrum
                while (len(self._kernel_cache) > self.kernel_cache_lengths
                       or self.kernel_cache_nbytes() > self.kernel_cache_bytes):
                    self._kernel_cache.popitem(last=False)
            if not self._kernel_cache:
                self._kernel_cache_parameters = None
        return spectrum[channels]

    def _kernel_snapshot(self) -> tuple:
        """What the cached spectra are checked against. On the CPU, a copy of the kernel parameters, compared by value:
        a change through ``.data`` (EMA, ``p.data.copy_``) moves neither the storage nor the version counter. On an
        accelerator, where reading a comparison back would make the host wait for the device at every layer, an alias of
        each and its version counter, compared by storage, offset, dtype and shape (so there, after an edit through
        ``.data``, call ``clear_kernel_cache()`` or ``.eval()``, which empties the cache)."""
        parameters = self._kernel_parameters()
        if parameters[0].device.type == "cpu":
            return tuple(p.detach().clone() for p in parameters)
        # an alias (no copy) holds the storage: no new tensor can take its address while the spectra are kept (the
        # caching allocator hands a freed block to the next tensor of its size, e.g. a parameter dict built anew for
        # each `functional_call`, whose tensors all start at version 0)
        return tuple((p.detach(), p._version) for p in parameters)

    def _kernel_cache_matches(self, channels: slice) -> bool:
        """Whether the cached spectra's rows `channels` come from the current kernel parameters (`_kernel_snapshot`)."""
        if self._kernel_cache_parameters is None:
            return False
        if not isinstance(self._kernel_cache_parameters[0], torch.Tensor):  # an accelerator's storage and versions
            return all(_same_memory(parameter, alias) and parameter._version == version
                       for parameter, (alias, version) in zip(self._kernel_parameters(), self._kernel_cache_parameters))
        for parameter, saved in zip(self._kernel_parameters(), self._kernel_cache_parameters):
            if (parameter.dtype, parameter.device, parameter.shape) != (saved.dtype, saved.device, saved.shape):
                return False
            if parameter is self.C:  # channels are dim 1 of C, dim 0 of the others
                parameter, saved = parameter[:, channels], saved[:, channels]
            else:
                parameter, saved = parameter[channels], saved[channels]
            if not torch.equal(parameter, saved):
                return False
        return True

    def clear_kernel_cache(self) -> None:
        """Forget the cached kernel spectra (e.g. to time a cold forward)."""
        with _KERNEL_CACHE_LOCK:
            self._kernel_cache.clear()
            self._kernel_cache_parameters = None

    def kernel_cache_nbytes(self) -> int:
        """Bytes held by the kernel cache of this layer."""
        with _KERNEL_CACHE_LOCK:
            return sum(t.numel() * t.element_size() for t in self._kernel_cache.values())

    def kernel(self, length: int, channels: slice = slice(None)) -> torch.Tensor:
        """``K [directions, H, length]`` (float32): K_c[h, l] = 2·Re Σ_n Ĉ_chn z_hn^l with z = exp(ΔA) (``s4d_kernel``);
        when autograd records the SSM parameters, through ``_S4DKernel`` (its own backward pass)."""
        if self._records_kernel_graph():
            # the discretisation's graph (a dozen [H, N/2] tensors, some complex128: 21 MB per layer at the released
            # size, whatever the length) is recomputed in the backward pass instead of kept
            # (deterministic: no RNG state to stash and restore, which costs CPU tensors on every call)
            # (not under torch.func's transforms, which refuse the checkpoint's saved-tensor hooks)
            if in_functorch_transform():
                dtA, z, C_hat = self._discretized(channels)
            else:
                dtA, z, C_hat = torch.utils.checkpoint.checkpoint(self._discretized, channels, use_reentrant=False,
                                                                  preserve_rng_state=False)
            return _S4DKernel.apply(dtA, z, C_hat, length, self.kernel_chunk_size)
        dtA, z, C_hat = self._discretized(channels)
        return s4d_kernel(dtA, z, C_hat, length, self.kernel_chunk_size)

    def circular_kernel(self, length: int, channels: slice = slice(None), period: int | None = None) -> torch.Tensor:
        """The packed kernel ``[H, period]`` (by default 2·length): causal lags at [0, L), zeros, then the anti-causal
        lags L−1..1 in the last L−1 columns (lag l at period − l), so that a circular convolution over ``period >= 2L −
        1`` points is the exact bidirectional one.

        Column 0 holds K_0[0] + K_1[0] (the authors' ``make_bidirectional``). Unidirectional: K_0 zero-padded.
        """
        period = 2 * length if period is None else period
        if period < 2 * length - 1:
            raise ValueError(f"`period` must be at least 2 * length - 1 = {2 * length - 1} (lags overlap), got {period}.")
        kernels = self.kernel(length, channels)
        causal = kernels[0]
        if not self.bidirectional:
            return nn.functional.pad(causal, (0, period - length))
        anti_causal = kernels[1]
        if torch.compiler.is_exporting():  # the same values without [H, L - 1] slices (whose strides fix L != 2)
            lags = -torch.arange(period, device=causal.device) % period  # column c holds anti-causal lag -c mod period
            padding = (0, period - length)
            return nn.functional.pad(causal, padding) + nn.functional.pad(anti_causal, padding)[:, lags]
        zeros = causal.new_zeros(causal.shape[0], period - 2 * length + 1)
        return torch.cat(
            [causal[:, :1] + anti_causal[:, :1], causal[:, 1:], zeros, anti_causal[:, 1:].flip(-1)], dim=-1
        )

    def forward(self, x: torch.Tensor, *, channel_group: int | None = None) -> torch.Tensor:
        """``x [B, L, H]`` (any float dtype) -> ``y [B, L, H]`` in x's dtype; FFT and kernel in `compute_dtype`.

        With ``channel_group``: `convolve_in_channel_groups_` (no autograd, in place), run through this call so that
        hooks on the module see it (accelerate's offloading loads the weights only around its ``forward``)."""
        if channel_group is not None:
            return self.convolve_in_channel_groups_(x, group=channel_group)
        return self._convolve(x.to(self.compute_dtype).transpose(1, 2)).transpose(1, 2).to(x.dtype)

    @torch.no_grad()
    def convolve_in_channel_groups_(self, x: torch.Tensor, group: int) -> torch.Tensor:
        """``forward`` without autograd, ``group`` channels at a time, written over ``x [B, L, H]`` in place.

        The FFT buffers then hold ``group`` channels instead of H (the long-input path of the LOCOST encoder).
        """
        for first in range(0, self.channels, group):
            channels = slice(first, first + group)
            y = self._convolve(x[:, :, channels].to(self.compute_dtype).transpose(1, 2), channels)
            x[:, :, channels] = y.transpose(1, 2).to(x.dtype)
        return x

    def _convolve(self, signal: torch.Tensor, channels: slice = slice(None)) -> torch.Tensor:
        """``signal [B, h, L]`` (`compute_dtype`) of the given channels -> ``[B, h, L]``."""
        length = signal.shape[-1]
        if self.authors_fft_size:
            # The authors' CUDA fftconv path (use_fast_fft_conv=True), for bit-compatibility only: an odd L is padded
            # by one zero step, then the FFT has max(2·2^⌈log2 L⌉, 16) points although the packed kernel has period
            # 2L, so anti-causal lags land in the wrong place or vanish whenever the two differ (see
            # LocostConfig.ssm_authors_fft_size). Not the architecture's function.
            kernel_length = length + length % 2
            fft_size = max(2 * 2 ** math.ceil(math.log2(kernel_length)), 16)
        else:
            kernel_length, fft_size = length, exact_fft_size(length)  # the packed kernel's period: exact convolution
        spectrum_bytes = self.channels * (fft_size // 2 + 1) * 2 * self.compute_dtype.itemsize  # complex
        if channels == slice(None) and self._records_kernel_graph():  # training: gradients flow into the kernel
            period = None if self.authors_fft_size else fft_size
            y = fft_convolution(signal, self.circular_kernel(kernel_length, period=period), None, fft_size)
        else:
            if channels == slice(None) or (self._cacheable() and spectrum_bytes <= self.kernel_cache_bytes):
                kernel_f = self.kernel_spectrum(kernel_length, fft_size, channels)  # all channels, cached when allowed
            else:  # a group of channels of a long input: computed for this group only
                period = None if self.authors_fft_size else fft_size
                kernel_f = torch.fft.rfft(self.circular_kernel(kernel_length, channels, period), n=fft_size)
            y = fft_convolution(signal, None, kernel_f, fft_size)
        return y + signal * self.D.to(self.compute_dtype)[channels, None]
