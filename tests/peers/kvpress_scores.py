"""kvpress's scores of one prompt, per layer: run in the peer environment (`make peers`), not kvcert's.

    python kvpress_scores.py MODEL_DIR IDS.npy OUT.npz --settings 16:5 8:9

MODEL_DIR: a transformers checkpoint, loaded in float64 (its weights promoted exactly); IDS.npy: (1, n) int64
token ids. A forward hook on every attention module calls the presses' ``score`` with what kvpress's own hook
hands them (the layer's input hidden states, the cache's keys and values, the attention call's keyword
arguments), after the layer has run over the whole prompt: ``SnapKVPress(window_size, kernel_size)`` for each
window:kernel setting, ``TOVAPress``, ``KnormPress`` and the presses of the blocks below. OUT.npz holds one
float64 array of shape (batch, kv_heads, n) per press and layer, named ``snapkv_w{window}_k{kernel}_layer{i}``,
``tova_layer{i}``, ``knorm_layer{i}`` and so on. Imports nothing from kvcert: this environment holds kvpress and
the transformers version it pins.

Why float64: a float32 forward pass in this transformers version and in kvcert's is no reference for a score's
definition. On one CI machine the two float32 runs of the same checkpoint and ids gave keys whose norms differ by
up to 1.0e-4 (relative) already in SmolLM2's first layer and SnapKV scores by up to 2.7e-4, while the float64
runs of ExpectedAttention agreed to the tests' 1e-5 there. In float64 what is left is the presses' own float32
arithmetic (a softmax taken in float32, a linear system cast to float32), which the blocks below keep at float64
where it matters.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import numpy as np
import torch
from kvpress import CapPress, CURPress, KeyDiffPress, KnormPress, LagKVPress, SnapKVPress, TOVAPress
from kvpress.utils import extract_keys_and_values, get_prerope_key_states
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("ids")
    parser.add_argument("out")
    parser.add_argument("--settings", nargs="+", default=["16:5"], help="window:kernel pairs")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float64, attn_implementation="sdpa")
    model.eval()
    ids = torch.from_numpy(np.load(args.ids))
    presses = {f"snapkv_w{w}_k{k}": SnapKVPress(window_size=int(w), kernel_size=int(k))
               for w, k in (setting.split(":") for setting in args.settings)}
    presses.update(tova=TOVAPress(), knorm=KnormPress())
    presses.update(expected_and_critical_presses(model))
    presses.update(presses_keydiff_lagkv_cur())
    presses.update(cap=InFloat64(CapPress()))  # needs the rotary embedding expected_and_critical_presses attaches
    arrays = {}

    def hook(module, inputs, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for name, press in presses.items():
            scores = press.score(module, kwargs["hidden_states"], keys, values, None, kwargs)
            arrays[f"{name}_layer{module.layer_idx}"] = scores.double().numpy()
        arrays.update(seeded_cur_scores(module, keys, values, kwargs))
        arrays.update(lagkv_live_channel_scores(module, keys, values, kwargs))
        arrays.update(leverage_scores(module, keys, kwargs))
        return output

    run_hooked(model, ids, [hook], extra=allocator_hooks(model, arrays))
    arrays.update(observed_attention_scores(args.model_dir, ids))
    np.savez(args.out, **arrays)
    return 0


class InFloat64:
    """A press whose ``score`` runs under KeptInFloat64, on one thread as CapPress needs (one_thread)."""

    def __init__(self, press):
        self.press = press

    def score(self, *args):
        with one_thread(), KeptInFloat64():
            return self.press.score(*args)


@contextmanager
def one_thread():
    """torch on one thread inside: this torch's batched linalg.solve fails (lu_solve pivots) on Gemma 3's 256-dim
    values when run on 2 threads (CapPress's linear system); on one it solves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

# ---------------------------------------------------------------------------- budget allocators
# kvpress's AdaKVPress (over SnapKVPress) and PyramidKVPress at each compression ratio: their per-head kept counts.
# AdaKV masks the evicted keys (module.masked_key_indices) instead of dropping them, so a head keeps the prompt's
# keys less its masked ones; PyramidKV drops them, so a layer keeps what its compress returns. OUT.npz gains
# ``adakv_cr{ratio}_layer{i}`` (batch, kv_heads) int64 kept counts and ``adakv_scores_layer{i}`` (batch, kv_heads, n)
# float64, the inner press's scores they were ranked by; ``pyramidkv_cr{ratio}_layer{i}`` (batch, kv_heads) int64.
ALLOCATOR_RATIOS = (0.25, 0.5, 0.75)
ADAKV_INNER = {"window_size": 16, "kernel_size": 5}  # the SnapKVPress AdaKVPress pools
ADAKV_ALPHA = 0.2
PYRAMIDKV = {"window_size": 64, "kernel_size": 5, "beta": 20}


def allocator_hooks(model, arrays: dict) -> list:
    """Forward hooks on every attention module that record the allocators' kept counts in ``arrays``."""
    from kvpress import AdaKVPress, CriticalAdaKVPress, PyramidKVPress

    def hook(module, inputs, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        batch, kv_heads, n = keys.shape[:3]
        hidden = kwargs["hidden_states"]
        for ratio in ALLOCATOR_RATIOS:
            adakv = AdaKVPress(SnapKVPress(compression_ratio=ratio, **ADAKV_INNER), alpha_safeguard=ADAKV_ALPHA)
            arrays[f"adakv_scores_layer{module.layer_idx}"] = adakv.press.score(
                module, hidden, keys, values, None, kwargs).double().numpy()
            adakv.compress(module, hidden, keys, values, None, kwargs)
            arrays[f"adakv_cr{ratio}_layer{module.layer_idx}"] = masked_kept_counts(module, batch, kv_heads, n)
            pyramid = PyramidKVPress(compression_ratio=ratio, **PYRAMIDKV)
            kept_keys, _ = pyramid.compress(module, hidden, keys, values, None, kwargs)
            arrays[f"pyramidkv_cr{ratio}_layer{module.layer_idx}"] = np.full((batch, kv_heads), kept_keys.shape[2])
            critical = CriticalAdaKVPress(SnapKVPress(compression_ratio=ratio, **ADAKV_INNER),
                                          alpha_safeguard=ADAKV_ALPHA)
            critical.compress(module, hidden, keys, values, None, kwargs)
            arrays[f"criticaladakv_cr{ratio}_layer{module.layer_idx}"] = masked_kept_counts(module, batch, kv_heads, n)
        return output

    return [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]


def masked_kept_counts(module, batch: int, kv_heads: int, n: int) -> np.ndarray:
    """(batch, kv_heads) int64: the keys a head-wise press left unmasked (its module.masked_key_indices), which are
    then cleared so that the next call of this layer does not mask."""
    batch_index, head_index, _ = module.masked_key_indices
    masked = torch.zeros(batch, kv_heads, dtype=torch.int64)
    masked.index_put_((batch_index, head_index), torch.ones_like(head_index), accumulate=True)
    module.masked_key_indices = None
    return (n - masked).numpy()


# --- ExpectedAttention, CriticalKV, ObservedAttention -------------------------------------------------------
# ``expected_attention_layer{i}``: ExpectedAttentionPress() with its defaults; ``criticalkv_layer{i}``:
# CriticalKVPress(SnapKVPress(window_size=16, kernel_size=5), first_stage_ratio=0) (the re-weighted scores
# alone); ``criticalkv_two_stage_layer{i}``: the same at compression_ratio 0.5 with the default first stage
# (0.5); ``observed_attention_layer{i}``: ObservedAttentionPress on the attention weights of an eager run.


class LayerRotary(torch.nn.Module):
    """The model's rotary embedding for one layer: kvpress calls ``module.rotary_emb(x, position_ids)``, and
    Gemma 3's (one table per layer type) needs the layer's type, which the model's own forward passes."""

    def __init__(self, rotary: torch.nn.Module, layer_type: str | None):
        super().__init__()
        self.rotary, self.layer_type = rotary, layer_type

    def forward(self, x, position_ids):
        if self.layer_type is None:
            return self.rotary(x, position_ids)
        return self.rotary(x, position_ids, self.layer_type)


def expected_and_critical_presses(model) -> dict:
    """ExpectedAttention and CriticalKV presses; gives every attention module the rotary embedding that
    kvpress's own hook would attach (bound to the layer's type where the model has several)."""
    import inspect

    from kvpress import CriticalKVPress, ExpectedAttentionPress

    rotary = model.model.rotary_emb
    typed = "layer_type" in inspect.signature(rotary.forward).parameters
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = LayerRotary(rotary, layer.self_attn.config.layer_types[layer.self_attn.layer_idx]
                                                 if typed else None)
    return {
        "expected_attention": ExpectedAttentionPress(),
        "criticalkv": CriticalKVPress(SnapKVPress(window_size=16, kernel_size=5), first_stage_ratio=0.0),
        "criticalkv_two_stage": CriticalKVPress(SnapKVPress(compression_ratio=0.5, window_size=16, kernel_size=5)),
    }


def observed_attention_scores(model_dir: str, ids: torch.Tensor) -> dict[str, np.ndarray]:
    """ObservedAttentionPress's scores per layer, from the attention weights of an eager run of the model loaded
    again in float64 (what its hook needs), {"observed_attention_layer{i}": (batch, kv_heads, n) float64}."""
    from kvpress import ObservedAttentionPress

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    press, arrays = ObservedAttentionPress(), {}

    def hook(module, inputs, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        scores = press.score(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
        arrays[f"observed_attention_layer{module.layer_idx}"] = scores.double().numpy()
        return output

    run_hooked(model, ids, [hook])
    return arrays


def run_hooked(model, ids: torch.Tensor, hooks: list, extra: list | None = None) -> None:
    """One forward pass of ``ids`` with each of ``hooks`` on every attention module (and the already registered
    handles ``extra``), every handle removed afterwards."""
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for hook in hooks
               for layer in model.model.layers] + list(extra or [])
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()


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
    """CURPress(use_random_leverage=True)'s scores of one layer, its projection drawn from a seeded global RNG (in
    float32, as kvcert draws it: SameDraws)."""
    torch.manual_seed(CUR_SKETCH_SEED + module.layer_idx)
    with SameDraws():
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

# ----------------------------------------------------------------------------------------------------------------
# Cap and LeverageScore (tests/test_peers.py's block of that name). Arrays, each (batch, kv_heads, n): ``cap_layer{i}``
# (CapPress() with its defaults, its linear system kept at float64 by InFloat64; needs the rotary embedding
# expected_and_critical_presses attaches); ``leverage_layer{i}`` (LeverageScorePress() with its defaults, its sketch
# drawn right after ``torch.manual_seed(LEVERAGE_SEED + i)``, its ridge system solved in float32 as kvpress casts
# it) and ``leverage_float64_layer{i}`` (the same with that cast kept at float64); ``leverage_seed`` holds
# LEVERAGE_SEED.
LEVERAGE_SEED = 4321


def leverage_scores(module, keys, kwargs) -> dict[str, np.ndarray]:
    """(Seeded) LeverageScorePress's scores of one layer, as kvpress computes them and in float64."""
    from kvpress import LeverageScorePress

    hidden, i = kwargs["hidden_states"], module.layer_idx
    torch.manual_seed(LEVERAGE_SEED + i)
    with SameDraws():
        leverage = LeverageScorePress().score(module, hidden, keys, None, None, kwargs)
    out = {f"leverage_layer{i}": leverage.double().numpy(), "leverage_seed": np.asarray(LEVERAGE_SEED)}
    torch.manual_seed(LEVERAGE_SEED + i)  # LeverageScorePress.score's body, its cast to float32 kept at float64
    prerope, press = get_prerope_key_states(module, hidden), LeverageScorePress()
    with KeptInFloat64():
        leverage = press.compute_leverage_scores(prerope, press.sketch_dimension)
    out[f"leverage_float64_layer{i}"] = ((leverage - leverage.mean()) / leverage.std().clamp_min(1e-6)).numpy()
    return out


class SameDraws(TorchFunctionMode):
    """A float64 ``torch.randn`` draws what the float32 one would (the same seeded normals, promoted), so that a
    sketch drawn in this float64 run is the one kvcert draws (in float32) from a generator with the same seed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.randn and kwargs.get("dtype") == torch.float64:
            return func(*args, **{**kwargs, "dtype": torch.float32}).double()
        return func(*args, **kwargs)


class KeptInFloat64(SameDraws):
    """kvpress's code with its arithmetic in float64 on float64 inputs: SameDraws, and a cast to float32 keeps a
    float64 tensor as it is. Lets a test compare kvcert with kvpress's definition apart from kvpress's float32
    rounding, without a copy of kvpress's code."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args[0].dtype == torch.float64:
            if torch.float32 in (*args[1:], kwargs.get("dtype")):  # a cast to float32: kept at float64
                return args[0]
        return super().__torch_function__(func, types, args, kwargs)


if __name__ == "__main__":
    raise SystemExit(main())
