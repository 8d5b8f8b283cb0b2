"""Scoring rules of kvcert.data.metrics: hand-computed values, and LongBench's own scoring.

LongBench scores with the ``rouge`` package (ROUGE-L F), ``fuzzywuzzy`` (code similarity), ``jieba``
(Chinese words) and its own normalization and classification rule; the second half of this file scores
LongBench-format prediction records (``pred``, ``answers``, ``all_classes`` per line, as its prediction
files hold them) by calling those packages directly, the way LongBench's evaluation does, and checks
that kvcert's metrics give the same numbers.
"""

import json
import re
import string
import warnings
from collections import Counter

import pytest

from kvcert.data import CORRECT_THRESHOLDS, METRICS, Item, is_correct, score, score_item


@pytest.mark.parametrize(
    "prediction, answers, metric, expected",
    [
        # RULER: fraction of references found, case-insensitive.
        ("The keys are 12345 and 99999.", ["12345", "67890"], "string_match_all", 50.0),
        ("ABCDE, fghij", ["abcde", "FGHIJ"], "string_match_all", 100.0),
        ("nothing here", ["12345"], "string_match_all", 0.0),
        ("The keys are 12345 and 99999.", ["12345", "67890"], "string_match_part", 100.0),
        ("nothing", ["12345", "67890"], "string_match_part", 0.0),
        # QA-F1: "the" is dropped; pred {eiffel, tower} vs ref {eiffel, tower, in, paris}: P=1, R=1/2.
        ("The Eiffel Tower.", ["Eiffel Tower in Paris"], "qa_f1", 200 / 3),
        ("Eiffel Tower", ["Louvre", "eiffel tower"], "qa_f1", 100.0),
        ("Big Ben", ["Eiffel Tower"], "qa_f1", 0.0),
        # ROUGE-L with different lengths: LCS = 2 ("a", "c"), P = 2/2, R = 2/4 -> F = 2/3.
        ("a c", ["a b c d"], "rouge_l", 200 / 3),
        # Retrieval and count: share of the numbers in the prediction that are right.
        ("Paragraph 12", ["Paragraph 12"], "retrieval", 100.0),
        ("Paragraph 12 or Paragraph 3", ["Paragraph 12"], "retrieval", 50.0),
        ("I do not know", ["Paragraph 12"], "retrieval", 0.0),
        ("There are 7 unique paragraphs.", ["7"], "count", 100.0),
        ("7 or 8", ["7"], "count", 50.0),
        # Code similarity: comment lines are skipped, then the line is compared.
        ("\n# the next line\nx = foo(1)\n", ["x = foo(1)"], "code_sim", 100.0),
        # difflib's matching blocks "ab": 2·2 / 8 characters.
        ("abcd", ["abxy"], "code_sim", 50.0),
    ],
)
def test_score_matches_hand_computed_values(prediction, answers, metric, expected):
    assert score(prediction, answers, metric) == pytest.approx(expected)


def test_classification_follows_longbench():
    classes = ["Abbreviation", "Expression abbreviated", "Animal"]
    assert score("Abbreviation", ["Abbreviation"], "classification", all_classes=classes) == 100.0
    # Two classes named: half credit if one of them is right.
    assert score("Abbreviation or Animal", ["Animal"], "classification", all_classes=classes) == 50.0
    assert score("Animal", ["Abbreviation"], "classification", all_classes=classes) == 0.0
    # A class that is only part of the reference name does not count against the prediction.
    nested = ["Other", "Other location"]
    assert score("Other location", ["Other location"], "classification", all_classes=nested) == 100.0
    with pytest.raises(ValueError, match="all_classes"):
        score("Animal", ["Animal"], "classification")


def test_first_line_only():
    assert score("Paris\nLondon is big", ["London"], "string_match_part", first_line=True) == 0.0
    assert score("\nLondon\nParis", ["London"], "string_match_part", first_line=True) == 100.0


def test_answers_may_be_a_single_string():
    assert score("it is 42", "42", "string_match_all") == 100.0


# At and just below each metric's threshold, as kvcert.data.metrics' docstring states them (with its reasons):
# exact-style metrics 100, QA-F1 and code similarity 50, ROUGE-L 25.
@pytest.mark.parametrize(
    "value, metric, expected",
    [
        (100.0, "string_match_all", True),
        (99.0, "string_match_all", False),
        (100.0, "string_match_part", True),
        (50.0, "qa_f1", True),
        (49.9, "qa_f1", False),
        (25.0, "rouge_l", True),
        (24.9, "rouge_l", False),
        (100.0, "classification", True),
        (50.0, "classification", False),
        (50.0, "retrieval", False),
        (100.0, "count", True),
        (50.0, "code_sim", True),
    ],
)
def test_is_correct_thresholds(value, metric, expected):
    assert is_correct(value, metric) is expected


def test_is_correct_threshold_override():
    assert is_correct(30.0, "qa_f1", threshold=25.0)
    assert not is_correct(80.0, "string_match_all", threshold=90.0)


