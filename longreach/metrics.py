"""ROUGE as the summarization literature reports it, without downloads (used by the demo and the examples).

``rouge_score`` with stemming; ROUGE-Lsum needs one sentence per line, which a regex splitter provides (NLTK's punkt,
what ``evaluate.load("rouge")`` uses, would need a download).
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences_per_line(text: str) -> str:
    return "\n".join(sentence for sentence in _SENTENCE_END.split(text.strip()) if sentence)


def rouge_per_document(predictions: list[str], references: list[str]) -> list[dict[str, float]]:
    """ROUGE-1/2/Lsum F1 (0 to 1) of each prediction against its reference."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"Got {len(predictions)} predictions for {len(references)} references; pass one per reference.")
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    return [{key: score.fmeasure for key, score in scorer.score(sentences_per_line(reference),
                                                                sentences_per_line(prediction)).items()}
            for prediction, reference in zip(predictions, references)]


def rouge_scores(predictions: list[str], references: list[str], digits: int = 2) -> dict[str, float]:
    """Mean ROUGE-1/2/Lsum F1 (x100, rounded to ``digits``) of ``predictions`` against ``references``."""
    per_document = rouge_per_document(predictions, references)
    return {key: round(100 * sum(scores[key] for scores in per_document) / max(len(per_document), 1), digits)
            for key in ("rouge1", "rouge2", "rougeLsum")}
