"""All speed and memory benchmarks in one command: a Markdown report and PNG plots in ``benchmarks/results/``.

LOCOST suite (issue 10): LOCOST beside transformers' LongT5 (local and transient-global attention), LED and T5, all at
the released LOCOST size (d_model 768, d_ff 2048, 12 + 12 layers, 12 heads of 64, gated-GELU for the T5 family;
LED with the same widths and a 512-token window), random weights (cost does not depend on the values), batch 1:

* ``encode``: encoder forward under ``torch.no_grad()``. LOCOST's kernel cache is emptied before every run, so each
  run pays for its kernels (a new length); repeated calls at one length would not.
* ``train`` / ``train_ckpt``: one training step (forward + backward of the LM loss on ``--summary_length`` labels),
  without / with gradient checkpointing.
* ``generate``: ``generate()`` end to end, greedy, exactly ``--summary_length`` new tokens.
* ``scale``: LOCOST alone, encode at ``--scale_lengths`` (default 100K to 1M tokens, the long-input path).

Each cell runs in its own Python process. It reports the median time of ``--repeats`` runs after one counted warm-up
run, the peak tensor memory *above the weights* allocated during the first run (CUDA: the allocator's peak; CPU: the
running total that torch's CPU allocator reports to the profiler; see ``peak_tensor_bytes``; the process's peak RSS
is kept in the cells too), the matmul FLOPs of one run counted in another process (``torch.utils.flop_counter``:
matmuls, convolutions and attention; FFTs and elementwise work not counted), the achieved GFLOP/s and, measured in
the timing process, the GFLOP/s of plain [1024, 1024] matmuls (the roofline). LOCOST cells also time the layer-0 SSM kernel against the matmul of its own
multiply-adds (on CPU both kernels: the compiled one and the torch ops). Ratios in the report come from cells of the same run.

The VCC-T5 and Dodo suites run ``benchmark_vcc_t5.py`` (VCC-T5 vs T5) and ``benchmark_dodo.py`` (Dodo vs Llama with the
full cache, and the training-memory comparison) and include their tables. Each script runs as one process under one
``--timeout`` and appends its cells or rows to ``vcc_t5.jsonl``, ``dodo.jsonl`` and ``dodo_training.jsonl`` as they
finish: a timeout or a crash keeps them (the section says which and shows them) and a rerun resumes there.

On a GPU, ``--in_process`` runs the cells one after another in this process (the CUDA allocator's peak is reset
before each cell and its cache emptied after it; CUDA start-up and imports are paid once): it is for device time that
is short; memory figures stay per cell, but kernels compiled or tuned by an earlier cell are not timed again.

Results are appended to ``cells.jsonl`` as each cell finishes; a rerun skips the cells already there (delete the file,
or pass ``--fresh``, to measure again). Each cell records how it was measured, among that its thread count
(``--threads``, else torch's default) and the CPU SSM kernel (compiled, or the torch ops with
``LONGREACH_SSM_KERNEL=torch``): a rerun refuses finished cells measured otherwise, and ``--report_only`` refuses cells
or script reports of several devices, dtypes, thread counts or SSM kernels, so that no table mixes them.
``--quick`` uses tiny models and lengths (a smoke run, not a measurement).

Usage::

    python benchmarks/run_all.py                                   # everything, CPU, 1K..64K (hours)
    python benchmarks/run_all.py --suites locost --tasks encode --lengths 1024 4096 16384
    python benchmarks/run_all.py --device cuda --dtype bfloat16 --out benchmarks/results/cuda-bf16
    python benchmarks/run_all.py --device cuda --in_process --cells_only --out /tmp/cells   # a short GPU lease
    python benchmarks/run_all.py --quick                           # tiny smoke run (about a minute)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

RELEASED = dict(vocab_size=32100, d_model=768, d_ff=2048, num_layers=12, num_heads=12, d_kv=64, d_state=512,
                summary_length=256, local_radius=127, global_block_size=16, attention_window=512)
TINY = dict(vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, d_state=16,
            summary_length=8, local_radius=8, global_block_size=4, attention_window=16)
MODELS = ["locost", "longt5-local", "longt5-tglobal", "led", "t5"]
TASKS = ["encode", "train", "train_ckpt", "generate"]
DEFAULT_LENGTHS = [1024, 4096, 16384, 65536]
QUICK_LENGTHS = [64, 128]
DEFAULT_SCALE_LENGTHS = [100_000, 250_000, 500_000, 1_000_000]


# ---------------------------------------------------------------------------------------------------------------------
# One cell (runs in its own process)
# ---------------------------------------------------------------------------------------------------------------------


def build_model(name: str, sizes: dict, length: int):
    """A seq2seq model with the given sizes and random weights (dropout off)."""
    import transformers

    t5_sizes = dict(vocab_size=sizes["vocab_size"], d_model=sizes["d_model"], d_ff=sizes["d_ff"],
                    num_layers=sizes["num_layers"], num_heads=sizes["num_heads"], d_kv=sizes["d_kv"],
                    feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                    decoder_start_token_id=0)
    if name == "locost":
        from longreach import LocostConfig, LocostForConditionalGeneration

        return LocostForConditionalGeneration(LocostConfig(**t5_sizes, d_state=sizes["d_state"]))
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(**t5_sizes))
    if name in ("longt5-local", "longt5-tglobal"):
        attention = "local" if name == "longt5-local" else "transient-global"
        config = transformers.LongT5Config(**t5_sizes, encoder_attention_type=attention,
                                           local_radius=sizes["local_radius"],
                                           global_block_size=sizes["global_block_size"])
        return transformers.LongT5ForConditionalGeneration(config)
    if name == "led":
        config = transformers.LEDConfig(
            vocab_size=sizes["vocab_size"], d_model=sizes["d_model"], encoder_layers=sizes["num_layers"],
            decoder_layers=sizes["num_layers"], encoder_attention_heads=sizes["num_heads"],
            decoder_attention_heads=sizes["num_heads"], encoder_ffn_dim=sizes["d_ff"], decoder_ffn_dim=sizes["d_ff"],
            attention_window=sizes["attention_window"], dropout=0.0, attention_dropout=0.0,
            max_encoder_position_embeddings=max(length + sizes["attention_window"], 1024),
            max_decoder_position_embeddings=max(sizes["summary_length"] + 2, 1024),
        )
        return transformers.LEDForConditionalGeneration(config)
    raise ValueError(f"`model` must be one of {MODELS}, got {name!r}.")


def rss_bytes(field: str = "VmRSS") -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (Linux ≥ 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_tensor_bytes(run, device) -> tuple[int | None, str, int | None]:
    """``(peak tensor bytes allocated during run() above those allocated before it, how it was measured, peak RSS
    above the RSS before it)``.

    CUDA: the caching allocator's statistics. CPU: the running total of allocated bytes that torch's CPU allocator
    reports to the profiler (``profile_memory=True``) with every allocation and free, the CPU counterpart of
    ``max_memory_allocated`` (frees of tensors allocated before the run are not counted, which can only overstate
    the peak). The process's peak RSS (Linux ``VmHWM`` reset through ``/proc/self/clear_refs``) is kept beside it:
    it is what the machine must have, but glibc keeps freed heap memory and its fragmentation depends on the order of
    allocations, so at 2K tokens a LOCOST training step with checkpointing had a tensor peak of 1.1 GB and an RSS peak
    of 3.6 to 4.8 GB from run to run of the same code: not a measure to compare models by.
    """
    import torch

    rss_reset = device.type == "cpu" and reset_peak_rss()
    rss_before = rss_bytes() if rss_reset else None
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        synchronize(device)
        return torch.cuda.max_memory_allocated() - before, "cuda max_memory_allocated", None
    if device.type != "cpu":
        run()
        return None, "unavailable", None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    rss_above = rss_bytes("VmHWM") - rss_before if rss_before is not None else None
    return profiled_peak_bytes(profiler), "cpu allocator total (profiler)", rss_above


def profiled_peak_bytes(profiler) -> int:
    """The peak of the CPU allocator's running total during a ``profile(profile_memory=True)`` session, above its value
    when the session started. The total carries over from earlier sessions in the same process (tensors allocated
    while profiling and freed outside it are never subtracted), so the raw peak of a later session counted them."""
    from torch._C._profiler import _EventType

    nodes, events = list(profiler.profiler.kineto_results.experimental_event_tree()), []
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            events.append((node.start_time_ns, node.extra_fields.total_allocated, node.extra_fields.alloc_size))
    if not events:
        return 0
    events.sort()
    start = events[0][1] - events[0][2]  # the total before the session's first allocation (or free)
    return max(total for _, total, _ in events) - start


def roofline_size(device) -> int:
    """Side of the square matmuls of the roofline: 1024 on a CPU; 4096 on a GPU, which a 1024 product cannot fill."""
    import torch

    return 1024 if torch.device(device).type == "cpu" else 4096


def matmul_seconds(flops: float, dtype, device, trials: int = 3) -> float:
    """Time of plain [size, size] @ [size, size] matmuls (``roofline_size``), scaled to ``flops``: the best of
    ``trials`` timings of at least 5 matmuls each. (One timing of 2 matmuls, as before, read 18.6 ms for the 1K
    kernel's FLOPs in a cell whose roofline read 140 GFLOP/s, i.e. 11.5 ms: the kernel's ratio looked 1.6x better.)"""
    import torch

    size = roofline_size(device)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    repeats = max(5, min(200, round(flops / (2 * size**3))))
    a @ b  # warm-up
    synchronize(device)
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best * flops / (repeats * 2 * size**3)


def host_description() -> str:
    """This machine: the platform, the CPU count and the widest vector instructions torch uses on it (two "AMD EPYC"
    machines of this project's runs differed by that: AVX2 against AVX512)."""
    import torch

    text = f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return f"{text} ({capability})" if capability else text


def machine_description(device) -> str:
    """Where a cell ran: :func:`host_description`, the GPU's name, torch and transformers versions."""
    import torch
    import transformers

    text = host_description()
    if torch.device(device).type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    return text + f"; torch {torch.__version__}, transformers {transformers.__version__}"


def roofline_gflops(dtype, device) -> float:
    """GFLOP/s of 20 plain square matmuls of ``roofline_size``."""
    flops = 20 * 2 * roofline_size(device) ** 3
    return flops / matmul_seconds(flops, dtype, device) / 1e9


def synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def kernel_versus_matmul(model, length: int, dtype, device) -> dict:
    """Layer-0 SSM kernel time against a plain matmul of its multiply-adds (2·directions·H·N·L FLOPs). On CPU both
    kernels are timed: the compiled one (``ssm_cpu_kernel``, the default where a C compiler works) and the torch ops
    (``LONGREACH_SSM_KERNEL=torch``); ``kernel_seconds`` is the one the model uses by default."""
    import torch

    from longreach.modeling import ssm_cpu_kernel

    conv = model.get_encoder().block[0].layer[0].ssm.conv

    def best_of_3() -> float:
        with torch.no_grad():
            conv.kernel(length)
            synchronize(device)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                conv.kernel(length)
                synchronize(device)
                times.append(time.perf_counter() - start)
        return min(times)

    directions = 2 if conv.bidirectional else 1
    flops = 2 * directions * conv.channels * 2 * conv.modes * length
    matmul = matmul_seconds(flops, torch.float32, device)
    result = {"kernel_seconds": best_of_3(), "kernel_matmul_seconds": matmul}
    if torch.device(device).type == "cpu":
        from longreach.modeling.ssm import _lag_chunks

        chunk, num_chunks = _lag_chunks(directions, length, conv.kernel_chunk_size)
        compiled = ssm_cpu_kernel.compiled_kernel_usable(chunk * num_chunks, conv.C)  # the rule s4d_kernel applies
        result["kernel_backend"] = "compiled" if compiled else "torch"
        saved = os.environ.get(ssm_cpu_kernel.BACKEND_VARIABLE)
        os.environ[ssm_cpu_kernel.BACKEND_VARIABLE] = "torch"
        try:
            result["kernel_torch_seconds"] = best_of_3()
            result["kernel_torch_over_matmul"] = result["kernel_torch_seconds"] / matmul
        finally:
            if saved is None:
                del os.environ[ssm_cpu_kernel.BACKEND_VARIABLE]
            else:
                os.environ[ssm_cpu_kernel.BACKEND_VARIABLE] = saved
    result["kernel_over_matmul"] = result["kernel_seconds"] / matmul
    return result


def make_run(model, task: str, input_ids, labels, summary_length: int):
    """The function a cell times for ``task`` (``profile_step.py`` profiles the same one): the model is put in the
    task's mode, LOCOST's kernel cache is emptied before every encode run, and outputs are checked."""
    import torch

    ssm_layers = [module for module in model.modules() if hasattr(module, "clear_kernel_cache")]

    if task in ("encode", "scale"):
        model.eval()
        encoder = model.get_encoder()

        def run():
            for layer in ssm_layers:
                layer.clear_kernel_cache()
            with torch.no_grad():
                output = encoder(input_ids=input_ids).last_hidden_state
            if not torch.isfinite(output).all():
                raise RuntimeError("non-finite encoder output")
    elif task in ("train", "train_ckpt"):
        model.train()
        model.config.use_cache = False
        if task == "train_ckpt":
            model.activation_checkpointing_enable()

        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=input_ids, labels=labels).loss.backward()
    elif task == "generate":
        model.eval()

        def run():
            output = model.generate(input_ids, max_new_tokens=summary_length,
                                    min_new_tokens=summary_length, do_sample=False, num_beams=1)
            if output.shape[1] < summary_length:
                raise RuntimeError(f"generated {output.shape[1]} tokens")
    else:
        raise ValueError(f"`task` must be one of {TASKS + ['scale']}, got {task!r}.")
    return run


