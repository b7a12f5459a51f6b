"""KV-cache bytes and decode-step time of Dodo (context compressed into nuggets) beside the same model with the full
context in its cache, at 1K, 4K and 16K context tokens.

Model: a small Llama (hidden 256, 4 layers, 8 query heads and 4 key/value heads of 32, MLP 688, vocab 1024) wrapped as
`DodoLlamaForCausalLM` with ratio 0.1 (k = int(0.1 n + 0.99) nuggets), one soft-prompt vector, random weights (the
cost does not depend on the values). "full" = the same model with θ and the whole context in its KV cache (a plain Llama
prefill of context + prompt); "Dodo" = θ with the nugget cache (+ soft prompt + prompt). After an 8-token prompt, one
decode step = one forward of 1 new token over the cache; the cache is cropped back after every step so that all steps
see the same length. Full and Dodo steps are interleaved (``--rounds`` x ``--steps``, after warm-up steps) to share
the machine's noise. Batch 1, float32 (``--dtype``), sdpa, ``torch.no_grad()``.

KV bytes are measured from the cache tensors (keys + values of every layer); Dodo also keeps K float32 scores (listed
apart). "compress" is the φ pass over the context plus the scorer's ι-layer pass, each also timed apart (the rest is
selection and gather; on a GPU each pass ends with a synchronisation). ``--memory`` adds the peak tensor memory of the full
prefill and of the compression (one more of each, measured as below). ``--lora_layers`` (with ``--scorer_features``)
puts LoRA on some layers only: with all of them >= ι the scorer reads the φ pass and runs no pass of its own.

With ``--training_memory``: peak memory and time of one compressor-mode training step (φ pass + scorer, θ pass over
``--target_length`` tokens with labels, backward into both adapters, the scorer and the soft prompt) with and without
activation checkpointing, same model and data, sdpa, float32, batch 1. Peak memory is the most tensor memory
allocated at once during the step above what existed before it (parameters, inputs): ``torch.cuda`` allocator
statistics on a GPU, the CPU allocator's running total reported to the profiler (``profile_memory=True``) on a CPU.
Times come from separate, unprofiled steps. Each row also checks that the two runs give the same loss and gradients.

Usage::

    python benchmarks/benchmark_dodo.py                        # 1K, 4K, 16K
    python benchmarks/benchmark_dodo.py --lengths 1024 4096 --threads 2 --json out.json
    python benchmarks/benchmark_dodo.py --training_memory --lengths 2048 4096 8192 --layers 8
    python benchmarks/benchmark_dodo.py --lengths 65536 --steps 5 --rounds 2 --warmup 1 --memory
    python benchmarks/benchmark_dodo.py --lora_layers 3 --scorer_features encoder_hidden  # ind_scorer=False

``--json`` / ``--jsonl``: each finished row is appended to the ``--jsonl`` file (by default ``--json``'s path ending in
``.jsonl``) and flushed; a rerun with the same options skips the rows already there (``--fresh`` measures them again;
rows measured otherwise, e.g. other ``--steps`` or threads, are refused) and ``--report_only`` prints their table
without measuring.

Prints a Markdown table with the full/Dodo ratios (or the checkpointing ratios). Not a test: timings depend on the
machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from longreach.modeling.input_checks import cache_of

SIZES = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    nugget_layer=3,
    nugget_ratio=0.1,
    lora_r=8,
    soft_prompt_length=1,
    lora_dropout=0.0,
)
PROMPT_LENGTH = 8


def cache_bytes(cache, first: int = 0, last: int | None = None) -> int:
    return sum(layer.keys[:, :, first:last].nbytes + layer.values[:, :, first:last].nbytes for layer in cache.layers)


def one_step(model, token, attention_mask, cache, nuggets=None):
    output = model(token, attention_mask=attention_mask, past_key_values=cache, nuggets=nuggets, use_cache=True)
    cache.crop(-1)  # same cache length for every step
    return output


def compress_parts(model, context, timed):
    """``(nuggets, times)``: a timed `compress` with its two passes over the context also timed apart, the φ pass (all
    layers, the compressor adapter: ``model.model``'s forward) and the scorer pass (the first ι layers without
    adapters, then the scorer: ``_scorer_features``; 0 where the scorer reads the φ pass); the rest (selection,
    gather) is the difference."""
    spent = {"phi": 0.0, "scorer": 0.0}

    def timing(name, function):
        def wrapper(*args, **kwargs):
            result, seconds = timed(lambda: function(*args, **kwargs))
            spent[name] += seconds
            return result
        return wrapper

    model.model.forward = timing("phi", model.model.forward)
    model._scorer_features = timing("scorer", model._scorer_features)
    try:
        nuggets, total = timed(lambda: model.compress(context))
    finally:  # the instance attributes shadowed the class's methods: removing them restores those
        del model.model.forward, model._scorer_features
    return nuggets, {"compress_s": total, "compress_phi_pass_s": spent["phi"], "compress_scorer_pass_s": spent["scorer"],
                     "compress_rest_s": total - spent["phi"] - spent["scorer"]}


def run(lengths: list[int], steps: int, rounds: int, warmup: int, device: str, dtype: str = "float32",
        memory: bool = False, on_row=None, **config_overrides) -> list[dict]:
    import longreach  # noqa: F401
    from longreach import DodoLlamaConfig, DodoLlamaForCausalLM

    def synchronize():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(function):
        # on a GPU the kernels run after the call returns: without the syncs, the prefill's time would be its launches
        # and the compression's would include the end of the prefill (the first GPU table had that fault)
        synchronize()
        start = time.perf_counter()
        result = function()
        synchronize()
        return result, time.perf_counter() - start

    torch.manual_seed(0)
    config = DodoLlamaConfig(**{**SIZES, **config_overrides})
    model = DodoLlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)).eval()
    rows = []
    with torch.no_grad():  # warm-up of both passes (kernels, allocator), not timed
        warm = torch.randint(3, SIZES["vocab_size"], (1, 64), device=device)
        model(warm, use_cache=True, logits_to_keep=1)
        model.compress(warm)
    for length in lengths:
        context = torch.randint(3, SIZES["vocab_size"], (1, length), device=device)
        prompt = torch.randint(3, SIZES["vocab_size"], (1, PROMPT_LENGTH), device=device)
        token = torch.randint(3, SIZES["vocab_size"], (1, 1), device=device)
        with torch.no_grad():
            full, full_prefill = timed(
                lambda: cache_of(model(torch.cat([context, prompt], 1), use_cache=True, logits_to_keep=1)))
            nuggets, parts = compress_parts(model, context, timed)
            if memory:  # one more prefill and compression each, under the memory profiler (CPU) or allocator stats
                parts["full_prefill_peak_bytes"] = peak_step_bytes(
                    lambda: model(torch.cat([context, prompt], 1), use_cache=True, logits_to_keep=1), device)
                parts["compress_peak_bytes"] = peak_step_bytes(lambda: model.compress(context), device)
            dodo = cache_of(model(prompt, nuggets=nuggets, use_cache=True, logits_to_keep=1))
            k = nuggets.mask.shape[1]
            full_mask = torch.ones(1, length + PROMPT_LENGTH + 1, dtype=torch.long, device=device)
            dodo_mask = torch.ones(1, PROMPT_LENGTH + 1, dtype=torch.long, device=device)
            times = {"full": [], "dodo": []}
            for _ in range(rounds):
                for name, cache, mask in (("full", full, full_mask), ("dodo", dodo, dodo_mask)):
                    for _ in range(warmup):
                        one_step(model, token, mask, cache)
                    for _ in range(steps):
                        times[name].append(timed(lambda: one_step(model, token, mask, cache))[1])
        full_context_bytes = cache_bytes(full, 0, length)
        nugget_bytes = cache_bytes(dodo, 0, k)
        rows.append(
            {
                "context_tokens": length,
                "dtype": dtype,
                "nuggets": k,
                "kv_bytes_full_context": full_context_bytes,
                "kv_bytes_nuggets": nugget_bytes,
                "nugget_score_bytes": nuggets.scores.nbytes,
                "kv_bytes_full_cache": cache_bytes(full),
                "kv_bytes_dodo_cache": cache_bytes(dodo),
                "step_ms_full_median": 1e3 * statistics.median(times["full"]),
                "step_ms_full_min": 1e3 * min(times["full"]),
                "step_ms_dodo_median": 1e3 * statistics.median(times["dodo"]),
                "step_ms_dodo_min": 1e3 * min(times["dodo"]),
                "full_prefill_s": full_prefill,
                **parts,
            }
        )
        if on_row is not None:
            on_row(rows)
    return rows


def peak_step_bytes(step, device: str) -> int:
    """Peak tensor bytes allocated during ``step()`` above what was allocated before it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    from run_all import profiled_peak_bytes  # this folder is the script's: run_all.py is beside it

    # The CPU allocator reports its running total of the memory allocated with every allocation and free; the peak is
    # taken above its value when this session started (it carries over from the earlier sessions of this process).
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    return profiled_peak_bytes(profiler)


