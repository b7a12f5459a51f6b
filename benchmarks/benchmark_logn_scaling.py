"""Long inputs read by a model trained on short ones: ROUGE-1 with and without ``cross_attention_logn_length``.

    longreach demo                                   # trains ./longreach-demo on inputs of at most 128 tokens
    python benchmarks/benchmark_logn_scaling.py --model longreach-demo [--documents 40] [--min_tokens 500]

On the demo's *training* documents of at least ``--min_tokens`` tokens (never the held-out ones), beam search as the
demo does it, ROUGE-1 F1 against the documents' summaries, for:

- ``whole``: the document read whole, no scaling;
- ``cut_to_N``: the document cut to N tokens (128, 256, 512), no scaling;
- ``whole_cross_attention_first_512``: the whole document encoded, but the decoder's cross-attention given only the
  first 512 encoder positions (does the encoder or the cross-attention fail on long inputs?);
- ``whole_logn_N``: the document read whole with ``cross_attention_logn_length = N`` (N = the longest training input,
  and twice that);
- ``lead``: the demo's lead baseline.

Prints one JSON line per setting. The corpus is rebuilt from the installed distributions, as the demo builds it, so
run it in the environment the demo model was trained in.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="longreach-demo", help="A folder written by `longreach demo`.")
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--min_tokens", type=int, default=500)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from rouge_score import rouge_scorer
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    from transformers.modeling_outputs import BaseModelOutput

    from longreach.demo import DemoSettings, build_corpus, lead_baseline

    settings = DemoSettings()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, trust_remote_code=True).eval()
    train, _ = build_corpus(settings.min_training_words)
    documents = [e for e in train if len(tokenizer(e["document"])["input_ids"]) >= args.min_tokens][: args.documents]
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)

    def rouge1(summaries: list[str]) -> float:
        scores = [scorer.score(e["summary"], s)["rouge1"].fmeasure for e, s in zip(documents, summaries)]
        return 100 * statistics.mean(scores)

    def summarize(max_length: int | None = None, logn_length: int | None = None, cross_positions: int | None = None):
        model.config.cross_attention_logn_length = logn_length
        summaries = []
        for example in documents:
            inputs = tokenizer(example["document"], return_tensors="pt", truncation=max_length is not None,
                               max_length=max_length)
            with torch.no_grad():
                if cross_positions is None:
                    output = model.generate(**inputs)
                else:
                    states = model.get_encoder()(**inputs).last_hidden_state[:, :cross_positions]
                    output = model.generate(encoder_outputs=BaseModelOutput(last_hidden_state=states),
                                            attention_mask=inputs["attention_mask"][:, :cross_positions])
            summaries.append(tokenizer.decode(output[0], skip_special_tokens=True))
        return summaries

    train_length = settings.max_source_length
    runs = {"whole": {}}
    runs.update({f"cut_to_{n}": {"max_length": n} for n in (128, 256, 512)})
    runs["whole_cross_attention_first_512"] = {"cross_positions": 512}
    runs.update({f"whole_logn_{n}": {"logn_length": n} for n in (train_length, 2 * train_length)})
    tokens = [len(tokenizer(e["document"])["input_ids"]) for e in documents]
    print(json.dumps({"documents": len(documents), "tokens_min": min(tokens), "tokens_max": max(tokens),
                      "training_inputs_up_to": train_length}), flush=True)
    for name, options in runs.items():
        summaries = summarize(**options)
        print(json.dumps({"setting": name, "rouge1": round(rouge1(summaries), 2), "first_summary": summaries[0]}),
              flush=True)
    lead = rouge1([lead_baseline(e["document"]) for e in documents])
    print(json.dumps({"setting": "lead", "rouge1": round(lead, 2)}), flush=True)


if __name__ == "__main__":
    main()
