"""kvpress's side of benchmarks/press_vs_kvpress.py, run in the peer environment (`make peers`), and the measurement
both sides share.

    PEER_PYTHON benchmarks/kvpress_worker.py MODEL_DIR THREADS

Loads MODEL_DIR (a transformers checkpoint: the bundled SmolLM2's converted safetensors) in float32, then answers
requests, one JSON object per line on stdin, one per line on stdout:
{"ids": [...], "press": "snapkv" | "knorm", "ratio": r, "max_new_tokens": n} -> what ``measure`` returns, plus
"tokens" (the generated ids); "ids" as a list of equally long lists is a batch (one row each, no padding), and
"tokens" then holds one list per row. kvpress's press wraps stock ``model.generate`` (``with press(model): ...``). An
empty line or end of input ends the worker. Imports nothing from kvcert: ``measure`` is imported by the kvcert
side too, so both time and size their runs with the same code.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import sys
import threading
import time

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """The process's resident set size now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the system (glibc), so that a run's RSS starts low."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRss:
    """The largest RSS seen by a thread sampling every ``period`` seconds while the block runs."""

    def __init__(self, period: float = 0.001):
        self.period, self.peak, self._stop = period, 0, threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period)

    def __enter__(self) -> PeakRss:
        self.start = rss_bytes()
        self.peak = self.start
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


class Stamps:
    """A ``generate`` streamer that only records when each put arrives (the prompt first, then each new token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def cache_bytes(cache) -> int:
    """Bytes a cache holds allocated after generation: kvcert's buffers with their spare capacity and per-slot
    log π, offset and positions; else each layer's keys and values."""
    total = 0
    for layer in cache.layers:
        buffers = getattr(layer, "_buffers", None)
        tensors = buffers if buffers is not None else (layer.keys, layer.values)
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


@torch.no_grad()
def measure(model, ids: list[int] | list[list[int]], max_new_tokens: int, press_context) -> dict:
    """One greedy answer of exactly ``max_new_tokens`` tokens under ``press_context`` (entered before the clock
    starts); ``ids`` a list of equally long lists: one answer per row, generated together (no padding). Returns
    tokens (one list per row for a batch), seconds (the whole generate call), prefill_s (until the first new
    token), decode_tokens_per_s (the other new tokens of every row over the rest), peak_rss_delta (the sampled
    peak RSS during the call less the RSS just before it) and cache_bytes (the cache generate returned)."""
    batched = bool(ids) and isinstance(ids[0], list)
    input_ids = torch.tensor(ids if batched else [ids])
    release_freed_memory()
    stamps = Stamps()
    with press_context, PeakRss() as rss:
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, streamer=stamps, return_dict_in_generate=True)
        end = time.perf_counter()
    first = stamps.times[1] if len(stamps.times) > 1 else end
    rows = out.sequences[:, input_ids.shape[-1]:].tolist()
    tokens = rows if batched else rows[0]
    result = {"tokens": tokens, "seconds": end - start, "prefill_s": first - start,
              "decode_tokens_per_s": (sum(len(r) for r in rows) - len(rows)) / (end - first) if end > first
              else float("nan"),
              "peak_rss_delta": rss.peak - rss.start, "cache_bytes": cache_bytes(out.past_key_values)}
    del out
    return result


def kvpress_press(name: str, ratio: float):
    """kvpress's press of that name, with its defaults (SnapKV: window 64, kernel 5)."""
    from kvpress import KnormPress, SnapKVPress

    return {"snapkv": SnapKVPress, "knorm": KnormPress}[name](compression_ratio=ratio)


def main() -> int:
    from transformers import AutoModelForCausalLM

    model_dir, threads = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(threads)
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # anything a library prints stays off the protocol
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from importlib.metadata import version

    protocol.write(json.dumps({"ready": True, "kvpress": version("kvpress"), "transformers": version("transformers"),
                               "torch": torch.__version__}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        press = kvpress_press(request["press"], request["ratio"])
        result = measure(model, request["ids"], request["max_new_tokens"], press(model))
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
