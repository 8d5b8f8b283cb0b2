"""Batches: several prompts of different lengths decoded together, each with its own compressed per-head cache.

The layout. A prompt of a batch is prefilled alone, on its own tokens (the left padding of a padded batch is
stripped first), by ``kvcert.generation.prefill``, and compressed by ``configuration_selections`` with its own
generator: its scores, its allocation and its Poisson draw are those it would get alone, whatever its
neighbours. A prompt's compressed cache is then one batch row of a ``BatchedLayer`` per layer: per KV head, the
row's kept slots (sampled ones first, as ``CompressedLayer.derive`` orders them), then padding slots up to the
longest row of the layer, then the tokens appended while decoding, written in place for every row at once.
A padding slot has log π = −inf and the bias of a slot the design did not keep, so its attention weight is
exactly 0 and it adds nothing to the Hájek estimate or its variance: the offset applies to real slots only. Every
slot carries its row's own position (the row's tokens count from 0, as one prompt alone does), so RoPE, the causal
mask and sliding windows see each row as they would see it alone; ``lag`` says how far a row's positions lag
the batch's (the left padding it had).

Why prefill row by row: the scores, π and draws of a row are then bitwise those of the prompt alone (a padded
prefill would mix the padding into query statistics, accumulated attention and the per-layer key statistics of
several policies), and only one row's full cache exists at a time. The decode, where batching pays, runs all
rows in each forward pass. Identical prompts of one batch (``num_return_sequences``) share one prefill.

What this module gives (``kvcert.presses`` uses it for ``model.generate`` on a padded batch and for
``Press.answer_batch`` / the pipeline with a list of documents):

* ``compress_prompt``: one prompt's prefill and selections, as a press makes them;
* ``stack_rows``: batch-1 compressed caches into one batched cache;
* ``batch_context``: the ``AttentionContext`` a batched decode attends with (its certificate recorder);
* ``row_steps``: one row's step table from a batched recorder;
* ``decode_rows``: greedy decoding of several prepared rows together (the pipeline's path);
* ``check_lengths``: the refusal of prompts longer than the model's window.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import GenerationConfig

from .attention import attach
from .cache import CompressedCache, CompressedLayer, decode_reserve
from .certificates import CertificateRecorder
from .context import AttentionContext
from .designs import Selection
from .estimator import NOT_RETAINED
from .generation import (Configuration, Decoding, Prefill, _footprint, _steps_frame, configuration_selections, eos_ids,
                          new_token_limit, prefill)
from .kernels import attention_path
from .policies import prefill_needs
from .prompts import build_prompt, model_limit
from .targets import TargetNotMetWarning, cap_binding_message

ALL_STEPS = 2**62  # no limit on a row's steps


class BatchedLayer(CompressedLayer):
    """One layer of a batch of different prompts: keys/values (batch, kv_heads, slots, head_dim); log_pi, offset
    and positions (batch, kv_heads, slots); lag (batch,) long.

    A row's slots are its kept prompt slots, then padding slots (log π = −inf, weight 0) up to the layer's longest
    row, then the appended tokens. ``length`` is the batch's logical length (what ``model.generate`` counts: the
    padded prompt length plus the tokens fed since); row r's tokens are appended at positions ``length − lag[r]``
    onwards, the positions the prompt alone would give them.
    """

    def __init__(self):
        super().__init__()
        self.lag: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append m tokens (batch, kv_heads, m, head_dim) to every row, at each row's own positions."""
        start = self.filled
        out = super().update(key_states, value_states, *args, **kwargs)
        self._buffers[4][:, :, start: self.filled] -= self.lag.view(-1, 1, 1)
        return out

    def _refuse(self, *args, **kwargs):
        raise ValueError("kvcert: a batch of compressed caches cannot be reordered or expanded (beam search, or "
                         "a cache reused for another batch); use num_beams=1 and a fresh generate call")

    reorder_cache = batch_select_indices = batch_repeat_interleave = _refuse