def training_memory(lengths: list[int], target_length: int, layers: int, repeats: int, device: str,
                    on_row=None) -> list[dict]:
    import longreach  # noqa: F401
    from longreach import DodoLlamaConfig, DodoLlamaForCausalLM

    config = DodoLlamaConfig(**{**SIZES, "num_hidden_layers": layers}, attn_implementation="sdpa")
    rows = []
    for length in lengths:
        torch.manual_seed(1)
        context = torch.randint(3, SIZES["vocab_size"], (1, length), device=device)
        target = torch.randint(3, SIZES["vocab_size"], (1, target_length), device=device)
        row, results = {"context_tokens": length, "target_tokens": target_length, "layers": layers}, {}
        for name in ("plain", "checkpointed"):
            torch.manual_seed(0)
            model = DodoLlamaForCausalLM(config).to(device).train()
            with torch.no_grad():  # fresh LoRA B is zero, which would leave the A matrices without gradient
                for parameter_name, parameter in model.named_parameters():
                    if ".lora_B." in parameter_name:
                        parameter.normal_(0.0, 0.02)
            if name == "checkpointed":
                model.activation_checkpointing_enable()  # transformers' default: use_reentrant=False

            def step():
                model(input_ids=target, context_input_ids=context, labels=target).loss.backward()

            model.zero_grad(set_to_none=True)
            step()  # warm-up
            model.zero_grad(set_to_none=True)
            row[f"peak_bytes_{name}"] = peak_step_bytes(step, device)
            times = []
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            row[f"step_s_{name}"] = statistics.median(times)
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=target, context_input_ids=context, labels=target).loss
            loss.backward()
            results[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        (plain_loss, plain_grads), (loss, grads) = results["plain"], results["checkpointed"]
        row["same_loss"] = loss == plain_loss
        row["max_relative_grad_diff"] = max(
            ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in plain_grads.items()
        )
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def training_markdown(rows: list[dict]) -> str:
    lines = [
        "| layers | context n | target m | peak plain | peak checkpointed | memory ratio | step plain | "
        "step checkpointed | time ratio | same loss / max rel. grad diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['layers']} | {row['context_tokens']} | {row['target_tokens']} "
            f"| {row['peak_bytes_plain'] / 2**20:,.1f} MiB | {row['peak_bytes_checkpointed'] / 2**20:,.1f} MiB "
            f"| {row['peak_bytes_plain'] / row['peak_bytes_checkpointed']:.2f}x "
            f"| {row['step_s_plain']:.2f} s | {row['step_s_checkpointed']:.2f} s "
            f"| {row['step_s_checkpointed'] / row['step_s_plain']:.2f}x "
            f"| {row['same_loss']} / {row['max_relative_grad_diff']:.1e} |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    memory = all("compress_peak_bytes" in row for row in rows)
    lines = [
        "| context n | nuggets k | KV of context: full | KV of context: Dodo | bytes ratio "
        "| decode step full (median / min) | decode step Dodo (median / min) | step ratio (median) "
        "| full prefill | Dodo compress | compress / prefill | compress: φ pass / scorer pass / rest |"
        + (" peak tensor memory: full prefill / compress |" if memory else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if memory else ""),
    ]
    for row in rows:
        lines.append(
            f"| {row['context_tokens']} | {row['nuggets']} | {row['kv_bytes_full_context']:,} B "
            f"| {row['kv_bytes_nuggets']:,} B (+{row['nugget_score_bytes']} B scores) "
            f"| {row['kv_bytes_full_context'] / row['kv_bytes_nuggets']:.2f}x "
            f"| {row['step_ms_full_median']:.2f} / {row['step_ms_full_min']:.2f} ms "
            f"| {row['step_ms_dodo_median']:.2f} / {row['step_ms_dodo_min']:.2f} ms "
            f"| {row['step_ms_full_median'] / row['step_ms_dodo_median']:.2f}x "
            f"| {row['full_prefill_s']:.3f} s | {row['compress_s']:.3f} s "
            f"| {row['compress_s'] / row['full_prefill_s']:.2f}x "
            f"| {row['compress_phi_pass_s']:.3f} / {row['compress_scorer_pass_s']:.3f} "
            f"/ {row['compress_rest_s']:.3f} s |"
            + (f" {row['full_prefill_peak_bytes'] / 2**20:,.0f} / {row['compress_peak_bytes'] / 2**20:,.0f} MiB |"
               if memory else "")
        )
    return "\n".join(lines)


#: What a row measures (its key in ``--jsonl``) and how (a rerun resumes only rows measured the same way), for the
#: decode-step run and the ``--training_memory`` run.
KEYS = {"decode": ("run", "context_tokens", "device", "dtype", "lora_layers", "scorer_features"),
        "training": ("run", "context_tokens", "target_tokens", "layers", "device")}
SETTINGS = {"decode": ("steps", "rounds", "warmup", "threads", "memory"), "training": ("repeats", "threads")}


def row_key(row: dict) -> str:
    return json.dumps([row.get(name) for name in KEYS[row.get("run", "decode")]])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="The model's dtype (the decode-step run; --training_memory is float32).")
    from run_all import add_journal_arguments, check_journal_arguments  # this folder is the script's: run_all.py

    add_journal_arguments(parser, "rows")
    parser.add_argument(
        "--training_memory", action="store_true", help="Peak memory of a training step with/without checkpointing."
    )
    parser.add_argument("--target_length", type=int, default=256, help="--training_memory: decoder tokens.")
    parser.add_argument("--layers", type=int, default=SIZES["num_hidden_layers"], help="--training_memory: layers.")
    parser.add_argument("--repeats", type=int, default=3, help="--training_memory: timed steps per setting.")
    parser.add_argument("--lora_layers", type=int, nargs="+", default=None,
                        help="LoRA on these layers only (default: every layer, the paper's setting). All >= "
                             "nugget_layer: the scorer reads the φ pass instead of running its own.")
    parser.add_argument("--memory", action="store_true",
                        help="Also the peak tensor memory of the full prefill and of the compression (one more "
                             "of each).")
    parser.add_argument("--scorer_features", default="base_final_norm", choices=["base_final_norm", "encoder_hidden"])
    args = parser.parse_args(argv)
    if any(length < 1 for length in args.lengths) or args.steps < 1:
        parser.error(f"--lengths and --steps must be positive, got --lengths {args.lengths} --steps {args.steps}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    if args.training_memory and (args.lora_layers is not None or args.scorer_features != "base_final_norm"
                                 or args.memory):
        parser.error("`--lora_layers`, `--scorer_features` and `--memory` apply to the decode-step run, not to "
                     "--training_memory (which measures memory itself).")
    if args.training_memory and args.dtype != "float32":
        parser.error(f"--training_memory runs in float32, got --dtype {args.dtype}")
    check_journal_arguments(parser, args, "rows")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {}  # the decode-step run's model, where it differs from SIZES
    if args.lora_layers is not None:
        overrides["lora_layers"] = args.lora_layers
    if args.scorer_features != "base_final_norm":
        overrides["scorer_features"] = args.scorer_features
    from run_all import append_cell, host_description, latest_rows, resume_rows, write_json  # beside this script

    # recorded in every row: what it measured and how (the thread count torch's default where --threads is not given)
    if args.training_memory:
        settings = dict(run="training", device=args.device, target_tokens=args.target_length, layers=args.layers,
                        repeats=args.repeats, threads=torch.get_num_threads())
    else:
        settings = dict(run="decode", device=args.device, dtype=args.dtype, lora_layers=args.lora_layers,
                        scorer_features=args.scorer_features, steps=args.steps, rounds=args.rounds,
                        warmup=args.warmup, threads=torch.get_num_threads(), memory=args.memory)
    planned = [dict(settings, context_tokens=length) for length in args.lengths]
    finished = {}
    if args.jsonl:  # (--report_only too: it shows no rows measured otherwise)
        finished = resume_rows(args.jsonl, planned, row_key, SETTINGS[settings["run"]],
                               lambda row: f"{row['run']} {row['context_tokens']}-token", fresh=args.fresh)

    def save(rows: list[dict]) -> None:  # called after each row: appended to --jsonl, --json renamed into place
        row = rows[-1] = {**rows[-1], **settings}
        finished[row_key(row)] = row
        if args.jsonl:
            append_cell(args.jsonl, row)
        if args.json:
            write_json(args.json, [finished[row_key(r)] for r in planned if row_key(r) in finished])

    lengths = list(dict.fromkeys(row["context_tokens"] for row in planned if row_key(row) not in finished))
    if lengths and not args.report_only:
        if args.training_memory:
            training_memory(lengths, args.target_length, args.layers, args.repeats, args.device, on_row=save)
        else:
            run(lengths, args.steps, args.rounds, args.warmup, args.device, args.dtype, args.memory, on_row=save,
                **overrides)
    if args.jsonl:
        rows = latest_rows(args.jsonl, planned, row_key)
    else:  # (a length given twice: one row)
        rows = list({row_key(r): finished[row_key(r)] for r in planned if row_key(r) in finished}.values())

    print(f"{host_description()}; torch {torch.__version__}, device {args.device}, dtype {args.dtype}, threads "
          f"{torch.get_num_threads()}, sizes {({**SIZES, **overrides})}")
    print(training_markdown(rows) if args.training_memory else markdown(rows))
    return rows


if __name__ == "__main__":
    main()
