"""Answer scoring for every workload, on a 0–100 scale.

Metrics (name → what it measures):

- ``string_match_all`` (RULER): percentage of references found in the prediction,
  case-insensitively. Used for needle retrieval, variable tracking, common words.
- ``string_match_part`` (RULER): 100 if any reference is found in the prediction, else 0.
- ``qa_f1`` (LongBench): token-level F1 after LongBench's normalization (lower case,
  no punctuation, no articles "a/an/the", single spaces); maximum over references.
- ``qa_f1_zh`` (LongBench, Chinese): token F1 over ``jieba`` words, each stripped of
  Chinese and ASCII punctuation and spaces.
- ``rouge_l`` (LongBench summarization): the ROUGE-L F of the ``rouge`` package
  (``Rouge().get_scores(...)["rouge-l"]["f"]``, its summary-level LCS over sentences split
  on "."), on the raw strings as LongBench passes them; maximum over references. Where the
  package raises (an empty prediction, or a text long enough to exhaust its recursive LCS),
  the score is 0, as in LongBench.
- ``rouge_zh`` (LongBench, Chinese): ``rouge_l`` of the ``jieba`` words joined by spaces.
- ``classification`` (LongBench trec, lsht): the classes of ``all_classes`` that occur in the
  prediction; LongBench then drops those that are only a part of the reference class, with
  its loop removing items from the list it walks (so a match right after a dropped one is
  kept; reproduced, so that scores stay LongBench's); 100/k if the reference is among the k
  remaining matches, else 0. Needs ``all_classes=``.
- ``retrieval`` (LongBench passage_retrieval_en): share of the numbers in the prediction
  equal to the reference paragraph number ("Paragraph 12" → 12); ``retrieval_zh`` the same
  for "段落12".
- ``count`` (LongBench passage_count): share of the numbers in the prediction equal to
  the reference count.
- ``code_sim`` (LongBench lcc, repobench-p): ``fuzzywuzzy``'s ``fuzz.ratio`` (an integer
  0–100) between the first prediction line that holds no backtick, "#" or "//" and the
  reference line. fuzzywuzzy uses ``difflib`` unless ``python-Levenshtein`` is installed,
  which LongBench's environment does not install (nor does kvcert's).

Any metric accepts ``first_line=True``: score only the first non-empty line of the
prediction (LongBench does this for trec, triviaqa and samsum).

Correctness rule (:func:`is_correct`, used to label items right or wrong for the
attribution and recompute analyses): a score counts as correct when it reaches the
metric's threshold in :data:`CORRECT_THRESHOLDS`:

- exact-style metrics (string matches, classification, retrieval, count): 100, i.e. every
  reference found / the single right class or number and nothing else;
- ``qa_f1`` (and ``qa_f1_zh``) and ``code_sim``: 50, i.e. the answer overlaps the reference more than it
  differs from it;
- ``rouge_l`` (and ``rouge_zh``): 25, because reference summaries are abstractive and even strong models
  score 20–35 ROUGE-L on LongBench summarization; 50 would call nearly every summary wrong.

A caller can pass another ``threshold`` explicitly.
"""

from __future__ import annotations

import re
import string
import warnings
from collections import Counter
from functools import lru_cache
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


@lru_cache(maxsize=1)
def _rouge():
    from rouge import Rouge

    return Rouge()


def _rouge_l_one(prediction: str, reference: str) -> float:
    try:
        return float(_rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"])
    except (ValueError, RecursionError):
        # LongBench scores 0 where the package gives up: an empty hypothesis (ValueError) or an LCS
        # table deeper than Python's recursion limit on long summaries.
        return 0.0


def rouge_l(prediction: str, answers: Sequence[str], **_: object) -> float:
    """Best ROUGE-L F of the ``rouge`` package over references, ×100."""
    return 100.0 * max(_rouge_l_one(prediction, ref) for ref in answers)


# --------------------------------------------------------------------------- LongBench, Chinese

# Full-width and CJK punctuation LongBench strips besides string.punctuation.
_ZH_PUNCTUATION = frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
) | _PUNCTUATION


