"""Encoder time and peak memory of LOCOST beside transformers' T5 and LongT5 (local attention), same run, same sizes.

All three encoders have the released LOCOST sizes (d_model 768, d_ff 2048, 12 layers, 12 heads for the attention
models, gated-GELU) and random weights. Each (model, length) cell runs in a fresh subprocess so that its peak RSS is
its own; the time is the median of ``--repeats`` forwards after one warm-up, batch 1, ``torch.no_grad()``.

Usage::

    python benchmarks/benchmark_locost_vs_peers.py --lengths 1024 4096 16384 --threads 2
    python benchmarks/benchmark_locost_vs_peers.py --json results.json

Prints a Markdown table with ratios to LOCOST. Cells that exceed ``--timeout`` or memory are reported as such.
``--json`` / ``--jsonl``: each finished cell is appended to the ``--jsonl`` file (by default ``--json``'s path ending in
``.jsonl``) and flushed; a rerun with the same options skips the cells already there (``--fresh`` measures them again;
other ``--threads``, ``--repeats`` or SSM kernel are refused) and ``--report_only`` prints their table without
measuring.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SIZES = dict(d_model=768, d_ff=2048, num_layers=12, num_heads=12, d_kv=64, feed_forward_proj="gated-gelu", vocab_size=32100)


def run_cell(model: str, length: int, threads: int, repeats: int) -> dict:
    import resource

    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if model == "locost":
        from longreach import LocostConfig
        from longreach.modeling.modeling_locost import LocostEncoder

        config = LocostConfig(**SIZES, d_state=512)
        encoder = LocostEncoder(config, torch.nn.Embedding(config.vocab_size, config.d_model))
    elif model == "t5":
        from transformers import T5Config, T5EncoderModel

        encoder = T5EncoderModel(T5Config(**SIZES))
    elif model == "longt5":
        from transformers import LongT5Config, LongT5EncoderModel

        encoder = LongT5EncoderModel(LongT5Config(**SIZES, encoder_attention_type="local", local_radius=127))
    else:
        raise ValueError(f"unknown model {model!r}")
    encoder.eval()
    input_ids = torch.randint(3, SIZES["vocab_size"], (1, length))
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            encoder(input_ids=input_ids)
            times.append(time.perf_counter() - start)
    return {
        "model": model,
        "length": length,
        "seconds": statistics.median(times[1:]),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


#: What a cell measures (its key in ``--jsonl``) and how (a rerun resumes only cells measured the same way).
KEY = ("model", "length")
SETTINGS = ("threads", "repeats", "ssm_kernel")


def cell_key(cell: dict) -> tuple:
    return tuple(cell.get(name) for name in KEY)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--models", nargs="+", default=["locost", "longt5", "t5"], choices=["locost", "longt5", "t5"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--max_t5_length", type=int, default=8192, help="full attention beyond this needs > 24 GB")
    from run_all import add_journal_arguments, check_journal_arguments  # run_all.py is beside this script

    add_journal_arguments(parser)
    parser.add_argument("--cell", nargs=2, metavar=("MODEL", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bad = [length for length in args.lengths if length < 1]
    if bad:
        parser.error(f"--lengths must be positive token counts, got {bad}")
    check_journal_arguments(parser, args)
    return args


def measure(model: str, length: int, args) -> dict:
    """One cell in a subprocess of its own (its peak RSS its own); a failure or a timeout is the cell's ``skipped``."""
    if model == "t5" and length > args.max_t5_length:
        return {"model": model, "length": length, "skipped": "full attention: memory"}
    command = [sys.executable, __file__, "--cell", model, str(length), "--threads", str(args.threads),
               "--repeats", str(args.repeats)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "length": length, "skipped": f"timeout {args.timeout}s"}
    if done.returncode != 0:
        return {"model": model, "length": length, "skipped": f"failed: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell(args.cell[0], int(args.cell[1]), args.threads, args.repeats)))
        return []
    from run_all import measure_with_journal, ssm_kernel_setting  # run_all.py is beside this script

    settings = dict(threads=args.threads, repeats=args.repeats, ssm_kernel=ssm_kernel_setting("cpu"))
    planned = [dict(settings, model=model, length=length) for length in args.lengths for model in args.models]
    results = measure_with_journal(  # each cell with the settings it was measured with
        args, planned, cell_key, SETTINGS, lambda cell: f"{cell['model']} {cell['length']}",
        lambda cell: {**measure(cell["model"], cell["length"], args), **settings}, echo=sys.stderr)

    print(f"\nEncoder forward, batch 1, {args.threads} threads, median of {args.repeats} (CPU)\n")
    print("| tokens | model | seconds | peak RSS (MiB) | time vs LOCOST | memory vs LOCOST |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in dict.fromkeys(args.lengths):
        row = {r["model"]: r for r in results if r["length"] == length}
        base = row.get("locost")
        for model in args.models:
            r = row.get(model)
            if r is None or "skipped" in r:
                print(f"| {length} | {model} | – | – | {r['skipped'] if r else ''} | |")
                continue
            ratio_t = ratio_m = "–"
            if base and "skipped" not in base:
                ratio_t = f"{r['seconds'] / base['seconds']:.2f}×"
                ratio_m = f"{r['peak_rss_mib'] / base['peak_rss_mib']:.2f}×"
            print(f"| {length} | {model} | {r['seconds']:.2f} | {r['peak_rss_mib']:.0f} | {ratio_t} | {ratio_m} |")
    return results


if __name__ == "__main__":
    main()
