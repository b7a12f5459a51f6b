"""One training step (forward + backward, batch 1) of LOCOST and its peers, eager against ``torch.compile``: the
question the GPU profile left (``benchmarks/results/cuda.md``: LOCOST's bfloat16 step at 16K launches twice as many
operators as LongT5-local's and the GPU waits for the host). LOCOST's training forward compiles as one graph, so a
compiled step runs without returning to Python between operators, and with CUDA graphs (``--modes reduce-overhead``)
without launching them one by one either.

``--scope blocks`` compiles each block on its own instead of the whole forward (transformers' "regional
compilation"): a stack's blocks share their compiled code, so it compiles about one encoder and one decoder block's
worth. On this project's 2-core CPU, tracing the whole released-size LOCOST step took 68 s (``aot_eager``, 64 tokens,
the accelerator's code paths) and its blocks 14 s.

Same models, sizes and inputs as ``run_all.py``'s ``train`` cells (``run_all.build_model``, ``run_all.make_run``);
per model and mode: the first step (compilation included) and the median of the timed steps after it, and the ratio
of each mode's median to eager's. ``--modes reduce-overhead`` (CUDA graphs) is for CUDA only.

    python benchmarks/benchmark_compiled_step.py --device cuda --dtype bfloat16 --lengths 4096 16384
    python benchmarks/benchmark_compiled_step.py --device cuda --dtype bfloat16 --lengths 16384 --scope blocks \
        --modes eager default reduce-overhead
    python benchmarks/benchmark_compiled_step.py --device cuda --dtype bfloat16 --lengths 16384 --scope blocks \
        --profile 30    # then one more step profiled: its device time, kernels, and operators by device time
    python benchmarks/benchmark_compiled_step.py --quick --backend aot_eager    # smoke run on the CPU

On an H100 that profile found the compiled step copying whole complex buffers (``ssm._geometric``; fixed), and with
CUDA graphs LOCOST's step at 16K then took 0.124 s against 0.231 s eager (``benchmarks/results/cuda.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch
from torch.autograd import DeviceType

import run_all
from profile_step import profile_table
from longreach.modeling import ssm, t5_blocks


def time_steps(model_name: str, length: int, mode: str, args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.unfused_feed_forward:  # LOCOST's feed-forward sublayers through their modules, not the fused function
        t5_blocks.T5LayerFF._fused_dropout_p = lambda self, hidden_states: None
    if args.feed_forward_step_elements:  # LOCOST's memory-saving feed-forward function: elements per step
        name = "FEED_FORWARD_STEP_ELEMENTS" if device.type == "cpu" else "ACCELERATOR_FEED_FORWARD_STEP_ELEMENTS"
        setattr(t5_blocks, name, args.feed_forward_step_elements)
    if args.fft_block_elements:  # LOCOST's FFT convolution: FFT elements per block of channels
        ssm.FFT_BLOCK_ELEMENTS = args.fft_block_elements
    sizes = run_all.TINY if args.quick else run_all.RELEASED
    torch.manual_seed(0)
    with device:
        model = run_all.build_model(model_name, sizes, length)
    model = model.to(dtype=dtype)
    input_ids = torch.randint(3, sizes["vocab_size"], (1, length), device=device)
    labels = torch.randint(3, sizes["vocab_size"], (1, sizes["summary_length"]), device=device)
    model.train()
    model.config.use_cache = False
    forward = model.forward
    compiled_graphs = 0
    if mode != "eager":
        torch._dynamo.reset()
        options = {"backend": args.backend} if args.backend != "inductor" else {"mode": None if mode == "default"
                                                                                  else mode}
        if args.scope == "model":
            forward = torch.compile(model.forward, **options)
            compiled_graphs = 1
        else:  # regional compilation: each block (the model's `_no_split_modules`) on its own, one graph for all
            blocks = [module for module in model.modules() if type(module).__name__ in model._no_split_modules]
            for block in blocks:
                # static sizes: encoder and decoder blocks enter through one frame (transformers'
                # `forward_with_checkpointing`), so the decoder's first call recompiles it, with symbolic sizes unless
                # told otherwise; the lengths here never change
                block.compile(dynamic=False, **options)
            compiled_graphs = len(blocks)

    def step():
        model.zero_grad(set_to_none=True)
        loss = forward(input_ids=input_ids, labels=labels).loss
        loss.backward()
        return loss

    def timed():
        run_all.synchronize(device)
        started = time.perf_counter()
        loss = step()
        run_all.synchronize(device)
        return time.perf_counter() - started, loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, loss = timed()
    if not torch.isfinite(loss):
        raise RuntimeError(f"{model_name} ({mode}): non-finite loss")
    seconds = [timed()[0] for _ in range(args.repeats)]
    peak = {"peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {}
    profile = profile_one_step(timed, device, args.profile, f"{model_name}, {length} tokens, {mode}") \
        if args.profile else {}
    return {**profile, **peak, "model": model_name, "length": length, "mode": mode, "device": args.device,
            "dtype": args.dtype,
            "backend": "eager" if mode == "eager" else args.backend, "first_step_seconds": first,
            "feed_forward_step_elements": args.feed_forward_step_elements or "default",
            "fft_block_elements": args.fft_block_elements or ssm.FFT_BLOCK_ELEMENTS,
            "scope": "-" if mode == "eager" else args.scope, "compiled_modules": compiled_graphs,
            "unfused_feed_forward": args.unfused_feed_forward,
            "seconds": statistics.median(seconds), "seconds_all": seconds}


def profile_one_step(timed, device: torch.device, rows: int, title: str) -> dict:
    """One more step under ``torch.profiler``: prints the operators with the most device time (``profile_step``'s
    table; compiled code shows as its generated kernels and the operators it falls back to) and returns the step's
    device time, host time and number of kernels launched (on CUDA; on the CPU, the operator calls)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        wall, _ = timed()
    events = profiler.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    device_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in kernels) if device.type == "cuda" else sum(
        e.count for e in events if e.device_type == DeviceType.CPU)
    print(f"\n{title}: profiled step {wall:.3f} s, device time {device_ms:.1f} ms, "
          f"{launches} {'kernels' if device.type == 'cuda' else 'operator calls'}")
    print("\n".join(profile_table(list(events), device, rows)), flush=True)
    return {"profiled_step_seconds": wall, "profiled_device_ms": device_ms, "profiled_launches": launches}


