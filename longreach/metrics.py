"""ROUGE as the summarization literature reports it, without downloads (used by the demo and the examples).

``rouge_score`` with stemming; ROUGE-Lsum needs one sentence per line, which a regex splitter provides (NLTK's punkt,
what ``evaluate.load("rouge")`` uses, would need a download).
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences_per_line(text: str) -> str:
    return "\n".join(sentence for sentence in _SENTENCE_END.split(text.strip()) if sentence)


def rouge_scores(predictions: list[str], references: list[str], digits: int = 2) -> dict[str, float]:
    """Mean ROUGE-1/2/Lsum F1 (x100, rounded to ``digits``) of ``predictions`` against ``references``."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"Got {len(predictions)} predictions for {len(references)} references; pass one per reference.")
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeLsum": 0.0}
    for prediction, reference in zip(predictions, references):
        scores = scorer.score(sentences_per_line(reference), sentences_per_line(prediction))
        for key in totals:
            totals[key] += scores[key].fmeasure
    return {key: round(100 * value / max(len(predictions), 1), digits) for key, value in totals.items()}
