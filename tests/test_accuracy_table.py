"""kvcert.analysis.accuracy on synthetic item tables (a test of our own tabulation logic): a table of cells that ran
another certain-head share keeps Poisson's rows per share and folds the full cache's and top-k's rows, which do not
depend on the share, into one row each; a table without the column is unchanged."""

from __future__ import annotations

import pandas as pd
import pytest

from kvcert.analysis.accuracy import COLUMNS, accuracy_table


def _items(rows, share=None):
    frame = pd.DataFrame([{"model": "m", "task": "t", "setting": "question_aware", "item_id": item, "policy": policy,
                           "design": design, "budget": budget, "seed": seed, "correct": correct}
                          for item, policy, design, budget, seed, correct in rows])
    return frame if share is None else frame.assign(head_fraction=share)


DEFAULT_CELL = [(0, "full", "full", 1.0, 0, True), (1, "full", "full", 1.0, 0, True),
                (0, "snapkv", "topk", 0.25, 0, True), (1, "snapkv", "topk", 0.25, 0, False),
                (0, "snapkv", "poisson", 0.25, 0, True), (0, "snapkv", "poisson", 0.25, 1, False),
                (1, "snapkv", "poisson", 0.25, 0, False), (1, "snapkv", "poisson", 0.25, 1, False)]
SHARE_CELL = [(0, "full", "full", 1.0, 0, True), (1, "full", "full", 1.0, 0, True),
              (0, "snapkv", "poisson", 0.25, 0, True), (0, "snapkv", "poisson", 0.25, 1, True),
              (1, "snapkv", "poisson", 0.25, 0, True), (1, "snapkv", "poisson", 0.25, 1, False)]


def test_a_table_without_shares_keeps_its_columns():
    table = accuracy_table(_items(DEFAULT_CELL))
    assert list(table.columns) == COLUMNS
    assert table.set_index("design")["accuracy"].to_dict() == {"full": 100.0, "poisson": 25.0, "topk": 50.0}


def test_poisson_rows_are_kept_per_share_and_the_others_fold_into_the_default():
    items = pd.concat([_items(DEFAULT_CELL), _items(SHARE_CELL, share=0.8)], ignore_index=True)
    table = accuracy_table(items)
    assert list(table.columns) == [*COLUMNS[:5], "head_fraction", *COLUMNS[5:]]
    got = {(r.design, r.head_fraction): (r.accuracy, r.n) for r in table.itertuples()}
    assert got == {("full", 0.5): (100.0, 2), ("topk", 0.5): (50.0, 2), ("poisson", 0.5): (25.0, 2),
                   ("poisson", 0.8): (pytest.approx(75.0), 2)}


def test_defended_poisson_rows_stay_apart_and_the_full_cache_folds():
    """A cell run with amendment 6's defenses records them on every row, the full cache's included: its Poisson rows
    make their own row (the policy names the defenses, as the claims label them); its full-cache rows fold into the
    undefended cell's, which ran the same items."""
    defended = _items(SHARE_CELL).assign(tail_mix=0.2, head_attention_share=0.5)
    table = accuracy_table(pd.concat([_items(DEFAULT_CELL), defended], ignore_index=True))
    assert list(table.columns) == COLUMNS
    got = {(r.policy, r.design): (r.accuracy, r.n) for r in table.itertuples()}
    assert got == {("full", "full"): (100.0, 2), ("snapkv", "topk"): (50.0, 2), ("snapkv", "poisson"): (25.0, 2),
                   ("snapkv+lambda0.2+eta0.5", "poisson"): (pytest.approx(75.0), 2)}
