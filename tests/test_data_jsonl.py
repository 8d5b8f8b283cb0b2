"""The Item contract, the workload registry and the JSON-lines loader."""

import dataclasses
import json
from pathlib import Path

import pytest

from kvcert.data import WORKLOADS, Item, load_items, score_item

FIXTURES = Path(__file__).parent / "fixtures"
ITEMS_FILE = FIXTURES / "items_small.jsonl"


# ----------------------------------------------------------------------------- Item


def test_item_is_frozen_hashable_and_concatenates_to_the_prompt():
    item = Item(id="a", context="Doc. ", question="Q?", answer_prefix=" A:", answers=["x", "y"],
                max_new_tokens=3, metric="string_match_all", task="t", meta={"depth": 0.5})
    assert item.answers == ("x", "y")
    assert item.prompt == "Doc. Q? A:"
    assert hash(item) == hash(dataclasses.replace(item, meta={}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.context = "other"  # type: ignore[misc]


# ----------------------------------------------------------------------------- registry


def test_registry_names():
    assert {"ruler", "longbench", "jsonl"} <= set(WORKLOADS)


def test_unknown_workload_names_the_value_and_the_known_names():
    with pytest.raises(ValueError) as err:
        load_items("needles", {}, None, 1)
    message = str(err.value)
    assert "'needles'" in message and "jsonl, longbench, ruler" in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- jsonl


def test_jsonl_fixture_loads_with_defaults():
    items = load_items("jsonl", {"path": str(ITEMS_FILE)}, None, None)
    assert [i.id for i in items] == ["fact-1", "fact-2", "fact-3"]
    first, second, third = items
    assert first.prompt == ("The meeting moved from Tuesday to Thursday because the hall was booked."
                            "\nWhen is the meeting? The meeting is on")
    assert first.max_new_tokens == 4
    assert second.answers == ("beans and leeks",)  # a single string becomes a one-element tuple
    assert second.metric == "qa_f1" and second.task == "garden"
    assert third.metric == "string_match_part" and third.max_new_tokens == 32  # jsonl.DEFAULTS
    assert third.task == "items_small"  # the file name
    assert score_item(third, " To the garden.") == 100.0  # its one answer found


def test_jsonl_config_defaults_apply_to_missing_fields():
    items = load_items("jsonl", {"path": str(ITEMS_FILE), "max_new_tokens": 9, "metric": "qa_f1"}, None, 2)
    assert [i.max_new_tokens for i in items] == [4, 9]
    assert items[0].metric == "string_match_part"  # the record's own value wins


def test_jsonl_n_items_larger_than_file():
    with pytest.raises(ValueError, match=r"n_items=5 requested but only 3 items"):
        load_items("jsonl", {"path": str(ITEMS_FILE)}, None, 5)


def test_jsonl_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_items("jsonl", {"path": str(missing)}, None, None)


def test_jsonl_needs_a_path_and_known_options():
    with pytest.raises(ValueError, match="data.path"):
        load_items("jsonl", {}, None, None)
    with pytest.raises(ValueError, match="unknown option.*pathh"):
        load_items("jsonl", {"pathh": "x"}, None, None)


GOOD = {"id": "ok-1", "context": "Some text.", "question": "Q?", "answers": ["a"]}


@pytest.mark.parametrize(
    "bad_line, expected_id, expected_text",
    [
        ('{"id": "x", "context": ', None, "invalid JSON"),
        (json.dumps({"id": "q7", "question": "Q?", "answers": ["a"]}), "q7", "missing key(s) context"),
        (json.dumps({**GOOD, "id": "q8", "answers": [1, 2]}), "q8", "'answers' must be a string or a list"),
        (json.dumps({**GOOD, "id": "q9", "context": "  "}), "q9", "'context' is empty"),
        (json.dumps({**GOOD, "id": "q10", "answers": []}), "q10", "'answers' is empty"),
        (json.dumps({**GOOD, "id": "q11", "context": 5}), "q11", "'context' must be a string"),
        (json.dumps({**GOOD, "id": "q12", "metric": "bleu"}), "q12", "unknown metric 'bleu'"),
        (json.dumps({**GOOD, "id": "q13", "max_new_tokens": 0}), "q13", "max_new_tokens"),
        (json.dumps(["not", "an", "object"]), None, "expected a JSON object"),
        (json.dumps(GOOD), "ok-1", "duplicate id, first seen on line 1"),
    ],
)
def test_jsonl_malformed_line_names_file_line_and_id(tmp_path, bad_line, expected_id, expected_text):
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + bad_line + "\n")  # the bad line is line 3
    with pytest.raises(ValueError) as err:
        load_items("jsonl", {"path": str(path)}, None, None)
    message = str(err.value)
    assert "\n" not in message
    assert f"{path}:3" in message
    assert expected_text in message
    if expected_id is not None:
        assert repr(expected_id) in message


# ----------------------------------------------------------------------------- the task of a file's records


@pytest.mark.parametrize("name, task", [
    ("qa/cal.jsonl", "qa"), ("qa/eval.jsonl", "qa"),  # a file named by its split alone: the folder's name
    ("w/qa-cal.jsonl", "qa"), ("w/qa_eval.jsonl", "qa"), ("w/qa.test.jsonl", "qa"), ("w/QA-Validation.jsonl", "QA"),
    ("w/items_small.jsonl", "items_small"), ("w/local.jsonl", "local"),  # no separator before "cal": no split
    ("w/summaries-train.jsonl", "summaries"),
])
def test_the_default_task_is_the_file_name_without_its_split(tmp_path, name, task):
    from kvcert.data.jsonl import default_task

    assert default_task(tmp_path / name) == task


def _write_items(path: Path, ids: list[str], **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({**GOOD, "id": i, **extra}) + "\n" for i in ids))
    return path


