"""Every bad input to ``kvcert-run`` ends in one clear line, a non-zero exit and no outputs.

Each row of ``CASES`` is one bad input a user can type (docs/bad_inputs.md lists the same rows). The row is
run through ``kvcert.runner.cli.main`` in this process (the console script's exact code path, without
paying ~10 s of torch import per row); a handful of rows also run through the installed console script in a
fresh process (``test_console_script``). Every row checks:

* the exit status is non-zero (2: bad input);
* the LAST line of stderr is ``kvcert-run: error: ...`` and names the key, value, file, line or item;
* nothing was written: the out_dir does not exist (or is unchanged when it existed before), in particular
  no items.parquet / steps.parquet and no ``.parts`` checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcert.runner import cli

# A tiny valid cell; each case changes one thing.
RULER = ["progress=false", "threads=1", "data=ruler", "data.context_tokens=200", "+data.max_new_tokens=2",
         "n_items=2", "policies=[snapkv]", "designs=[poisson]", "budgets=[0.5]", "seeds=[0]"]
JSONL = ["progress=false", "threads=1", "policies=[snapkv]", "designs=[poisson]", "budgets=[0.5]", "seeds=[0]"]

# (id, base overrides, extra overrides, text the last stderr line must contain, loads the model)
# {d} is the fixture directory.
CASES = [
    # budgets
    ("budget-zero", RULER, ["budgets=[0]"], "budgets: 0.0 is outside (0, 1]", False),
    ("budget-negative", RULER, ["budgets=[-0.25]"], "budgets: -0.25 is outside (0, 1]", False),
    ("budget-above-one", RULER, ["budgets=[1.5]"], "budgets: 1.5 is outside (0, 1]", False),
    ("budget-not-a-number", RULER, ["budgets=[abc]"], "budgets: 'abc' is not a number", False),
    ("budget-typo-key", RULER, ["budget=0.5"], "budget: unknown key (did you mean budgets?)", False),
    ("budget-appended-key", RULER, ["+budget=0.5"], "budget: unknown key (did you mean budgets?)", False),
    ("budgets-scalar", RULER, ["budgets=0.5"], "budgets=0.5: expected a non-empty list", False),
    # names
    ("policy-unknown", RULER, ["policies=[foo]"], "policies: 'foo' is unknown; known: ['cap',", False),
    ("policies-no-brackets", RULER, ["policies=snapkv"], "policies='snapkv': expected a non-empty list, e.g. 'policies=[snapkv]'", False),
    ("design-unknown", RULER, ["designs=[foo]"], "designs: 'foo' is unknown; known: ['clt', 'poisson', 'topk']", False),
    ("setting-unknown", RULER, ["setting=foo"], "setting='foo' is unknown; known: ['question_aware', 'streaming']", False),
    ("model-unknown", RULER, ["model=foo"], "model=foo: unknown model; known: gemma3, gguf, hf, smollm2", False),
    ("data-unknown", RULER, ["data=foo"], "data=foo: unknown data; known: jsonl, longbench, ruler", False),
    ("truncate-unknown", RULER, ["truncate=foo"], "truncate='foo' is unknown; known: ['middle', 'error']", False),
    ("extra-grid-policy", RULER, ["extra_grids=[{policies:[foo],designs:[poisson],budgets:[0.5]}]"],
     "extra_grids[0].policies: 'foo' is unknown", False),
    ("model-dtype-unknown", RULER, ["model.dtype=float8"], "model.dtype='float8' is unknown", False),
    ("model-key-appended", RULER, ["+model.dtyp=bfloat16"], "model.dtyp: unknown key", False),
    ("data-key-typo", RULER, ["data.context_token=100"], "data.context_tokens?)", False),
    ("design-option-typo", RULER, ["design_options.pimin=0.1"], "design_options.pimin: unknown key (did you mean design_options.pi_min?)", False),
    # numbers and flags
    ("seeds-not-int", RULER, ["seeds=[a]"], "seeds: 'a' is not an integer", False),
    ("n-shards-zero", RULER, ["n_shards=0"], "n_shards=0: must be >= 1", False),
    ("shard-out-of-range", RULER, ["shard=3", "n_shards=2"], "shard=3: must be < n_shards=2", False),
    ("shard-by-unknown", RULER, ["shard_by=prompt"], "shard_by='prompt' is unknown; known: ['item', 'task']", False),
    ("delta-above-one", RULER, ["delta=2"], "delta=2.0: must be <= 0.999", False),
    ("delta-zero", RULER, ["delta=0"], "delta=0.0: must be > 0.0", False),
    ("n-items-zero", RULER, ["n_items=0"], "n_items=0: must be >= 1", False),
    ("n-items-not-int", RULER, ["n_items=abc"], "n_items='abc': expected int", False),
    ("pi-min-not-number", RULER, ["design_options.pi_min=abc"], "design_options.pi_min='abc': expected float", False),
    ("pi-min-zero", RULER, ["design_options.pi_min=0"], "design_options.pi_min=0.0: must lie in (0, 1]", False),
    ("max-context-tiny", RULER, ["max_context_tokens=4"], "max_context_tokens=4: must be >= 8", False),
    ("oracle-not-bool", RULER, ["oracle=maybe"], "oracle='maybe': expected true or false", False),
    ("threads-not-int", RULER, ["threads=abc"], "threads='abc': expected int", False),
    ("out-dir-missing", [a for a in RULER], ["out_dir=???"], "missing value for out_dir", False),
    ("out-dir-under-a-file", RULER, ["out_dir={d}/a_file/cell"], "a_file is not a directory", False),
    # model files
    ("gguf-random-bytes", RULER, ["model=gguf", "model.path={d}/x.gguf"],
     "model.path={d}/x.gguf: not a loadable GGUF model", True),
    ("gguf-missing", RULER, ["model=gguf", "model.path={d}/missing.gguf"], "model.path={d}/missing.gguf: no such GGUF file", False),
    ("gguf-no-path", RULER, ["model=gguf"], "missing value for model.path", False),
    ("hf-not-a-model", RULER, ["model=hf", "model.name={d}/empty_model_dir"], "model.name={d}/empty_model_dir: cannot load", True),
    # data files and items
    ("jsonl-missing-file", JSONL, ["data=jsonl", "data.path={d}/missing.jsonl"], "jsonl items file not found: {d}/missing.jsonl", True),
    ("jsonl-no-path", JSONL, ["data=jsonl"], "missing value for data.path", False),
    ("jsonl-bad-line", JSONL, ["data=jsonl", "data.path={d}/bad_line.jsonl"], "{d}/bad_line.jsonl:2: invalid JSON", True),
    ("jsonl-empty-context", JSONL, ["data=jsonl", "data.path={d}/empty_context.jsonl"],
     "{d}/empty_context.jsonl:2 (item 'b'): 'context' is empty", True),
    ("jsonl-no-answers", JSONL, ["data=jsonl", "data.path={d}/no_answers.jsonl"],
     "{d}/no_answers.jsonl:1 (item 'a'): 'answers' is empty", True),
    ("jsonl-duplicate-id", JSONL, ["data=jsonl", "data.path={d}/duplicate.jsonl"],
     "{d}/duplicate.jsonl:2 (item 'a'): duplicate id, first seen on line 1", True),
    ("n-items-above-dataset", JSONL, ["data=jsonl", "data.path={d}/three.jsonl", "n_items=5"],
     "n_items=5 requested but only 3 items are available", True),
    ("shard-without-items", RULER, ["shard=4", "n_shards=5"], "shard=4 of n_shards=5 has no items (n_items=2)", True),
    ("ruler-task-unknown", RULER, ["data.tasks=[bogus]"], "unknown ruler task 'bogus'", True),
    ("ruler-context-too-small", RULER, ["data.context_tokens=-5"], "context_tokens=-5 is too small", True),
    ("longbench-unknown-option", JSONL, ["data=longbench", "data.path={d}/three.jsonl", "+data.foo=1"],
     "data=longbench: unknown option(s) foo", True),
    ("context-above-window-error", RULER, ["max_context_tokens=60", "truncate=error"],
     "prompt + answer need 198 tokens > max_context_tokens=60; set truncate=middle", True),
    ("out-dir-unwritable", RULER, ["out_dir=/proc/kvcert-reliability/cell"], "out_dir=/proc/kvcert-reliability/cell: ", True),
]


def _write_fixtures(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "x.gguf").write_bytes(os.urandom(4096))
    (d / "a_file").write_text("not a directory\n")
    (d / "empty_model_dir").mkdir(exist_ok=True)
    good = {"id": "a", "context": "The key is 7.", "question": " What is the key?", "answers": ["7"], "max_new_tokens": 2}
    line = json.dumps(good)
    (d / "bad_line.jsonl").write_text(line + '\n{"id": "b", "context": \n')
    (d / "empty_context.jsonl").write_text(line + "\n" + json.dumps({**good, "id": "b", "context": "  "}) + "\n")
    (d / "no_answers.jsonl").write_text(json.dumps({**good, "answers": []}) + "\n")
    (d / "duplicate.jsonl").write_text(line + "\n" + line + "\n")
    (d / "three.jsonl").write_text("".join(json.dumps({**good, "id": f"i{i}"}) + "\n" for i in range(3)))


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_inputs")
    _write_fixtures(d)
    return d


def _argv(base, extra, d: Path, out_dir: Path) -> list[str]:
    argv = [a.replace("{d}", str(d)) for a in [*base, *extra]]
    if not any(a.startswith("out_dir=") for a in argv):
        argv.append(f"out_dir={out_dir}")
    return argv


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _assert_no_outputs(argv: list[str], out_dir: Path) -> None:
    target = Path(next(a for a in argv if a.startswith("out_dir=")).split("=", 1)[1])
    for d in {out_dir, target}:
        assert not (d / "items.parquet").exists() and not (d / "steps.parquet").exists()
        assert not (d / ".parts").exists(), f"{d}/.parts left behind"
        assert not d.exists() or not any(d.iterdir()), f"{d} holds {sorted(p.name for p in d.iterdir())}"


def _params(cases):
    out = []
    for case in cases:
        marks = [pytest.mark.smollm2] if case[4] else []
        out.append(pytest.param(*case[1:4], id=case[0], marks=marks))
    return out


@pytest.mark.parametrize("base, extra, expected", _params(CASES))
def test_bad_input_is_one_line_and_writes_nothing(base, extra, expected, fixtures, tmp_path, capsys):
    out_dir = tmp_path / "out" / "cell"
    argv = _argv(base, extra, fixtures, out_dir)
    rc = cli.main(argv)
    err = capsys.readouterr().err
    last = _last_line(err)
    assert rc == 2, err[-3000:]
    assert last.startswith("kvcert-run: error: "), err[-3000:]
    assert expected.replace("{d}", str(fixtures)) in last, last
    _assert_no_outputs(argv, out_dir)


def test_partial_run_of_another_configuration_is_refused(fixtures, tmp_path, tmp_path_factory, capsys, monkeypatch):
    """An out_dir holding checkpoints of a different configuration is left untouched. The check comes after the
    model and the items are loaded, so a tiny GGUF model stands in for SmolLM2 (nothing is downloaded)."""
    from helpers.tiny_gguf import shared_kvcert_cache, shared_tiny_gguf

    tiny = shared_tiny_gguf(tmp_path_factory, "qwen2")
    monkeypatch.setenv("KVCERT_CACHE", str(shared_kvcert_cache(tmp_path_factory)))
    out_dir = tmp_path / "cell"
    (out_dir / ".parts").mkdir(parents=True)
    marker = out_dir / ".parts" / "identity.json"
    from kvcert.provenance import code_fingerprint

    marker.write_text(json.dumps({"config": {"n_items": 99}, "items_sha256": "x", "code_fingerprint": code_fingerprint()}))
    before = marker.read_text()
    rc = cli.main(_argv(RULER, ["model=gguf", f"model.path={tiny.path}"], fixtures, out_dir))
    last = _last_line(capsys.readouterr().err)
    assert rc == 2 and f"out_dir={out_dir} holds a partial run of a different configuration" in last
    assert marker.read_text() == before and sorted(p.name for p in out_dir.rglob("*")) == [".parts", "identity.json"]


@pytest.mark.smollm2
def test_context_above_window_is_truncated_with_truncate_middle(fixtures, tmp_path, capsys):
    """truncate=middle (the default) fits the prompt into max_context_tokens instead of failing."""
    import pandas as pd

    out_dir = tmp_path / "cell"
    rc = cli.main(_argv(RULER, ["max_context_tokens=60", "truncate=middle"], fixtures, out_dir))
    assert rc == 0, capsys.readouterr().err[-2000:]
    items = pd.read_parquet(out_dir / "items.parquet")
    assert len(items) == 4
    assert (items["context_tokens"] + 2 <= 60).all()  # prompt + max_new_tokens fit


# Rows also run through the installed console script in a fresh process (exit status of the process). A fresh
# process costs seconds (torch and transformers imported again): the first case runs in make test, the others,
# whose lines the in-process test above checks in make test too, in make test-full.
SUBPROCESS_CASES = ["budget-zero", "gguf-random-bytes", "jsonl-bad-line"]


def _console_params(cases):
    return [pytest.param(*p.values, marks=[*p.marks, *([pytest.mark.slow] if i else [])], id=p.id)
            for i, p in enumerate(_params(cases))]


def _console(name: str) -> list[str]:
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvcert.runner.cli"]


@pytest.mark.parametrize("base, extra, expected", _console_params([c for c in CASES if c[0] in SUBPROCESS_CASES]))
def test_console_script(base, extra, expected, fixtures, tmp_path):
    out_dir = tmp_path / "cell"
    argv = _argv(base, extra, fixtures, out_dir)
    proc = subprocess.run(_console("kvcert-run") + argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    last = _last_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last.startswith("kvcert-run: error: ") and expected.replace("{d}", str(fixtures)) in last, last
    _assert_no_outputs(argv, out_dir)


@pytest.mark.smollm2
@pytest.mark.slow  # make test-full: a fresh kvcert-run process (offline from its start), like the console cases above
def test_longbench_offline_without_path(tmp_path):
    """data=longbench with no data.path and no network: one line saying to set data.path (hermetic: offline)."""
    out_dir = tmp_path / "cell"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"), "HF_HUB_CACHE": str(tmp_path / "hf_hub")}
    argv = [*JSONL, "data=longbench", "n_items=2", f"out_dir={out_dir}"]
    proc = subprocess.run(_console("kvcert-run") + argv, capture_output=True, text=True, timeout=300, env=env)
    last = _last_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last.startswith("kvcert-run: error: LongBench subset 'narrativeqa' could not be fetched"), last
    assert "Set data.path to a local copy" in last
    _assert_no_outputs(argv, out_dir)
