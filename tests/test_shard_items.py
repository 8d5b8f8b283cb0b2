"""How a workload is split into shards (``kvcert.data.shard_items``) and the ``shard_by`` key (model-free)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from kvcert.data import Item, shard_items
from kvcert.errors import ConfigError
from kvcert.runner.config import validate


def _items(tasks: list[str], n: int) -> list[Item]:
    """n items, tasks interleaved round-robin as the RULER generator does."""
    return [Item(id=f"{tasks[i % len(tasks)]}/{i // len(tasks)}", context="c", question="q", answers=("a",),
                 max_new_tokens=4, metric="string_match_all", task=tasks[i % len(tasks)]) for i in range(n)]


def test_by_item_is_every_nth_item_as_the_records_were_sharded():
    items = _items(["a", "b", "c"], 13)
    for n in (1, 2, 3, 5):
        for k in range(n):
            assert shard_items(items, k, n) == items[k::n] == shard_items(items, k, n, "item")


@pytest.mark.parametrize("tasks, n_items, n_shards", [(["a", "b"], 40, 2), (["a", "b"], 12, 6), (["a", "b", "c"], 14, 3),
                                                      (["a"], 7, 2), (["a", "b", "c", "d"], 9, 4)])
def test_by_task_keeps_the_mix_and_partitions_the_workload(tasks, n_items, n_shards):
    items = _items(tasks, n_items)
    shards = [shard_items(items, k, n_shards, "task") for k in range(n_shards)]
    assert sorted(i.id for s in shards for i in s) == sorted(i.id for i in items)  # every item exactly once
    for task in tasks:
        counts = [sum(i.task == task for i in s) for s in shards]
        assert max(counts) - min(counts) <= 1, (task, counts)  # each shard holds its share of every task
    for shard in shards:  # workload order within a shard
        positions = [items.index(i) for i in shard]
        assert positions == sorted(positions)


def test_two_interleaved_tasks_split_in_two_by_item_are_task_pure_and_by_task_are_not():
    """The confound this key exists for: RULER interleaves tasks, so shard k of 2 by item is one task."""
    items = _items(["vt", "cwe"], 40)
    assert {i.task for i in shard_items(items, 0, 2, "item")} == {"vt"}
    assert {i.task for i in shard_items(items, 1, 2, "item")} == {"cwe"}
    for k in range(2):
        held = shard_items(items, k, 2, "task")
        assert [i.task for i in held].count("vt") == [i.task for i in held].count("cwe") == 10


def test_unknown_value_is_refused():
    with pytest.raises(ValueError, match=r"shard_by='prompt' is unknown; known: \['item', 'task'\]"):
        shard_items(_items(["a"], 2), 0, 1, "prompt")


def _config(**keys):
    base = {"policies": ["snapkv"], "designs": ["poisson"], "budgets": [0.5], "seeds": [0], "setting": "question_aware",
            "n_items": 4, "shard": 0, "n_shards": 2, "oracle": True, "certify": True, "delta": 0.05,
            "observation_window": 16, "truncate": "middle"}
    return OmegaConf.create({**base, **keys})


def test_validate_reads_shard_by_and_configs_written_before_it_shard_by_item():
    assert validate(_config()).shard_by == "item"  # a committed record's config.yaml has no shard_by
    assert validate(_config(shard_by="task")).shard_by == "task"
    with pytest.raises(ConfigError, match=r"^shard_by='x' is unknown; known: \['item', 'task'\]$"):
        validate(_config(shard_by="x"))
