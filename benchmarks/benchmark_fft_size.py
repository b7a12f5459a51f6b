"""The FFT convolution of LOCOST's SSM layer with 2L points against the next 5-smooth size >= 2L - 1, at lengths
where 2L has a large prime factor (and at a power of two, where the two are the same size).

    python benchmarks/benchmark_fft_size.py [--channels 64] [--threads 1] [--lengths 65536 65537 100003]

One eval-mode ``BidirectionalS4DConvolution`` forward, the kernel spectrum cached (as in inference), best of 5; both
sizes give the same convolution (``tests/test_ssm.py``).
"""

from __future__ import annotations

import argparse
import time

import torch

from longreach.modeling import ssm


def best_forward_seconds(conv, length: int, smooth_from: int, channels: int, repeats: int = 5) -> float:
    ssm.SMOOTH_FFT_FROM_LENGTH = smooth_from
    x = torch.randn(1, length, channels)
    conv.clear_kernel_cache()
    with torch.no_grad():
        conv(x)  # computes and caches the kernel spectrum for this FFT size
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            conv(x)
            times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 65537, 100003])
    args = parser.parse_args()
    if any(length < 1 for length in args.lengths) or args.channels < 1 or args.threads < 1:
        parser.error(f"--lengths, --channels and --threads must be positive, got {args.lengths}, {args.channels}, "
                     f"{args.threads}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    conv = ssm.BidirectionalS4DConvolution(args.channels, 16).eval()
    default = ssm.SMOOTH_FFT_FROM_LENGTH
    for length in args.lengths:
        exact = best_forward_seconds(conv, length, 10**12, args.channels)
        smooth = best_forward_seconds(conv, length, 1, args.channels)
        print(f"L={length}: {2 * length} points {exact * 1e3:.1f} ms, {ssm.exact_fft_size(length)} points "
              f"{smooth * 1e3:.1f} ms ({exact / smooth:.2f}x)")
    ssm.SMOOTH_FFT_FROM_LENGTH = default


if __name__ == "__main__":
    main()
