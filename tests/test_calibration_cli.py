"""``kvcert-calibrate`` and ``kvcert-run ... calibration=<file>`` end to end on a tiny GGUF model (nothing is
downloaded), and every bad input of both: one line naming the key, value or file, exit 2, nothing written.

docs/errors.md's table for ``kvcert-calibrate`` lists the same rows as ``CALIBRATE_CASES``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvcert.calibration import calibration_summary
from kvcert.runner import calibrate, cli
from kvcert.table_columns import CALIBRATED_ITEM_COLUMNS, KEY_COLUMNS

# Five new tokens: 20 calibration prompts then give each layer the ≥ 99 rows a finite quantile at the
# default level (0.99) needs. shard_by=task: both halves hold the workload's two tasks.
BASE = ["progress=false", "threads=1", "data=ruler", "data.context_tokens=200", "+data.max_new_tokens=5", "shard_by=task",
        "policies=[snapkv,uniform]", "designs=[topk,poisson]", "budgets=[0.5]", "seeds=[0]"]


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny GGUF models (another architecture for the refusals) and a KVCERT_CACHE shared by the session."""
    from helpers.tiny_gguf import shared_kvcert_cache, shared_tiny_gguf

    return {"qwen2": shared_tiny_gguf(tmp_path_factory, "qwen2").path,
            "qwen2_mqa": shared_tiny_gguf(tmp_path_factory, "qwen2_mqa").path,
            "cache": shared_kvcert_cache(tmp_path_factory)}


@pytest.fixture
def env(tiny, monkeypatch):
    monkeypatch.setenv("KVCERT_CACHE", str(tiny["cache"]))
    return tiny


@pytest.fixture(scope="module")
def fitted(tiny, tmp_path_factory):
    """A calibration fitted on shard 0 of 40 items (20 prompts), its kept cell, and the evaluation run on
    shard 1 with it."""
    import os

    os.environ["KVCERT_CACHE"] = str(tiny["cache"])
    root = tmp_path_factory.mktemp("calibrated")
    model = ["model=gguf", f"model.path={tiny['qwen2']}"]
    out = root / "cal.json"
    rc = calibrate.main([*BASE, *model, "n_items=40", "shard=0", "n_shards=2", f"out={out}",
                         f"out_dir={root / 'calibration-cell'}"])
    assert rc == 0
    run = root / "run"
    rc = cli.main([*BASE, *model, "n_items=40", "shard=1", "n_shards=2", f"calibration={out}", f"out_dir={run}"])
    assert rc == 0
    return {"file": out, "cell": root / "calibration-cell", "run": run, "model": model, "root": root}


def test_the_file_is_bound_to_the_model_and_the_design(fitted):
    payload = json.loads(fitted["file"].read_text())
    assert payload["format"] == "kvcert-calibration" and payload["method"] == "conformal"
    assert payload["level"] == pytest.approx(0.99) and payload["unit"] == "row"
    assert payload["model"]["model_type"] == "qwen2" and len(payload["model"]["weights_sha256"]) == 64
    assert payload["model"]["fingerprint"]["sha256"]  # the GGUF's own sha256, for the record
    assert payload["design"] == {"n_sink": 4, "n_recent": 32, "head_fraction": 0.5, "pi_min": 0.001, "delta": 0.05,
                                 "observation_window": 16, "policy_options": {}}
    assert payload["fitted_on"]["items"] == 20 and payload["fitted_on"]["settings"] == ["question_aware"]
    assert payload["fitted_on"]["tasks"] == {"niah_multikey_2": 10, "niah_multikey_4": 10}
    strata = {(s["policy"], s["design"], s["budget"]) for s in payload["strata"]}
    assert strata == {("snapkv", "poisson", 0.5), ("uniform", "poisson", 0.5)}  # topk has no certificate
    assert all(len(s["factors"]) == payload["model"]["num_layers"] for s in payload["strata"])


