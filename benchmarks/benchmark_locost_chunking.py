"""LOCOST encoder time and peak memory by the long-input path's piece length (``encoder_chunk_length`` on a CPU,
``encoder_accelerator_chunk_length`` elsewhere; 0 = None, the unchunked path), at the released size, random weights,
batch 1, ``torch.no_grad()``, eval.

The long-input path (``LocostEncoderBlock.forward_in_pieces_``) was sized for CPU memory: pieces of 2048 positions for
the projections and feed-forward, the FFT convolution over groups of channels of as many elements, each group with its
own kernel. This measures what that costs where launches are not free (a GPU) and checks that every setting gives the
unchunked output (max abs difference). Each run empties the kernel cache first, as ``run_all.py``'s encode cells do.

Usage::

    python benchmarks/benchmark_locost_chunking.py --device cuda --dtype bfloat16 --lengths 16384 65536 \
        --chunks 2048 16384 0 [--profile 16384]

Prints JSON lines, then a Markdown table (time and memory relative to the default 2048).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from run_all import RELEASED, build_model, synchronize  # the released size, as in the suite


def measure(encoder, input_ids, repeats: int, device: torch.device) -> tuple[float, int | None, torch.Tensor]:
    layers = [module for module in encoder.modules() if hasattr(module, "clear_kernel_cache")]

    def run():
        for layer in layers:
            layer.clear_kernel_cache()
        with torch.no_grad():
            return encoder(input_ids=input_ids).last_hidden_state

    peak = None
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    output = run()  # warm-up, and the memory run
    synchronize(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 16384, 0], help="0: None (unchunked).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=None,
                        help="Also print torch.profiler's table of one run at this length, default chunking.")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        model = build_model("locost", RELEASED, max(args.lengths))
    encoder = model.to(getattr(torch, args.dtype)).eval().get_encoder()
    attribute = "chunk_length" if device.type == "cpu" else "accelerator_chunk_length"  # see LocostEncoder.piece_length
    default_chunk = getattr(encoder, attribute)
    rows = []
    for length in args.lengths:
        input_ids = torch.randint(3, RELEASED["vocab_size"], (1, length), device=device)
        reference = None
        for chunk in args.chunks:
            setattr(encoder, attribute, chunk or None)
            try:
                seconds, peak, output = measure(encoder, input_ids, args.repeats, device)
            except torch.OutOfMemoryError as error:
                row = {"length": length, "chunk": chunk, "error": str(error).splitlines()[0][:200]}
            else:
                if reference is None:
                    reference = output.float()
                difference = (output.float() - reference).abs().max().item()
                row = {"length": length, "chunk": chunk, "seconds": seconds, "peak_bytes": peak,
                       "max_abs_difference_from_first": difference, "finite": bool(torch.isfinite(output).all())}
                del output
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
    setattr(encoder, attribute, default_chunk)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        input_ids = torch.randint(3, RELEASED["vocab_size"], (1, args.profile), device=device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        measure(encoder, input_ids, 1, device)  # warm-up
        with profile(activities=activities) as profiler:  # two runs: the memory run and one timed
            measure(encoder, input_ids, 1, device)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(profiler.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=48))
    print()
    setting = "encoder_chunk_length" if attribute == "chunk_length" else "encoder_accelerator_chunk_length"
    print(f"| tokens | {setting} | time (s) | peak memory above weights (MiB) | time / default | "
          "max abs difference from the first setting |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if "error" in row:
            print(f"| {row['length']} | {row['chunk'] or 'None'} | {row['error']} | | | |")
            continue
        base = next((r for r in rows if r["length"] == row["length"] and r["chunk"] == default_chunk
                     and "seconds" in r), None)
        ratio = f"{row['seconds'] / base['seconds']:.2f}" if base else "-"
        peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.0f}"
        print(f"| {row['length']} | {row['chunk'] or 'None'} | {row['seconds']:.3f} | {peak} | {ratio} | "
              f"{row['max_abs_difference_from_first']:.2e} |")


if __name__ == "__main__":
    main()
