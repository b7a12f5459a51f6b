"""KV-cache bytes and decode-step time of Dodo (context compressed into nuggets) beside the same model with the full
context in its cache, at 1K, 4K and 16K context tokens.

Model: a small Llama (hidden 256, 4 layers, 8 query heads and 4 key/value heads of 32, MLP 688, vocab 1024) wrapped as
`DodoLlamaForCausalLM` with ratio 0.1 (k = int(0.1 n + 0.99) nuggets), one soft-prompt vector, random weights (the
cost does not depend on the values). "full" = the same model with θ and the whole context in its KV cache (a plain Llama
prefill of context + prompt); "Dodo" = θ with the nugget cache (+ soft prompt + prompt). After an 8-token prompt, one
decode step = one forward of 1 new token over the cache; the cache is cropped back after every step so that all steps
see the same length. Full and Dodo steps are interleaved (``--rounds`` x ``--steps``, after warm-up steps) to share
the machine's noise. Batch 1, float32, sdpa, ``torch.no_grad()``.

KV bytes are measured from the cache tensors (keys + values of every layer); Dodo also keeps K float32 scores (listed
apart). "compress" is the φ pass over the context plus the scorer's ι-layer pass.

Usage::

    python benchmarks/benchmark_dodo.py                        # 1K, 4K, 16K
    python benchmarks/benchmark_dodo.py --lengths 1024 4096 --threads 2 --json out.json

Prints a Markdown table with the full/Dodo ratios. Not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

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


def run(lengths: list[int], steps: int, rounds: int, warmup: int, device: str) -> list[dict]:
    import longreach  # noqa: F401
    from longreach import DodoLlamaConfig, DodoLlamaForCausalLM

    torch.manual_seed(0)
    model = DodoLlamaForCausalLM(DodoLlamaConfig(**SIZES)).to(device).eval()
    rows = []
    for length in lengths:
        context = torch.randint(3, SIZES["vocab_size"], (1, length), device=device)
        prompt = torch.randint(3, SIZES["vocab_size"], (1, PROMPT_LENGTH), device=device)
        token = torch.randint(3, SIZES["vocab_size"], (1, 1), device=device)
        with torch.no_grad():
            start = time.perf_counter()
            full = model(torch.cat([context, prompt], 1), use_cache=True, logits_to_keep=1).past_key_values
            full_prefill = time.perf_counter() - start
            start = time.perf_counter()
            nuggets = model.compress(context)
            compress_time = time.perf_counter() - start
            dodo = model(prompt, nuggets=nuggets, use_cache=True, logits_to_keep=1).past_key_values
            k = nuggets.mask.shape[1]
            full_mask = torch.ones(1, length + PROMPT_LENGTH + 1, dtype=torch.long, device=device)
            dodo_mask = torch.ones(1, PROMPT_LENGTH + 1, dtype=torch.long, device=device)
            times = {"full": [], "dodo": []}
            for _ in range(rounds):
                for name, cache, mask in (("full", full, full_mask), ("dodo", dodo, dodo_mask)):
                    for _ in range(warmup):
                        one_step(model, token, mask, cache)
                    for _ in range(steps):
                        if device == "cuda":
                            torch.cuda.synchronize()
                        start = time.perf_counter()
                        one_step(model, token, mask, cache)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        times[name].append(time.perf_counter() - start)
        full_context_bytes = cache_bytes(full, 0, length)
        nugget_bytes = cache_bytes(dodo, 0, k)
        rows.append(
            {
                "context_tokens": length,
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
                "compress_s": compress_time,
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| context n | nuggets k | KV of context: full | KV of context: Dodo | bytes ratio "
        "| decode step full (median / min) | decode step Dodo (median / min) | step ratio (median) "
        "| full prefill | Dodo compress |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['context_tokens']} | {row['nuggets']} | {row['kv_bytes_full_context']:,} B "
            f"| {row['kv_bytes_nuggets']:,} B (+{row['nugget_score_bytes']} B scores) "
            f"| {row['kv_bytes_full_context'] / row['kv_bytes_nuggets']:.2f}x "
            f"| {row['step_ms_full_median']:.2f} / {row['step_ms_full_min']:.2f} ms "
            f"| {row['step_ms_dodo_median']:.2f} / {row['step_ms_dodo_min']:.2f} ms "
            f"| {row['step_ms_full_median'] / row['step_ms_dodo_median']:.2f}x "
            f"| {row['full_prefill_s']:.2f} s | {row['compress_s']:.2f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="Also write the rows to this file.")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.lengths, args.steps, args.rounds, args.warmup, args.device)
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, sizes {SIZES}")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
