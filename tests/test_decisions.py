"""What decided each answer (decisions.parquet, kvcert.runner.decisions) and how make verify-results uses it
(workflow/scripts/compare_results.py): across CPU models an answer changed at a near-tie passes and is named,
anything else fails.

The real cells are SmolLM2-135M on two short RULER items (marker smollm2: each test runs one cell, about 8 s on two
idle cores, 25-45 s on busy ones), run in this process so that a test
can plant a bug with monkeypatch: the Hájek offset with the wrong sign (+log π), and another policy's scores under
SnapKV's name. Each bug run is compared with an unmodified run through the comparison's own code and must fail;
one test (marker slow, two cells of study v5's task) does so through make verify-results' path for a record that
keeps no decisions.
Two tests edit a copy of the unmodified run's tables to plant one flipped answer (labelled where they do); the
accuracy-level tests write small decisions tables by hand (a test of our own comparison logic).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compare_results", ROOT / "workflow" / "scripts" / "compare_results.py")
compare_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_results)

from kvcert.runner.decisions import DECODE, DECODE_RTOL, DRAW, DRAW_RTOL, near_ties  # noqa: E402
from kvcert.table_columns import DECISION_COLUMNS  # noqa: E402

OVERRIDES = ["data=ruler", "data.context_tokens=256", "n_items=2", "model=smollm2", "policies=[snapkv]",
             "designs=[topk,poisson]", "budgets=[0.25]", "seeds=[0,1]", "threads=1", "progress=false"]


def _run(out_dir: Path, *extra: str) -> Path:
    """One real cell in this process (the caller's monkeypatches apply)."""
    from kvcert.hydra_app import compose
    from kvcert.runner.cell import run_cell

    threads = torch.get_num_threads()
    try:
        run_cell(compose([*OVERRIDES, *extra, f"out_dir={out_dir}"]), out_dir)
    finally:
        torch.set_num_threads(threads)
    return out_dir


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> Path:
    """The unmodified cell: the record every planted bug is compared with."""
    return _run(tmp_path_factory.mktemp("record") / "shard-0")


@pytest.mark.smollm2
def test_decisions_leave_items_and_steps_byte_identical(record, tmp_path):
    plain = _run(tmp_path / "without", "decisions=false")
    assert not (plain / "decisions.parquet").exists()
    for name in ("items.parquet", "steps.parquet"):
        assert _sha(record / name) == _sha(plain / name), name
    # config.yaml: the default leaves the key out (as committed cells were written); false is stated
    lines = (record / "config.yaml").read_text().splitlines()
    assert not any(line.startswith("decisions:") for line in lines)
    assert [line for line in (plain / "config.yaml").read_text().splitlines()
            if not line.startswith(("decisions:", "out_dir:"))] == [line for line in lines if not line.startswith("out_dir:")]
    manifest = json.loads((record / "manifest.json").read_text())
    assert manifest["outputs_sha256"]["decisions.parquet"] == _sha(record / "decisions.parquet")

    items, decisions = pd.read_parquet(record / "items.parquet"), pd.read_parquet(record / "decisions.parquet")
    assert list(decisions.columns) == DECISION_COLUMNS
    keys = ["item_id", "policy", "design", "budget", "seed"]
    joined = items.merge(decisions, on=keys, suffixes=("", "_decided"), validate="one_to_one")
    assert len(joined) == len(items) == 2 * 4  # full, top-k, two Poisson draws per item
    assert (joined["correct"] == joined["correct_decided"]).all()
    assert decisions["decode_margin"].dtype == np.float32 and (decisions["decode_margin"] >= 0).all()
    assert (decisions["decode_margin_step"] >= 0).all() and (decisions["decided_token"] != decisions["runner_up_token"]).all()
    poisson = decisions["design"] == "poisson"
    assert decisions.loc[poisson, "draw_margin"].between(0, 1).all()
    assert decisions.loc[~poisson, "draw_margin"].isna().all()
    assert (decisions.loc[decisions["policy"] == "full", "draws_sha256"] == "").all()
    # the two draws of an item kept different samples; nothing else draws (digest "")
    for _, group in decisions[decisions["policy"] != "full"].groupby("item_id"):
        assert group["draws_sha256"].nunique() == 3


@pytest.mark.smollm2
def test_the_wrong_offset_sign_fails(record, tmp_path, monkeypatch):
    import kvcert.cache
    from kvcert.estimator import NOT_RETAINED

    # planted bug: the Hájek offset +log π instead of −log π
    monkeypatch.setattr(kvcert.cache, "offset_bias",
                        lambda log_pi: torch.where(torch.isfinite(log_pi), log_pi, torch.full_like(log_pi, NOT_RETAINED)))
    diffs, _ = compare_results.compare_cells(record, _run(tmp_path / "bug"))
    poisson = [d for d in diffs if " poisson " in d]
    assert poisson, diffs
    assert not [d for d in diffs if " topk " in d or d.startswith("full ")], diffs  # π = 1 there: no offset


@pytest.mark.smollm2
def test_another_policy_under_snapkvs_name_fails(record, tmp_path, monkeypatch):
    import kvcert.generation

    original = kvcert.generation.get_policy
    # planted bug: SnapKV's configurations scored by key norms
    monkeypatch.setattr(kvcert.generation, "get_policy",
                        lambda name, **options: original("knorm") if name == "snapkv" else original(name, **options))
    diffs, _ = compare_results.compare_cells(record, _run(tmp_path / "bug"))
    assert any(" topk " in d for d in diffs), diffs  # top-k has no draw margin to hide behind
    assert any("sample (what the draws kept) changed" in d or "answer changed" in d or "cert_mean" in d for d in diffs), diffs


def _copy(cell: Path, to: Path) -> Path:
    shutil.copytree(cell, to)
    return to


def _plant_flip(cell: Path) -> dict:
    """EDITED TABLES: flip the answer of the first top-k row in ``cell``'s items.parquet (and its decisions row's
    ``correct``), as another CPU might have decided it. Returns the row's keys."""
    items = pd.read_parquet(cell / "items.parquet")
    i = int(np.flatnonzero(items["design"] == "topk")[0])
    items.loc[i, "correct"] = not bool(items.loc[i, "correct"])
    items.loc[i, "prediction"] = items.loc[i, "prediction"] + " (planted)"
    items.to_parquet(cell / "items.parquet", index=False)
    decisions = pd.read_parquet(cell / "decisions.parquet")
    j = (decisions["item_id"] == items.loc[i, "item_id"]) & (decisions["design"] == "topk")
    decisions.loc[j, "correct"] = items.loc[i, "correct"]
    decisions.to_parquet(cell / "decisions.parquet", index=False)
    return {"item_id": items.loc[i, "item_id"], "design": "topk"}


def _plant_near_tie(cell: Path, keys: dict) -> float:
    """EDITED TABLES: make the decode margin of ``keys``'s row in ``cell``'s decisions.parquet a near-tie."""
    decisions = pd.read_parquet(cell / "decisions.parquet")
    j = (decisions["item_id"] == keys["item_id"]) & (decisions["design"] == keys["design"])
    margin = np.float32(0.5 * DECODE_RTOL * abs(float(decisions.loc[j, "decided_logit"].iloc[0])))
    decisions.loc[j, "decode_margin"] = margin
    decisions.to_parquet(cell / "decisions.parquet", index=False)
    return float(margin)


@pytest.mark.smollm2
def test_one_planted_flip_passes_at_a_near_tie_and_fails_without(record, tmp_path):
    rerun = _copy(record, tmp_path / "rerun")
    keys = _plant_flip(rerun)
    diffs, accepted = compare_results.compare_cells(record, rerun)
    assert accepted == [] and len(diffs) == 1 and "with no near-tie" in diffs[0] and keys["item_id"] in diffs[0]

    near = _copy(record, tmp_path / "near")  # the record, its decode margin edited to a near-tie
    margin = _plant_near_tie(near, keys)
    diffs, accepted = compare_results.compare_cells(near, rerun)
    assert diffs == [] and len(accepted) == 1
    assert keys["item_id"] in accepted[0] and DECODE in accepted[0] and f"{margin:.3g}" in accepted[0]
    assert "near-tie per the record" in accepted[0]

    # a record without decisions: the rerun's margins decide, and say so
    legacy = _copy(record, tmp_path / "legacy")
    (legacy / "decisions.parquet").unlink()
    _plant_near_tie(rerun, keys)
    diffs, accepted = compare_results.compare_cells(legacy, rerun)
    assert diffs == [] and "near-tie per the rerun: the record predates decision margins" in accepted[0]


# --- accuracy.csv rows (make verify-results) on hand-written decisions: our own comparison logic -----------------

HEADER = "study,model,task,setting,policy,design,budget,accuracy,n,allocator,head_fraction\n"
ROW = "v5,smollm2,niah,question_aware,leverage,poisson,0.25,{accuracy},3,uniform,0.8\n"


def _decisions(correct: list[list[bool]], decode=1.0, draw=0.5, digest="a") -> pd.DataFrame:
    """Three items × len(correct[0]) draws of one configuration; margins far from a tie unless set."""
    rows = []
    for item, draws in enumerate(correct):
        for seed, right in enumerate(draws):
            rows.append({"item_id": f"i{item}", "policy": "leverage", "design": "poisson", "budget": 0.25,
                         "seed": seed, "setting": "question_aware", "allocator": "uniform", "head_fraction": 0.8,
                         "model": "smollm2", "task": "niah", "correct": right, "decode_margin": decode,
                         "decode_margin_step": 0, "decided_token": 1, "runner_up_token": 2, "decided_logit": 30.0,
                         "draw_margin": draw, "draws_sha256": digest})
    return pd.DataFrame(rows, columns=DECISION_COLUMNS)


def _study(root: Path, accuracy: float, decisions: pd.DataFrame | None) -> Path:
    root.mkdir(parents=True)
    (root / "accuracy.csv").write_text(HEADER + ROW.format(accuracy=accuracy))
    if decisions is not None:
        shard = root / "v5" / "cells" / "oracle-smollm2-share0.8" / "shard-0"
        shard.mkdir(parents=True)
        decisions.to_parquet(shard / "decisions.parquet", index=False)
    return root


RIGHT = [[True, True, True], [True, False, True], [False, False, False]]  # accuracy 100·(1 + 2/3 + 0)/3
FLIPPED = [[True, True, True], [True, True, True], [False, False, False]]  # item 1's second draw right


def _compare(committed, fresh, capsys):
    ok = compare_results.compare(committed, fresh, ["v5"], byte_for_byte=False, tables=("accuracy.csv",))
    return ok, capsys.readouterr().out


def test_a_near_tie_flip_per_the_rerun_is_accepted_and_named(tmp_path, capsys):
    rerun = _decisions(FLIPPED)
    rerun.loc[4, "draw_margin"] = DRAW_RTOL / 2  # item 1, seed 1: its draw within a CPU's rounding
    committed = _study(tmp_path / "record", 55.5556, None)  # a record that predates decisions
    ok, out = _compare(committed, _study(tmp_path / "rerun", 66.6667, rerun), capsys)
    assert ok, out
    assert "accepted v5 smollm2 niah question_aware leverage poisson 0.25 uniform 0.8: accuracy 55.5556 vs 66.6667" in out
    assert ("v5 oracle-smollm2-share0.8/shard-0 leverage poisson 0.25 share 0.8 seed 1 item i1: correct False -> True, "
            f"{DRAW} {DRAW_RTOL / 2:.3g} (near-tie per the rerun: the record predates decision margins)") in out
    assert "equal but for 1 accuracy explained by near-tie flips" in out


def test_a_flip_without_a_near_tie_or_beyond_the_near_ties_fails(tmp_path, capsys):
    committed = _study(tmp_path / "record", 55.5556, None)
    ok, out = _compare(committed, _study(tmp_path / "far", 66.6667, _decisions(FLIPPED)), capsys)
    assert not ok and "DIFFERS" in out and "(net 0.33 of 3 items)" in out
    # two draws flipped, one near-tie: more flips than near-ties can explain
    two = _decisions([[True, True, True], [True, True, True], [True, False, False]])
    two.loc[4, "decode_margin"] = 1e-3
    ok, out = _compare(committed, _study(tmp_path / "two", 77.7778, two), capsys)
    assert not ok and "DIFFERS" in out
    # the right direction matters: the near-tie draw is one the rerun got wrong, and the rerun gained
    wrong = _decisions(FLIPPED)
    wrong.loc[8, "decode_margin"] = 1e-3  # item 2, seed 2: wrong in the rerun
    ok, out = _compare(committed, _study(tmp_path / "wrong", 66.6667, wrong), capsys)
    assert not ok
    # no decisions in the rerun: nothing excuses it
    ok, out = _compare(committed, _study(tmp_path / "none", 66.6667, None), capsys)
    assert not ok


def test_with_the_records_decisions_each_flip_is_checked_by_the_record(tmp_path, capsys):
    record = _decisions(RIGHT)
    record.loc[4, "decode_margin"] = 1e-3  # the record's item 1, seed 1 was decided by a hair
    committed = _study(tmp_path / "record", 55.5556, record)
    ok, out = _compare(committed, _study(tmp_path / "rerun", 66.6667, _decisions(FLIPPED)), capsys)
    assert ok and "near-tie per the record" in out and f"{DECODE} 0.001" in out, out
    # the same flip, but the record decided it with a wide margin: fails, whatever the rerun's margins say
    ok, out = _compare(_study(tmp_path / "wide", 55.5556, _decisions(RIGHT)),
                       _study(tmp_path / "rerun2", 66.6667, _decisions(FLIPPED, decode=1e-3)), capsys)
    assert not ok
    # a draw near-tie counts only where the rerun's draws kept another set
    drawn = _decisions(RIGHT)
    drawn.loc[4, "draw_margin"] = DRAW_RTOL / 2
    for digest, passes in (("a", False), ("b", True)):
        root = tmp_path / f"drawn-{digest}"
        ok, out = _compare(_study(root / "record", 55.5556, drawn),
                           _study(root / "rerun", 66.6667, _decisions(FLIPPED, digest=digest)), capsys)
        assert ok is passes, out


def test_more_flips_than_a_correct_rerun_makes_fail_however_many_near_ties(tmp_path, capsys):
    # every draw of the rerun a draw near-tie (as most Poisson draws of a real cell are): two flips in one row are
    # each explained by a near-tie, but nine near-tie draws flip twice with probability below FLIP_TAIL
    assert compare_results.flip_bound(9) == 1 and compare_results.flip_bound(0) == 0
    assert compare_results.flip_bound(1443) == 8  # the two v5 cells recomputed on another CPU flipped one
    committed = _study(tmp_path / "record", 55.5556, None)
    two = _decisions([[True, True, True], [True, True, True], [True, False, False]], draw=DRAW_RTOL / 2)
    ok, out = _compare(committed, _study(tmp_path / "two", 77.7778, two), capsys)
    assert not ok, out
    assert ("v5: 2 near-tie flips in accuracy.csv's rows, more than a correct rerun makes: at most 1 of its 9 "
            f"near-tie draws (each flipping at rate {compare_results.FLIP_RATE:g}") in out
    # one flip among the same near-ties passes, named
    ok, out = _compare(committed, _study(tmp_path / "one", 66.6667, _decisions(FLIPPED, draw=DRAW_RTOL / 2)), capsys)
    assert ok and "explained by 1 near-tie flip:" in out, out


def test_near_ties_follow_the_stated_tolerances():
    row = {"decode_margin": 0.0, "decided_logit": 25.0, "draw_margin": float("nan")}
    assert near_ties({**row, "decode_margin": 0.99 * DECODE_RTOL * 25}) == {DECODE: pytest.approx(0.99 * DECODE_RTOL * 25)}
    assert near_ties({**row, "decode_margin": 1.01 * DECODE_RTOL * 25}) == {}
    assert near_ties({**row, "decode_margin": 1.0, "draw_margin": 0.99 * DRAW_RTOL}) == {DRAW: 0.99 * DRAW_RTOL}
    assert near_ties({**row, "decode_margin": float("nan"), "draw_margin": 1.01 * DRAW_RTOL}) == {}


@pytest.mark.smollm2
def test_verify_results_compares_the_cells_a_record_keeps(record, tmp_path, capsys):
    """A record that keeps its cells' tables (a run on a cluster, say) is compared shard by shard, row by row."""
    shard = Path("v5") / "cells" / "oracle-smollm2" / "shard-0"
    rerun = _copy(record, tmp_path / "fresh" / shard)
    keys = _plant_flip(rerun)  # EDITED TABLES, as above
    committed = _copy(record, tmp_path / "committed" / shard)
    assert not compare_results.compare_study_cells(tmp_path / "committed", tmp_path / "fresh", "v5")
    assert "verify-results: cells: v5 oracle-smollm2/shard-0: DIFFERS" in capsys.readouterr().out
    _plant_near_tie(committed, keys)
    assert compare_results.compare_study_cells(tmp_path / "committed", tmp_path / "fresh", "v5")
    out = capsys.readouterr().out
    assert f"verify-results: cells: accepted v5 oracle-smollm2/shard-0 snapkv topk 0.25 seed 0 item {keys['item_id']}" in out
    assert "1 shards agree row by row but for 1 near-tie flips (above)" in out


# --- make verify-results against a record that predates decisions (study v5's committed record), real cells ------

# Study v5's task and design, small: SmolLM2 on niah_multikey_2_512 (seed 50), leverage, Poisson at a certain-head
# share of 0.8 and half the cache, three draws per item. Every answer right, and most draws carry a draw near-tie.
V5_LIKE = ["data=ruler", "data.tasks=[{name:niah_multikey,label:niah_multikey_2_512,num_needles:2,context_tokens:512}]",
           "data.seed=50", "n_items=6", "model=smollm2", "policies=[leverage]", "designs=[poisson]",
           "design_options.head_fraction=0.8", "budgets=[0.5]", "seeds=[0,1,2]", "threads=1", "progress=false"]


def _v5_study(root: Path) -> Path:
    """One real v5-like cell in this process (the caller's monkeypatches apply) at
    ``root``/v5/cells/qa-smollm2-share0.8/shard-0, and the study's accuracy.csv as make verify-results reads it
    (kvcert-accuracy's table, with the study column the aggregate adds)."""
    from kvcert.analysis.accuracy import accuracy_table
    from kvcert.hydra_app import compose
    from kvcert.runner.cell import run_cell

    shard = root / "v5" / "cells" / "qa-smollm2-share0.8" / "shard-0"
    threads = torch.get_num_threads()
    try:
        run_cell(compose([*V5_LIKE, f"out_dir={shard}"]), shard)
    finally:
        torch.set_num_threads(threads)
    table = accuracy_table(pd.read_parquet(shard / "items.parquet"))
    table.insert(0, "study", "v5")
    (root / "accuracy.csv").write_text(table.to_csv(index=False))
    return root


@pytest.mark.smollm2
@pytest.mark.slow  # two real cells: make test-full
def test_a_changed_policy_fails_verify_results_against_a_record_without_decisions(tmp_path, monkeypatch, capsys):
    """The path make verify-results takes for study v5: the record keeps its tables but no decisions.parquet, so
    a changed answer is judged by the rerun's own margins, where most Poisson draws carry a draw near-tie. A
    planted bug (leverage's configurations scored by key norms) must fail there, and where a record keeps its
    cells, whose near-ties excuse most of its changed answers one by one, it fails by their number. (The other
    planted bug, the Hájek offset's sign, changes no answer of this cell: an accuracy table cannot see it;
    compare_cells does, test_the_wrong_offset_sign_fails, and so do the claims on certificates.) Two real
    cells, a few minutes on two cores."""
    import kvcert.generation

    record = _v5_study(tmp_path / "record")
    committed = tmp_path / "committed"  # what a committed record holds: its tables, no decisions.parquet
    committed.mkdir()
    shutil.copy(record / "accuracy.csv", committed / "accuracy.csv")
    args = ["--committed", str(committed), "v5", "--tables", "accuracy.csv"]
    assert compare_results.main([*args, "--fresh", str(record)]) == 0  # the same run again passes
    assert "accuracy.csv (v5): equal" in capsys.readouterr().out

    original = kvcert.generation.get_policy
    monkeypatch.setattr(kvcert.generation, "get_policy",
                        lambda name, **options: original("knorm") if name == "leverage" else original(name, **options))
    bug = _v5_study(tmp_path / "bug")
    monkeypatch.undo()
    shard = Path("v5") / "cells" / "qa-smollm2-share0.8" / "shard-0"
    decisions = pd.read_parquet(bug / shard / "decisions.parquet")
    poisson = decisions[decisions["design"] == "poisson"]
    assert sum(bool(near_ties(row)) for row in poisson.to_dict("records")) > len(poisson) / 2  # most draws
    assert compare_results.main([*args, "--fresh", str(bug)]) == 1
    out = capsys.readouterr().out
    assert "accuracy.csv (v5): DIFFERS" in out and "v5 smollm2 niah_multikey_2_512 question_aware leverage poisson" in out

    # a record that keeps its cell (items.parquet and decisions.parquet): its draw near-ties excuse changed answers
    # one by one (the draws kept another set), but not that many
    diffs, accepted = compare_results.compare_cells(record / shard, bug / shard)
    assert len(accepted) >= 2, (diffs, accepted)
    assert not compare_results.compare_study_cells(record, bug, "v5")
    out = capsys.readouterr().out
    assert f"v5: {len(accepted)} near-tie flips in its cells, more than a correct rerun makes" in out, out


# --- the recording itself, on tiny random-weight models (no download) -------------------------------------------


@pytest.mark.parametrize("arch, setting, allocator", [("llama", "question_aware", "uniform"),
                                                      ("gemma3", "streaming", "adakv")])
def test_the_decodes_own_draws_and_logits_are_what_decided(arch, setting, allocator):
    """The draw records of one decode, split per configuration (the cell's fast path), equal the selections made
    again (the slow path); the decode margin is the full cache's smallest top-two logit gap, from stock logits."""
    from helpers.tiny_models import build, prompt

    from kvcert.generation import Configuration, decode_configurations
    from kvcert.runner.decisions import LogitTops, draw_record, split_draws
    from kvcert.sampling import recording_draws

    reference, model, _ = build(arch)
    context, question = prompt(2, n_context=120)
    if setting == "question_aware":
        state = kvcert_prefill(model, torch.cat([context, question], -1), setting=setting)
    else:
        state = kvcert_prefill(model, context, question, setting=setting)
    group = [Configuration("full", "full", 1.0, 0), Configuration("snapkv", "topk", 0.5, 0),
             Configuration("snapkv", "poisson", 0.5, 0), Configuration("snapkv", "poisson", 0.5, 1)]
    tops = LogitTops(model)
    initial = state.last_logits if state.suffix_ids.shape[-1] == 0 else None
    with tops.recording(initial), recording_draws() as draws:
        decoded = decode_configurations(model, state, group, item_id="x", max_new_tokens=5, allocator=allocator)
    fast = split_draws(draws, group, len(state.cache.layers))
    slow = [draw_record(state, conf, item_id="x", allocator=allocator) for conf in group]
    assert fast is not None and fast[0] == fast[1] == (pytest.approx(float("nan"), nan_ok=True), "")
    assert fast[2:] == slow[2:] and fast[2][1] != fast[3][1]  # two seeds, two samples
    assert split_draws(draws[:-1], group, len(state.cache.layers)) is None  # records that do not add up

    # the full cache's tokens are stock greedy: its margin is the stock logits' smallest top-two gap
    ids = torch.cat([context, question], -1)
    with torch.no_grad():
        logits = reference(input_ids=ids).logits[0, -1]
        gaps = []
        for token in decoded[0].token_ids:
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            ids = torch.cat([ids, torch.tensor([[token]])], -1)
            logits = reference(input_ids=ids).logits[0, -1]
    margin = tops.decode_margin(0, decoded[0].token_ids)
    assert margin["decode_margin"] == pytest.approx(min(gaps), abs=1e-4)
    assert margin["decode_margin_step"] == int(np.argmin(gaps))


def kvcert_prefill(*args, **kwargs):
    import kvcert

    return kvcert.prefill(*args, **kwargs)


def test_an_unreadable_decisions_file_is_one_line(tmp_path, capsys):
    committed = _study(tmp_path / "record", 55.5556, None)
    fresh = _study(tmp_path / "rerun", 66.6667, _decisions(FLIPPED))
    bad = fresh / "v5" / "cells" / "oracle-smollm2-share0.8" / "shard-0" / "decisions.parquet"
    bad.write_bytes(b"not parquet")
    (tmp_path / "record" / "v5" / "cells").mkdir(parents=True)
    assert compare_results.main(["--committed", str(committed), "--fresh", str(fresh), "v5",
                                 "--tables", "accuracy.csv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"verify-results: error: {bad}: unreadable (ArrowInvalid)"]
