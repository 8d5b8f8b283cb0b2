"""A JSON-lines workload "no one here wrote": items in the documented schema, written by the tests.

Varied on purpose: logs, recipes, multilingual and emoji text; metrics ``string_match_part``, ``qa_f1``,
``string_match_all`` and the default; with and without ``answer_prefix`` / ``max_new_tokens`` /
``metric`` / ``task``; an integer id; answers as one string or a list.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def _log(rng: random.Random, n: int) -> str:
    hosts = ["atlas", "boreas", "cygnus", "deneb", "electra"]
    events = ["disk check passed", "backup rotated", "cert renewed", "cache warmed", "queue drained"]
    return "\n".join(f"[{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}] {rng.choice(hosts)}: {rng.choice(events)}"
                     for _ in range(n))


def items(seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    log = _log(rng, 18)
    return [
        {
            "id": "ops-incident",
            "context": f"Operations log, night shift.\n{log}\n[03:14] deneb: ROOT CAUSE is a full /var partition\n"
                       f"{_log(rng, 10)}\nEnd of log.",
            "question": "\nQuestion: what was the root cause on deneb?",
            "answers": ["a full /var partition", "full /var partition"],
            "answer_prefix": "\nAnswer:",
            "max_new_tokens": 6,
            "metric": "string_match_part",
            "task": "ops",
        },
        {
            "id": 17,  # integer ids are accepted and become strings
            "context": "Reisebericht — Tag 3. Wir fuhren von München über Innsbruck nach Bozen; "
                       "in Brixen gab es Knödel. 東京から大阪まで新幹線で約2時間半です。 "
                       "Ναύπλιο ήταν η πρώτη πρωτεύουσα. 🚆🏔️ Die Passwörter lauten: Edelweiß-42 und Zirbe-7. "
                       "Bergluft, Sonne, und viele Kühe auf der Alm. " * 2,
            "question": "\nWelche Passwörter wurden genannt?",
            "answers": ["Edelweiß-42", "Zirbe-7"],
            "metric": "string_match_all",
            "answer_prefix": " Die Passwörter:",
            "max_new_tokens": 7,
        },
        {
            "id": "recipe-qa",
            "context": "Grandmother's flatbread. Mix 500 g of flour with 300 ml of warm water, a spoon of olive oil "
                       "and a pinch of salt. Knead for ten minutes, rest the dough for an hour under a damp "
                       "cloth, then divide it into eight balls. Roll each thin and cook on a dry cast-iron pan "
                       "until blistered, about a minute per side. " * 3,
            "question": " How long should the dough rest?",
            "answers": "an hour under a damp cloth",
            "metric": "qa_f1",
            "max_new_tokens": 8,
        },
        {
            # Only the required keys: metric, max_new_tokens, answer_prefix and task take their defaults.
            "id": "minimal",
            "context": " ".join(f"Locker {i} holds item {rng.choice('ABCDEFGH')}{rng.randint(100, 999)}."
                                for i in range(1, 40)),
            "question": " Which item is in locker 12?",
            "answers": ["item"],
        },
    ]


def write_workload(path: str | Path, seed: int = 7) -> tuple[Path, list[dict]]:
    """Write the items (with a blank line, which the reader skips) and return (path, records)."""
    path = Path(path)
    records = items(seed)
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    lines.insert(2, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, records


def max_new_tokens(records: list[dict], default: int = 32) -> dict[str, int]:
    return {str(r["id"]): int(r.get("max_new_tokens", default)) for r in records}
