"""Encode one very long input with the released-size LOCOST encoder on CPU and print time and peak memory.

This is the proof that the design scales: the released configuration (d_model 768, d_state 512, 12 encoder
blocks) encoding 100K tokens under ``torch.no_grad()``. The authors' kernel computation would materialise
exp(ΔA·l) as [H, N/2, L] complex64 (here 768 × 256 × 100K × 8 bytes ≈ 157 GB); ours is computed in chunks of lags.

Usage::

    python benchmarks/benchmark_locost_long_input.py                  # 100,000 tokens, released size
    python benchmarks/benchmark_locost_long_input.py --length 16384 --threads 2

Weights are random (no download): time and memory do not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

import torch

from longreach import LocostConfig
from longreach.modeling.modeling_locost import LocostEncoder


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kernel_chunk_size", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = LocostConfig()  # the released model's size
    if args.kernel_chunk_size:
        config.ssm_kernel_chunk_size = args.kernel_chunk_size
    embedding = torch.nn.Embedding(config.vocab_size, config.d_model)
    encoder = LocostEncoder(config, embedding).eval()
    parameters = sum(p.numel() for p in encoder.parameters())
    input_ids = torch.randint(3, config.vocab_size, (1, args.length))
    naive_kernel_gb = config.d_model * (config.d_state // 2) * args.length * 8 / 1e9

    rss_before = rss_mib()
    start = time.perf_counter()
    with torch.no_grad():
        states = encoder(input_ids).last_hidden_state
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    result = {
        "tokens": args.length,
        "encoder_parameters": parameters,
        "threads": args.threads,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(args.length / seconds),
        "peak_rss_mib": round(peak),
        "rss_before_forward_mib": round(rss_before),
        "output_finite": bool(torch.isfinite(states).all()),
        "naive_kernel_tensor_gb": round(naive_kernel_gb, 1),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
