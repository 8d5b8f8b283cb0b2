"""kvcert against peer libraries whose version pins clash with kvcert's, each run in the peer environment.

kvpress 0.5.5 (NVIDIA's KV-cache compression library) pins transformers<5.3, so it cannot share kvcert's
environment: `make peers` installs it into its own (.venv-peers, or the Python named by KVCERT_PEER_PYTHON),
and tests/peers/kvpress_scores.py computes its scores there, on the same checkpoint and token ids, through
kvpress's own presses' ``score``. Per layer and KV head, for every key of the prompt:

* SnapKV (Li et al., 2024): kvcert's ``snapkv`` gives kvpress's scores for every key before the observation
  window except the kernel_size // 2 keys just before it. There the two differ by design: kvpress pools
  only over the keys before the window (zero padding at its end), kvcert over all keys, so kvcert's score of
  such a key also averages in the window keys inside its pooling kernel; the test checks that difference
  too, computed from kvcert's window attention. The window keys: kvpress scores them above every other key;
  kvcert keeps its recent window (32 keys by default) with certainty.
* TOVA (Oren et al., 2024): ``tova`` with ``heads: all`` gives kvpress's scores for every key but the last,
  which kvpress scores above every other key (kvcert's recent window keeps it). The default, ``heads:
  kv_group``, averages per KV head instead and must differ.
* Knorm (Devoto et al., 2024): kvcert scores 1 / ||k||, kvpress -||k||: the same order, checked as the exact
  relation between the two.
* KeyDiff (Park et al., 2025): kvcert scores 1 - cos(k, anchor), kvpress -cos(k, anchor): checked as kvcert =
  1 + kvpress (the shift keeps the Poisson design's scores non-negative; the order is the same).
* LagKV (Liang et al., 2025): equal for every key, with the default options, with lag 32 and cross_scoring, and
  with a lag too long for the prompt (LagKV then ranks by recency after the sinks), in every layer whose keys and
  values have no channel that is zero at every position. Gemma 3 has such key channels in some layers (a zero
  weight of its key norm): kvpress's min-max scaling divides 0 by 0 there, so its cross_scoring scores are NaN
  (checked) and its ranks an order of NaNs; kvcert leaves a channel without range out of the spread, and equals
  what kvpress's own spread (its ``_get_states_score``) gives on the other channels, combined as its ``score``
  combines it (tests/peers/kvpress_scores.py).
* CUR (CurDKV, Sengupta et al., 2025): equal for every key after the first 4, with the default options and with
  no local window and leverage kv_avg. kvpress overwrites its 4 sink keys' scores with 1 (checked); kvcert
  leaves the sinks to the design, which keeps its n_sink (4 by default) first keys with certainty. The sketched
  variant (kvpress's use_random_leverage, kvcert's sketch_dimension: 20) draws its projection at random: kvcert's
  with a generator seeded s equals kvpress's after torch.manual_seed(s) (the same draw), checked with one seed
  per layer, and differs from the unsketched scores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvcert
from kvcert.policies import get_policy
from kvcert.theory import passkey_prompt

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = Path(os.environ.get("KVCERT_PEER_PYTHON") or ROOT / ".venv-peers" / "bin" / "python")
KVPRESS_SCORES = ROOT / "tests" / "peers" / "kvpress_scores.py"
# float32 scores from the same operations in another transformers version: rounding only
RTOL, ATOL = 1e-5, 1e-9

# model, filler paragraphs of the prompt, (observation window, pooling kernel) pairs. Gemma 3's prompt stays
# shorter than its sliding window (512): beyond it, transformers' sliding-window cache hands kvpress only the
# last 511 keys of a sliding layer, while kvcert keeps every key and masks the ones outside the window.
CASES = [
    pytest.param(("smollm2", 40, [(16, 5), (8, 9)]), marks=pytest.mark.smollm2, id="smollm2"),
    pytest.param(("gemma3", 16, [(16, 5)]), marks=pytest.mark.slow, id="gemma3"),
]


@pytest.fixture(scope="module")
def peer_python() -> Path:
    if not PEER_PYTHON.is_file():
        pytest.fail(f"{PEER_PYTHON}: no peer environment; run `make peers` (or set KVCERT_PEER_PYTHON)")
    return PEER_PYTHON


def kvpress_scores(peer_python: Path, model, ids: torch.Tensor, settings, tmp_path: Path) -> dict[str, np.ndarray]:
    """kvpress's scores of ``ids`` (1, n), from the peer environment: {"snapkv_w{window}_k{kernel}_layer{i}" for
    each (window, kernel) in ``settings``, "tova_layer{i}", "knorm_layer{i}": (1, kv_heads, n) float64}."""
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    np.save(tmp_path / "ids.npy", ids.numpy())
    out = tmp_path / "kvpress_scores.npz"
    command = [str(peer_python), str(KVPRESS_SCORES), str(checkpoint), str(tmp_path / "ids.npy"), str(out),
               "--settings", *(f"{w}:{k}" for w, k in settings)]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing of kvcert's there
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    finally:
        shutil.rmtree(checkpoint)  # up to a GB of float32 weights
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as arrays:
        return dict(arrays)


@pytest.fixture(scope="module", params=CASES)
def compared(request, peer_python, tmp_path_factory):
    """(model name, model, ids (1, n), settings, kvpress's scores) of one case, kvpress run once per model."""
    model_name, n_noise, settings = request.param
    model, tokenizer = kvcert.load_model(model_name)
    context, question, _ = passkey_prompt(n_noise=n_noise, n_needles=4, seed=0)
    ids = tokenizer(context + question, return_tensors="pt").input_ids
    sliding = getattr(model.config, "sliding_window", None)
    assert sliding is None or ids.shape[-1] < sliding, "the prompt must stay within the sliding window (see CASES)"
    peer = kvpress_scores(peer_python, model, ids, settings, tmp_path_factory.mktemp(model_name))
    assert sys.executable != str(peer_python)  # the peer ran in its own environment, not kvcert's
    return model_name, model, ids, settings, peer


def pooled_window_share(view, window: int, kernel: int) -> np.ndarray:
    """What kvcert's pooling adds to the keys just before the window: per KV head, the window keys' attention
    (averaged over the window queries) inside each such key's kernel, / kernel, averaged over the query heads
    of the KV head. (batch, kv_heads, kernel // 2) float64, for keys n - window - kernel // 2 ... n - window - 1."""
    attention = view.window_attention().mean(dim=2).double()  # (b, q_heads, n)
    n = attention.shape[-1]
    half = kernel // 2
    shares = [attention[..., n - window: min(n, j + half + 1)].sum(-1) / kernel
              for j in range(n - window - half, n - window)]
    return view.group_mean(torch.stack(shares, dim=-1)).numpy()  # (b, q_heads, half) -> (b, kv_heads, half)


def test_snapkv_scores_equal_kvpress(compared):
    model_name, model, ids, settings, peer = compared
    n, layers = ids.shape[-1], model.config.num_hidden_layers
    for window, kernel in settings:
        state = kvcert.prefill(model, ids, observation_window=window,
                               policy_options={"snapkv": {"kernel_size": kernel}})
        ours = state.scores("snapkv")
        views = state.layer_views()
        assert len(ours) == layers
        edge = n - window - kernel // 2  # the first key whose kernel reaches into the window
        for i in range(layers):
            theirs, mine = peer[f"snapkv_w{window}_k{kernel}_layer{i}"], ours[i].double().numpy()
            assert mine.shape == theirs.shape == (1, model.config.num_key_value_heads, n)
            np.testing.assert_allclose(mine[..., :edge], theirs[..., :edge], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{model_name} layer {i}, window {window}, kernel {kernel}")
            extra = pooled_window_share(views[i], window, kernel)
            assert (extra > 0).all()  # the difference below is there, not an artefact of equal numbers
            # a difference of two float32 scores: its rounding is relative to the scores, not to the difference
            mine_edge, theirs_edge = mine[..., edge: n - window], theirs[..., edge: n - window]
            tolerance = RTOL * np.maximum(np.abs(mine_edge), np.abs(theirs_edge)) + ATOL
            assert (np.abs(mine_edge - theirs_edge - extra) <= tolerance).all(), (
                f"{model_name} layer {i}, window {window}, kernel {kernel}: keys before the window differ by "
                f"{(mine_edge - theirs_edge).ravel().tolist()}, not by {extra.ravel().tolist()}")
            # kvpress puts the window keys above every other key
            assert (theirs[..., n - window:] > theirs[..., : n - window].max(-1, keepdims=True)).all()


def test_tova_over_all_heads_equals_kvpress(compared):
    model_name, model, ids, _, peer = compared
    n, hk = ids.shape[-1], model.config.num_key_value_heads
    state = kvcert.prefill(model, ids, policy_options={"tova": {"heads": "all"}})
    per_group_tova = get_policy("tova")  # the default, heads: kv_group, on the same prefill
    for i, (mine, view) in enumerate(zip(state.scores("tova"), state.layer_views())):
        theirs, mine = peer[f"tova_layer{i}"], mine.double().numpy()
        per_group = per_group_tova.score(view).double().numpy()
        assert mine.shape == theirs.shape == (1, hk, n)
        np.testing.assert_allclose(mine[..., :-1], theirs[..., :-1], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{model_name} layer {i}")
        assert (theirs[..., -1] > theirs[..., :-1].max(-1)).all()  # kvpress keeps the last key above all
        if hk > 1:  # with one KV head both means are the same
            assert np.abs(per_group - mine).max() > 1e-6, f"{model_name} layer {i}: heads=kv_group == heads=all"


def test_knorm_is_the_reciprocal_of_kvpress(compared):
    model_name, model, ids, _, peer = compared
    state = kvcert.prefill(model, ids)
    for i, mine in enumerate(state.scores("knorm")):
        theirs = peer[f"knorm_layer{i}"]  # -||k||
        assert mine.shape == theirs.shape and (theirs < 0).all()
        np.testing.assert_allclose(mine.double().numpy(), -1.0 / theirs, rtol=RTOL, atol=0,
                                   err_msg=f"{model_name} layer {i}")


# ------------------------------------------------------------------------------------------------ KeyDiff, LagKV, CUR


def test_keydiff_is_one_plus_kvpress(compared):
    model_name, model, ids, _, peer = compared
    state = kvcert.prefill(model, ids)
    for i, mine in enumerate(state.scores("keydiff")):
        theirs = peer[f"keydiff_layer{i}"]  # -cos(k, anchor), in [-1, 1]
        assert mine.shape == theirs.shape and (mine >= 0).all()
        # rounding is relative to the cosine (|cos| <= 1), not to the shifted score, which can be near 0
        np.testing.assert_allclose(mine.double().numpy() - 1.0, theirs, rtol=RTOL, atol=RTOL,
                                   err_msg=f"{model_name} layer {i}")
        assert np.ptp(theirs) > 0.1  # the keys' directions do differ: the relation is not met by constants


LAGKV_CASES = {"lagkv": {}, "lagkv_lag32_cross": {"lag_size": 32, "cross_scoring": True},
               "lagkv_lag600": {"lag_size": 600}}


def test_lagkv_equals_kvpress(compared):
    model_name, model, ids, _, peer = compared
    n = ids.shape[-1]
    assert 4 + 2 * 128 <= n < 4 + 2 * 600  # the default lag scores some partitions, lag 600 none
    views = kvcert.prefill(model, ids).layer_views()
    dead_layers = []
    for i, view in enumerate(views):
        dead = [bool(((x == 0).all(dim=-2)).any()) for x in (view.keys, view.values)]  # an all-zero channel
        dead_layers += [i] if any(dead) else []
        for name, options in LAGKV_CASES.items():
            mine, theirs = get_policy("lagkv", **options).score(view).double().numpy(), peer[f"{name}_layer{i}"]
            assert mine.shape == theirs.shape
            message = f"{model_name} layer {i}, {name}"
            if any(dead) and name == "lagkv_lag32_cross":
                assert np.isnan(theirs).any(), message  # 0 / 0 in kvpress's min-max scaling
            if any(dead) and name != "lagkv_lag600":
                # the dead channels have no range in any partition: kvcert leaves them out, as removing them does
                theirs = peer[f"{name}_live_layer{i}"]
            np.testing.assert_allclose(mine, theirs, rtol=RTOL, atol=ATOL, err_msg=message)
            assert len(np.unique(mine)) > 10  # partitions were ranked (or the recency ramp applied)
    assert bool(dead_layers) == (model_name == "gemma3"), dead_layers  # the difference above is exercised


CUR_CASES = {"cur": {}, "cur_global_kvavg": {"local_window_size": None, "leverage": "kv_avg"}}
KVPRESS_CUR_SINKS = 4


def test_cur_equals_kvpress_after_its_sinks(compared):
    model_name, model, ids, _, peer = compared
    sinks = KVPRESS_CUR_SINKS
    views = kvcert.prefill(model, ids).layer_views()
    seed = int(peer["cur_sketch_seed"])
    for name, options in {**CUR_CASES, "cur_sketch20": {"sketch_dimension": 20}}.items():
        policy = get_policy("cur", **options)
        for i, view in enumerate(views):
            generator = torch.Generator().manual_seed(seed + i)  # kvpress drew after torch.manual_seed(seed + i)
            mine, theirs = policy.score(view, generator).double().numpy(), peer[f"{name}_layer{i}"]
            assert mine.shape == theirs.shape
            np.testing.assert_allclose(mine[..., sinks:], theirs[..., sinks:], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{model_name} layer {i}, {name}")
            assert (theirs[..., :sinks] == 1.0).all() and (mine[..., :sinks] < 1.0).all()
            np.testing.assert_allclose(mine.sum(-1), 1.0, rtol=1e-5)
            if name == "cur_sketch20":  # the projection changes the scores: the equality above is the same draw's
                assert np.abs(mine - get_policy("cur").score(view).double().numpy()).max() > 1e-6
