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
from kvpress import KnormPress, SnapKVPress, TOVAPress
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
    arrays = {}

    def hook(module, inputs, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for name, press in presses.items():
            scores = press.score(module, kwargs["hidden_states"], keys, values, None, kwargs)
            arrays[f"{name}_layer{module.layer_idx}"] = scores.double().numpy()
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


if __name__ == "__main__":
    raise SystemExit(main())
