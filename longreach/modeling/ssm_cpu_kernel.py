"""The S4D kernel on CPU as one compiled C function, powers and matmul fused: up to 8K lags (``MAX_LAGS``) it takes
1.3x-2.0x the time of a plain matmul of its multiply-adds where the torch ops of ``ssm.s4d_kernel`` take 1.7x-3.9x
(released size, discretisation included, 1 and 2 threads; ``benchmarks/run_all.py`` measures both).

Why C: per channel h the kernel is a product of two small matrices of powers, K[i·chunk + j] = 2·Re Σ_n W_n[i]·P_n[j]
with W = Ĉ·z^(i·chunk) and P = z^j. Made with torch ops, the powers go through memory several times and the matmul
is a batch of 768 small products (~10 FLOPs per byte), so the kernel runs at the speed of the caches; here each
channel's powers are made in the caches and used at once (the profile is in ``ssm.py``'s docstring).

Layout: both operands are rows over the modes, real parts then imaginary parts (``[Re | Im]`` of W, ``[Re | −Im]`` of
P), so every power is made and stored as a vector over the modes, and the matmul is a block of dot products (3 rows
of W against 4 of P, 8-wide vector accumulators, reduced at the end). Precision: z^j as a float product of a double
"anchor" z^(8a) and a float z^t (t < 8); z^(i·chunk) in double; about the rounding of the torch path.

The source is compiled once per machine with the system's C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) with
``-O3 -march=native`` (the cache key includes the CPU's model and flags) into ``$LONGREACH_CACHE/kernels`` (default
``~/.cache/longreach/kernels``), in about a second, and loaded with ``ctypes``; its SHA-256 is written beside it and
checked before every load (a truncated library would kill the process), and where the cache folder cannot be written
the library is built for the process alone, in a temporary folder. Blocks of channels run on
``torch.get_num_threads()`` threads: with ``-fopenmp``, on torch's own OpenMP threads (the ``libgomp.so.1`` torch has
loaded; threads of our own competed with its workers, which spin for a while after each parallel op: 32 against
24 ms at 1K on 2 threads), else on a thread pool of ours (``ctypes`` releases the GIL). Where no compiler works the
torch path is used and a warning says why. ``LONGREACH_SSM_KERNEL=torch`` always uses the torch path;
``LONGREACH_SSM_KERNEL=compiled`` raises instead of falling back (beyond ``MAX_LAGS`` both use the torch ops).

This module imports only the standard library and torch: it is copied into Hub checkpoints as remote code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .input_checks import functorch_wrapped

logger = logging.getLogger(__name__)

#: Environment variable choosing the CPU kernel: "auto" (default: compiled when a compiler works), "compiled", "torch".
BACKEND_VARIABLE = "LONGREACH_SSM_KERNEL"
#: Below this many multiply-adds (H·modes·padded lags) the channels are not split across threads.
_THREADING_WORK = 2**21
#: The compiled kernel is used up to this many (padded) lags. Measured at the released size against the torch ops,
#: same process, best of 5 (time / plain matmul of the same multiply-adds, discretisation included), 1 thread: 1.99
#: against 2.52 at 1K, 1.44 / 1.98 at 4K, 1.66 / 1.95 at 8K, then 1.71 / 1.54 at 16K and 1.67 / 1.50 at 32K; 2 threads:
#: 2.09 / 3.44 at 1K, 1.62 / 2.31 at 4K, 2.08 / 2.27 at 8K, 1.77 / 1.72 at 16K, 1.36 / 1.39 at 32K, 1.67 / 1.41 at 64K.
#: From 16K lags on, the per-channel products are large enough for MKL's batched matmul to be as fast or faster.
#: (Measured before the dot products kept their vectors in registers; after it, one run at 16K: 1.82 against 1.77 on
#: 1 thread, 1.52 against 1.81 on 2: still no clear gain there.)
MAX_LAGS = 8192

_C_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define HAVE_MXCSR 1
#endif

#define MR 3           /* rows of W per block of dot products */
#define NJ 4           /* rows of P per block */
#define STEP 8         /* powers z^(8a + t), t < STEP, from one double-precision anchor z^(8a) */
#define COLUMN_BLOCK 64 /* rows of P kept in the caches while all rows of W pass over them */

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#ifdef __clang__
#define SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
typedef int v4i __attribute__((vector_size(16)));
#define SHUFFLE(x, y, ...) __builtin_shuffle(x, y, (v4i){__VA_ARGS__})
#endif

/* Keep a value in a vector register. Without it GCC folds the loads of P into the FMAs and loads each P vector once
 * per W row (15 loads per 12 FMAs instead of 7: the dot products ran at 0.8x the speed of a matmul, now 1.0x). An
 * empty asm: it changes where values live, not one rounding. Only where an 8-float vector fits one register (AVX):
 * without AVX the constraint is impossible and the build would fail. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
#define IN_REGISTER(x) __asm__("" : "+x"(x))
#else
#define IN_REGISTER(x) (void)0
#endif

static long round_up(long x, long m) { return (x + m - 1) / m * m; }

/* [sum(x0), sum(x1), sum(x2), sum(x3)] of four 8-lane vectors */
static v4 sum4(v8 x0, v8 x1, v8 x2, v8 x3)
{
    v4 y0 = (v4){x0[0], x0[1], x0[2], x0[3]} + (v4){x0[4], x0[5], x0[6], x0[7]};
    v4 y1 = (v4){x1[0], x1[1], x1[2], x1[3]} + (v4){x1[4], x1[5], x1[6], x1[7]};
    v4 y2 = (v4){x2[0], x2[1], x2[2], x2[3]} + (v4){x2[4], x2[5], x2[6], x2[7]};
    v4 y3 = (v4){x3[0], x3[1], x3[2], x3[3]} + (v4){x3[4], x3[5], x3[6], x3[7]};
    v4 t0 = SHUFFLE(y0, y1, 0, 4, 1, 5) + SHUFFLE(y0, y1, 2, 6, 3, 7);
    v4 t1 = SHUFFLE(y2, y3, 0, 4, 1, 5) + SHUFFLE(y2, y3, 2, 6, 3, 7);
    return SHUFFLE(t0, t1, 0, 1, 4, 5) + SHUFFLE(t0, t1, 2, 3, 6, 7);
}

/* out[r * ldo + c] = <a_r, b_c> over kp floats (kp % 8 == 0) for r < min(MR, rows), c < min(NJ, cols) */
static void dot_block(const float *a, const float *b, long kp, float *out, long ldo, long rows, long cols)
{
    v8 acc[MR][NJ];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NJ; c++) acc[r][c] = (v8){0};
    for (long k = 0; k < kp; k += 8) {
        v8 av[MR];
        for (int r = 0; r < MR; r++) {
            av[r] = *(const v8 *)(a + r * kp + k);
            IN_REGISTER(av[r]);
        }
        for (int c = 0; c < NJ; c++) {
            v8 bv = *(const v8 *)(b + c * kp + k);
            IN_REGISTER(bv);
            for (int r = 0; r < MR; r++) acc[r][c] += av[r] * bv;
        }
    }
    for (int r = 0; r < MR && r < rows; r++) {
        v4 s = sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
        if (cols >= NJ) memcpy(out + r * ldo, &s, sizeof s);
        else for (long c = 0; c < cols; c++) out[r * ldo + c] = s[c];
    }
}

/* out[h][d * num_chunks + i][j] = 2 Re sum_n c_hat[d][h][n] z[h][n]^(i * chunk + j) for j < chunk, i < num_chunks,
 * d < dirs and h_begin <= h < h_end. z: [H][modes] complex128 as (re, im) pairs; c_hat: [dirs][H][modes] complex64.
 * Returns 0, or 1 when memory could not be allocated. */
int s4d_kernel_f32(const double *z, const float *c_hat, float *out, long H, long modes, long dirs, long chunk,
                   long num_chunks, long h_begin, long h_end)
{
    const long mp = round_up(modes, 8), kp = 2 * mp;  /* a row: real parts at [0, mp), imaginary parts at [mp, 2mp) */
    const long rows = dirs * num_chunks, rows_p = round_up(rows, MR), cols_p = round_up(chunk, NJ);
    float *a = aligned_alloc(64, rows_p * kp * sizeof(float));    /* W rows: 2 Ĉ z^(i chunk) as [Re | Im] */
    float *b = aligned_alloc(64, cols_p * kp * sizeof(float));    /* P rows: z^j as [Re | -Im] */
    float *q = aligned_alloc(64, 2 * STEP * mp * sizeof(float));  /* z^t, t < STEP: Re, Im rows */
    float *w = aligned_alloc(64, 2 * dirs * mp * sizeof(float));  /* 2 Ĉ: Re, Im rows per direction */
    float *f = aligned_alloc(64, 2 * mp * sizeof(float));         /* an anchor in float: Re, Im */
    double *dd = aligned_alloc(64, 8 * mp * sizeof(double));
    if (!a || !b || !q || !w || !f || !dd) {
        free(a); free(b); free(q); free(w); free(f); free(dd);
        return 1;
    }
#ifdef HAVE_MXCSR
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  /* flush denormals to zero: powers of decaying modes underflow */
#endif
    /* padding (modes beyond `modes`, rows beyond `rows` and `chunk`) stays zero */
    memset(a, 0, rows_p * kp * sizeof(float));
    memset(b, 0, cols_p * kp * sizeof(float));
    memset(w, 0, 2 * dirs * mp * sizeof(float));
    memset(dd, 0, 8 * mp * sizeof(double));
    double *zr = dd, *zi = dd + mp, *pr = dd + 2 * mp, *pi = dd + 3 * mp;
    double *sr = dd + 4 * mp, *si = dd + 5 * mp, *cr = dd + 6 * mp, *ci = dd + 7 * mp;
    float *fr = f, *fi = f + mp;
    for (long h = h_begin; h < h_end; h++) {
        for (long n = 0; n < modes; n++) {
            zr[n] = z[2 * (h * modes + n)];
            zi[n] = z[2 * (h * modes + n) + 1];
        }
        for (long d = 0; d < dirs; d++) {
            const float *ch = c_hat + 2 * (d * H + h) * modes;
            for (long n = 0; n < modes; n++) {
                w[2 * d * mp + n] = 2.0f * ch[2 * n];
                w[(2 * d + 1) * mp + n] = 2.0f * ch[2 * n + 1];
            }
        }
        /* q[t] = z^t for t < STEP (a double recurrence rounded to float), then s = z^STEP */
        for (long n = 0; n < mp; n++) { pr[n] = 1.0; pi[n] = 0.0; }
        for (long t = 0; t < STEP; t++)
            for (long n = 0; n < mp; n++) {
                q[2 * t * mp + n] = (float)pr[n];
                q[(2 * t + 1) * mp + n] = (float)pi[n];
                double x = pr[n] * zr[n] - pi[n] * zi[n];
                pi[n] = pr[n] * zi[n] + pi[n] * zr[n];
                pr[n] = x;
            }
        for (long n = 0; n < mp; n++) { sr[n] = pr[n]; si[n] = pi[n]; cr[n] = 1.0; ci[n] = 0.0; }
        /* P rows: z^(j0 + t) = z^j0 (anchor, double recurrence) * z^t (float product) */
        for (long j0 = 0; j0 < chunk; j0 += STEP) {
            for (long n = 0; n < mp; n++) { fr[n] = (float)cr[n]; fi[n] = (float)ci[n]; }
            for (long t = 0; t < STEP && j0 + t < chunk; t++) {
                float *row = b + (j0 + t) * kp;
                const float *qr = q + 2 * t * mp, *qi = q + (2 * t + 1) * mp;
                for (long n = 0; n < mp; n++) {
                    row[n] = fr[n] * qr[n] - fi[n] * qi[n];
                    row[mp + n] = -(fr[n] * qi[n] + fi[n] * qr[n]);
                }
            }
            for (long n = 0; n < mp; n++) {
                double x = cr[n] * sr[n] - ci[n] * si[n];
                ci[n] = cr[n] * si[n] + ci[n] * sr[n];
                cr[n] = x;
            }
        }
        /* s = z^chunk by binary powering (one exponent for all modes) */
        for (long n = 0; n < mp; n++) { sr[n] = 1.0; si[n] = 0.0; pr[n] = zr[n]; pi[n] = zi[n]; }
        for (long e = chunk; e; e >>= 1) {
            if (e & 1)
                for (long n = 0; n < mp; n++) {
                    double x = sr[n] * pr[n] - si[n] * pi[n];
                    si[n] = sr[n] * pi[n] + si[n] * pr[n];
                    sr[n] = x;
                }
            if (e > 1)
                for (long n = 0; n < mp; n++) {
                    double x = pr[n] * pr[n] - pi[n] * pi[n];
                    pi[n] = 2.0 * pr[n] * pi[n];
                    pr[n] = x;
                }
        }
        /* W rows: 2 Ĉ_d z^(i chunk), the power in double, the product with 2 Ĉ in float */
        for (long n = 0; n < mp; n++) { cr[n] = 1.0; ci[n] = 0.0; }
        for (long i = 0; i < num_chunks; i++) {
            for (long n = 0; n < mp; n++) { fr[n] = (float)cr[n]; fi[n] = (float)ci[n]; }
            for (long d = 0; d < dirs; d++) {
                float *row = a + (d * num_chunks + i) * kp;
                const float *wr = w + 2 * d * mp, *wi = w + (2 * d + 1) * mp;
                for (long n = 0; n < mp; n++) {
                    row[n] = wr[n] * fr[n] - wi[n] * fi[n];
                    row[mp + n] = wr[n] * fi[n] + wi[n] * fr[n];
                }
            }
            for (long n = 0; n < mp; n++) {
                double x = cr[n] * sr[n] - ci[n] * si[n];
                ci[n] = cr[n] * si[n] + ci[n] * sr[n];
                cr[n] = x;
            }
        }
        /* out[h][r][c] = <W_r, P_c>: a block of P rows stays in the caches while every W row passes */
        float *oh = out + h * rows * chunk;
        for (long c1 = 0; c1 < cols_p; c1 += COLUMN_BLOCK)
            for (long r0 = 0; r0 < rows_p; r0 += MR)
                for (long c0 = c1; c0 < c1 + COLUMN_BLOCK && c0 < cols_p; c0 += NJ)
                    dot_block(a + r0 * kp, b + c0 * kp, kp, oh + r0 * chunk + c0, chunk, rows - r0, chunk - c0);
    }
#ifdef HAVE_MXCSR
    _mm_setcsr(csr);
#endif
    free(a); free(b); free(q); free(w); free(f); free(dd);
    return 0;
}

#ifdef _OPENMP
/* All channels on `threads` threads of the OpenMP runtime torch itself uses (libgomp.so.1, already loaded): its
 * workers, often still spinning after torch's last parallel op, take the channels instead of competing with
 * threads of our own. */
int s4d_kernel_f32_parallel(const double *z, const float *c_hat, float *out, long H, long modes, long dirs,
                            long chunk, long num_chunks, int threads)
{
    int status = 0;
#pragma omp parallel num_threads(threads) reduction(| : status)
    {
        long count = omp_get_num_threads(), index = omp_get_thread_num();
        status |= s4d_kernel_f32(z, c_hat, out, H, modes, dirs, chunk, num_chunks, H * index / count,
                                 H * (index + 1) / count);
    }
    return status;
}
#endif
"""

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_error: str | None = None  # why the compiled kernel is unavailable (once known)
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, executor): rebuilt after a fork