def test_every_metric_has_a_threshold_and_scores_in_range():
    assert set(METRICS) == set(CORRECT_THRESHOLDS)
    for metric in METRICS:
        kwargs = {"all_classes": ["Paragraph 1", "7"]} if metric == "classification" else {}
        answers = {"retrieval": ["Paragraph 1"], "retrieval_zh": ["段落1"]}.get(metric, ["Paragraph 1", "7"])
        for prediction in ("", "Paragraph 1 7 7", "completely unrelated text", "段落1"):
            value = score(prediction, answers, metric, **kwargs)
            assert 0.0 <= value <= 100.0


def test_unknown_metric_is_rejected_with_the_known_names():
    with pytest.raises(ValueError, match=r"unknown metric 'bleu'; known metrics: .*qa_f1") as err:
        score("x", ["x"], "bleu")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown metric"):
        is_correct(100.0, "bleu")


def test_score_item_uses_metric_kwargs():
    item = Item(id="t1", context="c", question="q", answers=["Animal"], max_new_tokens=4,
                metric="classification", task="trec",
                metric_kwargs={"all_classes": ["Animal", "Abbreviation"], "first_line": True})
    assert score_item(item, "Animal\nAbbreviation") == 100.0


# --------------------------------------------------------------------------- LongBench's own scoring

# Prediction records in LongBench's format (one JSON object per line of pred/<subset>.jsonl).
PREDICTIONS = r"""
{"dataset": "gov_report", "pred": "The agency found that inspections were mostly on time. Paper records slowed the repairs.", "answers": ["The agency found inspections mostly on time but paper records slowed repairs."], "all_classes": null}
{"dataset": "gov_report", "pred": "", "answers": ["An empty summary scores zero."], "all_classes": null}
{"dataset": "qmsum", "pred": "the cat sat on the mat", "answers": ["the cat was on the mat"], "all_classes": null}
{"dataset": "multi_news", "pred": "Storms hit the coast. Thousands lost power. Officials urged people to stay home.", "answers": ["Thousands lost power as storms hit the coast, and officials asked residents to stay home.", "Storms left thousands without power."], "all_classes": null}
{"dataset": "samsum", "pred": "Anna will bring the cake.\nTom buys drinks.", "answers": ["Anna is bringing cake and Tom is buying drinks for the party."], "all_classes": null}
{"dataset": "lcc", "pred": "\n```python\n# finish the loop\n        total += value * weight\n", "answers": ["        total += value * weights[i]"], "all_classes": null}
{"dataset": "repobench-p", "pred": "// next\nreturn self.cache.get(key, default)\n", "answers": ["return self._cache.get(key)"], "all_classes": null}
{"dataset": "lcc", "pred": "# only comments\n// here", "answers": ["x = 1"], "all_classes": null}
{"dataset": "hotpotqa", "pred": "The Eiffel Tower, in Paris.", "answers": ["Eiffel Tower", "the tower in Paris"], "all_classes": null}
{"dataset": "triviaqa", "pred": "Mount Everest\nIt is the highest mountain.", "answers": ["Everest", "Mount Everest"], "all_classes": null}
{"dataset": "trec", "pred": "Expression abbreviated", "answers": ["Expression abbreviated"], "all_classes": ["Abbreviation", "Expression abbreviated", "Individual", "Animal"]}
{"dataset": "trec", "pred": "Other location or Other entity", "answers": ["Other location"], "all_classes": ["Other location", "Other", "location", "Other entity"]}
{"dataset": "trec", "pred": "Other location", "answers": ["Other location"], "all_classes": ["Other", "location", "Other location"]}
{"dataset": "passage_retrieval_en", "pred": "Paragraph 12, or maybe Paragraph 3", "answers": ["Paragraph 12"], "all_classes": null}
{"dataset": "passage_count", "pred": "There are 7 unique paragraphs out of 9.", "answers": ["7"], "all_classes": null}
{"dataset": "multifieldqa_zh", "pred": "我喜欢北京天安门。", "answers": ["我爱北京天安门"], "all_classes": null}
{"dataset": "dureader", "pred": "今天天气很好，我们去公园散步。", "answers": ["今天天气不错，适合去公园散步"], "all_classes": null}
{"dataset": "passage_retrieval_zh", "pred": "段落3", "answers": ["段落3"], "all_classes": null}
"""

# LongBench's dataset -> metric table (its eval.py), in kvcert's metric names, and the subsets it scores on
# the first line only. The English subsets must agree with kvcert's subset table.
LONGBENCH_METRIC = {
    "gov_report": "rouge_l", "qmsum": "rouge_l", "multi_news": "rouge_l", "samsum": "rouge_l",
    "lcc": "code_sim", "repobench-p": "code_sim", "hotpotqa": "qa_f1", "triviaqa": "qa_f1",
    "trec": "classification", "passage_retrieval_en": "retrieval", "passage_count": "count",
    "multifieldqa_zh": "qa_f1_zh", "dureader": "rouge_zh", "passage_retrieval_zh": "retrieval_zh",
}
FIRST_LINE = {"trec", "triviaqa", "samsum", "lsht"}


