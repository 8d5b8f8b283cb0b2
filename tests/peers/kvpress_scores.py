"""kvpress's scores of one prompt, per layer: run in the peer environment (`make peers`), not kvcert's.

    python kvpress_scores.py MODEL_DIR IDS.npy OUT.npz --settings 16:5 8:9

MODEL_DIR: a transformers checkpoint; IDS.npy: (1, n) int64 token ids. A forward hook on every attention
module calls the presses' ``score`` with what kvpress's own hook hands them (the layer's input hidden
states, the cache's keys and values, the attention call's keyword arguments), after the layer has run over
the whole prompt: ``SnapKVPress(window_size, kernel_size)`` for each window:kernel setting, ``TOVAPress`` and
``KnormPress``. OUT.npz holds one float64 array of shape (batch, kv_heads, n) per press and layer, named
``snapkv_w{window}_k{kernel}_layer{i}``, ``tova_layer{i}`` and ``knorm_layer{i}``. Imports nothing from
kvcert: this environment holds kvpress and the transformers version it pins.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from kvpress import CURPress, KeyDiffPress, KnormPress, LagKVPress, SnapKVPress, TOVAPress
from kvpress.utils import extract_keys_and_values
from transformers import AutoModelForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("ids")
    parser.add_argument("out")
    parser.add_argument("--settings", nargs="+", default=["16:5"], help="window:kernel pairs")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    ids = torch.from_numpy(np.load(args.ids))
    presses = {f"snapkv_w{w}_k{k}": SnapKVPress(window_size=int(w), kernel_size=int(k))
               for w, k in (setting.split(":") for setting in args.settings)}
    presses.update(tova=TOVAPress(), knorm=KnormPress())
    presses.update(presses_keydiff_lagkv_cur())
    arrays = {}

    def hook(module, inputs, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for name, press in presses.items():
            scores = press.score(module, kwargs["hidden_states"], keys, values, None, kwargs)
            arrays[f"{name}_layer{module.layer_idx}"] = scores.double().numpy()
        arrays.update(seeded_cur_scores(module, keys, values, kwargs))
        arrays.update(lagkv_live_channel_scores(module, keys, values, kwargs))
        return output

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    np.savez(args.out, **arrays)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# KeyDiff, LagKV and CUR (tests/test_peers.py's keydiff/lagkv/cur tests). Arrays, each (batch, kv_heads, n):
# ``keydiff_layer{i}``; ``lagkv_layer{i}`` (defaults: 4 sinks, lag 128), ``lagkv_lag32_cross_layer{i}`` (lag 32,
# cross_scoring), ``lagkv_lag600_layer{i}`` (a lag too long for the prompt: LagKV's no-compression ranking);
# ``cur_layer{i}`` (defaults), ``cur_global_kvavg_layer{i}`` (no local window, (k2 + v2) / 2) and
# ``cur_sketch20_layer{i}`` (use_random_leverage: a Gaussian (head_dim, 20) projection drawn right after
# ``torch.manual_seed(CUR_SKETCH_SEED + i)``); ``cur_sketch_seed`` holds CUR_SKETCH_SEED. Each partitioning LagKV
# array also comes as ``{name}_live_layer{i}``: its scores on the key and value channels that are not zero at every
# position (kvpress's min-max scaling divides 0 by 0 on an all-zero channel; see lagkv_live_channel_scores).
CUR_SKETCH_SEED = 1234


def presses_keydiff_lagkv_cur() -> dict:
    """The deterministic presses of this block, by array name prefix."""
    return {
        "keydiff": KeyDiffPress(),
        "lagkv": LagKVPress(),
        "lagkv_lag32_cross": LagKVPress(lag_size=32, cross_scoring=True),
        "lagkv_lag600": LagKVPress(lag_size=600),
        "cur": CURPress(),
        "cur_global_kvavg": CURPress(use_local_approximation=False, leverage_type="kv_avg"),
    }


def seeded_cur_scores(module, keys, values, kwargs) -> dict[str, np.ndarray]:
    """CURPress(use_random_leverage=True)'s scores of one layer, its projection drawn from a seeded global RNG."""
    torch.manual_seed(CUR_SKETCH_SEED + module.layer_idx)
    scores = CURPress(use_random_leverage=True).score(module, kwargs["hidden_states"], keys, values, None, kwargs)
    return {f"cur_sketch20_layer{module.layer_idx}": scores.double().numpy(),
            "cur_sketch_seed": np.asarray(CUR_SKETCH_SEED)}



def lagkv_live_channel_scores(module, keys, values, kwargs) -> dict[str, np.ndarray]:
    """Each partitioning LagKV press's scores of one layer, its spread computed by the press's own
    ``_get_states_score`` on the channels of each KV head's keys, and of its values, that are not zero at every
    position (the two can keep different channels, which ``score`` does not accept), then combined as ``score``
    does: the mean of the two, ranked within each partition unless cross_scoring, sinks and tail 1."""
    out = {}
    b, hk, n, _ = keys.shape
    for name, press in presses_keydiff_lagkv_cur().items():
        if not name.startswith("lagkv") or n < press.n_sink + 2 * press.lag_size:
            continue
        end = press.n_sink + ((n - press.n_sink) // press.lag_size) * press.lag_size
        scores = torch.ones((b, hk, n), dtype=torch.float64)
        for h in range(hk):
            spread = 0
            for states in (keys[:, h: h + 1], values[:, h: h + 1]):
                states = states[..., (states != 0).any(dim=-2)[0, 0]][:, :, press.n_sink: end]
                spread = spread + press._get_states_score(states.reshape(b, 1, -1, press.lag_size, states.shape[-1]))
            spread = spread / 2
            if not press.cross_scoring:
                spread = spread.argsort(dim=-1).argsort(dim=-1) / press.lag_size
            scores[:, h, press.n_sink: end - press.lag_size] = spread.reshape(b, -1).double()
        out[f"{name}_live_layer{module.layer_idx}"] = scores.numpy()
    return out

if __name__ == "__main__":
    raise SystemExit(main())
