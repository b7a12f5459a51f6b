"""ROUGE as the summarization literature reports it, and SQuAD's exact match and F1 for answers, without downloads
(used by the demo, the examples and the corpus command).

``rouge_score`` with stemming; ROUGE-Lsum needs one sentence per line, which a regex splitter provides (NLTK's punkt,
what ``evaluate.load("rouge")`` uses, would need a download). Exact match and F1 follow SQuAD v1.1's definitions
(answers lower-cased, without punctuation, articles and extra spaces; F1 over their words), which
``evaluate.load("squad")`` would also download: the question-answering scores VCC-T5 and Dodo report.

A reference may also be a list of acceptable texts (SQuAD's several answers per question): each score is then the best
over them, as SQuAD's ``metric_max_over_ground_truths`` and ``rouge_score``'s ``score_multi`` take it.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences_per_line(text: str) -> str:
    return "\n".join(sentence for sentence in _SENTENCE_END.split(text.strip()) if sentence)


def _texts(reference: str | list[str], row: int) -> list[str]:
    """A reference as the list of its acceptable texts (one string, or a non-empty list of them)."""
    texts = [reference] if isinstance(reference, str) else reference
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(text, str) for text in texts):
        raise ValueError(f"Each reference must be a string or a non-empty list of strings, got {reference!r} for "
                         f"prediction {row}.")
    return list(texts)


def rouge_per_document(predictions: list[str], references: list[str | list[str]]) -> list[dict[str, float]]:
    """ROUGE-1/2/Lsum F1 (0 to 1) of each prediction against its reference (the best over a list of them)."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"Got {len(predictions)} predictions for {len(references)} references; pass one per reference.")
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    return [{key: score.fmeasure for key, score in scorer.score_multi(
                [sentences_per_line(text) for text in _texts(reference, row)], sentences_per_line(prediction)).items()}
            for row, (prediction, reference) in enumerate(zip(predictions, references))]


def rouge_scores(predictions: list[str], references: list[str | list[str]], digits: int = 2) -> dict[str, float]:
    """Mean ROUGE-1/2/Lsum F1 (x100, rounded to ``digits``) of ``predictions`` against ``references``."""
    per_document = rouge_per_document(predictions, references)
    return {key: round(100 * sum(scores[key] for scores in per_document) / max(len(per_document), 1), digits)
            for key in ("rouge1", "rouge2", "rougeLsum")}


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _answer_f1(predicted: list[str], expected: list[str]) -> float:
    common = sum((Counter(predicted) & Counter(expected)).values())
    if not predicted or not expected:
        return float(predicted == expected)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def answer_scores(predictions: list[str], references: list[str | list[str]], digits: int = 2) -> dict[str, float]:
    """Mean exact match and word F1 (x100, rounded to ``digits``) of the normalised ``predictions`` against their
    ``references`` (one per prediction: an answer, or a list of acceptable answers, the best of which counts), as
    SQuAD v1.1 defines them; an empty answer scores F1 1 only against an empty reference."""
    if len(predictions) != len(references):
        raise ValueError(f"Got {len(predictions)} predictions for {len(references)} references; pass one per reference.")
    exact, f1 = [], []
    for row, (prediction, reference) in enumerate(zip(predictions, references)):
        predicted = normalize_answer(prediction).split()
        expected = [normalize_answer(text).split() for text in _texts(reference, row)]
        exact.append(max(float(predicted == answer) for answer in expected))
        f1.append(max(_answer_f1(predicted, answer) for answer in expected))
    count = max(len(exact), 1)
    return {"exact_match": round(100 * sum(exact) / count, digits), "f1": round(100 * sum(f1) / count, digits)}