def backend() -> str:
    """The CPU kernel asked for by ``$LONGREACH_SSM_KERNEL``: "auto", "compiled" or "torch"."""
    value = os.environ.get(BACKEND_VARIABLE, "auto").strip().lower() or "auto"
    if value not in ("auto", "compiled", "torch"):
        raise ValueError(f"${BACKEND_VARIABLE} must be 'auto', 'compiled' or 'torch', got {value!r}.")
    return value


def _cache_dir() -> Path:
    """``$LONGREACH_CACHE/kernels``, else ``$XDG_CACHE_HOME/longreach/kernels`` or ``~/.cache/longreach/kernels``;
    raises OSError where there is no home folder (no ``$HOME`` and no passwd entry, as in some containers)."""
    if os.environ.get("LONGREACH_CACHE"):
        return Path(os.environ["LONGREACH_CACHE"]) / "kernels"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "longreach" / "kernels"
    try:
        return Path.home() / ".cache" / "longreach" / "kernels"
    except RuntimeError as error:  # (what Path.home() raises then)
        raise OSError(f"no cache folder: {error}") from None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


#: Where Linux describes the CPU (macOS has no /proc: `_cpu_identity` asks ``sysctl`` there).
_CPUINFO = Path("/proc/cpuinfo")


def _cpu_identity() -> str:
    """What ``-march=native`` / ``-mcpu=native`` depends on: the CPU's model and feature flags (a shared cache folder
    may be read by machines with other CPUs). On macOS, ``sysctl``'s: ``platform.processor()`` there is "arm" or
    "i386" for every Mac."""
    try:
        lines = _CPUINFO.read_text(errors="replace").splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            result = subprocess.run(["sysctl", "machdep.cpu.brand_string", "hw.optional"], capture_output=True,
                                    text=True, errors="replace", timeout=60)
            if result.stdout.strip():
                return result.stdout
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor()