def stack_rows(rows: list[list[CompressedLayer]], lengths: list[int], *, reserve: int,
               length: int | None = None, release: bool = False) -> CompressedCache:
    """One batched cache from per-row caches.

    rows: per row, its layers (each batch 1: keys/values (1, kv_heads, k_r, head_dim), log_pi/offset/positions
    (1, kv_heads, k_r)); lengths: per row, the logical length its next token continues (its prompt's tokens, and
    any fed since); reserve: spare slots for the tokens to append; length: the batch's logical length (default
    max(lengths); ``model.generate`` counts the padded prompt's); release: drop each row's layer from ``rows`` (set
    it to None) once it is stacked, so that the rows' layers and the batch's do not all exist at once. Each layer
    of the result is a ``BatchedLayer`` of max_r k_r + reserve slots of capacity.
    """
    length = max(lengths) if length is None else length
    device = rows[0][0].keys.device
    lag = torch.tensor([length - n for n in lengths], dtype=torch.long, device=device)
    layers = []
    for index, per_row in enumerate(zip(*rows)):
        k_max = max(layer.filled for layer in per_row)

        def padded(name: str, value: float = 0.0) -> torch.Tensor:
            parts = []
            for layer in per_row:
                t = getattr(layer, name)
                pad = k_max - t.shape[2]
                parts.append(F.pad(t, (0, 0, 0, pad) if t.ndim == 4 else (0, pad), value=value))
            return torch.cat(parts)

        layer = BatchedLayer()
        layer.device, layer.length, layer.is_initialized, layer.lag = device, length, True, lag
        layer._allocate(padded("keys"), padded("values"), padded("log_pi", float("-inf")),
                        padded("offset", NOT_RETAINED), padded("positions"), k_max + reserve)
        layer.n_prefix_slots = k_max
        layer.n_sampled_slots = max(row.n_sampled_slots for row in per_row)
        layer.compressed = any(row.compressed for row in per_row)
        layers.append(layer)
        if release:
            for row in rows:
                row[index] = None
    return CompressedCache(layers)


def batch_context(cache: CompressedCache, *, certify: bool) -> AttentionContext:
    """The context a batched decode attends with: ``cache`` and, with ``certify`` and some compressed layer, a
    ``CertificateRecorder`` counting steps from the cache's length (no oracle: a batch has no shared full
    prefix to compare against)."""
    recorder = None
    if certify and any(layer.compressed for layer in cache.layers):
        keys = cache.layers[0].keys
        recorder = CertificateRecorder(max(layer.length for layer in cache.layers), oracle=False,
                                       path=attention_path(keys.dtype, keys.device))
    return AttentionContext(cache, recorder=recorder)


def row_steps(recorder: CertificateRecorder | None, row: int, *, delta: float, randomized: bool, limit: int,
              offset: int = 0) -> pd.DataFrame:
    """Row ``row``'s step table (``kvcert.generate``'s ``steps`` columns) from a batched recorder: the steps
    below ``limit``, numbered from ``offset`` (the steps the row certified before the batch decoded)."""
    frame = _steps_frame(recorder, row, delta, randomized, limit)
    if offset:
        frame["step"] = frame["step"] + offset
    return frame


def check_lengths(model, lengths: list[int], new_tokens: int | None, *, who: str, names: list[str]) -> None:
    """Refuse, in one line naming the first offending item and its lengths, prompts whose tokens (plus
    ``new_tokens`` where known) exceed the model's window (``max_position_embeddings``)."""
    limit = model_limit(model, None)
    for name, n in zip(names, lengths):
        need = n + (new_tokens or 0)
        if need > limit:
            extra = f" + {new_tokens} new tokens" if new_tokens else ""
            raise ValueError(f"{who}: {name}: {n} prompt tokens{extra} = {need} > the model's window of {limit} "
                             "tokens (max_position_embeddings); shorten or truncate the prompt")


@dataclass
class Compressed:
    """One prompt prefilled and compressed: state (its ``Prefill``), selections (per layer), choice (a target's
    log, or None) and fields (``AnswerCertificate``'s footprint fields: retained_tokens, context_tokens,
    cache_bytes, full_bytes, kept_bytes, target_choice)."""

    state: Prefill
    selections: list[Selection]
    choice: pd.DataFrame | None
    fields: dict


