"""The compiled CPU SSM kernel (``ssm_cpu_kernel``): equal to direct powers and to the torch path for every shape it
handles, the same bits whatever the thread split, and a clear fallback or error where it cannot be built."""

from __future__ import annotations

import logging
import shutil
import types

import pytest
import torch

from longreach.modeling import ssm, ssm_cpu_kernel
from longreach.modeling.ssm import BidirectionalS4DConvolution

from test_ssm import direct_kernel

needs_compiler = pytest.mark.skipif(ssm_cpu_kernel._compiler() is None,
                                    reason="no C compiler here: the torch path is the kernel (tested in test_ssm.py)")


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader as in a new process, with an empty cache folder."""
    monkeypatch.setenv("LONGREACH_CACHE", str(tmp_path))
    monkeypatch.setattr(ssm_cpu_kernel, "_library", None)
    monkeypatch.setattr(ssm_cpu_kernel, "_load_error", None)
    return tmp_path


def kernel_with(monkeypatch, backend: str, conv: BidirectionalS4DConvolution, length: int) -> torch.Tensor:
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, backend)
    with torch.no_grad():
        return conv.kernel(length)


@needs_compiler
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("channels, d_state, chunk_size, length", [
    (6, 16, 16, 300),    # 8 modes: one vector of modes; chunk 16 (the cap), 19 chunks, the last one partial
    (5, 6, 256, 1),      # 3 modes (padded to 8), one lag
    (3, 34, 5, 77),      # 17 modes; a chunk (5) that is neither a power of two nor a multiple of 4 or 8
    (4, 8, 256, 1000),   # chunk 32 or 45 -> 32, rows not a multiple of 3
    (2, 512, 256, 2048),  # the released d_state
    (2, 8, 256, 8192),   # MAX_LAGS: chunk 128, 64 chunks
])
def test_compiled_kernel_matches_direct_powers_and_the_torch_path(monkeypatch, bidirectional, channels, d_state,
                                                                   chunk_size, length):
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(channels, d_state, bidirectional=bidirectional, kernel_chunk_size=chunk_size)
    with torch.no_grad():  # some slow and some fast modes, so that powers decay through float32's denormals
        conv.inv_A_real.uniform_(-3.0, 1.0)
    compiled = kernel_with(monkeypatch, "compiled", conv, length)
    torch_path = kernel_with(monkeypatch, "torch", conv, length)
    reference = direct_kernel(conv, length)
    assert compiled.shape == torch_path.shape == reference.shape
    scale = reference.abs().max().item()
    torch.testing.assert_close(compiled.double(), reference, atol=2e-6 * scale, rtol=0)
    torch.testing.assert_close(torch_path.double(), reference, atol=4e-6 * scale, rtol=0)  # less exact: float doubling
    torch.testing.assert_close(compiled, torch_path, atol=4e-6 * scale, rtol=0)


@needs_compiler
def test_the_thread_split_does_not_change_a_bit(monkeypatch):
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "compiled")
    monkeypatch.setattr(ssm_cpu_kernel, "_THREADING_WORK", 0)
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(7, 32, kernel_chunk_size=64)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.no_grad():
                results.append(conv.kernel(500))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_compiler
def test_without_openmp_a_thread_pool_of_our_own_gives_the_same_bits(monkeypatch):
    """A compiler without OpenMP (Apple's clang) builds no ``s4d_kernel_f32_parallel``; the channels are then split
    over a pool of Python threads (ctypes releases the GIL)."""
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "compiled")
    monkeypatch.setattr(ssm_cpu_kernel, "_THREADING_WORK", 0)
    monkeypatch.setattr(ssm_cpu_kernel, "_pool", None)
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(7, 32, kernel_chunk_size=64)
    with torch.no_grad():
        with_openmp = conv.kernel(500)
        library = ssm_cpu_kernel.load()
        monkeypatch.setattr(ssm_cpu_kernel, "_library", types.SimpleNamespace(s4d_kernel_f32=library.s4d_kernel_f32))
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            pooled = conv.kernel(500)
        finally:
            torch.set_num_threads(previous)
    assert ssm_cpu_kernel._pool is not None and ssm_cpu_kernel._pool[1] == 2  # the pool ran it
    assert torch.equal(pooled, with_openmp)


@needs_compiler
def test_training_uses_it_forward_and_the_torch_backward(monkeypatch):
    """In a training step the compiled kernel is the forward of ``_S4DKernel``; its gradients (``s4d_kernel_vjp``)
    equal those of direct powers."""
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "compiled")
    calls = []
    compute = ssm.compiled_s4d_kernel_values
    monkeypatch.setattr(ssm, "compiled_s4d_kernel_values", lambda *args: calls.append(1) or compute(*args))
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(4, 16, kernel_chunk_size=16).train()
    weights = torch.randn(2, 4, 100, dtype=torch.float64)
    (direct_kernel(conv, 100) * weights).sum().backward()
    expected = [p.grad.clone() for p in conv.parameters() if p.grad is not None]
    conv.zero_grad()
    (conv.kernel(100).double() * weights).sum().backward()
    got = [p.grad for p in conv.parameters() if p.grad is not None]
    assert calls == [1] and len(got) == len(expected) == 5
    for value, reference in zip(got, expected):
        torch.testing.assert_close(value, reference.float(), atol=1e-4, rtol=1e-4)


@needs_compiler
def test_long_kernels_beyond_max_lags_use_the_torch_path(monkeypatch):
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "compiled")
    calls = []
    compute = ssm.compiled_s4d_kernel_values
    monkeypatch.setattr(ssm, "compiled_s4d_kernel_values", lambda *args: calls.append(args[2:]) or compute(*args))
    monkeypatch.setattr(ssm_cpu_kernel, "MAX_LAGS", 64)
    conv = BidirectionalS4DConvolution(3, 8, kernel_chunk_size=16)
    with torch.no_grad():
        conv.kernel(64)   # 4 chunks of 16 lags: compiled
        conv.kernel(65)   # 5 chunks of 16: torch ops
    assert calls == [(16, 4)]


@needs_compiler
def test_compiled_once_then_loaded_from_the_cache(fresh_loader):
    assert ssm_cpu_kernel.load() is not None
    built = list((fresh_loader / "kernels").glob("s4d_kernel_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    ssm_cpu_kernel._library = None
    assert ssm_cpu_kernel.load() is not None
    assert [p.stat().st_mtime_ns for p in (fresh_loader / "kernels").glob("s4d_kernel_*.so")] == [stamp]
    digest = built[0].with_name(built[0].name + ".sha256")
    assert sorted((fresh_loader / "kernels").iterdir()) == sorted([built[0], digest])  # no temporary left behind


# Loads the kernel with the cache folder of argv[1] and computes with it; prints where the library came from.
LOAD_AND_COMPUTE = """
import os, sys
os.environ["LONGREACH_CACHE"] = sys.argv[1]
os.environ["LONGREACH_SSM_KERNEL"] = "compiled"
import torch
from longreach.modeling import ssm_cpu_kernel
from longreach.modeling.ssm import BidirectionalS4DConvolution
torch.manual_seed(0)
with torch.no_grad():
    kernel = BidirectionalS4DConvolution(3, 8).kernel(50)
print(ssm_cpu_kernel.load()._name, float(kernel.abs().sum()))
"""


def _load_in_a_process(cache) -> tuple[str, float]:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", LOAD_AND_COMPUTE, str(cache)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"exit code {result.returncode}: {result.stderr[-2000:]}"  # -7: SIGBUS
    name, total = result.stdout.split()
    return name, float(total)


@needs_compiler
def test_a_truncated_library_in_the_cache_is_rebuilt_not_loaded(tmp_path):
    """A cached library cut short (a copied cache, a full disk) killed the process that loaded it (SIGBUS)."""
    name, expected = _load_in_a_process(tmp_path)
    library = next((tmp_path / "kernels").glob("s4d_kernel_*.so"))
    size = library.stat().st_size
    library.write_bytes(library.read_bytes()[: size // 2])
    assert _load_in_a_process(tmp_path) == (name, expected)
    assert library.stat().st_size == size


@needs_compiler
def test_a_cache_folder_that_cannot_be_written_still_gets_the_compiled_kernel(fresh_loader, monkeypatch, caplog):
    blocked = fresh_loader / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("LONGREACH_CACHE", str(blocked))  # kernels would go in a-file/kernels: mkdir fails, even as root
    with caplog.at_level(logging.WARNING, logger=ssm_cpu_kernel.__name__):
        assert ssm_cpu_kernel.load() is not None
    assert "cannot write the SSM kernel cache" in caplog.text and ssm_cpu_kernel.unavailable_reason() is None


def test_without_a_compiler_auto_falls_back_with_a_warning(fresh_loader, monkeypatch, caplog):
    monkeypatch.setattr(ssm_cpu_kernel, "_compiler", lambda: None)
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "auto")
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(3, 8)
    with caplog.at_level(logging.WARNING, logger=ssm_cpu_kernel.__name__), torch.no_grad():
        kernel = conv.kernel(50)
    assert "no C compiler found" in caplog.text and "LONGREACH_SSM_KERNEL=torch" in caplog.text
    torch.testing.assert_close(kernel.double(), direct_kernel(conv, 50), atol=2e-6, rtol=0)


def test_without_a_compiler_compiled_is_an_error(fresh_loader, monkeypatch):
    monkeypatch.setattr(ssm_cpu_kernel, "_compiler", lambda: None)
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "compiled")
    with pytest.raises(RuntimeError, match="LONGREACH_SSM_KERNEL=compiled.*no C compiler found"), torch.no_grad():
        BidirectionalS4DConvolution(3, 8).kernel(50)


def test_a_failing_compiler_names_its_error(fresh_loader, monkeypatch, tmp_path):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(ssm_cpu_kernel, "_compiler", lambda: str(broken))
    assert ssm_cpu_kernel.load() is None
    assert "this compiler is broken" in ssm_cpu_kernel.unavailable_reason()


def test_a_compiler_writing_another_encoding_falls_back_with_its_error(fresh_loader, monkeypatch, tmp_path):
    """A compiler whose messages are not in the locale's encoding (a localized gcc, a Windows console code page):
    decoding them raised a UnicodeDecodeError out of the model's forward instead of falling back to the torch ops."""
    latin1 = tmp_path / "latin1-cc"
    latin1.write_bytes(b"#!/bin/sh\nprintf 'cc (\\351dition 1)\\n'\nprintf 'erreur: \\351chec\\n' >&2\nexit 1\n")
    latin1.chmod(0o755)
    monkeypatch.setattr(ssm_cpu_kernel, "_compiler", lambda: str(latin1))
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "auto")
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(3, 8)
    with torch.no_grad():
        kernel = conv.kernel(50)
    assert "erreur: \ufffdchec" in ssm_cpu_kernel.unavailable_reason()
    torch.testing.assert_close(kernel.double(), direct_kernel(conv, 50), atol=2e-6, rtol=0)