def _compile(compiler: str) -> Path:
    # errors="replace": a compiler may write another encoding than the locale's (a localized gcc, a Windows console
    # code page); its messages are only shown
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, errors="replace",
                             timeout=60).stdout
    # OpenMP (to share torch's libgomp threads) where the compiler has it, else threads of our own (see
    # `compiled_s4d_kernel_values`)
    attempts = [[*openmp, "-O3", *arch] for openmp in (["-fopenmp"], []) for arch in (["-march=native"],
                                                                                      ["-mcpu=native"], [])]
    key = hashlib.sha256("\0".join([_C_SOURCE, compiler, version, platform.machine(), _cpu_identity()]).encode())
    name = f"s4d_kernel_{key.hexdigest()[:20]}.so"
    folder = None
    try:
        folder = _cache_dir()
        if _verified(folder / name):
            return folder / name
        folder.mkdir(parents=True, exist_ok=True)
        return _build(compiler, attempts, folder, folder / name)
    except OSError as error:  # a read-only or full cache folder, or none: a build for this process alone, compiled
        global _private_folder
        problem = f"cannot write the SSM kernel cache {folder}" if folder is not None else "no SSM kernel cache"
        logger.warning("longreach: %s (%s); building the compiled kernel for this process only (point "
                       "LONGREACH_CACHE at a writable folder to keep it).", problem, error)
        if _private_folder is None:
            _private_folder = tempfile.TemporaryDirectory(prefix="longreach-kernels-")
        private = Path(_private_folder.name)
        return _build(compiler, attempts, private, private / name)


