"""Synthetic long-context tasks in the style of RULER (NVIDIA/RULER), generated here.

Tasks (``tasks`` entries):

- ``niah_single``: one needle, asked for.
- ``niah_multikey``: ``num_needles`` needles with different labels (default 4); one is asked.
- ``niah_multivalue``: one label with ``num_values`` different values (default 4); all asked.
- ``niah_multiquery``: ``num_queries`` of ``num_needles`` needles asked at once (default 4 of 4).
- ``vt`` (variable tracking): ``num_chains`` chains of ``num_hops`` assignments
  ("VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE."); name every variable holding the value.
  ``example_words: N`` (N > 0) puts one worked example first, as RULER does: the same task
  over N words of noise, with its answer, on names and a value of its own (RULER's example
  is fitted to 500 tokens, about 300 noise words with these tokenizers). The default 0 is
  the version without one that amendment 4's pilot ran.
- ``cwe`` (common words extraction): a numbered word list in which ``num_common`` words
  occur ``freq_common`` times and the others ``freq_uncommon`` times; name the common ones.
  RULER's one worked example precedes the list. Its fixed part (example plus the common
  words) already takes several hundred tokens (about 650 with SmolLM2's tokenizer), so
  ``cwe`` needs ``context_tokens`` of 700 or more; a smaller target is an error that says so.
- ``fwe`` (frequent words extraction): coded words (``coded_wordlen`` random lower-case
  letters) drawn from a vocabulary of ``vocab_size`` (default ``context_tokens // 50``, as
  RULER) with Zipf frequencies of exponent ``alpha`` (2.0); the most frequent one is
  RULER's "..." noise; name the three after it. Needs ``context_tokens`` of 256 or more,
  so that the three answers' counts differ from the fourth's.

A ``tasks`` entry is a name, a name with its main count as a suffix (``niah_multikey_2`` is
``niah_multikey`` with ``num_needles: 2``; the suffix sets ``num_needles``, ``num_values``,
``num_queries`` and ``num_hops`` for multikey, multivalue, multiquery and vt), or a mapping
``{name: ..., label: ..., <knob>: ...}``. The label (the entry string by default) becomes
:attr:`Item.task`.

Needle formats (``needle_format``):

- ``passkey`` (default): "The {label} pass key is {5 digits}." and the question
  "What is the {label} pass key?" with answer prefix " The {label} pass key is". This is
  the format a 135M model can partly solve, so that the
  full cache gives a mix of right and wrong answers.
- ``ruler``: RULER's own "One of the special magic numbers for {adjective-noun} is: {7 digits}."
  and "What are all the special magic numbers for ... mentioned in the provided text?".

Length: every prompt (``context + question + answer_prefix``, encoded without special
tokens) is fitted to ``context_tokens`` tokens of the given tokenizer by a binary search on
the number of haystack words (list entries for ``cwe``): it never exceeds the target and
falls short by at most one word (for ``cwe``, the ``freq_uncommon`` list entries of one
more word: a few tokens at short targets, about 20 at 16k), or by at most
``SENTENCE_SLACK`` (8) tokens when that lets the haystack end on a whole sentence.

Determinism: item ``j`` of task ``label`` draws everything from a random generator seeded
by ``(seed, label, j)`` only, so the same seed gives identical items and asking for more
items never changes the earlier ones. Items of different tasks are interleaved round-robin.

Scoring follows RULER: ``string_match_all`` (every reference must appear in the prediction).
"""

from __future__ import annotations

import bisect
import re
import string
from dataclasses import dataclass
from random import Random
from typing import Any, Callable, Mapping, Sequence

from . import haystack as hs
from .item import Item

# Tokens of the target a prompt may give up to end its haystack on a whole sentence.
SENTENCE_SLACK = 8

# RULER draws needle depths from 40 evenly spaced percentages.
DEPTH_GRID = tuple(round(100 * i / 39) / 100 for i in range(40))

NIAH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
TASK_NAMES = NIAH_TASKS + ("vt", "cwe", "fwe")
ALIASES = {"variable_tracking": "vt", "common_words_extraction": "cwe", "freq_words_extraction": "fwe"}
PRIMARY_KNOB = {"niah_multikey": "num_needles", "niah_multivalue": "num_values",
                "niah_multiquery": "num_queries", "vt": "num_hops"}