def test_the_run_adds_calibrated_columns_from_the_files_factors(fitted):
    steps = pd.read_parquet(fitted["run"] / "steps.parquet")
    items = pd.read_parquet(fitted["run"] / "items.parquet")
    payload = json.loads(fitted["file"].read_text())
    evaluated = set(items["item_id"])
    assert not evaluated & set(payload["fitted_on"]["item_ids"])  # disjoint prompts
    for stratum in payload["strata"]:
        rows = steps[(steps["policy"] == stratum["policy"]) & (steps["design"] == "poisson")]
        layer = rows["layer"].to_numpy()
        pick = lambda name: np.asarray(stratum[name], dtype=float)[layer]  # noqa: E731
        expected = pick("factors") * (pick("cert_weights") * rows["cert"] + pick("norm_weights") * rows["out_norm"])
        assert payload["never_below_paper"] is True  # the default: never narrower than the paper's certificate
        expected = np.maximum(expected, rows["cert"])
        np.testing.assert_allclose(rows["cert_calibrated"], expected, rtol=1e-5)
        covered = (rows["true_err"] <= rows["cert_calibrated"]).astype("float32")
        np.testing.assert_array_equal(rows["coverage_calibrated"], covered)
    topk = steps[steps["design"] == "topk"]
    assert len(topk) and topk["cert_calibrated"].isna().all() and topk["coverage_calibrated"].isna().all()
    assert steps["cert_calibrated"].dtype == np.float32
    for column in ("cert_calibrated_mean", "cert_calibrated_max", "coverage_calibrated"):
        assert column in items
        assert items.loc[items["design"] != "poisson", column].isna().all()
        assert items.loc[items["design"] == "poisson", column].notna().all()
    one = items[(items["design"] == "poisson")].iloc[0]
    mine = steps[(steps["item_id"] == one["item_id"]) & (steps["policy"] == one["policy"]) & (steps["design"] == "poisson")]
    assert one["coverage_calibrated"] == pytest.approx(mine["coverage_calibrated"].mean())
    # The item columns summarize the stored (float32) step rows exactly, as cert_mean & co. do.
    by_run = {key: rows for key, rows in steps.groupby(KEY_COLUMNS)}
    for run in items[items["design"] == "poisson"].itertuples(index=False):
        stored = by_run[tuple(getattr(run, c) for c in KEY_COLUMNS)]
        assert {c: getattr(run, c) for c in CALIBRATED_ITEM_COLUMNS} == calibration_summary(stored), run.item_id


def test_fitting_from_the_kept_cell_gives_the_same_factors(fitted, env, tmp_path):
    out = tmp_path / "from-cells.json"
    assert calibrate.main([f"cells=[{fitted['cell']}]", f"out={out}"]) == 0
    assert json.loads(out.read_text())["strata"] == json.loads(fitted["file"].read_text())["strata"]


def test_an_uncalibrated_run_has_no_calibrated_columns(fitted, env, tmp_path):
    out = tmp_path / "plain"
    assert cli.main([*BASE, *fitted["model"], "n_items=2", f"out_dir={out}"]) == 0
    assert "cert_calibrated" not in pd.read_parquet(out / "steps.parquet")
    assert "coverage_calibrated" not in pd.read_parquet(out / "items.parquet")


# --- kvcert-run refusals --------------------------------------------------------------------------------------

RUN_CASES = [
    ("missing-file", [], "calibration={d}/nope.json", "calibration={d}/nope.json: no such file"),
    ("not-json", [], "calibration={d}/bad.json", "calibration={d}/bad.json: not a kvcert calibration file (JSONDecodeError"),
    ("another-model", ["model.path={mqa}"], "calibration={file}", "calibration={file} was fitted on another model"),
    ("other-knob", ["design_options.pi_min=0.01"], "calibration={file}",
     "calibration={file}: design_options.pi_min=0.01 here but 0.001 in the file"),
    ("other-delta", ["delta=0.1"], "calibration={file}", "calibration={file}: delta=0.1 here but 0.05 in the file"),
    ("other-budget", ["budgets=[0.3]"], "calibration={file}",
     "calibration={file} has no factors for setting=question_aware policy=snapkv design=poisson budget=0.3"),
    ("other-setting", ["setting=streaming"], "calibration={file}", "has no factors for setting=streaming"),
    # n_items=2: the first prompt of each task, both in shard 0 of 2 (by task) that the file was fitted on
    ("calibration-prompts", [], "calibration={file}",
     "calibration={file} was fitted on 2 of this run's 2 prompts (e.g. ruler/niah_multikey_2/s0/00000): evaluate on "
     "prompts it never saw"),
    ("unseen-task", ["data.tasks=[niah_single]"], "calibration={file}",
     "calibration={file} was fitted on tasks ['niah_multikey_2', 'niah_multikey_4'], but this run holds ['niah_single']"),
    # shard 1 of 2 by item is every second item of the workload: one task only, and half of it calibrated on
    ("task-pure-shard", ["n_items=40", "n_shards=2", "shard=1", "shard_by=item"], "calibration={file}",
     "calibration={file} was fitted on 10 of this run's 20 prompts"),
]


@pytest.mark.parametrize("extra, option, expected", [pytest.param(*c[1:], id=c[0]) for c in RUN_CASES])
def test_kvcert_run_refuses_a_file_that_does_not_fit(fitted, env, tmp_path, capsys, extra, option, expected):
    (tmp_path / "bad.json").write_text("{")
    fill = {"d": tmp_path, "file": fitted["file"], "mqa": env["qwen2_mqa"]}
    out = tmp_path / "out" / "cell"
    n_items = [] if any(e.startswith("n_items=") for e in extra) else ["n_items=2"]
    argv = [*BASE, *fitted["model"], *n_items, *[e.format(**fill) for e in extra], option.format(**fill),
            f"out_dir={out}"]
    rc = cli.main(argv)
    last = _last_line(capsys.readouterr().err)
    assert rc == 2 and last.startswith("kvcert-run: error: ") and expected.format(**fill) in last, last
    assert not out.exists() and not (tmp_path / "out").exists()


