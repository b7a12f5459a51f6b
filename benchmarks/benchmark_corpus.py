"""Corpus summarization: length-bucketed batches against one document at a time, same model, same documents.

    python benchmarks/benchmark_corpus.py [--documents 200] [--threads 2]
    python benchmarks/benchmark_corpus.py --device cuda --dtype bfloat16 --runs bucketed bucketed_static

A random-weight LOCOST (d_model 256, 4 encoder / 2 decoder layers; time does not depend on the values) summarizes
``--documents`` synthetic documents of mixed lengths (64 to 4,096 tokens, log-uniform) into 32 tokens each (a fixed
length: ``min_new_tokens`` = ``max_new_tokens``), once with ``summarize_corpus``'s buckets under
``--max_batch_tokens`` and once with batches of one. ``bucketed_static`` runs the buckets with
``cache_implementation="static"`` (``longreach summarize --cache_implementation static``; on a GPU ``generate()`` then
compiles the decoding step, so every new batch shape may compile again, and that time is in the run). Prints one JSON
line per run, whether the runs' summaries are the same, and the speed-ups. ``--quick``: 8 short documents (a smoke run).

``bucketed_padded`` and ``bucketed_static_padded`` (an experiment, not a library option) pad each batch's inputs to a
multiple of ``--pad_to_multiple_of`` tokens, so that fewer batch shapes reach the compiled step and the FFTs. ``--rounds N`` runs the list N
times in turn; a run's seconds are then the median of its rounds after the first, which holds the compiles (on an
H200 the first pass of even the dynamic cache took three times as long as the later ones:
``benchmarks/results/cuda.md``, fifth session).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build(args):
    from longreach import LocostConfig, LocostForConditionalGeneration
    from longreach.demo import train_tokenizer
    from longreach.pipelines.pipeline_summarization import LongSummarizationPipeline

    rng = random.Random(0)
    words = [f"word{i}" for i in range(2000)]
    shortest, longest = (16, 128) if args.quick else (64, 4096)
    lengths = [int(math.exp(rng.uniform(math.log(shortest), math.log(longest)))) for _ in range(args.documents)]
    texts = [" ".join(rng.choice(words) for _ in range(length)) for length in lengths]
    tokenizer = train_tokenizer(texts[:50], vocab_size=2048)
    torch.manual_seed(0)
    model = LocostForConditionalGeneration(LocostConfig(
        vocab_size=len(tokenizer), d_model=256, d_state=64, d_kv=32, d_ff=1024, num_layers=4, num_decoder_layers=2,
        num_heads=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=0)).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    return LongSummarizationPipeline(model=model, tokenizer=tokenizer, device=torch.device(args.device)), texts


RUNS = {"bucketed": ({}, {}), "one_by_one": ({"max_batch_size": 1}, {}),
        "bucketed_static": ({}, {"cache_implementation": "static"}),
        # an experiment, not a library option: each batch's inputs padded on the right to a multiple of
        # --pad_to_multiple_of tokens, so that fewer batch shapes reach the compiled decoding step (and the FFTs)
        "bucketed_padded": ({}, {}), "bucketed_static_padded": ({}, {"cache_implementation": "static"})}


def pad_inputs_to_multiple(summarizer, multiple: int):
    """Wraps ``summarizer._prepare_inputs`` so that its ``input_ids`` and ``attention_mask`` are right-padded (pad id,
    mask 0) to a multiple of ``multiple`` tokens; returns a function that undoes it."""
    original = summarizer._prepare_inputs

    def padded(documents, max_input_length, *questions):
        inputs, dropped = original(documents, max_input_length, *questions)
        extra = -inputs["input_ids"].shape[1] % multiple
        if extra:
            pad_id = summarizer.model.config.pad_token_id
            inputs = dict(inputs)
            inputs["input_ids"] = torch.nn.functional.pad(inputs["input_ids"], (0, extra), value=pad_id)
            inputs["attention_mask"] = torch.nn.functional.pad(inputs["attention_mask"], (0, extra), value=0)
        return inputs, dropped

    summarizer._prepare_inputs = padded
    return lambda: setattr(summarizer, "_prepare_inputs", original)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--max_batch_tokens", type=int, default=16384)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", nargs="+", default=["bucketed", "one_by_one"], choices=list(RUNS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--pad_to_multiple_of", type=int, default=512,
                        help="Input padding of the *_padded runs, in tokens.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Times each run is repeated, in turn; with more than one, a run's seconds are the median "
                             "of the rounds after the first (which holds the compiles).")
    parser.add_argument("--quick", action="store_true", help="8 documents of 16 to 128 tokens (a smoke run).")
    parser.add_argument("--json", default=None, help="Also write the runs to this file.")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    if args.rounds < 1:
        raise ValueError(f"`--rounds` must be positive, got {args.rounds}.")
    if args.pad_to_multiple_of < 1:
        raise ValueError(f"`--pad_to_multiple_of` must be positive, got {args.pad_to_multiple_of}.")
    if args.quick:
        args.documents = min(args.documents, 8)
    if args.threads:
        torch.set_num_threads(args.threads)
    from longreach.corpus import Corpus, finished_records, summarize_corpus

    summarizer, texts = build(args)
    corpus = Corpus()
    for index, text in enumerate(texts):
        corpus.add(f"doc{index:04d}", text)
    generate_kwargs = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens, "num_beams": 1}
    results, summaries = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        warm_up = Corpus()
        warm_up.add("warm-up", texts[0])
        summarize_corpus(summarizer, warm_up, Path(folder) / "warm-up.jsonl", progress=False,
                         generate_kwargs=generate_kwargs)
        for round_number in range(args.rounds):  # the runs in turn, so that a slow spell of the machine hits all
            for name in args.runs:
                options, extra_generate_kwargs = RUNS[name]
                options = {"max_batch_tokens": args.max_batch_tokens, **options}
                undo = pad_inputs_to_multiple(summarizer, args.pad_to_multiple_of) if name.endswith("_padded") \
                    else None
                torch._dynamo.utils.counters.clear()
                path = Path(folder) / f"{name}-{round_number}.jsonl"
                start = time.perf_counter()
                stats = summarize_corpus(summarizer, corpus, path, progress=False,
                                         generate_kwargs={**generate_kwargs, **extra_generate_kwargs}, **options)
                seconds = time.perf_counter() - start
                if undo:
                    undo()
                compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                if round_number == 0:
                    summaries[name] = finished_records(path)
                    results[name] = {"run": name, "documents": stats["documents"],
                                     "input_tokens": stats["input_tokens"], "device": args.device,
                                     "dtype": args.dtype, "threads": torch.get_num_threads(),
                                     "batches": len(run_plan(summarizer, corpus, options)), "seconds_all": [],
                                     "graphs_compiled_all": []}
                    if name.endswith("_padded"):
                        results[name]["pad_to_multiple_of"] = args.pad_to_multiple_of
                result = results[name]
                result["seconds_all"].append(round(seconds, 3))
                result["graphs_compiled_all"].append(compiled_graphs)
                # one round: its time; more: the median of the rounds after the first (compiled graphs reused)
                later = result["seconds_all"][1:] or result["seconds_all"]
                result["seconds"] = round(statistics.median(later), 3)
                result["documents_per_second"] = round(result["documents"] / result["seconds"], 2)
                print(json.dumps(result), flush=True)
    first = args.runs[0]
    for name in args.runs[1:]:
        results[name]["same_summaries_as_" + first] = summaries[name] == summaries[first]
        print(f"{name}: {results[first]['seconds'] / max(results[name]['seconds'], 1e-9):.2f}x the speed of {first}, "
              f"same summaries: {summaries[name] == summaries[first]}")
    if args.json:
        from run_all import write_json  # the neighbouring script

        write_json(args.json, list(results.values()))
    return results


def run_plan(summarizer, corpus, options) -> list[list[int]]:
    """The batches ``summarize_corpus`` makes of ``corpus`` with these options (all documents to do)."""
    from longreach.corpus import plan_batches

    lengths = sorted((len(ids) for ids in summarizer.tokenizer(corpus.texts)["input_ids"]), reverse=True)
    return plan_batches(lengths, options["max_batch_tokens"], options.get("max_batch_size"))


if __name__ == "__main__":
    main()