# Knobs each task accepts, with defaults. Shared knobs come after.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "niah_single": {"num_needles": 1, "num_values": 1, "num_queries": 1},
    "niah_multikey": {"num_needles": 4, "num_values": 1, "num_queries": 1},
    "niah_multivalue": {"num_needles": 1, "num_values": 4, "num_queries": 1},
    "niah_multiquery": {"num_needles": 4, "num_values": 1, "num_queries": 4},
    "vt": {"num_chains": 1, "num_hops": 4, "example_words": 0},
    "cwe": {"num_common": 10, "freq_common": None, "freq_uncommon": None},
    "fwe": {"alpha": 2.0, "vocab_size": None, "coded_wordlen": 6},
}
# Knobs a top-level config value may set for a task (niah_single stays single).
TOP_LEVEL_KNOBS = {
    "niah_single": set(),
    "niah_multikey": {"num_needles"},
    "niah_multivalue": {"num_values"},
    "niah_multiquery": {"num_needles", "num_queries"},
    "vt": {"num_chains", "num_hops", "example_words"},
    "cwe": {"num_common", "freq_common", "freq_uncommon"},
    "fwe": {"alpha", "vocab_size", "coded_wordlen"},
}
NIAH_SHARED = {"needle_format": "passkey", "value_digits": None}
SHARED_KNOBS = {"max_new_tokens": None, "haystack": "noise", "context_tokens": 1000}

CONFIG_KEYS = {"name", "tasks", "seed", "n_items"} | set(SHARED_KNOBS) | set(NIAH_SHARED) | {
    knob for defaults in TASK_DEFAULTS.values() for knob in defaults}

DEFAULTS = {
    "tasks": ["niah_multikey_2", "niah_multikey_4"],
    "seed": 0,
    "n_items": 50,
}


@dataclass(frozen=True)
class TaskSpec:
    """One entry of ``tasks`` after parsing: the builder name, the label, the knobs."""

    name: str
    label: str
    knobs: Mapping[str, Any]


@dataclass
class Draft:
    """An item waiting for its length: ``render(n)`` builds it with ``n`` filler units."""

    render: Callable[[int], tuple[str, str, str, dict]]
    max_fill: int
    answers: list[str]
    max_new_tokens: int
    # For haystacks: the largest filler size <= n that ends on a whole sentence.
    snap: Callable[[int], int] | None = None


# ----------------------------------------------------------------------------- config


def _task_knobs(name: str) -> dict[str, Any]:
    knobs = dict(TASK_DEFAULTS[name])
    knobs.update(SHARED_KNOBS)
    if name in NIAH_TASKS:
        knobs.update(NIAH_SHARED)
    return knobs


def _unknown_task(entry: object) -> ValueError:
    return ValueError(f"unknown ruler task {entry!r}; known tasks: {', '.join(TASK_NAMES)} "
                      f"(optionally with a count suffix, e.g. niah_multikey_2)")


def parse_task(entry: Any, cfg: Mapping[str, Any]) -> TaskSpec:
    """Turn one ``tasks`` entry into a :class:`TaskSpec` with every knob resolved."""
    overrides: dict[str, Any] = {}
    if isinstance(entry, str):
        name, label = ALIASES.get(entry, entry), entry
        if name not in TASK_DEFAULTS:
            match = re.fullmatch(r"(.+)_(\d+)", entry)
            base = ALIASES.get(match.group(1), match.group(1)) if match else None
            if base not in PRIMARY_KNOB:
                raise _unknown_task(entry)
            name = base
            overrides[PRIMARY_KNOB[base]] = int(match.group(2))
    elif isinstance(entry, Mapping):
        if "name" not in entry:
            raise ValueError(f"ruler task entry {dict(entry)!r} has no 'name'")
        name = ALIASES.get(entry["name"], entry["name"])
        if name not in TASK_DEFAULTS:
            raise _unknown_task(entry["name"])
        overrides = {k: v for k, v in entry.items() if k not in ("name", "label")}
        primary = PRIMARY_KNOB.get(name)
        label = entry.get("label") or (f"{name}_{overrides[primary]}" if primary in overrides else name)
    else:
        raise ValueError(f"ruler task entry must be a name or a mapping, got {entry!r}")

    knobs = _task_knobs(name)
    unknown = set(overrides) - set(knobs)
    if unknown:
        raise ValueError(f"ruler task {label!r}: unknown option(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(knobs))}")
    settable_from_top = TOP_LEVEL_KNOBS[name] | set(SHARED_KNOBS) | (set(NIAH_SHARED) if name in NIAH_TASKS else set())
    for knob in settable_from_top:
        if cfg.get(knob) is not None:
            knobs[knob] = cfg[knob]
    knobs.update(overrides)
    if name in NIAH_TASKS:
        knobs["num_needles"] = max(int(knobs["num_needles"]), int(knobs["num_queries"]))
    return TaskSpec(name=name, label=label, knobs=knobs)


