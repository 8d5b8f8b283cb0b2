"""Tokens per second of the press under stock ``model.generate`` against batch size, top-k and Poisson side by side.

SmolLM2-135M-Instruct on the CPU: the first B of eight pass-key prompts of different lengths (built with
``kvcert.build_prompt``, left-padded as a decoder's tokenizer pads them), B in 1, 2, 4, 8, greedy, a fixed number
of new tokens (no stop token), under ``kvcert.press(policy="snapkv", design=..., compression_ratio=0.5)``, and the
stock model without a press as the reference. Every round runs each (batch size, configuration) once, in an order
that alternates from round to round, so that the configurations share the machine's load; the table prints medians
over the rounds:

* ``tok/s``: the batch's new tokens over the whole ``generate`` call (the press prefills the rows one at a time, so
  this includes B prefills);
* ``decode tok/s``: the new tokens after the first over the time from the first new token to the end (a streamer
  stamps them): what decoding the rows together buys;
* ``heap MB``: the largest heap in use during the call (glibc's ``mallinfo2``: malloc'd and mmap'd bytes, which
  hold torch's CPU tensors; sampled every millisecond by a thread) above the heap in use before it: what the call
  itself allocates, whatever the process kept from earlier calls;
* ``RSS MB``: the resident memory's high-water mark during the call above the resident memory before it (the mark
  reset first, ``/proc/self/clear_refs``; Linux): memory the allocator already holds from earlier calls is reused
  without showing here, so this reads low after a larger call;
* ``x B=1``: decode tok/s over the same configuration's at batch 1.

    python benchmarks/press_batch_throughput.py [--batches 1 2 4 8] [--new-tokens 32] [--rounds 3] [--threads 2]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading
import time

import torch
import torch.nn.functional as F

import kvcert
from kvcert.device_check import reset_peak_resident, resident_kb
from kvcert.theory import passkey_prompt

CONFIGURATIONS = ("full", "topk", "poisson")  # full: the stock model, no press
NOISE = (10, 22, 14, 26, 12, 18, 24, 16)  # noise sentences of the eight prompts: lengths differ


class Stamps:
    """A streamer that stamps the first new token and the end."""

    def __init__(self):
        self.puts, self.first, self.end_time = 0, None, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self):
        self.end_time = time.perf_counter()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapPeak:
    """The largest heap in use (bytes malloc'd from arenas plus mmap'd blocks) while the block runs, sampled by a
    thread; None where glibc's mallinfo2 is not available."""

    def __init__(self, interval: float = 0.001):
        try:
            self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
            self._mallinfo2.restype = _Mallinfo2
        except (OSError, AttributeError):
            self._mallinfo2 = None
        self.interval, self.before, self.peak = interval, None, None

    def _in_use(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def __enter__(self):
        if self._mallinfo2 is None:
            return self
        self.before = self.peak = self._in_use()
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, self._in_use())
                time.sleep(self.interval)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._mallinfo2 is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._in_use())

    @property
    def mb(self) -> float | None:
        return None if self.before is None else (self.peak - self.before) / 2**20


def prompts(tokenizer, new_tokens: int) -> list[torch.Tensor]:
    out = []
    for i, noise in enumerate(NOISE):
        context, question, _ = passkey_prompt(n_noise=noise, n_needles=1, seed=100 + i)
        out.append(kvcert.build_prompt(tokenizer, context, question, " The pass key is",
                                       max_new_tokens=new_tokens).prefix_ids)
    return out


def left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(r.shape[-1] for r in rows)
    ids = torch.stack([F.pad(r[0], (n - r.shape[-1], 0), value=pad) for r in rows])
    mask = torch.stack([F.pad(torch.ones_like(r[0]), (n - r.shape[-1], 0)) for r in rows])
    return ids, mask


def run(model, tokenizer, rows: list[torch.Tensor], configuration: str, new_tokens: int) -> dict:
    ids, mask = left_padded(rows, tokenizer.pad_token_id)
    stamps = Stamps()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id, streamer=stamps)
    reset_peak_resident()
    before = resident_kb("VmRSS")
    with HeapPeak() as heap:
        start = time.perf_counter()
        if configuration == "full":
            out = model.generate(**kwargs)
        else:
            press = kvcert.press(policy="snapkv", design=configuration, compression_ratio=0.5, seed=0)
            with press(model):
                out = model.generate(**kwargs)
        wall = time.perf_counter() - start
    peak = resident_kb("VmHWM")
    generated = out.shape[0] * (out.shape[-1] - ids.shape[-1])
    decode = stamps.end_time - stamps.first
    return {"configuration": configuration, "batch": len(rows), "new_tokens": generated, "seconds": wall,
            "tok_s": generated / wall, "decode_tok_s": (generated - len(rows)) / decode,
            "heap_mb": heap.mb, "rss_mb": None if peak is None or before is None else (peak - before) / 1024,
            "prompt_tokens": [int(r.shape[-1]) for r in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write every measurement to this file")
    args = parser.parse_args(argv)
    if max(args.batches) > len(NOISE) or min(args.batches) < 1:
        parser.error(f"--batches: each batch size must lie in [1, {len(NOISE)}]")
    torch.set_num_threads(args.threads)
    model, tokenizer = kvcert.load_model("smollm2")
    rows = prompts(tokenizer, args.new_tokens)
    run(model, tokenizer, rows[:1], "poisson", 2)  # warm-up: kernels, allocator
    cells = [(b, c) for b in args.batches for c in CONFIGURATIONS]
    measured = []
    for i in range(args.rounds):
        order = cells if i % 2 == 0 else cells[::-1]
        for batch, configuration in order:
            measured.append(run(model, tokenizer, rows[:batch], configuration, args.new_tokens))
            print(f"round {i + 1}/{args.rounds}: {configuration} B={batch}: {measured[-1]['tok_s']:.1f} tok/s",
                  flush=True)
    print(f"\nSmolLM2-135M on the CPU ({args.threads} threads), snapkv at compression_ratio 0.5, greedy, "
          f"{args.new_tokens} new tokens per row; prompts of {[int(r.shape[-1]) for r in rows]} tokens; medians over "
          f"{args.rounds} rounds\n")
    print("| configuration | batch | tok/s | decode tok/s | x B=1 (decode) | heap MB | RSS MB |")
    print("|---|---|---|---|---|---|---|")
    median = {}
    for batch, configuration in cells:
        runs = [m for m in measured if m["batch"] == batch and m["configuration"] == configuration]
        median[batch, configuration] = {k: statistics.median(m[k] for m in runs)
                                        for k in ("tok_s", "decode_tok_s", "heap_mb", "rss_mb")
                                        if runs[0][k] is not None}
    for configuration in CONFIGURATIONS:
        base = median.get((min(args.batches), configuration), {}).get("decode_tok_s")
        for batch in args.batches:
            m = median[batch, configuration]
            heap, rss = (f"{m[k]:.0f}" if k in m else "n/a" for k in ("heap_mb", "rss_mb"))
            print(f"| {configuration} | {batch} | {m['tok_s']:.1f} | {m['decode_tok_s']:.1f} | "
                  f"{m['decode_tok_s'] / base:.2f} | {heap} | {rss} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": measured}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
