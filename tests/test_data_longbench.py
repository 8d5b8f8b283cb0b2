"""The LongBench adapter on a small local fixture in LongBench's exact record schema."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcert.data import is_correct, load_items, score_item
from kvcert.data.longbench import RECORD_FIELDS, subset_specs

FIXTURE = Path(__file__).parent / "fixtures" / "longbench_small.jsonl"
RECORDS = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([r["context"] + " " + r["input"] for r in RECORDS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def load(tokenizer, n_items=None, **cfg):
    return load_items("longbench", {"path": str(FIXTURE), **cfg}, tokenizer, n_items)


def n_tokens(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_fixture_has_the_longbench_schema():
    for record in RECORDS:
        assert set(record) == set(RECORD_FIELDS)


def test_round_trip_builds_longbench_prompts(tokenizer):
    items = load(tokenizer, max_context_tokens=None)
    by_id = {i.id: i for i in items}
    assert len(items) == len(RECORDS)
    for record in RECORDS:
        item = by_id[f"longbench/{record['dataset']}/{record['_id']}"]
        template = subset_specs()[record["dataset"]]["prompt"]
        # The prompt is LongBench's template filled with the record (braces in input kept).
        assert item.prompt == template.replace("{context}", record["context"]).replace("{input}", record["input"])
        assert item.context.endswith(record["context"])  # the document is in the compressible part
        assert record["input"] in item.question
        assert item.answer_prefix == ""
        assert item.answers == tuple(record["answers"])
        assert item.task == record["dataset"]
        assert not item.meta["truncated"]
    trec = by_id["longbench/trec/trec-0001"]
    assert "{NASA}" in trec.question
    # metrics and answer lengths are LongBench's own (dataset2metric, dataset2maxlen: data/assets/longbench.yaml)
    assert trec.metric == "classification" and trec.max_new_tokens == 64
    assert trec.metric_kwargs == {"all_classes": RECORDS[2]["all_classes"], "first_line": True}
    assert by_id["longbench/hotpotqa/hq-0001"].max_new_tokens == 32
    assert by_id["longbench/gov_report/gov-0001"].metric == "rouge_l"
    assert by_id["longbench/gov_report/gov-0001"].max_new_tokens == 512
    assert by_id["longbench/passage_count/pc-0001"].metric == "count"


def test_subsets_are_interleaved(tokenizer):
    items = load(tokenizer, subsets=["hotpotqa", "trec", "gov_report"])
    assert [i.task for i in items] == ["hotpotqa", "trec", "gov_report", "hotpotqa"]
    assert [i.task for i in load(tokenizer, 2, subsets=["hotpotqa", "trec"])] == ["hotpotqa", "trec"]


def test_middle_truncation_keeps_both_ends(tokenizer):
    whole_short, _ = load(tokenizer, max_context_tokens=None, subsets=["hotpotqa"])
    budget = n_tokens(tokenizer, whole_short.prompt) + 10  # the short record fits, the long one not
    short, item = load(tokenizer, max_context_tokens=budget, subsets=["hotpotqa"])
    record = RECORDS[1]
    full_context = subset_specs()["hotpotqa"]["prompt"].split("{context}")[0] + record["context"]
    assert item.meta["truncated"]
    assert n_tokens(tokenizer, item.prompt) <= budget
    assert n_tokens(tokenizer, item.prompt) >= budget - 4
    assert item.context.startswith(full_context[:100])  # the instructions and the first passage
    assert item.context.endswith(full_context[-30:])  # the end of the last passage
    assert "Passage 30:" not in item.context  # the middle is gone
    assert item.question.endswith("Question: What did the village of Oakridge keep?\nAnswer:")
    # Short records are not touched by the same budget.
    assert short.id.endswith("hq-0001") and not short.meta["truncated"]


def test_budget_smaller_than_the_question_is_an_error(tokenizer):
    with pytest.raises(ValueError, match=r"max_context_tokens=20 is too small"):
        load(tokenizer, max_context_tokens=20, subsets=["hotpotqa"])


def test_gold_answers_score_right_and_wrong_answers_wrong(tokenizer):
    for item in load(tokenizer):
        assert is_correct(score_item(item, item.answers[0]), item.metric), item.id
        assert not is_correct(score_item(item, "zzz"), item.metric), item.id


def test_directory_and_zip_sources(tokenizer, tmp_path):
    directory = tmp_path / "lb"
    directory.mkdir()
    for subset in ("hotpotqa", "trec"):
        lines = [json.dumps(r) for r in RECORDS if r["dataset"] == subset]
        (directory / f"{subset}.jsonl").write_text("\n".join(lines) + "\n")
    from_dir = load_items("longbench", {"path": str(directory), "subsets": ["hotpotqa", "trec"]}, tokenizer, None)
    assert [i.task for i in from_dir] == ["hotpotqa", "trec", "hotpotqa"]
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for file in directory.iterdir():
            zf.write(file, f"data/{file.name}")
    from_zip = load_items("longbench", {"path": str(archive)}, tokenizer, None)
    assert [i.id for i in from_zip] == [i.id for i in from_dir]


def test_errors(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"n_items=99 requested but only 6 items"):
        load(tokenizer, 99)
    with pytest.raises(ValueError, match=r"unknown LongBench subset 'dureader'"):
        load(tokenizer, subsets=["dureader"])
    with pytest.raises(ValueError, match=r"no records for subset\(s\) qasper"):
        load(tokenizer, subsets=["qasper"])
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_items("longbench", {"path": str(tmp_path / "nowhere.jsonl")}, tokenizer, None)
    broken = tmp_path / "broken.jsonl"
    record = {k: v for k, v in RECORDS[0].items() if k != "answers"}
    broken.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=rf"{broken}:2: missing LongBench field\(s\) answers"):
        load_items("longbench", {"path": str(broken)}, tokenizer, None)
    with pytest.raises(ValueError, match=r"unknown option\(s\) max_tokens"):
        load(tokenizer, max_tokens=10)


def test_hub_offline_gives_a_one_line_error(tmp_path):
    pytest.importorskip("datasets")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = (
        "from kvcert.data import load_items\n"
        "try:\n"
        "    load_items('longbench', {'subsets': ['hotpotqa']}, None, 1)\n"
        "except RuntimeError as err:\n"
        "    print('ERROR', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 1, done.stdout + done.stderr
    assert "'hotpotqa'" in lines[0] and "THUDM/LongBench" in lines[0] and "data.path" in lines[0]
    shutil.rmtree(tmp_path / "hf", ignore_errors=True)