def run_cell(cell: dict) -> dict:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if cell.get("threads"):
        torch.set_num_threads(cell["threads"])
    torch.manual_seed(0)
    sizes = TINY if cell["quick"] else RELEASED
    device, dtype = torch.device(cell["device"]), getattr(torch, cell["dtype"])
    task, length = cell["task"], cell["length"]
    with device:  # initialised where it runs (a GPU initialises the 250M parameters in a fraction of the time)
        model = build_model(cell["model"], sizes, length)
    model = model.to(dtype=dtype)
    input_ids = torch.randint(3, sizes["vocab_size"], (1, length), device=device)
    labels = torch.randint(3, sizes["vocab_size"], (1, sizes["summary_length"]), device=device)
    run = make_run(model, task, input_ids, labels, sizes["summary_length"])

    gc.collect()
    if cell.get("count_flops"):
        # a process of its own (see run_counted_cell): the counter keeps tensors alive (a checkpointed step's peak
        # went from 1.9 to 4.1 GB), which ran LongT5 with transient-global attention out of memory at 16K tokens
        counter = FlopCounterMode(display=False)
        with counter:
            run()
        return {"flops": counter.get_total_flops()}
    # the warm-up run is also the memory run
    peak_above, memory_method, rss_above = peak_tensor_bytes(run, device)
    times = []
    for _ in range(cell["repeats"]):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    result = {
        **cell,
        "seconds": seconds,
        "seconds_all": times,
        "peak_memory_above_weights_bytes": peak_above,
        "memory_method": memory_method,
        "peak_rss_above_start_bytes": rss_above,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "threads_used": torch.get_num_threads(),
        "machine": machine_description(device),
        # the roofline, in this process: GFLOP/s of plain square matmuls (1024 on a CPU, 4096 on a GPU)
        "matmul_gflops": roofline_gflops(dtype, device),
    }
    if cell["model"] == "locost" and task == "encode":
        result.update(kernel_versus_matmul(model, length, device=device, dtype=dtype))
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------


