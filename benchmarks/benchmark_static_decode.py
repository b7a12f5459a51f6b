"""Decoding steps of ``generate()`` with the default dynamic cache, a static cache, and a static cache with the
decoding step compiled (``cache_implementation="static"`` plus transformers' ``CompileConfig``, which is what
``generate()`` does by itself on a GPU): LOCOST and VCC-T5 against transformers' T5 and LongT5-local at the same
sizes. VCC-T5 (``vcc-t5``) has T5's dimensions and the VCC settings of ``benchmark_vcc_t5.py``, with its first
``NUM_VIP`` tokens as VIP tokens; its decoder attends over the compressed encoder states.

A decoding step of these models is small next to the encoder, so on a GPU it waits on the host's per-operator work
(``benchmarks/results/cuda.md``: Dodo's 4-layer decode steps took about 5 ms whatever the cache); a compiled step with
CUDA graphs (``--mode reduce-overhead``, ``CompileConfig``'s default) launches one graph instead.

Per model, length and cache: ``generate()`` of 1 and of ``--new_tokens`` tokens (greedy, exactly that many), each the
median of ``--repeats`` runs after a warm-up (compilation included there), and the time per decoding step, their
difference over ``new_tokens - 1`` (the encoder and the first step cancel out). The tokens of every cache are checked
equal to the dynamic cache's.

    python benchmarks/benchmark_static_decode.py --device cuda --dtype bfloat16 --lengths 4096 16384
    python benchmarks/benchmark_static_decode.py --quick --backend aot_eager    # smoke run on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch
from transformers import CompileConfig

import benchmark_vcc_t5
import run_all

CACHES = ["dynamic", "static", "static-compiled"]
MODELS = [*run_all.MODELS, "vcc-t5"]
#: VCC-T5's settings at the released size (``benchmark_vcc_t5.py``'s) and at the tiny one
VCC = {"released": benchmark_vcc_t5.VCC,
       "tiny": dict(num_vanilla_layers=1, segment_length=16, block_size=4, num_refined_blocks=2, num_vip_slots=4)}
NUM_VIP = benchmark_vcc_t5.NUM_VIP  # VIP tokens at the start of the input


def build_model(name: str, sizes: dict, length: int, quick: bool):
    """``run_all.build_model``'s models, and VCC-T5 with T5's sizes there."""
    if name != "vcc-t5":
        return run_all.build_model(name, sizes, length)
    from longreach import VCCT5Config, VCCT5ForConditionalGeneration

    t5_config = run_all.build_model("t5", sizes, length).config  # the same T5 dimensions and token ids
    return VCCT5ForConditionalGeneration(VCCT5Config(**{key: getattr(t5_config, key) for key in (
        "vocab_size", "d_model", "d_ff", "num_layers", "num_heads", "d_kv", "feed_forward_proj", "dropout_rate",
        "pad_token_id", "eos_token_id", "decoder_start_token_id")}, **VCC["tiny" if quick else "released"]))


def generate_seconds(model, inputs: dict, new_tokens: int, generate_kwargs: dict, repeats: int, device):
    """Median seconds of ``repeats`` calls of ``generate()`` after one warm-up, and the tokens of the last call."""
    def call():
        return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              num_beams=1, **generate_kwargs)

    with torch.inference_mode():
        call()
        seconds = []
        for _ in range(repeats):
            run_all.synchronize(device)
            started = time.perf_counter()
            output = call()
            run_all.synchronize(device)
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), output


def time_decoding(model_name: str, length: int, args) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sizes = run_all.TINY if args.quick else run_all.RELEASED
    torch.manual_seed(0)
    with device:
        model = build_model(model_name, sizes, length, args.quick)
    model = model.to(dtype=dtype).eval()
    inputs = {"input_ids": torch.randint(3, sizes["vocab_size"], (1, length), device=device)}
    if model_name == "vcc-t5":
        inputs["vip_mask"] = torch.zeros_like(inputs["input_ids"])
        inputs["vip_mask"][:, :NUM_VIP] = 1
    rows, expected = [], None
    for cache in args.caches:
        generate_kwargs = {}
        if cache != "dynamic":
            generate_kwargs["cache_implementation"] = "static"
        if cache == "static-compiled":
            torch._dynamo.reset()
            compile_config = CompileConfig(fullgraph=True, backend=args.backend, dynamic=False,
                                           mode=None if args.backend != "inductor" else args.mode)
            compile_config._compile_all_devices = True  # generate() compiles on accelerators only, unless told
            generate_kwargs["compile_config"] = compile_config
        else:
            generate_kwargs["disable_compile"] = True
        row = {"model": model_name, "length": length, "cache": cache, "device": args.device, "dtype": args.dtype,
               "new_tokens": args.new_tokens,
               "compile": "-" if cache != "static-compiled" else
               args.backend if args.backend != "inductor" else f"inductor/{args.mode}"}
        try:
            one, _ = generate_seconds(model, inputs, 1, generate_kwargs, args.repeats, device)
            many, output = generate_seconds(model, inputs, args.new_tokens, generate_kwargs, args.repeats, device)
            if expected is None:
                expected = output
            row.update(generate_one_seconds=one, generate_seconds=many,
                       step_seconds=(many - one) / (args.new_tokens - 1), same_tokens=bool(torch.equal(output,
                                                                                                       expected)))
        except Exception as error:  # noqa: BLE001  a cache that fails (a compile error, out of memory) is a row
            traceback.print_exc()
            row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    dynamic = {(row["model"], row["length"]): row.get("step_seconds") for row in rows if row["cache"] == "dynamic"}
    lines = ["| tokens | model | cache | generate 1 token (s) | generate N (s) | step (ms) | dynamic / this "
             "| same tokens |", "|---:|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['length']} | {row['model']} | {row['cache']} | {row['error']} | | | | |")
            continue
        base = dynamic.get((row["model"], row["length"]))
        ratio = f"{base / row['step_seconds']:.2f}" if base and row["step_seconds"] > 0 else "-"
        lines.append(f"| {row['length']} | {row['model']} | {row['cache']} | {row['generate_one_seconds']:.3f} | "
                     f"{row['generate_seconds']:.3f} | {row['step_seconds'] * 1e3:.2f} | {ratio} | "
                     f"{'yes' if row['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["locost", "t5", "longt5-local"], choices=MODELS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--caches", nargs="+", default=CACHES, choices=CACHES)
    parser.add_argument("--new_tokens", type=int, default=64, help="Tokens generated (at least 2).")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: a smoke run).")
    parser.add_argument("--mode", default="reduce-overhead",
                        help="torch.compile mode with inductor (reduce-overhead: CUDA graphs, CompileConfig's "
                             "default).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3, help="Timed calls after the warm-up.")
    parser.add_argument("--quick", action="store_true", help="Tiny models (a smoke run, not a measurement).")
    parser.add_argument("--json", default=None, help="Also write the rows to this file.")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1 or any(length < 1 for length in args.lengths):
        raise ValueError(f"`--new_tokens` must be at least 2 and `--repeats` and `--lengths` positive, got "
                         f"{args.new_tokens}, {args.repeats} and {args.lengths}.")
    rows = [row for length in args.lengths for model_name in args.models
            for row in time_decoding(model_name, length, args)]
    print(markdown(rows))
    if args.json:
        run_all.write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
