"""Filler text and word pools for the synthetic (RULER-style) tasks.

Two haystacks:

- ``noise``: RULER's repeated five sentences ("The grass is green. ...").
- ``prose``: plain narrative English produced here by a small seeded grammar (village
  life, weather, small errands). It is written for this project, varies from item to item,
  and never contains digits or the words "key"/"pass", so it cannot be confused with a
  needle or a value.

Both are served as a list of sentences; the task builder decides how many words to keep.
"""

from __future__ import annotations

import random
import string

NOISE_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")

# ---------------------------------------------------------------- word pools (needle labels,
# RULER keys, common-words lists). Plain English words; lower case, letters only.

ADJECTIVES = (
    "amber", "ancient", "autumn", "bitter", "blue", "bold", "brave", "bright", "brisk", "broad",
    "calm", "clever", "cold", "copper", "crimson", "curious", "dark", "distant", "dusty", "eager",
    "early", "empty", "faint", "fancy", "fierce", "frozen", "gentle", "giant", "golden", "green",
    "grey", "hidden", "hollow", "humble", "icy", "ivory", "jolly", "keen", "lazy", "little",
    "lively", "lonely", "loud", "lucky", "marble", "mellow", "misty", "modern", "muddy", "narrow",
    "noble", "olive", "orange", "pale", "plain", "polite", "proud", "purple", "quick", "quiet",
    "rapid", "rare", "rosy", "royal", "rusty", "sandy", "scarlet", "secret", "shiny", "silent",
    "silver", "simple", "sleepy", "slow", "small", "smooth", "snowy", "soft", "solid", "sour",
    "spare", "steady", "steep", "stormy", "sturdy", "sunny", "sweet", "swift", "tall", "tender",
    "thick", "tidy", "tiny", "velvet", "violet", "warm", "wild", "windy", "wise", "wooden",
)

NOUNS = (
    "anchor", "apple", "arrow", "badger", "bakery", "barrel", "basket", "beacon", "bell", "bench",
    "bicycle", "blanket", "boat", "bottle", "bridge", "bucket", "butter", "cabin", "camel", "candle",
    "canyon", "carpet", "castle", "cellar", "chair", "cherry", "chimney", "cloud", "clover", "comet",
    "compass", "cottage", "crane", "crystal", "daisy", "desert", "dolphin", "door", "dragon", "drum",
    "eagle", "engine", "falcon", "feather", "fence", "ferry", "fiddle", "forest", "fountain", "fox",
    "garden", "glacier", "goose", "harbor", "harvest", "hammer", "helmet", "island", "jacket", "kettle",
    "kitten", "ladder", "lagoon", "lantern", "lemon", "lighthouse", "lizard", "meadow", "mirror", "mountain",
    "needle", "oak", "ocean", "orchard", "otter", "owl", "paddle", "parrot", "pebble", "pepper",
    "piano", "pillow", "pine", "planet", "pocket", "pond", "puzzle", "rabbit", "raven", "ribbon",
    "river", "robin", "rocket", "saddle", "sail", "salmon", "shell", "shovel", "sparrow", "spider",
    "spoon", "squirrel", "stable", "statue", "summit", "table", "teapot", "thistle", "thunder", "tiger",
    "tower", "trumpet", "tulip", "tunnel", "turtle", "umbrella", "valley", "violin", "wagon", "walnut",
    "whale", "whistle", "willow", "window", "wizard", "wolf", "yarn", "zebra",
)

VERBS = (
    "argue", "bake", "borrow", "build", "carry", "chase", "climb", "collect", "cook", "count",
    "dance", "dig", "draw", "drift", "explore", "fold", "gather", "glide", "guard", "hum",
    "hunt", "juggle", "jump", "knit", "laugh", "listen", "march", "mend", "paint", "plant",
    "polish", "pour", "pull", "race", "read", "repair", "row", "sail", "scatter", "sew",
    "shout", "sing", "sketch", "skip", "sweep", "swim", "travel", "wander", "whisper", "write",
)

COMMON_WORDS = tuple(sorted(set(ADJECTIVES + NOUNS + VERBS)))


def pseudo_words(rng: random.Random, n: int, exclude: set[str]) -> list[str]:
    """``n`` distinct pronounceable made-up words, for word lists longer than the pools."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        syllables = rng.randint(2, 3)
        word = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def random_label_words(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct single-word labels (pass-key needles)."""
    return rng.sample(ADJECTIVES + NOUNS, n)


def random_ruler_keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct "adjective-noun" keys, RULER's needle-key format."""
    keys: set[str] = set()
    ordered: list[str] = []
    while len(ordered) < n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.add(key)
            ordered.append(key)
    return ordered


def random_numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    """``n`` distinct numbers with exactly ``digits`` digits (no leading zero)."""
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    values: list[str] = []
    while len(values) < n:
        value = str(rng.randint(low, high))
        if value not in values:
            values.append(value)
    return values


def random_variable_names(rng: random.Random, n: int, length: int = 5) -> list[str]:
    """``n`` distinct upper-case variable names (RULER variable tracking)."""
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choices(string.ascii_uppercase, k=length))
        if name not in names:
            names.append(name)
    return names


# ---------------------------------------------------------------- the prose grammar