def cell_key(cell: dict) -> tuple:
    return tuple(cell[name] for name in ("suite", "model", "task", "length", "device", "dtype", "quick"))


#: How a cell was measured beyond its key: a rerun resumes only cells measured the same way. ``threads`` is the count
#: the cell ran with (``--threads``, or torch's default where it is not given) and ``ssm_kernel`` the CPU SSM kernel
#: (:func:`ssm_kernel_setting`): either one changes every LOCOST time, so cells of two settings are never one table.
CELL_SETTINGS = ("threads", "repeats", "in_process", "skip_flops", "ssm_kernel")


def describe_cell(cell: dict) -> str:
    return f"{cell['model']} {cell['task']} {cell['length']}"


def check_resumed_settings(cells: list[dict], finished: dict, results: Path, key=cell_key, settings=CELL_SETTINGS,
                           describe=describe_cell, elsewhere: str = "another --out") -> None:
    """A rerun skips the cells already in ``results`` (a JSONL file); one measured with other ``settings`` would be
    reported beside the new ones as if measured alike, so it is refused (measure again with ``--fresh`` or
    ``elsewhere``). ``finished``: ``{key(cell): cell}`` of the finished cells; ``cells``: those this run would measure.
    The benchmark scripts that ``run_all`` runs check their rows with it too."""
    for cell in cells:
        earlier = finished.get(key(cell))
        if earlier is None:
            continue
        differ = [name for name in settings if earlier.get(name) != cell.get(name)]
        if differ:  # (in_process and skip_flops are recorded only when set)
            shown = ", ".join(f"{name} {repr(earlier[name]) if name in earlier else 'not recorded'} there, "
                              f"{cell.get(name)!r} now" for name in differ)
            raise SystemExit(f"{results} holds the {describe(cell)} cell measured otherwise ({shown}): pass --fresh "
                             f"to measure again, or {elsewhere}.")