def compress_prompt(model, press, prefix_ids: torch.Tensor, setting: str) -> Compressed:
    """Prefill ``prefix_ids`` (1, n) alone and select its retained sets with ``press``'s configuration (a
    ``kvcert.Press``: policy, design, budget, seed, item_id, options, allocator, target, observation window), as
    the press does for one prompt."""
    needs = prefill_needs([press.policy], press.policy_options)
    state = prefill(model, prefix_ids, None, setting=setting, observation_window=press.observation_window, **needs,
                    policy_options=press.policy_options)
    selections, choice = configuration_selections(
        state, Configuration(press.policy, press.design, press.budget, press.seed), item_id=press.item_id,
        options=press.options, allocator=press.allocator, allocator_options=press.allocator_options,
        target=press._target)
    retained, cache_bytes, full_bytes, kept_bytes = _footprint(state, selections)
    fields = {"retained_tokens": retained, "context_tokens": state.context_tokens, "cache_bytes": cache_bytes,
              "full_bytes": full_bytes, "kept_bytes": kept_bytes, "target_choice": choice}
    return Compressed(state, selections, choice, fields)


@dataclass
class Row:
    """One prompt ready to decode in a batch: layers (batch-1 compressed layers, the suffix already appended),
    length (the position its next token takes), logits ((1, vocab) float32, the next token's), steps (the step
    table of what it fed already, the suffix; steps 0 … suffix − 1), suffix (its suffix's token count),
    randomized (whether its design certifies)."""

    layers: list[CompressedLayer]
    length: int
    logits: torch.Tensor
    steps: pd.DataFrame
    suffix: int
    randomized: bool


def feed_suffix(model, compressed: Compressed, suffix_ids: torch.Tensor, *, max_new_tokens: int, certify: bool,
                delta: float, randomized: bool) -> Row:
    """Feed ``suffix_ids`` (1, s) on ``compressed``'s cache, alone, exactly as ``Press.answer`` does for one
    question (its first pass of ``kvcert.generation.Decoding``); the row it leaves to decode in a batch."""
    asked = dataclasses.replace(compressed.state, suffix_ids=suffix_ids.to(compressed.state.prefix_ids.device))
    decoding = Decoding(model, asked, [compressed.selections], max_new_tokens=max_new_tokens, certify=certify,
                        delta=delta, randomized=[randomized])
    s = suffix_ids.shape[-1]
    steps = row_steps(decoding.recorder, 0, delta=delta, randomized=randomized, limit=s)
    layers = decoding.cache.layers
    return Row(layers, layers[0].length, decoding._logits, steps, s, randomized)


@torch.no_grad()
def decode_rows(model, rows: list[Row], *, max_new_tokens: int, stop_ids: set[int], certify: bool, delta: float,
                progress: bool = True) -> list[tuple[list[int], list[float], pd.DataFrame]]:
    """Greedy decoding of ``rows`` together, one batch row each, as ``kvcert.generation.Decoding`` decodes one:
    per row (token ids, log-probabilities, step table: the row's suffix steps, then one per fed token but the
    last). A row stops at a stop id or ``max_new_tokens``; the batch runs until every row has stopped (a stopped
    row's passes are not recorded in its table)."""
    cache = stack_rows([row.layers for row in rows], [row.length for row in rows], reserve=max_new_tokens)
    context = batch_context(cache, certify=certify)
    lag = cache.layers[0].lag
    logits = torch.cat([row.logits for row in rows])
    n = len(rows)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    done = [False] * n
    device = rows[0].layers[0].keys.device
    bar = tqdm(total=max_new_tokens, desc="decoding", unit="token", disable=not progress or n < 2, leave=False)
    with attach(model, context):
        while True:
            log_probs = torch.log_softmax(logits, dim=-1)
            chosen = torch.argmax(log_probs, dim=-1)
            picked = log_probs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            for r in range(n):
                if not done[r]:
                    tokens[r].append(int(chosen[r]))
                    logprobs[r].append(float(picked[r]))
                    done[r] = tokens[r][-1] in stop_ids or len(tokens[r]) == max_new_tokens
            bar.update(1)
            if all(done):
                break
            positions = (cache.layers[0].length - lag).view(n, 1)
            out = model(input_ids=chosen.unsqueeze(-1).to(device), position_ids=positions, cache=cache, use_cache=True)
            logits = out.logits[:, -1].float()
    bar.close()
    results = []
    for r, row in enumerate(rows):
        later = row_steps(context.recorder, r, delta=delta, randomized=row.randomized, limit=len(tokens[r]) - 1,
                          offset=row.suffix)
        frames = [f for f in (row.steps, later) if len(f)]
        steps = pd.concat(frames, ignore_index=True) if len(frames) > 1 else (frames[0] if frames else later)
        results.append((tokens[r], logprobs[r], steps.reset_index(drop=True)))
    return results


