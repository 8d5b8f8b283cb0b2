"""``kvcert-device-check``: the command a cluster user runs first, run here on the CPU (bfloat16, the paper
scale's dtype), and its verdict logic on made-up numbers (our own logic: the numbers say so)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from kvcert import device_check
from kvcert.device_check import BOUNDS, PAPER_DTYPE, Run, checks

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_dtype_is_the_paper_scales():
    scale = yaml.safe_load((ROOT / "workflow" / "scales" / "paper.yaml").read_text())
    dtypes = {o.split("=", 1)[1] for overrides in scale["models"].values() for o in overrides
              if o.startswith("model.dtype=")}
    assert dtypes == {PAPER_DTYPE}


def _run(rel_cert: float, rel_err: float, coverage: float, tokens: list[int], logprob: float) -> Run:
    steps = pd.DataFrame({"rel_cert": [rel_cert] * 4, "rel_err": [rel_err] * 4,
                          "coverage": [1.0] * int(coverage * 4) + [0.0] * (4 - int(coverage * 4))})
    return Run([tokens], [np.asarray([logprob])], [steps])


def test_each_bound_fails_its_own_line():
    """Made-up runs: the reference, a device run within every bound, and one run per bound broken."""
    bounds = BOUNDS["bfloat16"]
    reference = _run(0.2, 0.05, 1.0, [1, 2, 3], -0.5)
    good = checks(_run(0.21, 0.052, 1.0, [1, 2, 3], -0.6), reference, bounds, 1.1, (10.0, 20.0))
    assert all(line[4] for line in good), good
    broken = {
        "tokens": checks(_run(0.2, 0.05, 1.0, [1, 9, 3], -0.5), reference, bounds, 1.1, (10.0, 20.0)),
        "outputs": checks(_run(0.2, 0.05, 1.0, [1, 2, 3], -0.5 - 2 * bounds.logprob), reference, bounds, 1.1,
                          (10.0, 20.0)),
        "certificates": checks(_run(0.2 * 2 * bounds.ratio, 0.05, 1.0, [1, 2, 3], -0.5), reference, bounds, 1.1,
                               (10.0, 20.0)),
        "error": checks(_run(0.2, 0.05 / (2 * bounds.ratio), 1.0, [1, 2, 3], -0.5), reference, bounds, 1.1,
                        (10.0, 20.0)),
        "coverage": checks(_run(0.2, 0.05, 0.75, [1, 2, 3], -0.5), reference, bounds, 1.1, (10.0, 20.0)),
        "overhead": checks(reference, reference, bounds, bounds.overhead + 0.1, (10.0, 20.0)),
        "memory": checks(reference, reference, bounds, 1.1, (bounds.memory * 1000.0 + 65.0, 1000.0)),
    }
    for name, lines in broken.items():
        failed = [line[0] for line in lines if not line[4]]
        assert failed == [name], (name, lines)


@pytest.mark.smollm2
def test_the_command_passes_on_this_machine(capsys):
    """The real command, shortened (one prompt in both settings, four tokens, one timing round): every line is
    printed with its verdict, and on this machine every verdict is PASS except, possibly, the overhead line: it
    compares wall-clock times, which tests never assert (another job on the machine moves them), so there the
    test asserts only that a measured ratio and its verdict are printed and that the command's exit status and
    last line follow the verdicts."""
    rc = device_check.main(["--prompts", "1", "--new-tokens", "4", "--reps", "1"])
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.endswith(("PASS", "FAIL"))}
    assert set(lines) >= {"tokens", "outputs", "certificates", "coverage", "error", "overhead", "memory"}, out
    assert "bfloat16 on cpu" in out and "certified attention: pytorch" in out
    assert all(line.endswith("PASS") for name, line in lines.items() if name != "overhead"), out
    assert re.search(r"d/c \d+\.\d+", lines["overhead"]), out
    passed = lines["overhead"].endswith("PASS")
    assert rc == (0 if passed else 1), out
    assert out.rstrip().endswith("kvcert-device-check: PASS" if passed else "kvcert-device-check: FAIL (overhead)"), out


@pytest.mark.smollm2
def test_the_command_checks_a_standin_model(tmp_path, capsys):
    """``--model hf:<dir>``: the check a GPU node without network runs on a stand-in built there, here a small
    Llama-shaped one in bfloat16 on the CPU against its own float32 reference. Every line gets a verdict, the
    numerics lines pass (the overhead line compares wall-clock times: see the test above), and a model that
    cannot be loaded is refused in one line, exit status 2."""
    from kvcert import load_tokenizer
    from kvcert.standins import build_model

    standin = build_model("llama", tmp_path / "llama", load_tokenizer("smollm2"), layers=2, kv_heads=2, head_dim=32)
    rc = device_check.main(["--model", f"hf:{standin}", "--prompts", "1", "--new-tokens", "4", "--reps", "1"])
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.endswith(("PASS", "FAIL"))}
    assert f"hf:{standin} in bfloat16 on cpu" in out
    assert set(lines) >= {"tokens", "outputs", "certificates", "coverage", "error", "overhead", "memory"}, out
    assert all(lines[name].endswith("PASS") for name in ("outputs", "certificates", "coverage", "error")), out
    assert rc in (0, 1)
    assert device_check.main(["--model", "hf:", "--prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvcert-device-check: --model hf:"), err