def markdown(rows: list[dict]) -> str:
    eager = {(row["model"], row["length"]): row["seconds"] for row in rows if row["mode"] == "eager"}
    lines = ["| tokens | model | mode | scope | first step (s) | step (s, median) | eager / this |",
             "|---:|---|---|---|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['length']} | {row['model']} | {row['mode']} | | {row['error']} | | |")
            continue
        base = eager.get((row["model"], row["length"]))
        ratio = f"{base / row['seconds']:.2f}" if base else "-"
        lines.append(f"| {row['length']} | {row['model']} | {row['mode']} | {row['scope']} | "
                     f"{row['first_step_seconds']:.2f} | {row['seconds']:.3f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["locost", "longt5-local"], choices=run_all.MODELS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--modes", nargs="+", default=["eager", "default"],
                        choices=["eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs"])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: a smoke run).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3, help="Timed steps after the first.")
    parser.add_argument("--quick", action="store_true", help="Tiny models (a smoke run, not a measurement).")
    parser.add_argument("--scope", choices=["model", "blocks"], default="model",
                        help="Compile the whole forward (model) or each block on its own (blocks: transformers' "
                             "'regional compilation'; the blocks of a stack share their compiled code, so it compiles "
                             "about one block's worth, and the Python between blocks stays eager).")
    parser.add_argument("--unfused_feed_forward", action="store_true",
                        help="Run LOCOST's feed-forward sublayers through their modules instead of the fused "
                             "memory-saving function in eager steps too (compiled steps always do).")
    parser.add_argument("--feed_forward_step_elements", type=int, default=None,
                        help="Elements per step of LOCOST's memory-saving feed-forward function (default: the "
                             "library's for the device).")
    parser.add_argument("--fft_block_elements", type=int, default=None,
                        help="FFT elements per block of channels in LOCOST's FFT convolution "
                             f"(default: the library's, {ssm.FFT_BLOCK_ELEMENTS}; 2**40: all channels at once).")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="After the timed steps, profile one more and print this many operators by device time.")
    parser.add_argument("--json", default=None, help="Also write the rows to this file.")
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(length < 1 for length in args.lengths):
        raise ValueError(f"`--repeats` and `--lengths` must be positive, got {args.repeats} and {args.lengths}.")
    if args.feed_forward_step_elements is not None and args.feed_forward_step_elements < 1:
        raise ValueError(f"`--feed_forward_step_elements` must be positive, got {args.feed_forward_step_elements}.")
    if args.fft_block_elements is not None and args.fft_block_elements < 1:
        raise ValueError(f"`--fft_block_elements` must be positive, got {args.fft_block_elements}.")
    if args.backend != "inductor" and any(mode not in ("eager", "default") for mode in args.modes):
        raise ValueError(f"`--modes` {args.modes}: modes other than eager and default need the inductor backend, "
                         f"got --backend {args.backend}.")
    rows = []
    for length in args.lengths:
        for model_name in args.models:
            for mode in args.modes:
                try:
                    row = time_steps(model_name, length, mode, args)
                except Exception as error:  # noqa: BLE001  a cell that fails (out of memory, a compile error) is a row
                    traceback.print_exc()  # the whole story goes to the log; the row says what failed
                    message = (str(error).splitlines() or [""])[0][:120]
                    row = {"model": model_name, "length": length, "mode": mode,
                           "error": f"{type(error).__name__}: {message}"}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(markdown(rows))
    if args.json:
        run_all.write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
