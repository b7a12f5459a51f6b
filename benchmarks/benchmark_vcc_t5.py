"""Encoder time and peak memory of VCC-T5 in the paper's base setting beside transformers' T5 with the same weights.

VCC: 4 vanilla layers on 512-token segments + 8 VCC layers, blocks of 16, 90 refined blocks per layer, 48 VIP slots
(the paper's QA setting; VIPs = the first 5 tokens). Both encoders have 12 layers of a small T5 (d_model 64, 4 heads
of 16, d_ff 128, relu) and the *same* random weights (the T5 encoder's state dict is loaded into the VCC encoder;
parameter names are identical). Each (model, length) cell runs in a fresh subprocess. Its memory on a CPU is the
process's peak RSS during the forwards above a baseline taken just before them (Linux: the peak is reset through
``/proc/self/clear_refs`` and read from ``VmHWM``): the working memory of the forward, without Python, torch, the
weights and the inputs (but with what a process's first forward loads, library code and thread pools: tens of MiB,
alike for both models). A VCC cell builds the T5 model too, to copy its weights; that copy is still alive when the
baseline is taken and until the peak is read, so it is neither counted in VCC's figure nor freed memory that VCC's
forward could reuse unseen. (The process's whole peak, ``peak_rss_mib`` in the JSON, counts VCC's T5 copy and ~250 MiB
of Python + torch; the table falls back to it only where the peak cannot be reset.) With ``--device cuda`` the memory is
the CUDA allocator's peak above the weights and inputs. Batch 1, float32 (``--dtype``), ``torch.no_grad()``,
eval, the default attention implementation (sdpa) unless ``--attn eager``; time = median of ``--repeats`` forwards
after one warm-up (T5 at >= 16K tokens on a CPU: a single forward, no warm-up, because one forward takes minutes; on
a GPU the first session's T5 cells at 16K had no warm-up either).

Usage::

    python benchmarks/benchmark_vcc_t5.py                               # VCC at 8K/16K/64K, T5 at 8K/16K
    python benchmarks/benchmark_vcc_t5.py --vcc_lengths 8192 --t5_lengths 8192 --threads 2 --json out.json
    python benchmarks/benchmark_vcc_t5.py --generate 64 --vcc_lengths 16384 --t5_lengths 16384 --device cuda
    python benchmarks/benchmark_vcc_t5.py --dims base --vcc_lengths 4096 8192 16384 --repeats 1   # t5-base's dims

``--generate N`` times ``generate()`` of N new tokens (greedy, ``min_new_tokens=N``) of the whole seq2seq models
instead (VCC-T5 with T5's weights, decoder included), the encoder's memory then included in the peak.

``--json`` / ``--jsonl``: each finished cell is appended to the ``--jsonl`` file (by default ``--json``'s path ending
in ``.jsonl``) and flushed; a rerun with the same options skips the cells already there (``--fresh`` measures them
again; other ``--threads`` / ``--repeats`` are refused) and ``--report_only`` prints their table without measuring.

Prints a Markdown table with the VCC/T5 ratios. Not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SIZES = dict(vocab_size=32128, d_model=64, d_kv=16, d_ff=128, num_layers=12, num_heads=4, feed_forward_proj="relu",
             dropout_rate=0.0)
#: ``--dims``: the small T5 above, or the released t5-base (d_model 768, 12 heads of 64, d_ff 3072, relu, 12 layers)
DIMS = {"small": SIZES, "base": {**SIZES, "d_model": 768, "d_kv": 64, "d_ff": 3072, "num_heads": 12}}
VCC = dict(num_vanilla_layers=4, segment_length=512, block_size=16, num_refined_blocks=90, num_vip_slots=48)
NUM_VIP = 5


def run_cell(model: str, length: int, threads: int, repeats: int, attention: str, device: str = "cpu",
             dtype: str = "float32", generate_tokens: int = 0, dims: str = "small") -> dict:
    import resource

    import torch
    from transformers import T5Config, T5EncoderModel, T5ForConditionalGeneration

    from run_all import reset_peak_rss, rss_bytes  # run_all.py is beside this script

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    device = torch.device(device)
    t5_sizes = DIMS[dims]
    token_ids = dict(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    t5_config = T5Config(**t5_sizes, **token_ids)
    t5_config._attn_implementation = attention
    if generate_tokens:  # the whole seq2seq model, with T5's decoder (the same one in both)
        t5 = T5ForConditionalGeneration(t5_config).eval()
    else:
        t5 = T5EncoderModel(t5_config).eval()
    inputs = {"input_ids": torch.randint(3, t5_sizes["vocab_size"], (1, length))}
    extra = {}
    if model == "vcc":
        from longreach import VCCT5Config, VCCT5ForConditionalGeneration
        from longreach.modeling.modeling_vcc_t5 import VCCT5Encoder

        config = VCCT5Config(**t5_sizes, **token_ids, **VCC)
        config._attn_implementation = attention
        if generate_tokens:
            timed_model = VCCT5ForConditionalGeneration(config).eval()
            state_dict = t5.state_dict()
        else:
            timed_model = VCCT5Encoder(config, torch.nn.Embedding(config.vocab_size, config.d_model)).eval()
            state_dict = {key.removeprefix("encoder."): value for key, value in t5.state_dict().items()
                          if key.startswith("encoder.")}
        missing, unexpected = timed_model.load_state_dict(state_dict, strict=False)
        assert not missing and not unexpected, (missing, unexpected)  # embed_tokens too: the same weights
        vip_mask = torch.zeros_like(inputs["input_ids"])
        vip_mask[:, :NUM_VIP] = 1
        inputs["vip_mask"] = vip_mask
        sizes = config.compression_sizes(config.padded_length(length))
        extra = {"padded_length": config.padded_length(length), "compressed_length": sizes["compressed_length"]}
        # ``t5`` stays alive until the memory is measured: part of the baseline, its memory cannot be reused unseen
    elif model == "t5":
        timed_model = t5
    else:
        raise ValueError(f"unknown model {model!r}")
    timed_model = timed_model.to(device=device, dtype=getattr(torch, dtype))
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":  # the allocator's peak above the weights and inputs
        synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # the baseline of the RSS figure: the process now, with the weights (both copies in a VCC cell) and the inputs
    rss_baseline = rss_bytes() if reset_peak_rss() else None
    warmup = 0 if (model == "t5" and length >= 16384 and device.type == "cpu") else 1  # minutes a forward there
    if warmup == 0:
        repeats = 1
    times = []
    with torch.no_grad():
        for index in range(warmup + repeats):
            synchronize()
            start = time.perf_counter()
            if generate_tokens:
                output = timed_model.generate(**inputs, max_new_tokens=generate_tokens,
                                              min_new_tokens=generate_tokens, do_sample=False)
            else:
                output = timed_model(**inputs).last_hidden_state
            synchronize()
            if index >= warmup:
                times.append(time.perf_counter() - start)
    if generate_tokens:
        assert output.shape == (1, generate_tokens + 1)  # the decoder start token and the new tokens
        extra["generated_tokens"] = generate_tokens
    else:
        assert output.shape == (1, length, t5_sizes["d_model"]) and torch.isfinite(output).all()
    if device.type == "cuda":
        extra["peak_cuda_above_start_mib"] = (torch.cuda.max_memory_allocated() - cuda_before) / 2**20
    peak_above = None if rss_baseline is None else (rss_bytes("VmHWM") - rss_baseline) / 2**20
    del t5
    return {
        "model": model, "length": length, "attention": attention, "threads": threads, "device": str(device),
        "dtype": dtype, "dims": dims,
        "seconds_median": statistics.median(times), "seconds_min": min(times), "runs": len(times),
        "peak_rss_above_baseline_mib": peak_above,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_mib": rss_before,
        **extra,
    }


def run_in_subprocess(model: str, length: int, args) -> dict:
    command = [sys.executable, __file__, "--cell", model, str(length), "--threads", str(args.threads),
               "--repeats", str(args.repeats), "--attn", args.attn, "--device", args.device, "--dtype", args.dtype,
               "--generate", str(args.generate), "--dims", args.dims]
    started = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "length": length, "error": f"timeout after {args.timeout} s"}
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["killed (out of memory?)"]
        return {"model": model, "length": length, "error": f"exit {result.returncode}: {tail[0]}"}
    cell = json.loads(result.stdout.strip().splitlines()[-1])
    cell["wall_seconds"] = time.perf_counter() - started
    return cell


def table(cells: list[dict]) -> str:
    """Memory: on a CPU the process's peak RSS above its RSS once the weights and inputs exist (where a cell could not
    reset the peak, not Linux, the whole process's peak, VCC's with the T5 copy); on a GPU, the CUDA allocator's peak
    above the weights and inputs."""
    by_key = {(cell["model"], cell["length"]): cell for cell in cells}
    measured = [cell for cell in cells if "error" not in cell]
    if any("peak_cuda_above_start_mib" in cell for cell in measured):
        memory_key, memory_name = "peak_cuda_above_start_mib", "peak CUDA above weights"
    elif all(cell.get("peak_rss_above_baseline_mib") is not None for cell in measured):
        memory_key, memory_name = "peak_rss_above_baseline_mib", "peak RSS above weights"
    else:
        memory_key, memory_name = "peak_rss_mib", "peak RSS of the process"
    lines = [
        f"| tokens | VCC time (s) | VCC {memory_name} (MiB) | VCC r | T5 time (s) | T5 {memory_name} (MiB) | "
        "T5 / VCC time | T5 / VCC memory |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length in sorted({cell["length"] for cell in cells}):
        vcc, t5 = by_key.get(("vcc", length)), by_key.get(("t5", length))

        def fmt(cell, key, digits=2):
            if cell is None:
                return "-"
            if "error" in cell:
                return cell["error"]
            return f"{cell[key]:.{digits}f}"

        ratio_time = ratio_memory = "-"
        if vcc and t5 and "error" not in vcc and "error" not in t5:
            ratio_time = f"{t5['seconds_median'] / vcc['seconds_median']:.1f}x"
            ratio_memory = f"{t5[memory_key] / vcc[memory_key]:.1f}x" if vcc[memory_key] else "-"
        lines.append(
            f"| {length} | {fmt(vcc, 'seconds_median')} | {fmt(vcc, memory_key, 0)} | "
            f"{vcc.get('compressed_length', '-') if vcc else '-'} | {fmt(t5, 'seconds_median')} | "
            f"{fmt(t5, memory_key, 0)} | {ratio_time} | {ratio_memory} |"
        )
    return "\n".join(lines)


#: What a cell measures (its key in ``--jsonl``) and how (a rerun resumes only cells measured the same way).
KEY = ("model", "length", "device", "dtype", "attention", "dims", "generate")
SETTINGS = ("threads", "repeats")


def cell_key(cell: dict) -> tuple:
    return tuple(cell.get(name) for name in KEY)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vcc_lengths", type=int, nargs="*", default=[8192, 16384, 65536])
    parser.add_argument("--t5_lengths", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--timeout", type=int, default=1800, help="Seconds per cell.")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--generate", type=int, default=0, metavar="TOKENS",
                        help="Time generate() of this many new tokens (greedy), the whole seq2seq model, instead of "
                             "the encoder.")
    parser.add_argument("--dims", choices=list(DIMS), default="small",
                        help="small: d_model 64 (the default); base: the released t5-base's dimensions.")
    from run_all import add_journal_arguments, check_journal_arguments  # run_all.py is beside this script

    add_journal_arguments(parser)
    parser.add_argument("--cell", nargs=2, metavar=("MODEL", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generate < 0:
        parser.error(f"--generate must be 0 (the encoder) or a number of new tokens, got {args.generate}")
    bad = [length for length in args.vcc_lengths + args.t5_lengths if length < 1]
    if bad:
        parser.error(f"--vcc_lengths and --t5_lengths must be positive token counts, got {bad}")
    check_journal_arguments(parser, args)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell(args.cell[0], int(args.cell[1]), args.threads, args.repeats, args.attn, args.device,
                                  args.dtype, args.generate, args.dims)))
        return []
    from run_all import measure_with_journal  # run_all.py is beside this script

    settings = dict(device=args.device, dtype=args.dtype, attention=args.attn, dims=args.dims,
                    generate=args.generate, threads=args.threads, repeats=args.repeats)
    planned = [dict(settings, model=model, length=length)
               for model, lengths in (("vcc", args.vcc_lengths), ("t5", args.t5_lengths)) for length in lengths]
    # the settings recorded in each cell (an error cell too), beside what it measured
    cells = measure_with_journal(
        args, planned, cell_key, SETTINGS, lambda cell: f"{cell['model']} {cell['length']}",
        lambda cell: {**run_in_subprocess(cell["model"], cell["length"], args), **settings})
    print()
    print(table(cells))
    return cells


if __name__ == "__main__":
    main()