def load_cells(path: Path) -> list[dict]:
    """The cells (or rows) of a JSONL file; a last line cut short by a kill during its write is left out."""
    if not Path(path).exists():
        return []
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    cells = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            cells.append(json.loads(line))
        except json.JSONDecodeError:
            if index < len(lines) - 1:  # only the last line, without its newline, can be half written
                raise
    return cells


def append_cell(path: Path, cell: dict) -> None:
    """Append ``cell`` as one JSON line and flush it to disk. A last line cut short by a kill (no newline at its end,
    which :func:`load_cells` leaves out) is dropped first: written after it, the new cell would join it in one line
    that no later run could read."""
    with open(path, "a+b") as handle:
        if handle.seek(0, os.SEEK_END):
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.seek(0)
                handle.truncate(handle.read().rfind(b"\n") + 1)
        handle.write((json.dumps(cell) + "\n").encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def failed(row: dict) -> bool:
    """A cell or row that measured nothing (an error, a timeout, a skip): measured again by a rerun."""
    return "error" in row or "skipped" in row


def resume_rows(path, planned: list[dict], key, settings, describe, fresh: bool = False) -> dict:
    """``{key(row): row}`` of the rows of ``planned`` already finished in the JSONL file ``path`` (``--jsonl`` of
    the benchmark scripts), the same pattern as ``cells.jsonl``: rows are appended as they finish, a rerun skips the
    finished ones and refuses those measured with other ``settings`` (names of row fields). ``fresh``: the file is
    emptied first."""
    path = Path(path)
    if fresh:
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    finished = {key(row): row for row in load_cells(path) if not failed(row)}
    check_resumed_settings(planned, finished, path, key=key, settings=settings, describe=describe,
                           elsewhere="another --jsonl")
    return {key(row): finished[key(row)] for row in planned if key(row) in finished}


def latest_rows(path, planned: list[dict], key) -> list[dict]:
    """The last row of each of ``planned`` in the JSONL file ``path`` (a failed one where it was not measured
    since), in ``planned``'s order: the rows of a table."""
    last = {key(row): row for row in load_cells(path)}
    rows = [last[key(row)] for row in planned if key(row) in last]
    return list({id(row): row for row in rows}.values())  # a row planned twice (a length given twice) once


def add_journal_arguments(parser, what: str = "cells") -> None:
    """``--json``, ``--jsonl``, ``--fresh`` and ``--report_only`` of the benchmark scripts (``what``: their cells or
    rows), read back by :func:`check_journal_arguments`."""
    parser.add_argument("--json", default=None,
                        help=f"Also write the {what} to this file, rewritten after each one under a temporary name. "
                             f"Unless --jsonl is given, the {what} are also appended to the same path ending in .jsonl.")
    parser.add_argument("--jsonl", default=None,
                        help=f"Append each finished one of the {what} to this file (flushed); a rerun with the same "
                             f"settings skips those already there and refuses {what} measured otherwise.")
    parser.add_argument("--fresh", action="store_true", help=f"Forget the {what} already in --jsonl.")
    parser.add_argument("--report_only", action="store_true",
                        help=f"Measure nothing: print the table of the {what} already in --jsonl.")


def check_journal_arguments(parser, args, what: str = "cells") -> None:
    """``args.jsonl`` made the journal's path (:func:`journal_path`), and ``--report_only`` checked against it."""
    args.jsonl = journal_path(parser, args.json, args.jsonl)
    if args.report_only and args.jsonl is None:
        parser.error(f"--report_only reads the {what} of --jsonl (or --json): give one of them")
    if args.report_only and args.fresh:
        parser.error("--report_only shows what --jsonl holds and --fresh forgets it: give one of them")


def measure_with_journal(args, planned: list[dict], key, settings, describe, measure, echo=None) -> list[dict]:
    """The cells of ``planned`` (each ``measure(cell)``d unless ``args.report_only``), resumed from and appended to
    ``args.jsonl`` (:func:`resume_rows`), ``args.json`` rewritten after each (renamed into place); the cells of the
    table are returned in ``planned``'s order. A finished cell is printed as a JSON line to ``echo`` (stdout)."""
    finished = {}
    if args.jsonl:  # (--report_only too: it shows no rows measured otherwise)
        finished = resume_rows(args.jsonl, planned, key, settings, describe, fresh=args.fresh)
    if not args.report_only:
        for cell in planned:
            if key(cell) in finished:
                continue
            result = measure(cell)
            print(json.dumps(result), file=echo or sys.stdout, flush=True)
            finished[key(cell)] = result  # a length given twice is measured once
            if args.jsonl:
                append_cell(args.jsonl, result)
            if args.json:  # under a temporary name, renamed into place
                write_json(args.json, [finished[key(c)] for c in planned if key(c) in finished])
    return latest_rows(args.jsonl, planned, key) if args.jsonl else list(finished.values())


def journal_path(parser, json_path: str | None, jsonl_path: str | None) -> Path | None:
    """The ``--jsonl`` file of a benchmark script: as given, else ``--json``'s path ending in ``.jsonl``; None without
    either (nothing kept, nothing resumed)."""
    if jsonl_path:
        if json_path and Path(jsonl_path) == Path(json_path):
            parser.error(f"--jsonl {jsonl_path}: the same file as --json; expected another path")
        return Path(jsonl_path)
    if not json_path:
        return None
    path = Path(json_path).with_suffix(".jsonl")
    if path == Path(json_path):
        parser.error(f"--json {json_path}: ends in .jsonl, the name of the file its cells are appended to; expected "
                     "a .json path, or --jsonl")
    return path


def write_json(path: str | os.PathLike, data) -> None:
    """``data`` as indented JSON in ``path``, written beside it under a temporary name and renamed into place (the
    ``--json`` file of the benchmark scripts)."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=2), encoding="utf-8")
    os.replace(temporary, path)


def run_in_subprocess(cell: dict, timeout: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--cell", json.dumps(cell)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**cell, "error": f"timeout after {timeout} s"}
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        return {**cell, "error": f"exit {result.returncode}: {lines[-1] if lines else 'killed (out of memory?)'}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_here(cell: dict) -> dict:
    """``run_cell`` in this process (``--in_process``): an error, out of memory included, becomes the cell's
    ``error``, and the allocator's cache is emptied after every cell."""
    import torch

    try:
        return run_cell(cell)
    except Exception as error:  # noqa: BLE001  (reported in the cell, as a subprocess's failure is)
        return {**cell, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_counted_cell(cell: dict, timeout: int, in_process: bool = False) -> dict:
    """The cell's time and memory (one process), then its matmul FLOPs (``torch.utils.flop_counter``, another
    process, so that a count that runs out of memory loses only the FLOP figures) and the achieved GFLOP/s.
    ``in_process``: both in this process, one after the other (``timeout`` is not enforced)."""
    run = run_here if in_process else (lambda c: run_in_subprocess(c, timeout))
    result = run(cell)
    if "error" in result:
        return result
    if cell.get("skip_flops"):
        return result
    counted = run({**cell, "count_flops": True})
    if "error" in counted:
        return {**result, "flops_error": counted["error"]}
    flops = counted["flops"]
    result.update(flops=flops)
    if flops:
        gflops = flops / result["seconds"] / 1e9
        result.update(gflops=gflops, fraction_of_matmul=gflops / result["matmul_gflops"])
    return result


def ssm_kernel_setting(device: str) -> str | None:
    """The LOCOST SSM kernel that cells on ``device`` use up to ``ssm_cpu_kernel.MAX_LAGS`` lags: on a CPU,
    "compiled" (``ssm_cpu_kernel``) or "torch" (``LONGREACH_SSM_KERNEL=torch``, or no C compiler here); elsewhere
    None (no CPU kernel runs)."""
    import torch

    from longreach.modeling import ssm_cpu_kernel

    if torch.device(device).type != "cpu":
        return None
    if ssm_cpu_kernel.backend() == "torch" or ssm_cpu_kernel.load() is None:
        return "torch"
    return "compiled"


def locost_cells(args) -> list[dict]:
    import torch

    # the thread count a cell runs with: --threads, else torch's default here (which $OMP_NUM_THREADS changes)
    threads = args.threads or torch.get_num_threads()
    common = dict(suite="locost", device=args.device, dtype=args.dtype, quick=args.quick, repeats=args.repeats,
                  threads=threads, ssm_kernel=ssm_kernel_setting(args.device),
                  **({"skip_flops": True} if args.skip_flops else {}),
                  **({"in_process": True} if args.in_process else {}))
    cells = [dict(common, model=model, task=task, length=length)
             for task in args.tasks if task != "scale" for length in args.lengths for model in args.models]
    if "scale" in args.tasks and "locost" in args.models:
        cells += [dict(common, model="locost", task="scale", length=length, repeats=1)
                  for length in args.scale_lengths]
    return cells


#: The first line of the report run_all writes as ``--out/README.md`` (a README.md there that starts otherwise is not
#: its own, and is neither replaced nor deleted).
REPORT_TITLE = "# Benchmarks\n"

#: The reports of the benchmark scripts that run_all runs (``script_suite``), in ``--out``, and the JSONL files their
#: cells and rows are appended to as they finish (``name.jsonl`` beside ``name.md``).
SCRIPT_SUITE_REPORTS = ("vcc_t5.md", "dodo.md", "dodo_training.md")
SCRIPT_SUITE_ROWS = tuple(name.replace(".md", ".jsonl") for name in SCRIPT_SUITE_REPORTS)


def run_script(command: list[str], timeout: float) -> tuple[int | None, str, str]:
    """``(exit status, stdout, stderr)`` of ``python *command``; the status is None when it ran past ``timeout``
    seconds. The script runs in a process group of its own, killed whole on a timeout or an interruption here (Ctrl-C,
    or SIGTERM under :func:`exit_on_sigterm`): the processes it started for its cells do not go on measuring beside
    the next suite, or after this one."""
    process = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return process.returncode, stdout, stderr
    except BaseException as error:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (OSError, AttributeError):  # gone already; or no process groups here
            process.kill()
        stdout, stderr = process.communicate()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        return None, stdout, stderr


def script_suite(name: str, command: list[str], out: Path, timeout: int, run: bool = True) -> str:
    """Run one of the existing benchmark scripts; its printed table is kept in ``name.md``, reused by a rerun with the
    same options (its first line records them; a report without that line, or of other options, is measured again).
    The script appends each cell or row to ``name.jsonl`` as it finishes (``--jsonl``), so a timeout (``timeout``
    seconds for the whole script) or a crash keeps them: the section then says what happened above the table of the
    finished ones (``--report_only`` of the script), and a rerun resumes where it stopped. ``run=False``
    (``--report_only``): the report as it is, whatever its options; the finished rows where there is none."""
    report, rows = out / f"{name}.md", out / f"{name}.jsonl"
    recorded = f"<!-- run_all: {' '.join(Path(part).name if part.endswith('.py') else part for part in command)} -->"
    if report.exists():
        text = report.read_text(encoding="utf-8")
        first, _, rest = text.partition("\n")
        if first == recorded:
            return rest
        if not run:
            return rest if first.startswith("<!-- run_all:") else text
    command = [*command, "--jsonl", str(rows)]
    if run:
        status, stdout, stderr = run_script(command, timeout)
        if status == 0:  # the tables, without the per-cell JSON lines the scripts print as they go
            text = "\n".join(line for line in stdout.splitlines() if not line.startswith("{"))
            temporary = report.with_suffix(".md.tmp")
            temporary.write_text(recorded + "\n" + text, encoding="utf-8")
            temporary.replace(report)
            return text
        lines = stderr.strip().splitlines()
        problem = (f"timeout after {timeout} s" if status is None
                   else f"failed (exit {status}): {lines[-1] if lines else 'killed (out of memory?)'}")
    else:
        problem = "not finished"
    if not load_cells(rows):
        return f"{problem}; nothing finished"
    status, stdout, stderr = run_script([*command, "--report_only"], timeout)
    if status != 0:
        return f"{problem}; the finished rows are in {rows.name}, and its table could not be made: {stderr[-300:]}"
    return (f"{problem}: the table holds what finished before (in {rows.name}; a rerun resumes there).\n\n"
            + "\n".join(line for line in stdout.splitlines() if not line.startswith("{")).strip())


def script_suite_settings(out: Path, name: str) -> set[tuple]:
    """``{(device, dtype)}`` of a script suite's report in ``out`` (from the options its first line records), else of
    the rows of ``name.jsonl``; empty where neither says (a report written before run_all recorded its options).
    Dodo's training step runs in float32 whatever ``--dtype`` is."""
    report, rows = out / f"{name}.md", out / f"{name}.jsonl"
    if report.exists():
        first = report.read_text(encoding="utf-8").partition("\n")[0]
        if not first.startswith("<!-- run_all:"):
            return set()
        words = first.split()
        option = {word: words[index + 1] for index, word in enumerate(words[:-1]) if word.startswith("--")}
        return {(option.get("--device", "cpu"), option.get("--dtype", "float32"))}
    return {(row.get("device", "cpu"), row.get("dtype", "float32")) for row in load_cells(rows)}


def fmt_bytes(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def markdown(cells: list[dict]) -> str:
    """One table per task: time, memory above weights, GFLOP/s (and share of the matmul roofline) per model, and
    the peer/LOCOST time and memory ratios (> 1: LOCOST faster / smaller)."""
    lines = []
    by_key = {(c["model"], c["task"], c["length"]): c for c in cells}
    for task in [t for t in TASKS + ["scale"] if any(c["task"] == t for c in cells)]:
        models = [m for m in MODELS if any(c["model"] == m and c["task"] == task for c in cells)]
        lines += [f"### {task}", "",
                  "| tokens | model | time (s) | peak tensor memory above weights (MiB) | GFLOP/s | matmul GFLOP/s | "
                  "time / LOCOST | memory / LOCOST |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for length in sorted({c["length"] for c in cells if c["task"] == task}):
            locost = by_key.get(("locost", task, length))
            for model in models:
                cell = by_key.get((model, task, length))
                if cell is None:
                    continue
                if "error" in cell:
                    lines.append(f"| {length} | {model} | {cell['error']} | | | | | |")
                    continue
                ratio_time = ratio_memory = "-"
                if model != "locost" and locost and "error" not in locost:
                    ratio_time = f"{cell['seconds'] / locost['seconds']:.2f}"
                    memory, locost_memory = (c["peak_memory_above_weights_bytes"] for c in (cell, locost))
                    if memory and locost_memory and cell.get("memory_method") == locost.get("memory_method"):
                        ratio_memory = f"{memory / locost_memory:.2f}"
                gflops = f"{cell['gflops']:.1f}" if "gflops" in cell else "-"
                roofline = f"{cell['matmul_gflops']:.1f}" if "matmul_gflops" in cell else "-"
                lines.append(f"| {length} | {model} | {cell['seconds']:.3f} | "
                             f"{fmt_bytes(cell['peak_memory_above_weights_bytes'])} | {gflops} | {roofline} | "
                             f"{ratio_time} | {ratio_memory} |")
        lines.append("")
    kernel_cells = [c for c in cells if "kernel_over_matmul" in c]
    if kernel_cells:
        lines += ["### LOCOST SSM kernel (layer 0) against a plain matmul of its multiply-adds", "",
                  "kernel: the one used by default (on CPU: compiled, `ssm_cpu_kernel`, where a C compiler works, up "
                  "to `ssm_cpu_kernel.MAX_LAGS` lags); torch ops: `LONGREACH_SSM_KERNEL=torch`.", "",
                  "| lags | kernel | kernel (ms) | matmul (ms) | kernel / matmul | torch ops (ms) | torch ops / matmul |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for cell in sorted(kernel_cells, key=lambda c: c["length"]):
            torch_ops = (f"{cell['kernel_torch_seconds'] * 1e3:.1f} | {cell['kernel_torch_over_matmul']:.2f}"
                         if "kernel_torch_seconds" in cell else "- | -")
            lines.append(f"| {cell['length']} | {cell.get('kernel_backend', 'torch')} | "
                         f"{cell['kernel_seconds'] * 1e3:.1f} | {cell['kernel_matmul_seconds'] * 1e3:.1f} | "
                         f"{cell['kernel_over_matmul']:.2f} | {torch_ops} |")
        lines.append("")
    return "\n".join(lines)


def plot(cells: list[dict], out: Path) -> list[Path]:
    """time and memory against length, one PNG per task (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task in sorted({c["task"] for c in cells}):
        figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
        for model in MODELS:
            points = sorted((c["length"], c) for c in cells
                            if c["task"] == task and c["model"] == model and "error" not in c)
            if not points:
                continue
            lengths = [length for length, _ in points]
            time_axis.plot(lengths, [c["seconds"] for _, c in points], marker="o", label=model)
            memory = [(length, c["peak_memory_above_weights_bytes"] / 2**20) for length, c in points
                      if c["peak_memory_above_weights_bytes"]]
            if memory:
                memory_axis.plot(*zip(*memory), marker="o", label=model)
        for axis, label in ((time_axis, "seconds"), (memory_axis, "peak above weights (MiB)")):
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("input tokens")
            axis.set_ylabel(label)
            axis.grid(True, which="both", alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend()
        figure.suptitle(task)
        figure.tight_layout()
        path = out / f"{task}.png"
        temporary = out / f".{task}.png.tmp"  # renamed into place: never a half-written plot
        figure.savefig(temporary, dpi=100, format="png")
        temporary.replace(path)
        plt.close(figure)
        written.append(path)
    return written


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", nargs="+", choices=["locost", "vcc", "dodo"], default=["locost", "vcc", "dodo"])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument("--tasks", nargs="+", choices=TASKS + ["scale"], default=TASKS + ["scale"])
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="Input tokens (default 1K-64K).")
    parser.add_argument("--scale_lengths", type=int, nargs="+", default=None,
                        help="LOCOST-only encode lengths (default 100K, 250K, 500K, 1M).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads per cell (default: torch's).")
    parser.add_argument("--repeats", type=int, default=None, help="Timed runs per cell after the warm-up (default 2).")
    parser.add_argument("--timeout", type=int, default=3600,
                        help="Seconds per cell; for the VCC and Dodo suites, per script (what finished is kept).")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--quick", action="store_true", help="Tiny models and lengths: a smoke run.")
    parser.add_argument("--fresh", action="store_true", help="Forget earlier cells in --out.")
    parser.add_argument("--skip_flops", action="store_true",
                        help="Do not count FLOPs (one more run per cell, in its own process): no GFLOP/s.")
    parser.add_argument("--report_only", action="store_true",
                        help="Run nothing: rewrite the report and plots from every cell already in --out (cells of "
                             "several runs, e.g. lengths or tasks run separately).")
    parser.add_argument("--in_process", action="store_true",
                        help="Run the cells in this process, one after the other (a GPU lease that is short; see the "
                             "module's docstring). --timeout is then not enforced.")
    parser.add_argument("--cells_only", action="store_true",
                        help="Measure the LOCOST suite's cells into --out/cells.jsonl and stop: no report, plots or "
                             "script suites (write them later with --report_only).")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.lengths = args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    args.scale_lengths = args.scale_lengths or ([256] if args.quick else DEFAULT_SCALE_LENGTHS)
    args.repeats = args.repeats or (1 if args.quick else 2)
    for name in ("lengths", "scale_lengths"):
        bad = [value for value in getattr(args, name) if value < 1]
        if bad:
            parser.error(f"--{name} must be positive token counts, got {bad}")
    check_device_here(parser, args.device)
    return args


def check_device_here(parser, device: str) -> None:
    """A CUDA ``--device`` on a machine without CUDA: one line now, not an error cell per cell or a traceback."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); use --device "
                     "cpu")


def report_settings(cells: list[dict], results: Path, out: Path, suites: list[str], args) -> tuple:
    """``(device, dtype, quick)`` of a ``--report_only`` report: those of the LOCOST cells and of the script suites'
    reports in ``out`` (``suites``), else ``args``'. A report is one device and dtype, and the ratios of a table come
    from cells measured with one thread count and one SSM kernel: cells or reports of several are refused (one table
    per (model, task, length) would keep one of them and hide the others)."""
    settings = sorted({(cell["device"], cell["dtype"], bool(cell["quick"])) for cell in cells}, key=str)
    if len(settings) > 1:
        raise SystemExit(f"{results} holds cells of several devices / dtypes / quick settings {settings}: report "
                         "them from separate --out folders.")
    measured = sorted({(cell.get("threads_used"), cell.get("ssm_kernel")) for cell in cells if not failed(cell)},
                      key=str)
    if len(measured) > 1:
        shown = ", ".join(f"{threads} threads and SSM kernel {kernel or 'not recorded'}"
                          for threads, kernel in measured)
        raise SystemExit(f"{results} holds cells measured with several thread counts / SSM kernels ({shown}): their "
                         "ratios would mix them; report them from separate --out folders.")
    device, dtype, quick = settings[0] if settings else (args.device, args.dtype, args.quick)
    sources = [(f"the LOCOST cells of {results.name}", device, dtype)] if settings else []
    for name in suites:  # (Dodo's training step runs in float32 whatever --dtype: its device only)
        sources += [(name, suite_device, None if name == "dodo_training" else suite_dtype)
                    for suite_device, suite_dtype in sorted(script_suite_settings(out, name))]
    devices, dtypes = {source[1] for source in sources}, {source[2] for source in sources if source[2]}
    if len(devices) > 1 or len(dtypes) > 1:
        shown = "; ".join(f"{source}: {source_device}{', ' + source_dtype if source_dtype else ''}"
                          for source, source_device, source_dtype in sources)
        raise SystemExit(f"{out} holds results of several devices / dtypes ({shown}): report them from separate --out "
                         "folders, or leave a suite out with --suites.")
    if sources:
        device, dtype = sources[0][1], next(iter(dtypes), dtype)
    return device, dtype, quick


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell))))
        return Path(".")
    with exit_on_sigterm():
        return _main(args, sys.argv[1:] if argv is None else argv)


