"""Corpus summarization: length-bucketed batches against one document at a time, same model, same documents.

    python benchmarks/benchmark_corpus.py [--documents 200] [--threads 2]

A random-weight LOCOST (d_model 256, 4 encoder / 2 decoder layers; time does not depend on the values) summarizes
``--documents`` synthetic documents of mixed lengths (64 to 4,096 tokens, log-uniform) into 32 tokens each (a fixed
length: ``min_new_tokens`` = ``max_new_tokens``), once with ``summarize_corpus``'s buckets under
``--max_batch_tokens`` and once with batches of one. Prints one JSON line per run and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import math
import random
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
    lengths = [int(math.exp(rng.uniform(math.log(64), math.log(4096)))) for _ in range(args.documents)]
    texts = [" ".join(rng.choice(words) for _ in range(length)) for length in lengths]
    tokenizer = train_tokenizer(texts[:50], vocab_size=2048)
    torch.manual_seed(0)
    model = LocostForConditionalGeneration(LocostConfig(
        vocab_size=len(tokenizer), d_model=256, d_state=64, d_kv=32, d_ff=1024, num_layers=4, num_decoder_layers=2,
        num_heads=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=0)).eval()
    return LongSummarizationPipeline(model=model, tokenizer=tokenizer), texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--max_batch_tokens", type=int, default=16384)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from longreach.corpus import Corpus, summarize_corpus

    summarizer, texts = build(args)
    corpus = Corpus()
    for index, text in enumerate(texts):
        corpus.add(f"doc{index:04d}", text)
    generate_kwargs = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens, "num_beams": 1}
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        warm_up = Corpus()
        warm_up.add("warm-up", texts[0])
        summarize_corpus(summarizer, warm_up, Path(folder) / "warm-up.jsonl", progress=False,
                         generate_kwargs=generate_kwargs)
        for name, options in (("bucketed", {"max_batch_tokens": args.max_batch_tokens}),
                              ("one_by_one", {"max_batch_size": 1})):
            start = time.perf_counter()
            stats = summarize_corpus(summarizer, corpus, Path(folder) / f"{name}.jsonl", progress=False,
                                     generate_kwargs=generate_kwargs, **options)
            seconds = time.perf_counter() - start
            results[name] = {"run": name, "documents": stats["documents"], "input_tokens": stats["input_tokens"],
                             "seconds": round(seconds, 1), "documents_per_second": round(stats["documents"] / seconds, 2),
                             "threads": torch.get_num_threads()}
            print(json.dumps(results[name]), flush=True)
    print(f"speed-up of bucketed batches over one at a time: "
          f"{results['one_by_one']['seconds'] / results['bucketed']['seconds']:.2f}x")


if __name__ == "__main__":
    main()
