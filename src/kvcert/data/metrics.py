"""Answer scoring for every workload, on a 0–100 scale.

Metrics (name → what it measures):

- ``string_match_all`` (RULER): percentage of references found in the prediction,
  case-insensitively. Used for needle retrieval, variable tracking, common words.
- ``string_match_part`` (RULER): 100 if any reference is found in the prediction, else 0.
- ``qa_f1`` (LongBench): token-level F1 after SQuAD-style normalization (lower case,
  no punctuation, no articles "a/an/the", single spaces); maximum over references.
- ``rouge_l`` (LongBench summarization): ROUGE-L F1, i.e. the longest common subsequence
  of lower-cased word tokens (``\\w+``), F = 2PR/(P+R); maximum over references.
  LongBench calls the ``rouge`` package, whose summary-level variant splits sentences on
  "." and counts distinct words; this plain sentence-level LCS form can differ from it by
  a few points on long summaries, never in ranking direction on identical texts.
- ``classification`` (LongBench trec): the classes of ``all_classes`` that occur in the
  prediction, ignoring those that are only a part of the reference class; 100/k if the
  reference is among the k matches, else 0. Needs ``all_classes=``.
- ``retrieval`` (LongBench passage_retrieval_en): share of the numbers in the prediction
  equal to the reference paragraph number ("Paragraph 12" → 12).
- ``count`` (LongBench passage_count): share of the numbers in the prediction equal to
  the reference count.
- ``code_sim`` (LongBench lcc, repobench-p): similarity ratio (difflib) between the
  first prediction line that is not a comment or code fence and the reference line.

Any metric accepts ``first_line=True``: score only the first non-empty line of the
prediction (LongBench does this for trec, triviaqa and samsum).

Correctness rule (:func:`is_correct`, used to label items right or wrong for the
attribution and recompute analyses): a score counts as correct when it reaches the
metric's threshold in :data:`CORRECT_THRESHOLDS`:

- exact-style metrics (string matches, classification, retrieval, count): 100, i.e. every
  reference found / the single right class or number and nothing else;
- ``qa_f1`` and ``code_sim``: 50, i.e. the answer overlaps the reference more than it
  differs from it;
- ``rouge_l``: 25, because reference summaries are abstractive and even strong models
  score 20–35 ROUGE-L on LongBench summarization; 50 would call nearly every summary wrong.

A caller can pass another ``threshold`` explicitly.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable, Mapping, Sequence

MetricFn = Callable[..., float]

_PUNCTUATION = frozenset(string.punctuation)

# A small tolerance so that 99.99999 from floating-point arithmetic still counts as 100.
_EPS = 1e-9


# --------------------------------------------------------------------------- RULER


def string_match_all(prediction: str, answers: Sequence[str], **_: object) -> float:
    """Percentage of references contained in the prediction (case-insensitive)."""
    pred = prediction.lower()
    found = sum(ref.lower() in pred for ref in answers)
    return 100.0 * found / len(answers)


def string_match_part(prediction: str, answers: Sequence[str], **_: object) -> float:
    """100 if at least one reference is contained in the prediction, else 0."""
    pred = prediction.lower()
    return 100.0 * max(float(ref.lower() in pred) for ref in answers)


# --------------------------------------------------------------------------- LongBench


def normalize_answer(text: str) -> str:
    """SQuAD/LongBench normalization: lower, drop punctuation and articles, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: Sequence[str], **_: object) -> float:
    """Best token F1 over references, after :func:`normalize_answer`, ×100."""
    pred_tokens = normalize_answer(prediction).split()
    return 100.0 * max(_token_f1(pred_tokens, normalize_answer(ref).split()) for ref in answers)


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    # Classic O(len(a)·len(b)) dynamic programme keeping one row.
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def _rouge_tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def rouge_l(prediction: str, answers: Sequence[str], **_: object) -> float:
    """Best ROUGE-L F1 over references, ×100."""
    pred = _rouge_tokens(prediction)
    best = 0.0
    for ref in answers:
        ref_tokens = _rouge_tokens(ref)
        lcs = _lcs_length(pred, ref_tokens) if pred and ref_tokens else 0
        if lcs:
            precision, recall = lcs / len(pred), lcs / len(ref_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return 100.0 * best


def _classification_one(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    matches = [c for c in all_classes if c in prediction]
    # A class that is only part of the reference's name ("Entity" inside "Other entity")
    # is not held against the prediction.
    matches = [c for c in matches if not (c in reference and c != reference)]
    return 1.0 / len(matches) if reference in matches else 0.0


def classification(prediction: str, answers: Sequence[str], *, all_classes: Sequence[str] | None = None,
                   **_: object) -> float:
    """LongBench classification accuracy (needs ``all_classes``), ×100."""
    if not all_classes:
        raise ValueError("metric 'classification' needs all_classes=[...] (the label set)")
    return 100.0 * max(_classification_one(prediction, ref, all_classes) for ref in answers)


def _share_of_numbers_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == target for n in numbers) / len(numbers)


def retrieval(prediction: str, answers: Sequence[str], **_: object) -> float:
    """LongBench passage retrieval: references look like "Paragraph 12", ×100."""
    best = 0.0
    for ref in answers:
        found = re.findall(r"Paragraph (\d+)", ref)
        if not found:
            raise ValueError(f"metric 'retrieval' expects references like 'Paragraph 12', got {ref!r}")
        best = max(best, _share_of_numbers_equal(prediction, found[0]))
    return 100.0 * best


def count(prediction: str, answers: Sequence[str], **_: object) -> float:
    """LongBench passage count: share of the numbers in the prediction equal to the count, ×100."""
    return 100.0 * max(_share_of_numbers_equal(prediction, str(ref).strip()) for ref in answers)


def _first_code_line(prediction: str) -> str:
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(prediction: str, answers: Sequence[str], **_: object) -> float:
    """Similarity ratio of the first code line to the reference line, ×100."""
    line = _first_code_line(prediction)
    return 100.0 * max(difflib.SequenceMatcher(None, line, ref).ratio() for ref in answers)


# --------------------------------------------------------------------------- registry

METRICS: dict[str, MetricFn] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
}

CORRECT_THRESHOLDS: dict[str, float] = {
    "string_match_all": 100.0,
    "string_match_part": 100.0,
    "qa_f1": 50.0,
    "rouge_l": 25.0,
    "classification": 100.0,
    "retrieval": 100.0,
    "count": 100.0,
    "code_sim": 50.0,
}


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known metrics: {', '.join(sorted(METRICS))}")


def score(prediction: str, answers: Sequence[str], metric: str, **kw: object) -> float:
    """Score ``prediction`` against ``answers`` with ``metric``; a float in [0, 100]."""
    _check_metric(metric)
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        raise ValueError("score() needs at least one reference answer")
    if kw.pop("first_line", False):
        prediction = prediction.lstrip("\n").split("\n")[0]
    value = METRICS[metric](prediction, list(answers), **kw)
    return min(100.0, max(0.0, float(value)))


def is_correct(score_value: float, metric: str, threshold: float | None = None) -> bool:
    """Whether a score counts as a correct answer (rule in the module docstring)."""
    _check_metric(metric)
    bar = CORRECT_THRESHOLDS[metric] if threshold is None else threshold
    return score_value >= bar - _EPS


def score_item(item: "object", prediction: str) -> float:
    """Score a prediction for an :class:`~kvcert.data.Item`, with its metric arguments."""
    kwargs: Mapping[str, object] = getattr(item, "metric_kwargs", {}) or {}
    return score(prediction, item.answers, item.metric, **dict(kwargs))
