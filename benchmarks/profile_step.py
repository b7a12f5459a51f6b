"""Where the time of one benchmark cell goes: ``torch.profiler``'s table of one run of a ``run_all.py`` cell (same
model, sizes, inputs and timed function, ``run_all.make_run``), by operator, for LOCOST and any peer, on CPU or CUDA.

``run_all.py`` says how long a cell takes; this says why, which is what issue 10 asks for where a target is missed
(for example the training step on a GPU, where LOCOST takes about twice LongT5-local's time). One warm-up run, then
one profiled run; the table is sorted by self time (device time on CUDA), with each operator's share of the total, and
a summary line: wall time of the profiled run, the number of operator calls and, on CUDA, the device time against the
host time (launch-bound when the host's exceeds the device's).

Usage::

    python benchmarks/profile_step.py --model locost --task train --length 1024
    python benchmarks/profile_step.py --model longt5-local --task train --length 1024 --out profile.md
    python benchmarks/profile_step.py --device cuda --dtype bfloat16 --model locost --task train --length 16384
    python benchmarks/profile_step.py --quick --model locost --task train_ckpt --length 64    # tiny smoke run

Tasks: ``encode``, ``train``, ``train_ckpt`` and ``generate``, as in ``run_all.py``. ``--out`` appends the table to a
Markdown file (written to a temporary name and renamed into place).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from run_all import (
    MODELS, RELEASED, TASKS, TINY, build_model, check_device_here, machine_description, make_run, synchronize,
)


def profile_table(events, device: torch.device, rows: int) -> list[str]:
    """Markdown rows: the operators with the most self time, their calls and share. On CUDA an operator's time is
    the device time of the kernels it launched itself (``self_device_time_total`` of the host-side operator); the
    kernels' own rows are left out, as they would count that time twice."""
    events = [e for e in events if e.device_type == DeviceType.CPU]
    attribute = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in events if getattr(e, attribute) > 0]
    total = sum(getattr(e, attribute) for e in events) or 1
    events.sort(key=lambda e: getattr(e, attribute), reverse=True)
    kind = "device" if device.type == "cuda" else "CPU"
    lines = [f"| operator | calls | self {kind} time (ms) | share |", "| --- | ---: | ---: | ---: |"]
    for event in events[:rows]:
        value = getattr(event, attribute)
        lines.append(f"| `{event.key[:60]}` | {event.count} | {value / 1e3:.1f} | {100 * value / total:.1f}% |")
    rest = sum(getattr(e, attribute) for e in events[rows:])
    if rest:
        lines.append(f"| (the other {len(events) - rows} operators) | | {rest / 1e3:.1f} | {100 * rest / total:.1f}% |")
    return lines


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="locost")
    parser.add_argument("--task", choices=TASKS, default="train")
    parser.add_argument("--length", type=int, default=1024, help="Input tokens.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    parser.add_argument("--rows", type=int, default=25, help="Operators in the table.")
    parser.add_argument("--quick", action="store_true", help="Tiny model (a smoke run, not a measurement).")
    parser.add_argument("--out", default=None, help="Append the table to this Markdown file.")
    args = parser.parse_args(argv)
    check_device_here(parser, args.device)
    if args.length < 1:
        parser.error(f"--length must be at least 1, got {args.length}")
    if args.rows < 1:
        parser.error(f"--rows must be at least 1, got {args.rows}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    sizes = TINY if args.quick else RELEASED
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with device:
        model = build_model(args.model, sizes, args.length)
    model = model.to(dtype=dtype)
    input_ids = torch.randint(3, sizes["vocab_size"], (1, args.length), device=device)
    labels = torch.randint(3, sizes["vocab_size"], (1, sizes["summary_length"]), device=device)
    run = make_run(model, args.task, input_ids, labels, sizes["summary_length"])

    run()  # warm-up: kernels compiled, caches and allocator filled
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        run()
        synchronize(device)
        wall = time.perf_counter() - start
    events = list(profiler.key_averages())
    operators = [e for e in events if e.device_type == DeviceType.CPU]
    calls = sum(e.count for e in operators)
    summary = f"profiled run: {wall:.3f} s wall clock (under the profiler), {calls} operator calls"
    if device.type == "cuda":  # the kernels' own events for the device's busy time; operators' self CPU for the host
        device_ms = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU) / 1e3
        host_ms = sum(e.self_cpu_time_total for e in operators) / 1e3
        summary += f"; device time {device_ms:.1f} ms (kernels), host time {host_ms:.1f} ms (operators)"
    title = (f"### {args.model}, {args.task}, {args.length} tokens, {args.dtype}, {device.type}"
             f"{' (quick: tiny model)' if args.quick else ''}")
    lines = [title, "", machine_description(device) + f"; {torch.get_num_threads()} threads", "", summary, "",
             *profile_table(events, device, args.rows), ""]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        previous = out.read_text(encoding="utf-8") if out.exists() else ""
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=out.parent, delete=False, suffix=".tmp") as handle:
            handle.write(previous + ("\n" if previous and not previous.endswith("\n\n") else "") + text)
        os.replace(handle.name, out)
    return text


if __name__ == "__main__":
    main()