# ----------------------------------------------------------------------------- helpers


def _join_list(words: Sequence[str]) -> str:
    """"a", "a and b", "a, b, and c" (RULER's query join)."""
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + ", and " + words[-1]


def _sample_depths(rng: Random, n: int) -> list[float]:
    if n <= len(DEPTH_GRID):
        return rng.sample(DEPTH_GRID, n)
    return [rng.choice(DEPTH_GRID) for _ in range(n)]


def _insert_at_depths(sentences: list[str], inserts: Sequence[str], depths: Sequence[float]) -> str:
    """Place ``inserts`` between sentences at relative ``depths`` (0 = start, 1 = end).

    Inserts at the same boundary keep their given order, so an ordered chain stays ordered
    when its depths are sorted.
    """
    boundaries = [int(len(sentences) * d) for d in depths]
    pieces: list[str] = []
    order = sorted(range(len(inserts)), key=lambda i: (boundaries[i], i))
    cursor = 0
    for i in order:
        pieces.extend(sentences[cursor:boundaries[i]])
        cursor = max(cursor, boundaries[i])
        pieces.append(inserts[i])
    pieces.extend(sentences[cursor:])
    return " ".join(pieces)


def _sentence_snapper(sentences: Sequence[str]) -> Callable[[int], int]:
    ends = [0]
    for sentence in sentences:
        ends.append(ends[-1] + len(sentence.split()))

    def snap(n_words: int) -> int:
        return ends[bisect.bisect_right(ends, n_words) - 1]

    return snap


# ----------------------------------------------------------------------------- builders