_PEOPLE = (
    "the old fisherman", "a young teacher", "my grandmother", "the baker's daughter", "the night porter",
    "a tired traveller", "the village doctor", "our neighbour", "the ferryman", "a quiet student",
    "the shepherd", "the mayor's clerk", "a visiting painter", "the postwoman", "the blacksmith",
    "my cousin", "the innkeeper", "a retired sailor", "the librarian", "the gardener",
)
_THINGS = (
    "a wooden chair", "the broken lantern", "an old map of the coast", "a basket of apples",
    "the garden gate", "a letter from the city", "the heavy winter coat", "a pot of soup",
    "the leaking roof", "a bundle of firewood", "the church bells", "a jar of honey",
    "the fishing nets", "a pair of boots", "the kitchen clock", "a sack of flour",
    "the little rowing boat", "a box of candles", "the stone wall", "a faded photograph",
)
_PLACES = (
    "by the harbour", "near the railway bridge", "in the back garden", "at the edge of the village",
    "behind the mill", "on the market square", "along the river path", "under the old elm",
    "beside the chapel", "at the top of the hill", "in the narrow lane", "next to the bakery",
    "on the windy shore", "inside the barn", "across the meadow",
)
_TIMES = (
    "In the early morning", "Late that autumn", "After the long winter", "Before the market opened",
    "On a grey afternoon", "When the rain stopped", "Just after sunrise", "That evening",
    "Every Sunday", "During the harvest", "Once the snow had melted", "Around midday",
)
_PAST_VERBS = (
    "painted", "carried", "repaired", "sold", "found", "described", "forgot", "cleaned",
    "measured", "borrowed", "wrapped", "polished", "inspected", "delivered", "admired",
    "moved", "guarded", "mentioned", "collected", "returned",
)
_FEELINGS = (
    "calm", "cheerful", "restless", "hopeful", "weary", "content", "puzzled", "proud", "uneasy", "glad",
)
_WEATHER = (
    "The wind came in from the sea and smelled of salt.",
    "A thin mist lay over the fields until noon.",
    "The rain drummed on the slate roofs all night.",
    "The sky cleared slowly and the air turned cold.",
    "Snow gathered in the corners of every window.",
    "The afternoon was warm and the road was dusty.",
    "Clouds rolled over the hills like grey wool.",
    "The river rose after the storm and ran brown and fast.",
)
_TEMPLATES = (
    "{Time}, {person} {verb} {thing} {place}.",
    "{Person} {verb} {thing} and then walked home {place}.",
    "Nobody could remember why {person} {verb} {thing} {place}.",
    "{Person} felt {feeling} as {pronoun} {verb} {thing}.",
    "{Time}, {person} and {person2} talked for an hour {place}.",
    "It was {person2} who first noticed that {person} had {verb} {thing}.",
    "{Weather}",
    "{Person} said that {thing} had been there for as long as anyone knew.",
    "{Time}, the whole village seemed {feeling}, and {person} {verb} {thing} {place}.",
    "Later, {person} {verb} {thing} once more, slowly and with great care.",
)


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def prose_sentences(rng: random.Random, n: int) -> list[str]:
    """``n`` sentences of seeded narrative prose."""
    sentences: list[str] = []
    for _ in range(n):
        template = rng.choice(_TEMPLATES)
        person, person2 = rng.sample(_PEOPLE, 2)
        sentence = template.format(
            Time=rng.choice(_TIMES),
            person=person,
            Person=_capitalize(person),
            person2=person2,
            verb=rng.choice(_PAST_VERBS),
            thing=rng.choice(_THINGS),
            place=rng.choice(_PLACES),
            feeling=rng.choice(_FEELINGS),
            pronoun=rng.choice(("she", "he", "they")),
            Weather=rng.choice(_WEATHER),
        )
        sentences.append(sentence)
    return sentences


def noise_sentences(n: int) -> list[str]:
    """The first ``n`` sentences of RULER's repeated noise text."""
    return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]


def haystack_sentences(kind: str, rng: random.Random, min_words: int) -> list[str]:
    """Enough sentences of haystack ``kind`` (``noise`` or ``prose``) for ``min_words`` words."""
    if kind == "noise":
        per_sentence = 3  # the shortest noise sentence has three words
        return noise_sentences(min_words // per_sentence + len(NOISE_SENTENCES))
    if kind == "prose":
        sentences: list[str] = []
        words = 0
        while words < min_words:
            batch = prose_sentences(rng, 64)
            sentences.extend(batch)
            words += sum(len(s.split()) for s in batch)
        return sentences
    raise ValueError(f"unknown haystack {kind!r}; known haystacks: noise, prose")


def take_words(sentences: list[str], n_words: int) -> list[str]:
    """The first ``n_words`` words of ``sentences``, still split into sentences.

    The last sentence may be cut short: the budget is met at word granularity (about one
    token), as RULER does with its essay haystack.
    """
    kept: list[str] = []
    remaining = n_words
    for sentence in sentences:
        if remaining <= 0:
            break
        words = sentence.split()
        if len(words) <= remaining:
            kept.append(sentence)
            remaining -= len(words)
        else:
            kept.append(" ".join(words[:remaining]))
            remaining = 0
    return kept
