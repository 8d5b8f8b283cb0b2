"""kvpress's SnapKV scores of one prompt, per layer: run in the peer environment (`make peers`), not kvcert's.

    python kvpress_snapkv_scores.py MODEL_DIR IDS.npy OUT.npz --settings 16:5 8:9

MODEL_DIR: a transformers checkpoint; IDS.npy: (1, n) int64 token ids. For each window:kernel setting, a
forward hook on every attention module calls ``SnapKVPress(window_size, kernel_size).score`` with what
kvpress's own hook hands it (the layer's input hidden states, the cache's keys and values, the attention
call's keyword arguments), after the layer has run over the whole prompt. OUT.npz holds one float64 array
per setting and layer, named ``w{window}_k{kernel}_layer{i}``, of shape (batch, kv_heads, n). Imports
nothing from kvcert: this environment holds kvpress and the transformers version it pins.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from kvpress import SnapKVPress
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
    arrays = {}
    for setting in args.settings:
        window, kernel = (int(x) for x in setting.split(":"))
        press = SnapKVPress(window_size=window, kernel_size=kernel)

        def hook(module, inputs, kwargs, output, window=window, kernel=kernel, press=press):
            keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
            scores = press.score(module, kwargs["hidden_states"], keys, values, None, kwargs)
            arrays[f"w{window}_k{kernel}_layer{module.layer_idx}"] = scores.double().numpy()
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