def _draft_niah(knobs: Mapping[str, Any], rng: Random) -> Draft:
    fmt = knobs["needle_format"]
    if fmt not in ("passkey", "ruler"):
        raise ValueError(f"unknown needle_format {fmt!r}; known: passkey, ruler")
    n_keys, n_values, n_queries = int(knobs["num_needles"]), int(knobs["num_values"]), int(knobs["num_queries"])
    if min(n_keys, n_values, n_queries) < 1:
        raise ValueError("ruler needles: num_needles, num_values and num_queries must be >= 1")
    digits = int(knobs["value_digits"] or (5 if fmt == "passkey" else 7))
    passkey = fmt == "passkey"

    keys = hs.random_label_words(rng, n_keys) if passkey else hs.random_ruler_keys(rng, n_keys)
    flat_values = hs.random_numbers(rng, n_keys * n_values, digits)
    values = [flat_values[i * n_values:(i + 1) * n_values] for i in range(n_keys)]
    needles: list[tuple[str, str]] = [(k, v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    depths = _sample_depths(rng, len(needles))
    asked = sorted(rng.sample(range(n_keys), n_queries))
    asked_keys = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = _join_list(asked_keys)
    single = len(answers) == 1

    if passkey:
        def needle_text(key: str, value: str) -> str:
            return f"The {key} pass key is {value}." if n_values == 1 else f"One of the {key} pass keys is {value}."
        if len(needles) == 1:
            preamble = ("A pass key is hidden inside a lot of irrelevant text. Find it and memorize it. "
                        "I will quiz you about the pass key afterwards.\n")
        else:
            preamble = ("Some pass keys are hidden inside a lot of irrelevant text. Find them and memorize them. "
                        "I will quiz you about the pass keys afterwards.\n")
        if single:
            question, prefix = f"What is the {query} pass key?", f" The {query} pass key is"
        else:
            question, prefix = f"What are all the {query} pass keys?", f" The {query} pass keys are"
    else:
        def needle_text(key: str, value: str) -> str:
            return f"One of the special magic numbers for {key} is: {value}."
        if single:
            preamble = ("A special magic number is hidden within the following text. Make sure to memorize it. "
                        "I will quiz you about the number afterwards.\n")
            question = f"What is the special magic number for {query} mentioned in the provided text?"
            prefix = f" The special magic number for {query} mentioned in the provided text is"
        else:
            preamble = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                        "I will quiz you about the numbers afterwards.\n")
            question = f"What are all the special magic numbers for {query} mentioned in the provided text?"
            prefix = f" The special magic numbers for {query} mentioned in the provided text are"

    needle_texts = [needle_text(k, v) for k, v in needles]
    max_fill = int(knobs["context_tokens"])
    filler = hs.haystack_sentences(knobs["haystack"], rng, max_fill)
    asked_set = set(asked_keys)

    def render(n_words: int) -> tuple[str, str, str, dict]:
        sentences = hs.take_words(filler, n_words)
        context = preamble + _insert_at_depths(sentences, needle_texts, depths) + "\n"
        meta = {"needle_depths": list(depths),
                "answer_depths": [d for (k, _), d in zip(needles, depths) if k in asked_set],
                "num_needles": len(needles)}
        return context, question, prefix, meta

    per_answer = 8 if passkey else 16
    max_new = knobs["max_new_tokens"] or per_answer * len(answers)
    return Draft(render=render, max_fill=max_fill, answers=answers, max_new_tokens=int(max_new),
                 snap=_sentence_snapper(filler))


def _merge_keeping_order(rng: Random, chains: list[list[str]]) -> list[str]:
    """Randomly interleave several lists, each keeping its own order."""
    cursors = [0] * len(chains)
    merged: list[str] = []
    while len(merged) < sum(map(len, chains)):
        open_chains = [i for i, c in enumerate(chains) if cursors[i] < len(c)]
        i = rng.choice(open_chains)
        merged.append(chains[i][cursors[i]])
        cursors[i] += 1
    return merged


def _vt_chains(rng: Random, n_chains: int, n_hops: int) -> tuple[list[str], list[str], str, list[str]]:
    """Chains of assignments: (statements in a random interleaving, every name, the asked value, its answers)."""
    names = hs.random_variable_names(rng, n_chains * (n_hops + 1))
    chain_values = hs.random_numbers(rng, n_chains, 5)
    chains: list[list[str]] = []
    for c in range(n_chains):
        chain_names = names[c * (n_hops + 1):(c + 1) * (n_hops + 1)]
        statements = [f"VAR {chain_names[0]} = {chain_values[c]}."]
        statements += [f"VAR {chain_names[j + 1]} = VAR {chain_names[j]}." for j in range(n_hops)]
        chains.append(statements)
    return _merge_keeping_order(rng, chains), names, chain_values[0], names[: n_hops + 1]


def _draft_vt(knobs: Mapping[str, Any], rng: Random) -> Draft:
    n_chains, n_hops = int(knobs["num_chains"]), int(knobs["num_hops"])
    if n_chains < 1 or n_hops < 1:
        raise ValueError("ruler vt: num_chains and num_hops must be >= 1")
    example_words = int(knobs.get("example_words") or 0)
    if example_words < 0:
        raise ValueError(f"ruler vt: example_words must be >= 0, got {example_words}")
    statements, names, value, answers = _vt_chains(rng, n_chains, n_hops)
    depths = sorted(_sample_depths(rng, len(statements)))

    preamble = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"

    def question_and_prefix(asked: str) -> tuple[str, str]:
        return (f"Question: Find all variables that are assigned the value {asked} in the text above.",
                f" Answer: According to the chain(s) of variable assignment in the text above, "
                f"{n_hops + 1} variables are assigned the value {asked}, they are: ")

    question, prefix = question_and_prefix(value)
    max_fill = int(knobs["context_tokens"])
    filler = hs.haystack_sentences(knobs["haystack"], rng, max_fill)
    example = ""
    if example_words:
        # Drawn last, from a generator of its own, so the item's draws equal those without an example;
        # redrawn until it shares no name or value with the item (a copied answer must be wrong).
        example_rng = Random(rng.random())
        while True:
            ex_statements, ex_names, ex_value, ex_answers = _vt_chains(example_rng, n_chains, n_hops)
            if not set(ex_names) & set(names) and ex_value != value:
                break
        ex_depths = sorted(_sample_depths(example_rng, len(ex_statements)))
        ex_sentences = hs.take_words(hs.noise_sentences(example_words // 3 + 5), example_words)
        ex_question, ex_prefix = question_and_prefix(ex_value)
        example = (preamble + _insert_at_depths(ex_sentences, ex_statements, ex_depths) + "\n"
                   + ex_question + ex_prefix + " ".join(ex_answers) + "\n\n")

    def render(n_words: int) -> tuple[str, str, str, dict]:
        sentences = hs.take_words(filler, n_words)
        context = example + preamble + _insert_at_depths(sentences, statements, depths) + "\n"
        return context, question, prefix, {"needle_depths": list(depths)}

    return Draft(render=render, max_fill=max_fill, answers=answers,
                 max_new_tokens=int(knobs["max_new_tokens"] or 30), snap=_sentence_snapper(filler))


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _draft_cwe(knobs: Mapping[str, Any], rng: Random) -> Draft:
    target = int(knobs["context_tokens"])
    n_common = int(knobs["num_common"])
    # RULER's own choice: short contexts use 6/1 repetitions, long ones 30/3.
    freq_common = int(knobs["freq_common"] or (6 if target < 4096 else 30))
    freq_uncommon = int(knobs["freq_uncommon"] or (1 if target < 4096 else 3))
    if n_common < 1 or freq_common <= freq_uncommon or freq_uncommon < 1:
        raise ValueError("ruler cwe: need num_common >= 1 and freq_common > freq_uncommon >= 1")
    # Every list entry ("12. word") takes at least two tokens, which bounds the list size.
    max_fill = target // (2 * freq_uncommon) + 1
    example_size = 20
    pool = list(hs.COMMON_WORDS)
    rng.shuffle(pool)
    needed = n_common + max_fill + example_size
    if needed > len(pool):
        pool += hs.pseudo_words(rng, needed - len(pool), set(pool))
    # Real words first: the worked example, then the common words, then the uncommon ones.
    example_words, pool = pool[:example_size], pool[example_size:]
    common = pool[:n_common]
    order_seed = rng.random()

    intro = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.\n")
    question = f"Question: What are the {n_common} most common words in the above list?"
    prefix = f" Answer: The top {n_common} words that appear most often in the list are:"

    # One worked example, as RULER prepends (10 words three times, 10 words once).
    example_rng = Random(order_seed + 1)
    example_list = example_words[:10] * 3 + example_words[10:]
    example_rng.shuffle(example_list)
    example_answer = " " + _numbered(example_words[:10])
    example = intro + _numbered(example_list) + "\n" + question + prefix + example_answer + "\n"

    def render(n_uncommon: int) -> tuple[str, str, str, dict]:
        uncommon = pool[n_common:n_common + n_uncommon]
        words = common * freq_common + uncommon * freq_uncommon
        Random(order_seed).shuffle(words)
        context = example + intro + _numbered(words) + "\n"
        return context, question, prefix, {"freq_common": freq_common, "freq_uncommon": freq_uncommon,
                                           "num_uncommon": n_uncommon}

    return Draft(render=render, max_fill=max_fill, answers=common,
                 max_new_tokens=int(knobs["max_new_tokens"] or 120))


def _draft_fwe(knobs: Mapping[str, Any], rng: Random) -> Draft:
    target = int(knobs["context_tokens"])
    alpha, wordlen = float(knobs["alpha"]), int(knobs["coded_wordlen"])
    vocab_size = int(knobs["vocab_size"] or max(target // 50, 5))
    if target < 256:
        raise ValueError(f"ruler fwe: context_tokens={target} is too short; need 256 or more, so that the three "
                         "answers' counts differ from the fourth's")
    if alpha <= 1 or vocab_size < 5 or wordlen < 2:
        raise ValueError("ruler fwe: need alpha > 1, vocab_size >= 5 and coded_wordlen >= 2")
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(string.ascii_lowercase, k=wordlen))
        if word not in vocab:
            vocab.append(word)
    vocab[0] = "..."  # RULER: the most frequent "word" is noise, and the question says to ignore it
    order_seed = rng.random()
    from scipy.special import zeta

    # Zipf counts as RULER computes them: n k^-alpha / zeta(alpha), rounded down, for rank k of the vocabulary.
    shares = [k ** -alpha / float(zeta(alpha)) for k in range(1, vocab_size + 1)]

    context_head = ("Read the following coded text and track the frequency of each coded word. "
                    "Find the three most frequently appeared coded words. ")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
    prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"

    def render(n_words: int) -> tuple[str, str, str, dict]:
        counts = [int(n_words * share) for share in shares]
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        Random(order_seed).shuffle(words)
        return context_head + " ".join(words) + "\n", question, prefix, {"counts": counts[:5]}

    return Draft(render=render, max_fill=target, answers=vocab[1:4], max_new_tokens=int(knobs["max_new_tokens"] or 50))


BUILDERS: dict[str, Callable[[Mapping[str, Any], Random], Draft]] = {
    **{name: _draft_niah for name in NIAH_TASKS},
    "vt": _draft_vt,
    "cwe": _draft_cwe,
    "fwe": _draft_fwe,
}


# ----------------------------------------------------------------------------- fitting


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` without special tokens."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def fit_to_length(draft: Draft, tokenizer: Any, target: int, label: str) -> tuple[tuple[str, str, str, dict], int]:
    """The largest filler size whose prompt has at most ``target`` tokens (binary search)."""

    def length(n: int) -> tuple[tuple[str, str, str, dict], int]:
        parts = draft.render(n)
        return parts, count_tokens(tokenizer, "".join(parts[:3]))

    best, best_len = length(0)
    best_n = 0
    if best_len > target:
        raise ValueError(f"ruler task {label!r}: context_tokens={target} is too small; "
                         f"the prompt without any haystack already has {best_len} tokens")
    low, high = 1, draft.max_fill
    while low <= high:
        mid = (low + high) // 2
        parts, n_tokens = length(mid)
        if n_tokens <= target:
            best, best_len, best_n = parts, n_tokens, mid
            low = mid + 1
        else:
            high = mid - 1
    # Ending the haystack on a whole sentence reads better than a cut one ("The sky is");
    # take it when it costs at most SENTENCE_SLACK tokens of the target.
    if draft.snap is not None and best_n > 0:
        snapped = draft.snap(best_n)
        if 0 < snapped < best_n:
            parts, n_tokens = length(snapped)
            if target - n_tokens <= SENTENCE_SLACK:
                best, best_len = parts, n_tokens
    return best, best_len


# ----------------------------------------------------------------------------- entry point


def load_ruler(cfg: Mapping[str, Any], tokenizer: Any, n_items: int | None) -> list[Item]:
    """Generate ``n_items`` RULER-style items (``cfg.n_items`` or 50 when None)."""
    unknown = set(cfg) - CONFIG_KEYS
    if unknown:
        raise ValueError(f"data=ruler: unknown option(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(CONFIG_KEYS))}")
    tasks = cfg.get("tasks") or DEFAULTS["tasks"]
    if isinstance(tasks, (str, Mapping)):
        tasks = [tasks]
    specs = [parse_task(entry, cfg) for entry in tasks]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"data=ruler: task labels must be distinct, got {labels}")
    seed = cfg.get("seed", DEFAULTS["seed"])
    total = n_items if n_items is not None else int(cfg.get("n_items") or DEFAULTS["n_items"])
    if total < 0:
        raise ValueError(f"n_items must be >= 0, got {total}")

    items: list[Item] = []
    for i in range(total):
        spec = specs[i % len(specs)]
        index = i // len(specs)
        rng = Random(f"kvcert.ruler|{seed}|{spec.label}|{index}")
        draft = BUILDERS[spec.name](spec.knobs, rng)
        target = int(spec.knobs["context_tokens"])
        (context, question, prefix, meta), n_tokens = fit_to_length(draft, tokenizer, target, spec.label)
        meta.update({"seed": seed, "index": index, "haystack": spec.knobs.get("haystack"),
                     "context_tokens": target, "prompt_tokens": n_tokens})
        items.append(Item(
            id=f"ruler/{spec.label}/s{seed}/{index:05d}",
            context=context,
            question=question,
            answer_prefix=prefix,
            answers=tuple(draft.answers),
            max_new_tokens=draft.max_new_tokens,
            metric="string_match_all",
            task=spec.label,
            meta=meta,
        ))
    return items