def test_one_workload_split_in_two_files_calibrates_and_evaluates_and_another_task_is_refused(tmp_path):
    """The check kvcert-run applies before using a calibration (Calibration.check_prompts) passes for the
    evaluation file of the calibration file's workload, and refuses a really different task."""
    from kvcert.calibration import Calibration
    from kvcert.errors import CalibrationError

    def calibrated_on(path):
        items = load_items("jsonl", {"path": str(path)}, None, None)
        return Calibration(method="conformal", level=0.99, base="paper", unit="prompt", model={}, design={},
                           fitted_on={"item_ids": [i.id for i in items], "tasks": sorted({i.task for i in items})},
                           source=str(path))

    def prompts(path):
        return [(i.id, i.task) for i in load_items("jsonl", {"path": str(path)}, None, None)]

    for cal, evaluation in ((tmp_path / "qa" / "cal.jsonl", tmp_path / "qa" / "eval.jsonl"),
                            (tmp_path / "w" / "qa-cal.jsonl", tmp_path / "w" / "qa-eval.jsonl")):
        calibration = calibrated_on(_write_items(cal, ["c1", "c2"]))
        calibration.check_prompts(prompts(_write_items(evaluation, ["e1", "e2"])))  # one task: no refusal
    other = _write_items(tmp_path / "w" / "summaries-eval.jsonl", ["s1"])
    with pytest.raises(CalibrationError, match=r"fitted on tasks \['qa'\], but this run holds \['summaries'\]"):
        calibration.check_prompts(prompts(other))
    # a record's own task still decides: the qa workload's evaluation file holding another task is refused
    relabelled = _write_items(tmp_path / "w2" / "qa-eval.jsonl", ["e3"], task="summaries")
    with pytest.raises(CalibrationError, match="but this run holds"):
        calibration.check_prompts(prompts(relabelled))
    # and data.task names the task of every record that names none, whatever the file is called
    assert {i.task for i in load_items("jsonl", {"path": str(other), "task": "qa"}, None, None)} == {"qa"}