def generation_settings(model, padded_length: int) -> tuple[set[int], int | None]:
    """(the stop ids, the new tokens) of the ``model.generate`` call running now: read from its prepared
    ``GenerationConfig`` (the innermost caller frame holding one, the call's own arguments applied), else the
    model's generation config and no token count (a forward outside ``generate``)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            config = frame.f_locals.get("generation_config")
            if isinstance(config, GenerationConfig):
                eos = getattr(config, "_eos_token_tensor", None)
                stop = set(eos.reshape(-1).tolist()) if isinstance(eos, torch.Tensor) else set()
                if eos is None and config.eos_token_id is not None:
                    value = config.eos_token_id
                    stop = set(value if isinstance(value, (list, tuple)) else [value])
                new = config.max_new_tokens
                if new is None and config.max_length is not None:
                    new = config.max_length - padded_length
                return stop, new
            frame = frame.f_back
    finally:
        del frame
    return eos_ids(model), None


class GenerateBatch:
    """A padded batch under a press's ``model.generate``.

    ``start`` runs at the prefill, in the press's forward pre-hook: it strips each row's left padding, prefills
    and compresses each distinct prompt alone (``compress_prompt``), stacks the rows into one batched cache and
    keeps the rows' next-token logits. The model's own forward then runs on a stand-in (each row's last token, no
    cache: one cheap pass) whose logits and cache ``finish`` replaces by the rows'. Every later step of
    ``generate`` decodes all rows in one forward pass on the batched cache; ``fed`` records the tokens fed per
    row, so that a row's certificate ends where its answer ends (its first stop token), as it would alone.
    """

    def __init__(self, press, cache: CompressedCache, logits: torch.Tensor, fields: list[dict], stop: set[int]):
        self.press, self.cache, self.logits, self.fields, self.stop = press, cache, logits, fields, stop
        self.context = batch_context(cache, certify=press.certify)
        self.pending = True
        self._fed: list[torch.Tensor] = []

    @classmethod
    def start(cls, run, ids: torch.Tensor, mask: torch.Tensor | None, kwargs: dict) -> GenerateBatch:
        """run: the press's run (``press``, ``model``, ``busy``); ids: (batch, n) left-padded prompt ids; mask:
        (batch, n) generate's attention mask (1: token, 0: padding) or None; kwargs: the forward's keywords."""
        press, model = run.press, run.model
        who = "kvcert.press"
        refuse_decode_bound(press, who)
        if press.oracle:
            raise ValueError(f"{who}: oracle=True measures one prompt at a time against its full cache; a batch of "
                             f"{ids.shape[0]} rows has none to share (generate the prompts one at a time)")
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise ValueError(f"{who}: {name}=True with a batch: kvcert's rows are prefilled one at a time and "
                                 "their attentions and hidden states are not returned")
        rows, n_pad = ids.shape
        if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
            mask = torch.ones_like(ids)
        prompts, lengths = [], []
        for r in range(rows):
            real = mask[r].bool()
            n = int(real.sum())
            if n == 0 or not bool(real[n_pad - n:].all()):
                raise ValueError(f"{who}: row {r} of the batch is not left-padded (its attention mask is "
                                 f"{mask[r].tolist()[:8]}…); pad prompts on the left (tokenizer.padding_side = "
                                 "'left'), as generate expects for decoder-only models")
            prompts.append(ids[r: r + 1, n_pad - n:])
            lengths.append(n)
        stop, new_tokens = generation_settings(model, n_pad)
        check_lengths(model, lengths, new_tokens, who=who, names=[f"row {r} of the batch" for r in range(rows)])
        unique, index = distinct(prompts)
        layers, logits, fields = [], [], []
        run.busy = True
        try:
            for prompt in tqdm(unique, desc="prefill", unit="prompt", disable=len(unique) < 2, leave=False):
                compressed = compress_prompt(model, press, prompt, "question_aware")
                warn_target(press, compressed)
                layers.append(compressed.state.cache.derive(compressed.selections).layers)
                logits.append(compressed.state.last_logits)
                fields.append(compressed.fields)
                del compressed  # the prompt's full cache: one exists at a time
        finally:
            run.busy = False
        cache = stack_rows([layers[i] for i in index], lengths, reserve=decode_reserve(new_tokens), length=n_pad,
                           release=True)
        del layers
        for layer in cache.layers:  # the generated tokens' slots grow on demand, never past max_new_tokens
            layer.grow_on_demand(new_tokens)
        run.context = None  # the stand-in forward attends as the model normally would
        return cls(press, cache, torch.cat([logits[i] for i in index]), [fields[i] for i in index], stop)

    def stand_in(self, kwargs: dict, key: str) -> dict:
        """The forward's keywords for the stand-in pass: each row's last token, no cache, no mask."""
        ids = kwargs["input_ids"]
        return {**kwargs, "input_ids": ids[:, -1:], key: None, "use_cache": False, "attention_mask": None,
                "position_ids": None}

    def finish(self, run, output):
        """After the stand-in pass: generate receives the rows' logits (batch, 1, vocab) and the batched cache,
        and every later pass attends to it; the press records one certificate per row."""
        self.pending = False
        output.logits = self.logits.to(output.logits.dtype).unsqueeze(1)
        output["cache"] = run.cache
        run.context = self.context
        randomized = self.press.design == "poisson"
        run.press._record_rows([(functools.partial(self.steps, r, randomized), fields)
                                for r, fields in enumerate(self.fields)])
        return output

    def fed(self, ids: torch.Tensor | None) -> None:
        """A decode pass feeds ``ids`` (batch, 1), one token per row."""
        if ids is not None:
            self._fed.append(ids[:, -1].detach().cpu())

    def steps(self, row: int, randomized: bool) -> pd.DataFrame:
        """Row ``row``'s step table so far: its passes up to the one that fed its first stop token."""
        limit = ALL_STEPS
        if self._fed and self.stop:
            fed = torch.stack(self._fed)[:, row]  # (passes,)
            hits = torch.isin(fed, torch.tensor(sorted(self.stop))).nonzero()
            if len(hits):
                limit = int(hits[0, 0])
        return row_steps(self.context.recorder, row, delta=self.press.delta, randomized=randomized, limit=limit)