def test_the_prompt_check_can_be_switched_off(fitted, env, tmp_path):
    """check_calibration_prompts=false runs on the calibration prompts themselves (e.g. to read in-sample coverage)."""
    out = tmp_path / "in-sample"
    assert cli.main([*BASE, *fitted["model"], "n_items=2", f"calibration={fitted['file']}",
                     "check_calibration_prompts=false", f"out_dir={out}"]) == 0
    assert pd.read_parquet(out / "items.parquet")["coverage_calibrated"].notna().any()


# --- kvcert-calibrate refusals -------------------------------------------------------------------------------

# (id, overrides, text of the last line); {d}: a temporary directory holding a_file and an empty cell
CALIBRATE_CASES = [
    ("no-out", ["n_items=20"], "missing value for out (set it on the command line, e.g. out=...)"),
    ("level-above-one", ["level=2", "out={d}/c.json"], "level=2.0: must be <= 1.0"),
    ("level-one", ["level=1", "out={d}/c.json"], "level=1.0: must be < 1 (no finite factor covers every row)"),
    ("level-zero", ["level=0", "out={d}/c.json"], "level=0.0: must be > 0.0"),
    ("level-not-a-number", ["level=abc", "out={d}/c.json"], "level='abc': expected float"),
    ("unit-unknown", ["unit=item", "out={d}/c.json"], "unit='item' is unknown; known: ['row', 'prompt']"),
    ("base-unknown", ["base=foo", "out={d}/c.json"], "base='foo' is unknown; known: ['paper', 'design']"),
    ("unknown-key", ["+foo=1", "out={d}/c.json"], "foo: unknown key"),
    ("out-is-a-directory", ["out={d}"], "out={d}: is a directory; give the calibration file's name"),
    ("out-below-a-file", ["out={d}/a_file/c.json"], "out={d}/a_file/c.json: cannot write there ({d}/a_file is not a directory)"),
    ("oracle-off", ["oracle=false", "out={d}/c.json"], "oracle=false: calibration compares the certificate with the true error"),
    ("certify-off", ["certify=false", "out={d}/c.json"], "certify=false: there is no certificate to calibrate"),
    ("applies-a-calibration", ["calibration=x.json", "out={d}/c.json"], "calibration=x.json: kvcert-calibrate fits a calibration"),
    ("no-poisson", ["designs=[topk]", "out={d}/c.json"], "designs=['topk']: no configuration has a certificate to calibrate"),
    ("bad-budget", ["budgets=[0]", "out={d}/c.json"], "budgets: 0.0 is outside (0, 1]"),
    ("cells-not-a-list", ["cells={d}", "out={d}/c.json"], "expected a non-empty list of cell directories"),
    ("cells-missing", ["cells=[{d}/nope]", "out={d}/c.json"], "{d}/nope: missing cell directory"),
    ("cells-without-tables", ["cells=[{d}/empty]", "out={d}/c.json"], "{d}/empty/steps.parquet: missing"),
    ("floor-not-a-flag", ["never_below_paper=maybe", "out={d}/c.json"], "never_below_paper='maybe': expected true or false"),
]


@pytest.mark.parametrize("extra, expected", [pytest.param(*c[1:], id=c[0]) for c in CALIBRATE_CASES])
def test_kvcert_calibrate_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, extra, expected):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = calibrate.main([*BASE, "n_items=20", *[e.format(d=tmp_path) for e in extra]])
    last = _last_line(capsys.readouterr().err)
    assert rc == 2 and last.startswith("kvcert-calibrate: error: "), last
    assert expected.format(d=tmp_path) in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no file, no temporary cell left behind


def test_the_error_page_lists_every_refusal_of_both_tables():
    """docs/errors.md has a row for each case above ({d}, {file} as written in the table)."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    section = readme[readme.index("#### `kvcert-calibrate`"):]
    section = section[: section.index("\n#### ", 10)]
    for case in CALIBRATE_CASES:
        assert case[2].format(d="<dir>") in section, case[0]
    for case in RUN_CASES:
        assert case[3].format(d="<dir>", file="<file>") in section, case[0]


def test_kvcert_calibrate_needs_enough_prompts(env, tmp_path, capsys):
    rc = calibrate.main([*BASE, "model=gguf", f"model.path={env['qwen2']}", "n_items=12", f"out={tmp_path}/c.json"])
    last = _last_line(capsys.readouterr().err)
    assert rc == 2 and last == ("kvcert-calibrate: error: n_items=12: shard 0 of 1 gives 12 calibration prompts; "
                                "unit=row at level 0.99 needs at least 19")
    assert list(tmp_path.iterdir()) == []


def test_cells_of_different_knobs_are_not_mixed(fitted, env, tmp_path, capsys):
    other = tmp_path / "other"
    assert cli.main([*BASE, *fitted["model"], "n_items=2", "design_options.pi_min=0.01", f"out_dir={other}"]) == 0
    rc = calibrate.main([f"cells=[{fitted['cell']},{other}]", f"out={tmp_path}/c.json"])
    last = _last_line(capsys.readouterr().err)
    assert rc == 2 and f"{other}: design_options.pi_min=0.01 but {fitted['cell']} has 0.001" in last, last
    assert not (tmp_path / "c.json").exists()
