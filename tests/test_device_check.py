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
from kvcert.scales import scales_folder

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_dtype_is_the_paper_scales():
    scale = yaml.safe_load((scales_folder(ROOT) / "paper.yaml").read_text())
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


@pytest.mark.slow  # SmolLM2 in two dtypes against the float32 reference, several decodes: make test-full
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


def test_a_model_that_cannot_be_loaded_is_one_line(capsys):
    """``--model`` with nothing to load: one line naming the option, exit status 2 (the stand-in itself is checked
    end to end through ``make device-check-standin``, below)."""
    assert device_check.main(["--model", "hf:", "--prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvcert-device-check: --model hf:"), err


@pytest.mark.smollm2
@pytest.mark.long  # two loads of a Llama-3.1-8B-shaped stand-in (its 128k-token embedding): make test-long
def test_the_standin_target_runs_both_checks(tmp_path):
    """``make device-check-standin``, what a GPU node without network runs (docs/cluster.md): the stand-in with
    Llama-3.1-8B's heads (one layer here) built from a carried tokenizer, then the device check through the PyTorch
    path and again with KVCERT_TRITON=1 (on this CPU that selects no Triton kernel: its header says which path
    ran). Two full tables, the numerics lines passing in both; the exit status is 1 only if a line fails (the
    overhead line compares wall-clock times on a shared machine)."""
    import os
    import subprocess
    import sys

    from kvcert import load_tokenizer

    load_tokenizer("smollm2").save_pretrained(tmp_path / "tokenizer")
    done = subprocess.run(["make", "-s", "device-check-standin", f"NODE_PYTHON={sys.executable}", "STANDIN_LAYERS=1",
                           f"STANDIN_DIR={tmp_path / 'standins'}", f"CARRY_TOKENIZER={tmp_path / 'tokenizer'}",
                           "DEVICE_CHECK_ARGS=--prompts 1 --new-tokens 2 --reps 1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})  # no GPU, no Triton
    out = done.stdout
    headers = [line for line in out.splitlines() if line.startswith("kvcert-device-check: hf:")]
    assert len(headers) == 2 and all(f"{tmp_path / 'standins'}/models/llama in bfloat16" in h for h in headers), out
    for name in ("outputs", "certificates", "coverage", "error"):
        verdicts = [line for line in out.splitlines() if line.startswith(name + " ")]
        assert len(verdicts) == 2 and all(v.endswith("PASS") for v in verdicts), out
    assert done.returncode == (1 if " FAIL" in out else 0), done.stderr[-2000:]