#: Where a process builds the kernel when the cache folder cannot be written (removed at exit).
_private_folder: tempfile.TemporaryDirectory | None = None


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _verified(library: Path) -> bool:
    """Whether ``library`` holds the bytes its build recorded beside it: a truncated or altered library (a cache
    copied in part, a full disk, another tool) would kill the process when loaded (SIGBUS), not raise an error."""
    try:
        recorded = _digest_file(library).read_text(encoding="ascii", errors="replace").strip()
        return recorded == hashlib.sha256(library.read_bytes()).hexdigest()
    except OSError:
        return False


def _build(compiler: str, attempts: list[list[str]], folder: Path, library: Path) -> Path:
    """Compile into ``folder`` with the first flags that build a library that loads here; written as ``library``
    with its SHA-256 beside it, each renamed into place (a library without its digest, or with another one's, is
    rebuilt, never loaded)."""
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = Path(work) / "s4d_kernel.c"
        source.write_text(_C_SOURCE, encoding="utf-8")  # its comments are not ASCII: not the locale's
        errors = []
        for flags in attempts:
            built = Path(work) / "s4d_kernel.so"
            result = subprocess.run([compiler, *flags, "-std=gnu11", "-fPIC", "-shared", "-o", str(built), str(source)],
                                    capture_output=True, text=True, errors="replace", timeout=300)
            if result.returncode == 0 and _loads(built):
                digest = Path(work) / "digest"
                digest.write_text(hashlib.sha256(built.read_bytes()).hexdigest() + "\n", encoding="ascii")
                os.replace(digest, _digest_file(library))
                os.replace(built, library)  # atomic: a concurrent process sees the whole library or none
                return library
            errors.append(f"{' '.join(flags)}: {result.stderr.strip()[-500:]}")
    raise RuntimeError(f"{compiler} failed: " + " | ".join(errors))


