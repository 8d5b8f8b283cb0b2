"""The RULER-style generator: determinism, token lengths, needles, scoring, config errors."""

import random
import re

import pytest

from kvcert.data import is_correct, load_items, score_item
from kvcert.data import haystack as hs
from kvcert.data import ruler

ALL_TASKS = ["niah_single", "niah_multikey_2", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
# Tasks whose filler unit is a list entry or a coded word (several tokens), not a haystack word.
WORD_LIST_TASKS = ("cwe", "fwe")


def _train_bpe_tokenizer():
    """A small byte-level BPE tokenizer trained on the generator's own vocabulary (real, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [hs.NOISE_TEXT] * 5 + hs.prose_sentences(random.Random(0), 300) + [" ".join(hs.COMMON_WORDS)]
    corpus += ["The amber pass key is 12345. VAR ABCDE = VAR FGHIJ. 1. apple 2. river 3. oak"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tokenizer():
    return _train_bpe_tokenizer()


def n_tokens(tokenizer, text):
    return len(tokenizer.encode(text, add_special_tokens=False))


def make(tokenizer, n_items, **cfg):
    return load_items("ruler", cfg, tokenizer, n_items)


# ----------------------------------------------------------------------------- determinism


def test_same_seed_same_items_and_other_seed_other_items(tokenizer):
    cfg = dict(tasks=ALL_TASKS, context_tokens=1200, seed=7, haystack="prose")
    first = make(tokenizer, 6, **cfg)
    again = make(tokenizer, 6, **cfg)
    assert [i.prompt for i in first] == [i.prompt for i in again]
    assert [i.answers for i in first] == [i.answers for i in again]
    other = make(tokenizer, 6, **{**cfg, "seed": 8})
    assert all(a.prompt != b.prompt for a, b in zip(first, other))


def test_more_items_keep_the_earlier_ones(tokenizer):
    short = make(tokenizer, 4, tasks=["niah_single", "vt"], context_tokens=300)
    longer = make(tokenizer, 8, tasks=["niah_single", "vt"], context_tokens=300)
    assert longer[:4] == short


def test_tasks_are_interleaved(tokenizer):
    items = make(tokenizer, 7, tasks=["niah_single", "niah_multikey_2", "vt"], context_tokens=300)
    assert [i.task for i in items] == ["niah_single", "niah_multikey_2", "vt"] * 2 + ["niah_single"]
    assert len({i.id for i in items}) == 7


# ----------------------------------------------------------------------------- length


@pytest.mark.parametrize("haystack", ["noise", "prose"])
@pytest.mark.parametrize("target", [1200, 2500])
def test_prompt_length_is_just_under_the_target(tokenizer, haystack, target):
    items = make(tokenizer, 12, tasks=ALL_TASKS, context_tokens=target, haystack=haystack)
    for item in items:
        length = n_tokens(tokenizer, item.prompt)
        assert length == item.meta["prompt_tokens"]
        # Haystack tasks: within one word, or SENTENCE_SLACK to end on a full sentence.
        # cwe, fwe: within one list entry or coded word (plus the shuffle's effect on merges).
        slack = 16 if item.task in WORD_LIST_TASKS else ruler.SENTENCE_SLACK
        assert target - slack <= length <= target, (item.task, length)


def test_short_targets_work_for_haystack_tasks(tokenizer):
    for item in make(tokenizer, 5, tasks=ALL_TASKS[:5], context_tokens=300):
        assert 300 - ruler.SENTENCE_SLACK <= n_tokens(tokenizer, item.prompt) <= 300


def test_too_small_target_is_an_error(tokenizer):
    with pytest.raises(ValueError, match=r"context_tokens=20 is too small"):
        make(tokenizer, 1, tasks=["niah_single"], context_tokens=20)


# ----------------------------------------------------------------------------- content


def test_passkey_needles_are_in_the_context_and_the_answer_is_right(tokenizer):
    items = make(tokenizer, 10, tasks=["niah_single", "niah_multikey_4"], context_tokens=500, haystack="prose")
    for item in items:
        (answer,) = item.answers
        match = re.fullmatch(r"What is the (\w+) pass key\?", item.question)
        assert match, item.question
        label = match.group(1)
        assert item.answer_prefix == f" The {label} pass key is"
        assert item.context.count(f"The {label} pass key is {answer}.") == 1
        needles = re.findall(r"The (\w+) pass key is (\d{5})\.", item.context)
        assert len(needles) == item.meta["num_needles"] == (1 if item.task == "niah_single" else 4)
        assert len({v for _, v in needles}) == len(needles)  # values are distinct
        assert 0.0 <= item.meta["answer_depths"][0] <= 1.0
        assert item.max_new_tokens == 8 and item.metric == "string_match_all"  # 8 tokens per 5-digit answer (ruler.py)
        # What a model that found the needle would write is scored right; a distractor is not.
        assert is_correct(score_item(item, f" {answer}."), item.metric)
        others = [v for _, v in needles if v != answer]
        if others:
            assert not is_correct(score_item(item, f" {others[0]}."), item.metric)


def test_needle_depths_follow_the_meta(tokenizer):
    (item,) = make(tokenizer, 1, tasks=["niah_single"], context_tokens=1500)
    (answer,) = item.answers
    position = item.context.index(answer) / len(item.context)
    assert abs(position - item.meta["answer_depths"][0]) < 0.1


def test_multivalue_and_multiquery_ask_for_every_value(tokenizer):
    multivalue, multiquery = make(tokenizer, 2, tasks=["niah_multivalue", "niah_multiquery"], context_tokens=600)
    assert len(multivalue.answers) == 4 and len(multiquery.answers) == 4  # num_values, num_queries default 4 (ruler.py)
    for item in (multivalue, multiquery):
        for answer in item.answers:
            assert f" is {answer}." in item.context
        assert "pass keys" in item.question
        assert score_item(item, " " + ", ".join(item.answers)) == 100.0
        assert score_item(item, " " + ", ".join(item.answers[:2])) == 100 * 2 / len(item.answers)  # share found


def test_ruler_needle_format(tokenizer):
    (item,) = make(tokenizer, 1, tasks=["niah_multikey_3"], needle_format="ruler", context_tokens=500)
    (answer,) = item.answers
    assert len(answer) == 7  # RULER's 7-digit magic numbers
    key = re.search(r"for ([a-z]+-[a-z]+) mentioned", item.question).group(1)
    assert f"One of the special magic numbers for {key} is: {answer}." in item.context
    assert item.context.count("One of the special magic numbers for") == 3
    assert item.answer_prefix.startswith(" The special magic number for")


def test_variable_tracking_chain_is_in_order(tokenizer):
    (item,) = make(tokenizer, 1, tasks=[{"name": "vt", "num_hops": 3}], context_tokens=600)
    assert item.task == "vt_3" and len(item.answers) == 4  # the default label names the count
    value = re.search(r"assigned the value (\d{5})", item.question).group(1)
    first, *rest = item.answers
    positions = [item.context.index(f"VAR {first} = {value}.")]
    for previous, name in zip(item.answers, rest):
        positions.append(item.context.index(f"VAR {name} = VAR {previous}."))
    assert positions == sorted(positions)
    assert score_item(item, " " + " ".join(item.answers)) == 100.0


def test_variable_tracking_worked_example_comes_first_and_changes_nothing_else(tokenizer):
    task = {"name": "vt", "num_chains": 2, "num_hops": 2}
    plain = make(tokenizer, 3, tasks=[task], context_tokens=700)
    shown = make(tokenizer, 3, tasks=[{**task, "example_words": 90}], context_tokens=700)
    for without, item in zip(plain, shown):
        # The item's own draws are those of the version without an example.
        assert (item.answers, item.question, item.answer_prefix) == (without.answers, without.question,
                                                                     without.answer_prefix)
        example, rest = item.context.split("\n\n", 2)[:2], item.context.split("\n\n", 2)[2]
        example_text = "\n\n".join(example)
        asked = re.search(r"assigned the value (\d{5}) in the text above\. Answer", example_text).group(1)
        names = re.search(r"they are: ([A-Z ]+)$", example_text).group(1).split()
        assert len(names) == 3 and asked not in item.question
        assert not set(names) & set(re.findall(r"VAR ([A-Z]{5})", rest))  # a copied answer is wrong
        assert f"VAR {names[0]} = {asked}." in example_text
        noise = re.sub(r"VAR [A-Z]{5} = (VAR [A-Z]{5}|\d{5})\.", "", example_text.split("\n")[2])
        assert len(noise.split()) == 90 and len(re.findall(r"VAR [A-Z]{5} = ", example_text)) == 6
        assert rest.startswith("Memorize and track") and f"VAR {item.answers[1]} = VAR {item.answers[0]}." in rest
        assert 700 - ruler.SENTENCE_SLACK <= n_tokens(tokenizer, item.prompt) <= 700


def test_frequent_words_follow_zipf_and_the_answer_is_ranks_two_to_four(tokenizer):
    for item in make(tokenizer, 3, tasks=["fwe"], context_tokens=1200):
        words = item.context.split("coded words. ", 1)[1].split()
        counts = {w: words.count(w) for w in set(words)}
        ranked = sorted(counts, key=counts.get, reverse=True)
        assert ranked[0] == "..."  # RULER's noise word, which the question says to ignore
        assert sorted(ranked[1:4]) == sorted(item.answers) and len(item.answers) == 3
        assert sorted(counts.values(), reverse=True)[:5] == item.meta["counts"]
        assert counts[ranked[3]] > counts[ranked[4]]  # the answer is unique
        assert len(counts) <= 1200 // 50  # RULER's vocabulary size, context_tokens // 50 (rare ranks round to 0)
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
        assert item.max_new_tokens == 50 and "Please ignore the dots" in item.question
        assert score_item(item, " " + ", ".join(item.answers) + ".") == 100.0


def test_common_words_occur_most_often(tokenizer):
    (item,) = make(tokenizer, 1, tasks=["cwe"], context_tokens=1200)
    main_list = item.context.split("Memorize the ones that appear most often.\n")[-1]
    words = re.findall(r"\d+\. ([a-z]+)", main_list)
    counts = {w: words.count(w) for w in set(words)}
    assert len(item.answers) == 10  # num_common's default, RULER's
    assert all(counts[w] == item.meta["freq_common"] for w in item.answers)
    assert all(c == item.meta["freq_uncommon"] for w, c in counts.items() if w not in item.answers)
    assert item.max_new_tokens == 120  # cwe's default answer length (ruler.py, after RULER)


def test_default_tasks_are_two_and_four_key_passkeys(tokenizer):
    items = make(tokenizer, 4, context_tokens=300)
    assert [i.task for i in items] == ["niah_multikey_2", "niah_multikey_4"] * 2
    assert [i.meta["num_needles"] for i in items] == [2, 4, 2, 4]
    assert all(len(i.answers) == 1 and i.max_new_tokens == 8 for i in items)


def test_config_from_cfg_n_items(tokenizer):
    assert len(load_items("ruler", {"context_tokens": 300, "n_items": 3}, tokenizer, None)) == 3


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"tasks": ["niah_huge"]}, r"unknown ruler task 'niah_huge'; known tasks: niah_single"),
        ({"tasks": ["cwe_3"]}, r"unknown ruler task 'cwe_3'"),
        ({"tasks": [{"name": "vt", "num_needles": 2}]}, r"unknown option\(s\) num_needles"),
        ({"context_token": 500}, r"unknown option\(s\) context_token"),
        ({"haystack": "essay"}, r"unknown haystack 'essay'"),
        ({"tasks": ["niah_single", "niah_single"]}, r"labels must be distinct"),
        ({"needle_format": "uuid"}, r"unknown needle_format 'uuid'"),
        ({"tasks": [{"name": "vt", "example_words": -1}]}, r"ruler vt: example_words must be >= 0, got -1"),
        ({"tasks": ["fwe"], "context_tokens": 200}, r"ruler fwe: context_tokens=200 is too short; need 256"),
        ({"tasks": [{"name": "fwe", "alpha": 1.0}]}, r"ruler fwe: need alpha > 1"),
    ],
)
def test_config_errors_are_one_line(tokenizer, cfg, message):
    with pytest.raises(ValueError, match=message) as err:
        make(tokenizer, 1, **{"context_tokens": 300, **cfg})
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the bundled model


@pytest.mark.smollm2
def test_lengths_with_the_smollm2_tokenizer():
    models = pytest.importorskip("kvcert.models")
    tok = models.load_tokenizer("smollm2")
    items = load_items("ruler", {"tasks": ALL_TASKS, "context_tokens": 1000}, tok, 6)
    for item in items:
        length = len(tok.encode(item.prompt, add_special_tokens=False))
        slack = 16 if item.task in WORD_LIST_TASKS else ruler.SENTENCE_SLACK
        assert 1000 - slack <= length <= 1000, (item.task, length)
    # The question of the pass-key tasks is the one measured on this model.
    assert re.fullmatch(r"What is the \w+ pass key\?", items[1].question)
