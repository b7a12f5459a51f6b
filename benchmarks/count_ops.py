"""The operators one step of a model dispatches, counted on the meta device: a CPU-only measure of the host-side work
that bounds an eager step on a GPU.

Each operator costs the host a few microseconds to dispatch and launch, whether its kernel then runs for one
microsecond or a thousand. On an H200, LOCOST's eager bfloat16 training step at 16K tokens took 131 ms of GPU time and
443 ms of host time under the profiler, with 61,106 operator calls against LongT5-local's 28,326
(``benchmarks/results/profile_train_16k_cuda.md``): the step waits on the host. Counting what a step dispatches says
where that host time goes, and whether a change reduces it, without a GPU.

On the meta device tensors have shapes and no data: nothing is computed, a released-size step at 16K tokens is counted
in seconds, and code that chooses by device type takes its accelerator paths (the device is not "cpu"), so the counts
are those of a CUDA step. The input checks skip their reads of values there. Models whose shapes depend on values
(VCC-T5's choice of VIP tokens, Dodo's nugget counts) cannot run on the meta device and are not counted.

Per cell it prints the operators dispatched in the forward pass and in all, how many of them are views (no kernel: a
slice, a transpose, a detach), and the source lines that dispatched the most (the first frame in longreach or
transformers; "(autograd engine)" for the backward of built-in operators). Operators dispatched inside other
operators' implementations (composite ops) are counted too, as the profiler counts them.

Usage::

    python benchmarks/count_ops.py                                   # LOCOST, LongT5-local, T5: train at 16K
    python benchmarks/count_ops.py --models locost --tasks train train_ckpt encode --lengths 4096 16384 --json ops.json
    python benchmarks/count_ops.py --quick                           # tiny models (a smoke run)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_all import RELEASED, TINY, build_model  # noqa: E402

TASKS = ["train", "train_ckpt", "encode"]
COUNTED_MODELS = ["locost", "longt5-local", "longt5-tglobal", "led", "t5"]


def is_view(func) -> bool:
    """Whether an operator returns an alias of an input without writing it (a view: no kernel), as opposed to an
    in-place operator (``add_``, ``copy_``), which also returns an alias, written."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def dispatch_site() -> str:
    """``file:line function`` of the innermost frame in longreach or transformers that dispatched the operator."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/longreach/" in name or "/transformers/" in name:
            return f"{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "(autograd engine)"


class OperatorCounter(TorchDispatchMode):
    """Counts every aten operator dispatched while active: by operator, by source line, and views apart."""

    def __init__(self):
        super().__init__()
        self.by_operator, self.by_site = collections.Counter(), collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_operator[str(func.overloadpacket)] += 1
        self.by_site[dispatch_site()] += 1
        self.views += is_view(func)
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_operator.values())


def count_cell(model_name: str, task: str, length: int, sizes: dict, dtype: torch.dtype, top: int = 10) -> dict:
    """Operators of one step (``task``) of ``model_name`` at ``length`` input tokens, on the meta device."""
    torch.manual_seed(0)
    model = build_model(model_name, sizes, length)
    if task == "train_ckpt":  # (transformers 5.23 renamed gradient_checkpointing_enable)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model = model.to(device="meta", dtype=dtype).train(task != "encode")
    input_ids = torch.zeros(1, length, dtype=torch.long, device="meta")
    labels = torch.zeros(1, sizes["summary_length"], dtype=torch.long, device="meta")
    counter = OperatorCounter()
    with counter:
        if task == "encode":
            with torch.no_grad():
                model.get_encoder()(input_ids=input_ids)
            forward = counter.total
        else:
            loss = model(input_ids=input_ids, labels=labels).loss
            forward = counter.total
            loss.backward()
    return {
        "model": model_name, "task": task, "length": length, "dtype": str(dtype).replace("torch.", ""),
        "forward_operators": forward, "operators": counter.total, "views": counter.views,
        "top_operators": counter.by_operator.most_common(top), "top_sites": counter.by_site.most_common(top),
    }


def markdown(cells: list[dict]) -> str:
    lines = ["| model | task | tokens | operators (forward) | of which views | × the first model's |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    first = {(c["task"], c["length"]): c["operators"] for c in reversed(cells)}  # the first model of each task/length
    for cell in cells:
        ratio = cell["operators"] / first[(cell["task"], cell["length"])]
        lines.append(f"| {cell['model']} | {cell['task']} | {cell['length']} | {cell['operators']:,} "
                     f"({cell['forward_operators']:,}) | {cell['views']:,} | {ratio:.2f} |")
    for cell in cells:
        lines.append(f"\n{cell['model']}, {cell['task']}, {cell['length']} tokens: the source lines that dispatched the "
                     "most\n")
        lines.extend(f"- {count:,} {site}" for site, count in cell["top_sites"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=COUNTED_MODELS, default=["locost", "longt5-local", "t5"])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=["train"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--top", type=int, default=10, help="Source lines listed per cell.")
    parser.add_argument("--quick", action="store_true", help="Tiny models and 64 tokens (a smoke run).")
    parser.add_argument("--json", default=None, help="Also write the cells to this file.")
    args = parser.parse_args(argv)
    if any(length < 1 for length in args.lengths):
        parser.error(f"--lengths must be positive token counts, got {args.lengths}.")
    sizes, lengths = (TINY, [64]) if args.quick else (RELEASED, args.lengths)
    cells = [count_cell(model, task, length, sizes, getattr(torch, args.dtype), args.top)
             for task in args.tasks for length in lengths for model in args.models]
    print(f"torch {torch.__version__}, meta device (accelerator code paths), {args.dtype}"
          f"{', tiny models' if args.quick else ', released LOCOST size'}, batch 1\n")
    print(markdown(cells))
    if args.json:
        path = Path(args.json)
        with tempfile.NamedTemporaryFile("w", dir=path.parent or ".", suffix=".tmp", delete=False) as handle:
            json.dump(cells, handle, indent=1)
        Path(handle.name).replace(path)
    return cells


if __name__ == "__main__":
    main()