def _loads(built: Path) -> bool:
    """Whether a freshly built library loads here (an OpenMP build needs a libgomp.so.1 as new as the compiler's;
    torch's own copy is the one already loaded)."""
    try:
        ctypes.CDLL(str(built))
    except OSError:
        return False
    return True


def load() -> ctypes.CDLL | None:
    """The compiled kernel's library (compiled on first use), or None where it cannot be built (the reason is in
    ``unavailable_reason()`` and was logged once)."""
    global _library, _load_error
    if _library is not None or _load_error is not None:
        return _library
    with _lock:
        if _library is None and _load_error is None:
            try:
                compiler = _compiler()
                if compiler is None:
                    raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
                library = ctypes.CDLL(str(_compile(compiler)))
                library.s4d_kernel_f32.restype = ctypes.c_int
                library.s4d_kernel_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 7
                if hasattr(library, "s4d_kernel_f32_parallel"):
                    library.s4d_kernel_f32_parallel.restype = ctypes.c_int
                    library.s4d_kernel_f32_parallel.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5 + [ctypes.c_int]
                _library = library
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _load_error = str(error)
                logger.warning("longreach: the compiled CPU SSM kernel is unavailable (%s); using the torch ops "
                               "(slower kernels up to 8K lags). Set %s=torch to silence this.", error, BACKEND_VARIABLE)
    return _library