@needs_compiler
def test_the_kernel_builds_where_the_locale_encoding_is_not_utf8(tmp_path):
    """The C source (its comments hold Ĉ) was written in the locale's encoding: under an ASCII locale (or Windows'
    cp1252) a UnicodeEncodeError came out of the model's forward."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8"}
    result = subprocess.run([sys.executable, "-c", "import locale; print(locale.getpreferredencoding())\n" +
                             LOAD_AND_COMPUTE, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    encoding, name, total = result.stdout.split()
    assert encoding.lower() in ("ansi_x3.4-1968", "ascii", "us-ascii")  # the condition was reached
    assert (name, float(total)) == _load_in_a_process(tmp_path)
    assert name.startswith(str(tmp_path / "kernels"))  # built into the cache, not the torch path


def test_torch_backend_never_compiles(fresh_loader, monkeypatch):
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "torch")
    monkeypatch.setattr(ssm_cpu_kernel, "load", lambda: pytest.fail("the torch backend must not load the library"))
    with torch.no_grad():
        BidirectionalS4DConvolution(3, 8).kernel(20)
    assert not (fresh_loader / "kernels").exists()


def test_a_bad_backend_value_is_named(monkeypatch):
    monkeypatch.setenv(ssm_cpu_kernel.BACKEND_VARIABLE, "fast")
    with pytest.raises(ValueError, match=r"LONGREACH_SSM_KERNEL must be 'auto', 'compiled' or 'torch', got 'fast'"):
        ssm_cpu_kernel.backend()


def test_compiler_is_found_where_the_machine_has_one():
    """Not a skip in disguise: where `cc`/`gcc`/`clang` exist, the loader finds one (so the tests above ran)."""
    expected = any(shutil.which(name) for name in ("cc", "gcc", "clang"))
    assert (ssm_cpu_kernel._compiler() is not None) == expected


@needs_compiler
@pytest.mark.parametrize("flags", [["-O3"], ["-O3", "-mno-avx"]], ids=["no -march", "no AVX"])
def test_the_source_builds_and_computes_without_native_flags(tmp_path, flags):
    """The loader's last attempt is a plain ``-O3`` build (for compilers or CPUs where ``-march=native`` fails): the
    source must build there too, and without AVX (an x86 register hint for 8-float vectors once broke both), and give
    the kernel of the native build (other FMA contraction: close, not the same bits)."""
    import ctypes
    import platform
    import subprocess

    if "-mno-avx" in flags and platform.machine() not in ("x86_64", "AMD64", "i686", "i386"):
        pytest.skip("-mno-avx is an x86 flag")
    source, built = tmp_path / "kernel.c", tmp_path / "kernel.so"
    source.write_text(ssm_cpu_kernel._C_SOURCE)
    result = subprocess.run([ssm_cpu_kernel._compiler(), *flags, "-std=gnu11", "-fPIC", "-shared", "-o", str(built),
                             str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    library = ctypes.CDLL(str(built))
    torch.manual_seed(0)
    conv = BidirectionalS4DConvolution(5, 34)
    with torch.no_grad():
        _, z, C_hat = conv._discretized()
    chunk, num_chunks = ssm._lag_chunks(2, 300, conv.kernel_chunk_size)
    z_pairs, c_pairs = torch.view_as_real(z).contiguous(), torch.view_as_real(C_hat).contiguous()
    values = torch.empty(5, 2 * num_chunks, chunk)
    assert library.s4d_kernel_f32(ctypes.c_void_p(z_pairs.data_ptr()), ctypes.c_void_p(c_pairs.data_ptr()),
                                  ctypes.c_void_p(values.data_ptr()), ctypes.c_long(5), ctypes.c_long(17),
                                  ctypes.c_long(2), ctypes.c_long(chunk), ctypes.c_long(num_chunks),
                                  ctypes.c_long(0), ctypes.c_long(5)) == 0
    expected = ssm_cpu_kernel.compiled_s4d_kernel_values(z, C_hat, chunk, num_chunks)
    torch.testing.assert_close(values, expected, atol=2e-6 * expected.abs().max().item(), rtol=0)


@needs_compiler
def test_without_a_home_folder_the_kernel_is_built_for_the_process(fresh_loader, monkeypatch, caplog):
    """No $LONGREACH_CACHE, no $XDG_CACHE_HOME and no home folder (no $HOME, no passwd entry: some containers), where
    `Path.home()` raises: built in the process's temporary folder, as for a cache folder that cannot be written."""
    monkeypatch.delenv("LONGREACH_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(ssm_cpu_kernel.Path, "home", staticmethod(no_home))
    with caplog.at_level(logging.WARNING, logger=ssm_cpu_kernel.__name__):
        assert ssm_cpu_kernel.load() is not None
    assert "no SSM kernel cache (no cache folder" in caplog.text and ssm_cpu_kernel.unavailable_reason() is None
    assert "~/.cache" not in caplog.text  # (no such folder: the warning named it as the one that could not be written)


def test_on_macos_the_kernel_cache_tells_cpus_apart_by_sysctl(monkeypatch, tmp_path):
    """macOS has no /proc/cpuinfo, and ``platform.processor()`` is "arm" on every Apple Silicon Mac: a library built
    with ``-mcpu=native`` on an M3 would be loaded by an M1 sharing the cache folder. ``sysctl``'s CPU model and
    feature flags tell them apart."""
    import platform
    import subprocess

    # no /proc/cpuinfo, however it is read
    monkeypatch.setattr(ssm_cpu_kernel, "_CPUINFO", tmp_path / "no_cpuinfo", raising=False)
    monkeypatch.setattr(ssm_cpu_kernel, "Path", lambda *parts: tmp_path / "no_cpuinfo")
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    machines = {"Apple M1": "hw.optional.arm.FEAT_BF16: 0\n", "Apple M3": "hw.optional.arm.FEAT_BF16: 1\n"}
    identities = []
    for brand, flags in machines.items():
        def sysctl(command, brand=brand, flags=flags, **kwargs):
            assert command[0] == "sysctl"
            return subprocess.CompletedProcess(command, 0, f"machdep.cpu.brand_string: {brand}\n{flags}", "")

        monkeypatch.setattr(subprocess, "run", sysctl)
        identities.append(ssm_cpu_kernel._cpu_identity())
    assert identities[0] != identities[1] and "Apple M1" in identities[0] and "FEAT_BF16: 1" in identities[1]
