"""Scoring rules of kvcert.data.metrics, checked against hand-computed values."""

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
        # ROUGE-L: LCS("the cat sat on the mat", "the cat was on the mat") = 5 of 6 words each side.
        ("the cat sat on the mat", ["the cat was on the mat"], "rouge_l", 500 / 6),
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
        for prediction in ("", "Paragraph 1 7 7", "completely unrelated text"):
            value = score(prediction, ["Paragraph 1", "7"] if metric != "retrieval" else ["Paragraph 1"], metric,
                          **kwargs)
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