@contextlib.contextmanager
def exit_on_sigterm():
    """SIGTERM (a scheduler's time limit, ``kill``) ends this process as Ctrl-C does, with ``SystemExit(143)``, so
    that a script suite running in a process group of its own (:func:`run_script`) is killed with it. (SIGKILL cannot
    be caught: it leaves the suite running.) In the main thread only; the previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args, argv: list[str]) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "cells.jsonl"
    report = out / "README.md"
    if report.is_file() and not report.read_text(encoding="utf-8", errors="replace").startswith(REPORT_TITLE):
        # (--out . in a project's folder): its README.md is not ours to replace, nor to delete with --fresh
        raise SystemExit(f"--out {args.out}: {report} is not a report of run_all.py (it does not start with "
                         f"{REPORT_TITLE.strip()!r}) and would be replaced; move it away or pass another --out.")
    if args.fresh:  # what this script writes, not the other reports that --out (results/ by default) holds
        results.unlink(missing_ok=True)
        for name in ("README.md", *SCRIPT_SUITE_REPORTS, *SCRIPT_SUITE_ROWS):
            (out / name).unlink(missing_ok=True)
    finished = {cell_key(cell): cell for cell in load_cells(results) if "error" not in cell}
    if not args.report_only:
        check_resumed_settings(locost_cells(args) if "locost" in args.suites else [], finished, results)
    done = set(finished)
    if "locost" in args.suites and not args.report_only:
        if args.in_process and args.device.startswith("cuda"):
            import torch  # CUDA context, cuBLAS handle and workspace: not part of the first cell's time or memory

            roofline_gflops(getattr(torch, args.dtype), args.device)
        for cell in locost_cells(args):
            if cell_key(cell) in done:
                continue
            result = run_counted_cell(cell, args.timeout, in_process=args.in_process)
            done.add(cell_key(cell))  # a length given twice is measured once
            append_cell(results, result)
            print(json.dumps(result), flush=True)
    if args.cells_only:
        print(f"cells in {results}; write the report with --report_only")
        return results
    keys = {cell_key(cell) for cell in locost_cells(args)}
    cells = [cell for cell in load_cells(results)
             if (cell.get("suite") == "locost" if args.report_only else cell_key(cell) in keys)]
    # the machines the cells ran on (recorded in each cell); cells from before that was recorded may come from another
    # machine than this one, so they are counted, not attributed; with no cell at all, the suites run here
    machines = sorted({cell["machine"] for cell in cells if "machine" in cell})
    unrecorded = sum("machine" not in cell for cell in cells)
    if unrecorded:
        machines.append(f"{unrecorded} cells measured before their machine was recorded")
    machines = machines or [host_description()]
    if args.report_only:  # the report's device and dtype: those of its cells and script suites, which must agree
        suites = {"vcc": ["vcc_t5"], "dodo": ["dodo", "dodo_training"]}
        suites = [name for suite in args.suites for name in suites.get(suite, [])]
        args.device, args.dtype, args.quick = report_settings(cells, results, out, suites, args)
    sections = [f"{REPORT_TITLE}\n{' / '.join(machines)}; device {args.device}, {args.dtype}"
                f"{', quick (tiny models)' if args.quick else ''}."
                " Regenerate: `python benchmarks/run_all.py "
                + " ".join(argv) + "`.\n"]
    if cells:
        sections.append("## LOCOST vs LongT5, LED, T5\n\n" + markdown(cells))
        plot(cells, out)
    here = Path(__file__).parent
    import torch

    threads = ["--threads", str(args.threads or torch.get_num_threads())]  # the LOCOST cells' count
    if args.report_only:  # only the script suites already measured (or begun)
        args.suites = [suite for suite in args.suites if suite == "locost" or any(
            (out / f"{name}{ending}").exists() for name in (["vcc_t5"] if suite == "vcc" else ["dodo", "dodo_training"])
            for ending in (".md", ".jsonl"))]
    if "vcc" in args.suites:
        lengths = ["1024"] if args.quick else ["8192", "16384", "65536", "131072"]
        command = [str(here / "benchmark_vcc_t5.py"), "--vcc_lengths", *lengths, "--t5_lengths", *lengths[:2],
                   "--repeats", "1" if args.quick else "3", "--timeout", str(args.timeout), "--device", args.device,
                   "--dtype", args.dtype, *threads]
        sections.append("## VCC-T5 vs T5\n\n" + script_suite("vcc_t5", command, out, args.timeout, run=not args.report_only))
    if "dodo" in args.suites:
        quick = ["--lengths", "256", "--steps", "2", "--rounds", "1", "--warmup", "1"] if args.quick else []
        command = [str(here / "benchmark_dodo.py"), "--device", args.device, "--dtype", args.dtype, *threads, *quick]
        sections.append("## Dodo vs Llama (full cache)\n\n" + script_suite("dodo", command, out, args.timeout, run=not args.report_only))
        training = ["--lengths", "256", "--repeats", "1", "--target_length", "16"] if args.quick else []
        command = [str(here / "benchmark_dodo.py"), "--training_memory", "--device", args.device, *threads,
                   *training]
        sections.append("## Dodo training step, activation checkpointing (float32)\n\n"
                        + script_suite("dodo_training", command, out, args.timeout, run=not args.report_only))
    temporary = out / "README.md.tmp"
    temporary.write_text("\n\n".join(sections), encoding="utf-8")
    temporary.replace(report)
    print(f"wrote {report}")
    return report


if __name__ == "__main__":
    main()
