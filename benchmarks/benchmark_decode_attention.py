"""One decoding step's cross-attention, as the T5 blocks of LOCOST and VCC-T5 run it: one query per head against L
encoder states (12 heads of 64, a float padding mask), timed per call through ``torch.nn.functional.
scaled_dot_product_attention`` (torch's choice, without the mask, and each backend forced) and through the eager
matrix products and softmax (``t5_blocks.eager_attention_forward``'s arithmetic), in float32 and bfloat16.

It is the measurement behind ``t5_blocks._one_float32_query_on_cuda``: on an H200, sdpa chose its memory-efficient
kernel for float32 and took 1.95 ms per call at 16K states against 0.06 ms for the eager products
(``benchmarks/results/cuda.md``).

    python benchmarks/benchmark_decode_attention.py --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION)


def microseconds_per_call(function, device: torch.device, iterations: int) -> float:
    for _ in range(min(5, iterations)):
        function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            function()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iterations * 1e3
    started = time.perf_counter()
    for _ in range(iterations):
        function()
    return (time.perf_counter() - started) / iterations * 1e6


def measure(length: int, dtype: torch.dtype, device: torch.device, iterations: int, heads: int = 12,
            head_dim: int = 64) -> dict[str, float | str]:
    """Microseconds per call for each way of computing the step (a string where a backend refuses the inputs)."""
    query = torch.randn(1, heads, 1, head_dim, device=device, dtype=dtype)
    key, value = (torch.randn(1, heads, length, head_dim, device=device, dtype=dtype) for _ in range(2))
    mask = torch.zeros(1, 1, 1, length, device=device, dtype=dtype)

    def eager():
        scores = query @ key.transpose(2, 3) + mask
        return torch.softmax(scores.float(), dim=-1).to(dtype) @ value

    def sdpa(masked: bool = True):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask if masked else None, scale=1.0)

    row: dict[str, float | str] = {
        "eager": microseconds_per_call(eager, device, iterations),
        "sdpa": microseconds_per_call(sdpa, device, iterations),
        "sdpa, no mask": microseconds_per_call(lambda: sdpa(False), device, iterations),
    }
    for backend in BACKENDS:
        try:
            with sdpa_kernel(backend):
                row[f"sdpa {backend.name.lower()}"] = microseconds_per_call(sdpa, device, iterations)
        except RuntimeError as error:  # the backend does not take these inputs (dtype, device)
            row[f"sdpa {backend.name.lower()}"] = f"n/a ({str(error).splitlines()[0][:60]})"
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16",
                                                                                         "float16"])
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args(argv)
    if args.iterations < 1 or any(length < 1 for length in args.lengths):
        raise ValueError(f"`--iterations` and `--lengths` must be positive, got {args.iterations} and {args.lengths}.")
    device = torch.device(args.device)
    rows = []
    for name in args.dtypes:
        for length in args.lengths:
            row = {"dtype": name, "length": length, **measure(length, getattr(torch, name), device, args.iterations)}
            rows.append(row)
    columns = [column for column in rows[0] if column not in ("dtype", "length")]
    print("| dtype | encoder states | " + " | ".join(f"{column} (µs)" for column in columns) + " |")
    print("| --- | ---: |" + " ---: |" * len(columns))
    for row in rows:
        cells = [f"{row[c]:.1f}" if isinstance(row[c], float) else row[c] for c in columns]
        print(f"| {row['dtype']} | {row['length']} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