def unavailable_reason() -> str | None:
    """Why the compiled kernel could not be built, once ``load()`` has tried; None when it was built."""
    return _load_error


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[0] != os.getpid() or _pool[1] != threads:  # threads do not survive a fork
        _pool = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="longreach-ssm"))
    return _pool[2]


def compiled_kernel_usable(lags: int, *tensors: torch.Tensor) -> bool:
    """Whether the compiled kernel should compute a kernel of ``lags`` (padded to whole chunks) from these tensors: on
    CPU, not under ``torch.compile``, at most ``MAX_LAGS`` lags, asked for by ``$LONGREACH_SSM_KERNEL`` and built.
    Raises when "compiled" was asked for and cannot be built. Not for tensors that a ``torch.func`` transform wraps
    (their data cannot be read by pointer)."""
    if any(t.device.type != "cpu" for t in tensors) or torch.compiler.is_compiling() or lags > MAX_LAGS:
        return False
    if any(functorch_wrapped(t) for t in tensors):
        return False
    choice = backend()
    if choice == "torch":
        return False
    if load() is None:
        if choice == "compiled":
            raise RuntimeError(f"{BACKEND_VARIABLE}=compiled, but the compiled SSM kernel cannot be built: "
                               f"{unavailable_reason()}")
        return False
    return True


def compiled_s4d_kernel_values(z: torch.Tensor, C_hat: torch.Tensor, chunk: int, num_chunks: int) -> torch.Tensor:
    """``values [H, directions·num_chunks, chunk]`` (float32) with values[h, d·num_chunks + i, j] =
    2·Re Σ_n Ĉ[d, h, n]·z[h, n]^(i·chunk + j): the layout of ``ssm.s4d_kernel``'s matmul output. ``z`` [H, N/2]
    complex128, ``C_hat`` [directions, H, N/2] complex64, on CPU (``compiled_kernel_usable`` says when to use it)."""
    directions, width, modes = C_hat.shape
    z_pairs = torch.view_as_real(z.detach().to(torch.complex128)).contiguous()
    c_pairs = torch.view_as_real(C_hat.detach().to(torch.complex64)).contiguous()
    values = torch.empty(width, directions * num_chunks, chunk, dtype=torch.float32)
    library = load()
    if library is None:
        raise RuntimeError(f"the compiled SSM kernel cannot be built: {unavailable_reason()}")
    pointers = (z_pairs.data_ptr(), c_pairs.data_ptr(), values.data_ptr(), width, modes, directions, chunk, num_chunks)

    def run(first: int, last: int) -> int:
        return library.s4d_kernel_f32(*pointers, first, last)

    threads = min(torch.get_num_threads(), width)
    if threads <= 1 or width * modes * num_chunks * chunk < _THREADING_WORK:
        statuses = [run(0, width)]
    elif hasattr(library, "s4d_kernel_f32_parallel"):  # torch's OpenMP threads
        statuses = [library.s4d_kernel_f32_parallel(*pointers, threads)]
    else:  # threads of our own (ctypes releases the GIL)
        bounds = [width * t // threads for t in range(threads + 1)]
        statuses = list(_executor(threads).map(run, bounds[:-1], bounds[1:]))
    if any(statuses):
        raise MemoryError("the compiled SSM kernel could not allocate its buffers")
    return values