def _jieba_words(text: str) -> list[str]:
    import jieba

    jieba.setLogLevel(60)  # its dictionary-loading messages would go to stderr on every first use
    return list(jieba.cut(text, cut_all=False))


def _normalize_zh(token: str) -> str:
    return "".join(ch for ch in token.lower() if ch not in _ZH_PUNCTUATION and not ch.isspace())


def qa_f1_zh(prediction: str, answers: Sequence[str], **_: object) -> float:
    """Best token F1 over references of the normalized ``jieba`` words (empty words dropped), ×100."""
    def words(text):
        return [w for w in (_normalize_zh(t) for t in _jieba_words(text)) if w]

    pred = words(prediction)
    return 100.0 * max(_token_f1(pred, words(ref)) for ref in answers)


def rouge_zh(prediction: str, answers: Sequence[str], **_: object) -> float:
    """``rouge_l`` on ``jieba`` words joined by spaces, ×100."""
    pred = " ".join(_jieba_words(prediction))
    return 100.0 * max(_rouge_l_one(pred, " ".join(_jieba_words(ref))) for ref in answers)


def _classification_one(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    matches = [c for c in all_classes if c in prediction]
    # A class that is only part of the reference's name ("Entity" inside "Other entity") is not held
    # against the prediction. LongBench removes such classes from the list while iterating over it, so
    # the match right after a removed one is never examined and stays; kept that way, so that scores
    # equal LongBench's.
    kept, unexamined = [], False
    for c in matches:
        if unexamined or not (c in reference and c != reference):
            kept.append(c)
            unexamined = False
        else:
            unexamined = True
    return 1.0 / len(kept) if reference in kept else 0.0


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


def _retrieval(prediction: str, answers: Sequence[str], pattern: str, name: str, example: str) -> float:
    best = 0.0
    for ref in answers:
        found = re.findall(pattern, ref)
        if not found:
            raise ValueError(f"metric {name!r} expects references like {example!r}, got {ref!r}")
        best = max(best, _share_of_numbers_equal(prediction, found[0]))
    return 100.0 * best


def retrieval(prediction: str, answers: Sequence[str], **_: object) -> float:
    """LongBench passage retrieval: references look like "Paragraph 12", ×100."""
    return _retrieval(prediction, answers, r"Paragraph (\d+)", "retrieval", "Paragraph 12")


def retrieval_zh(prediction: str, answers: Sequence[str], **_: object) -> float:
    """LongBench passage_retrieval_zh: references look like "段落12", ×100."""
    return _retrieval(prediction, answers, r"段落(\d+)", "retrieval_zh", "段落12")


def count(prediction: str, answers: Sequence[str], **_: object) -> float:
    """LongBench passage count: share of the numbers in the prediction equal to the count, ×100."""
    return 100.0 * max(_share_of_numbers_equal(prediction, str(ref).strip()) for ref in answers)


def _first_code_line(prediction: str) -> str:
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


@lru_cache(maxsize=1)
def _fuzz():
    with warnings.catch_warnings():
        # Without python-Levenshtein fuzzywuzzy warns that it uses difflib, which is what LongBench measured with.
        warnings.simplefilter("ignore", UserWarning)
        from fuzzywuzzy import fuzz
    return fuzz


def code_sim(prediction: str, answers: Sequence[str], **_: object) -> float:
    """``fuzz.ratio`` of the first code line and the reference line (0–100)."""
    line = _first_code_line(prediction)
    return float(max(_fuzz().ratio(line, ref) for ref in answers))


# --------------------------------------------------------------------------- registry

METRICS: dict[str, MetricFn] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_zh": rouge_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
}

CORRECT_THRESHOLDS: dict[str, float] = {
    "string_match_all": 100.0,
    "string_match_part": 100.0,
    "qa_f1": 50.0,
    "qa_f1_zh": 50.0,
    "rouge_l": 25.0,
    "rouge_zh": 25.0,
    "classification": 100.0,
    "retrieval": 100.0,
    "retrieval_zh": 100.0,
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