def _rouge_f(prediction, reference):
    from rouge import Rouge

    try:
        return Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except Exception:  # LongBench scores 0 whatever the package raises
        return 0.0


def _fuzz_ratio(a, b):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fuzzywuzzy import fuzz
    return fuzz.ratio(a, b)


def _jieba(text):
    import jieba

    return list(jieba.cut(text, cut_all=False))


def _squad_normalize(text):
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _f1(pred, ref):
    same = sum((Counter(pred) & Counter(ref)).values())
    return 0.0 if same == 0 else 2 * (same / len(pred)) * (same / len(ref)) / (same / len(pred) + same / len(ref))


def _longbench_score(dataset, prediction, reference, all_classes):
    """One (prediction, reference) pair as LongBench's evaluation scores it, in [0, 1]."""
    metric = LONGBENCH_METRIC[dataset]
    if metric == "rouge_l":
        return _rouge_f(prediction, reference)
    if metric == "rouge_zh":
        return _rouge_f(" ".join(_jieba(prediction)), " ".join(_jieba(reference)))
    if metric == "code_sim":
        lines = [ln for ln in prediction.lstrip("\n").split("\n") if not any(c in ln for c in ("`", "#", "//"))]
        return _fuzz_ratio(lines[0] if lines else "", reference) / 100
    if metric == "qa_f1":
        return _f1(_squad_normalize(prediction).split(), _squad_normalize(reference).split())
    if metric == "qa_f1_zh":
        punct = set(string.punctuation) | set("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
        def words(text):
            out = ["".join("".join(ch for ch in w.lower() if ch not in punct).split()) for w in _jieba(text)]
            return [w for w in out if w]
        return _f1(words(prediction), words(reference))
    if metric == "classification":
        walked = [c for c in all_classes if c in prediction]
        i = 0
        while i < len(walked):
            if walked[i] in reference and walked[i] != reference:
                del walked[i]  # as list.remove inside a for loop over the list: the next class shifts into i
            i += 1  # ... and the loop moves past it unexamined
        return 1.0 / len(walked) if reference in walked else 0.0
    if metric in ("retrieval", "retrieval_zh"):
        target = re.findall(r"Paragraph (\d+)" if metric == "retrieval" else r"段落(\d+)", reference)[0]
        numbers = re.findall(r"\d+", prediction)
        return 0.0 if not numbers else sum(n == target for n in numbers) / len(numbers)
    if metric == "count":
        numbers = re.findall(r"\d+", prediction)
        return 0.0 if not numbers else sum(n == reference for n in numbers) / len(numbers)
    raise AssertionError(metric)


def test_longbench_subset_table_matches_longbench():
    from kvcert.data.longbench import subset_specs

    for subset, spec in subset_specs().items():
        if subset in LONGBENCH_METRIC:
            assert spec["metric"] == LONGBENCH_METRIC[subset], subset
            assert bool(spec.get("first_line")) == (subset in FIRST_LINE), subset


@pytest.mark.parametrize("line", [ln for ln in PREDICTIONS.splitlines() if ln.strip()],
                         ids=lambda ln: json.loads(ln)["dataset"])
def test_scores_equal_longbench_on_prediction_records(line):
    record = json.loads(line)
    dataset, prediction = record["dataset"], record["pred"]
    if dataset in FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    expected = 100 * max(_longbench_score(dataset, prediction, ref, record["all_classes"]) for ref in record["answers"])
    kwargs = {"all_classes": record["all_classes"]} if record["all_classes"] else {}
    got = score(record["pred"], record["answers"], LONGBENCH_METRIC[dataset], first_line=dataset in FIRST_LINE,
                **kwargs)
    assert got == pytest.approx(expected, abs=1e-9)


def test_rouge_l_is_the_packages_summary_level_score():
    """The pair a plain sentence-level LCS scores 83.3 (5 of 6 words): the rouge package, and so LongBench, 80.0."""
    assert score("the cat sat on the mat", ["the cat was on the mat"], "rouge_l") == pytest.approx(80.0, abs=1e-5)
    # Split on ".", the two sentences of a prediction are matched separately: not the one-sequence LCS.
    one = score("storms hit the coast and thousands lost power", ["thousands lost power as storms hit the coast"],
                "rouge_l")
    two = score("storms hit the coast. thousands lost power", ["thousands lost power as storms hit the coast"],
                "rouge_l")
    assert two > one


def test_code_sim_is_fuzzywuzzys_integer_ratio():
    value = score("x = compute(a, b)", ["y = compute(a, c)"], "code_sim")
    assert value == int(value) and 0 < value < 100


def test_classification_keeps_longbench_removal_order():
    """LongBench drops a match that is part of the reference name, but skips the match right after it."""
    classes = ["Other", "location", "Other location"]
    # "Other" is dropped, "location" (right after it) is never examined and stays: 2 matches, half credit.
    assert score("Other location", ["Other location"], "classification", all_classes=classes) == 50.0
    # With the order changed, both parts are examined and dropped: full credit.
    assert score("Other location", ["Other location"], "classification",
                 all_classes=["Other", "Other location", "location"]) == 100.0