def refuse_decode_bound(press, who: str) -> None:
    """Compression during decoding (a press's ``max_cache_tokens``) runs on one prompt at a time: a batch is refused."""
    bound = getattr(press, "max_cache_tokens", None)
    if bound is not None:
        raise ValueError(f"{who}: max_cache_tokens={bound} (compression during decoding) runs one prompt at a time; "
                         "generate the prompts one at a time, or leave max_cache_tokens out for a batch")


def warn_target(press, compressed: Compressed) -> None:
    """A target that keeps its cap somewhere says so, as for one prompt."""
    if compressed.choice is not None and (message := cap_binding_message(compressed.choice, press._target,
                                                                          press.budget)):
        warnings.warn(message, TargetNotMetWarning, stacklevel=3)


def answer_rows(press, model, tokenizer, *, contexts: list[str], questions, answer_prefix: str = "",
                max_new_tokens: int | None = None, truncate: str = "middle") -> list[list[tuple]]:
    """``Press.answer_batch``'s rows: per context, per question, (text, token_ids, steps, fields), each the one
    ``Press.answer`` gives alone (see there)."""
    who = "kvcert.press.answer_batch"
    if isinstance(contexts, str) or not isinstance(contexts, (list, tuple)) or not contexts:
        raise ValueError(f"{who}: contexts must be a non-empty list of strings")
    for i, context in enumerate(contexts):
        if not isinstance(context, str):
            raise ValueError(f"{who}: contexts[{i}] is a {type(context).__name__}, not a string")
    if isinstance(questions, str) or not isinstance(questions, (list, tuple)) or not questions:
        raise ValueError(f"{who}: questions must be a non-empty list of strings, or one such list per context")
    per_context = [list(q) for q in questions] if all(isinstance(q, (list, tuple)) for q in questions) else None
    if per_context is None:
        per_context = [list(questions)] * len(contexts)
    if len(per_context) != len(contexts):
        raise ValueError(f"{who}: {len(per_context)} lists of questions for {len(contexts)} contexts")
    for i, asked in enumerate(per_context):
        if not asked or not all(isinstance(q, str) for q in asked):
            raise ValueError(f"{who}: the questions of context {i} must be a non-empty list of strings")
    refuse_decode_bound(press, who)
    if press.oracle:
        raise ValueError(f"{who}: oracle=True measures one prompt at a time against its full cache; use answer")
    max_new_tokens = new_token_limit(model, max_new_tokens)
    limit = model_limit(model, None)
    prompts = []
    for i, (context, asked) in enumerate(zip(contexts, per_context)):
        built = [build_prompt(tokenizer, context, q, answer_prefix, setting="streaming", max_new_tokens=max_new_tokens,
                              limit=limit, truncate=truncate, name=f"{who}: context {i}") for q in asked]
        for j, prompt in enumerate(built):
            if not torch.equal(prompt.prefix_ids, built[0].prefix_ids):
                raise ValueError(f"{who}: context {i}: question {j} leaves the context cut differently from question "
                                 "0 (the prompt exceeds the model's window): shorten the context")
        prompts.append(built)
    randomized = press.design == "poisson"
    rows, fields = [], []
    for built in tqdm(prompts, desc="documents", unit="document", disable=len(prompts) < 2, leave=False):
        compressed = compress_prompt(model, press, built[0].prefix_ids, "streaming")
        warn_target(press, compressed)
        for prompt in built:
            rows.append(feed_suffix(model, compressed, prompt.suffix_ids, max_new_tokens=max_new_tokens,
                                    certify=press.certify, delta=press.delta, randomized=randomized))
            fields.append(compressed.fields)
        del compressed
    decoded = decode_rows(model, rows, max_new_tokens=max_new_tokens, stop_ids=eos_ids(model, tokenizer),
                          certify=press.certify, delta=press.delta)
    out, k = [], 0
    for built in prompts:
        answers = []
        for _ in built:
            tokens, _, steps = decoded[k]
            answers.append((tokenizer.decode(tokens, skip_special_tokens=True), tokens, steps, fields[k]))
            k += 1
        out.append(answers)
    return out


def distinct(prompts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """(the distinct prompts in first-seen order, per prompt the index of its distinct one): identical prompts of
    a batch share one prefill."""
    seen: dict[tuple, int] = {}
    unique, index = [], []
    for ids in prompts:
        key = tuple(ids.reshape(-1).tolist())
        if key not in seen:
            seen[key] = len(unique)
            unique.append(ids)
        index.append(seen[key])
    return unique, index


__all__ = ["ALL_STEPS", "BatchedLayer", "Compressed", "GenerateBatch", "Row", "answer_rows", "batch_context",
           "check_lengths", "compress_prompt", "decode_rows", "distinct", "feed_suffix", "generation_settings",
           "row_steps", "stack_rows"]
