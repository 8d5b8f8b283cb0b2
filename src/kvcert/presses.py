"""kvcert as a press for stock ``model.generate``: compress the prompt at its prefill, decode with the Hájek offset,
and leave a certificate summary per answer.

```python
press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.5)
with press(model):
    out = model.generate(**inputs, max_new_tokens=32)
press.certificate.max_rel_cert, press.certificate.exceeded   # the answer's certificate
```

How it hooks in, without replacing anything of the model's: inside the ``with`` the model's attention
implementation is a kvcert attention function registered through ``transformers.AttentionInterface`` under a name
of the press's own (as ``kvcert.attach`` does), and one forward pre-hook and one forward hook sit on the model.
When ``generate`` (or any caller) starts a prompt, i.e. calls the model with an empty ``transformers.Cache``, the
pre-hook hands the model a ``PressCache`` (a ``CompressedCache``) in its place; the prefill runs over the whole
prompt (question-aware: the question is part of it) while kvcert attention records what the policy reads, and the
cache is compressed physically: the policy's scores, the allocator's counts, the design's retained sets (the
selections ``kvcert.generate`` makes), the kept slots gathered per KV head. Each layer is compressed as soon as the
prefill has run it (``kvcert.generation.LayerSelector``: every allocator and policy reads one layer at a time), so
the full cache of one layer exists at a time, as under kvpress's presses; with a target, design clt, the oracle or
``max_cache_tokens`` the forward hook compresses every layer once the prefill has run
(``configuration_selections``: a target searches its layers' sizes together, the oracle keeps the full cache).
Slots for generated tokens are allocated ``kvcert.cache.DECODE_CHUNK`` at a time (an eighth more of the cache once
it is larger), never more than ``generate``'s ``max_new_tokens``. ``generate`` keeps the cache the model returned,
so every later step attends to the compressed cache with the −log π offset and, with ``certify``, hands its
variance to the answer's ``CertificateRecorder``. On exit the hooks are removed, the attention implementation is
the one before, and the registered names are gone.

A batch (several rows, or a left-padded prompt; ``num_return_sequences``) is compressed row by row and decoded
together (``kvcert.batching``: each row's prompt prefilled alone on its own tokens, its own retained sets and draw,
one batch row of the cache per prompt); ``press.certificates`` then holds one certificate per row. Beam search is
refused in one line.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, Pipeline
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface
from transformers.pipelines import PIPELINE_REGISTRY

from .allocators import ALLOCATORS, get_allocator
from .attention import ATTENTION_NAME, padding_mask, register
from .cache import CompressedCache, decode_reserve
from .context import AttentionContext
from .decode_compression import DecodeCompressor, check_decode_bound
from .designs import DESIGNS, DesignOptions, check_design_defenses
from .generation import (RUN, Configuration, LayerSelector, PrefillRecording, _footprint, _steps_frame,
                         configuration_selections, decode_batch, decoding_context, eos_ids, generate, item_seed,
                         layer_footprint, layer_view, new_token_limit, new_recorder, prefill)
from .prompts import build_prompt, model_limit
from .policies import get_policy, prefill_needs
from .targets import TargetNotMetWarning, cap_binding_message, check_target

_GENERATE_DEFAULTS = {name: p.default for name, p in inspect.signature(generate).parameters.items()}
PRESS_NAME = f"{ATTENTION_NAME}_press"  # the attention implementation a press registers starts with this
DEFAULT_EPS = 0.1  # the relative certificate above which a step and layer is listed, unless the press says otherwise
_ALL_STEPS = 2**62  # no limit on the steps of an answer: generate feeds every token but the last


class PressCache(CompressedCache):
    """The cache a press hands to the model at a prompt's prefill: the prompt's slots, then, once the prefill has
    run, only the retained ones (its layers are replaced by the compressed ones)."""


@dataclass(frozen=True)
class AnswerCertificate:
    """The certificate of one answer generated under a press.

    steps: one row per (step, layer, KV head) that attended to the compressed cache, the columns of
    ``kvcert.generate``'s ``steps`` (``rel_cert`` = ε̂_δ/‖ô‖; NaN for a deterministic design); eps: the threshold of
    ``exceeded``; retained_tokens: mean retained prompt slots per layer and KV head; context_tokens: the prompt's
    length; cache_bytes / full_bytes / kept_bytes: as in ``kvcert.generate``'s result; target_choice: with a target,
    the chosen expected sample size per layer and KV head (``kvcert.targets.CHOICE_COLUMNS``), else None.
    """

    steps: pd.DataFrame
    eps: float
    retained_tokens: float
    context_tokens: int
    cache_bytes: int
    full_bytes: int
    kept_bytes: int
    target_choice: pd.DataFrame | None = None
    peak_cache_tokens: int | None = None  # with max_cache_tokens: the most slots a layer held after a pass
    decode_compressions: int = 0  # with max_cache_tokens: layer compressions while decoding

    @property
    def n_steps(self) -> int:
        """Decode steps that attended to the compressed cache (every generated token but the last)."""
        return int(self.steps["step"].nunique()) if len(self.steps) else 0

    @property
    def max_rel_cert(self) -> float:
        """The largest relative certificate over steps, layers and KV heads (NaN: no certificate)."""
        values = self.steps["rel_cert"].to_numpy(dtype=float)
        return float(np.nanmax(values)) if np.isfinite(values).any() else math.nan

    @property
    def mean_rel_cert(self) -> float:
        """The mean relative certificate over steps, layers and KV heads (NaN: no certificate)."""
        values = self.steps["rel_cert"].to_numpy(dtype=float)
        return float(np.nanmean(values)) if np.isfinite(values).any() else math.nan

    def above(self, eps: float) -> pd.DataFrame:
        """(step, layer, rel_cert): the steps and layers where some KV head's relative certificate exceeds
        ``eps``, with the largest over the layer's heads; ordered by step, then layer."""
        over = self.steps[self.steps["rel_cert"] > eps]
        table = over.groupby(["step", "layer"], as_index=False)["rel_cert"].max()
        return table.astype({"step": "int64", "layer": "int64"}).reset_index(drop=True)

    @property
    def exceeded(self) -> list[tuple[int, int]]:
        """(step, layer) pairs where some KV head's relative certificate exceeds ``eps``."""
        return list(self.above(self.eps)[["step", "layer"]].itertuples(index=False, name=None))


@dataclass
class Press:
    """A kvcert configuration to apply to a model around stock ``model.generate``: ``with press(model): ...``.

    policy: a registered scoring policy (``kvcert.POLICIES``, or one of ``kvcert.register_policy``); design:
    ``poisson`` (certificate) or ``topk``; budget: the retained fraction of the prompt in (0, 1], or
    compression_ratio = 1 − budget in [0, 1) (kvpress's), exactly one of them; seed: the Poisson draw (every
    answer of the press draws with it; item_id derives it per item as the cell runner does); allocator /
    allocator_options: slots per (layer, KV head) (``kvcert.ALLOCATORS``); policy_options: keyword options of
    the policy; options: the design's certainty head and probability floor; observation_window: the last prompt
    tokens whose queries score the cache; certify: compute the certificate at each step; oracle: also measure
    the true error against the full cache (the prompt's uncompressed cache is kept); delta: the certificate's
    level; target_error / target_delta / target_floor: a target relative error instead of a fixed budget (the
    budget its cap; ``kvcert.targets``; the floor's default is ``kvcert.generate``'s); eps: the threshold of
    ``certificate.exceeded``; max_cache_tokens / compression_interval: compression during long generations
    (``kvcert.decode_compression``): while decoding no (layer, KV head) holds more than ``max_cache_tokens`` slots,
    the cache being compressed again with the same policy and design (the certificate with the stages' compound
    π) whenever the next token would exceed it, to an expected ``max_cache_tokens − compression_interval`` (None:
    compressed once, after the prefill; one prompt per call).

    After each answer, ``certificate`` is that answer's ``AnswerCertificate`` (None before the first).
    """

    policy: str = RUN.policies[0]
    design: str = "poisson"
    budget: float | None = None
    compression_ratio: float | None = None
    seed: int = 0
    item_id: str | None = None
    allocator: str = RUN.allocator
    allocator_options: dict | None = None
    policy_options: dict | None = None
    options: DesignOptions = DesignOptions()
    observation_window: int = RUN.observation_window
    certify: bool = True
    oracle: bool = False
    delta: float = RUN.delta
    target_error: float | None = None
    target_delta: float | None = None
    target_floor: float | str | None = _GENERATE_DEFAULTS["target_floor"]
    eps: float = DEFAULT_EPS
    max_cache_tokens: int | None = None
    compression_interval: int | None = None
    _answer: tuple | None = field(default=None, init=False, repr=False)  # the last answer's (steps(), fields)
    _rows: list | None = field(default=None, init=False, repr=False)  # a batch's (steps(), fields) per row

    def __post_init__(self):
        if (self.budget is None) == (self.compression_ratio is None):
            given = "both" if self.budget is not None else "neither"
            raise ValueError(f"kvcert.press: give exactly one of budget and compression_ratio (got {given})")
        if self.compression_ratio is not None:
            if not 0.0 <= self.compression_ratio < 1.0:
                raise ValueError(f"kvcert.press: compression_ratio={self.compression_ratio!r} must lie in [0, 1)")
            self.budget = 1.0 - float(self.compression_ratio)
        elif not 0.0 < self.budget <= 1.0:
            raise ValueError(f"kvcert.press: budget={self.budget!r} must lie in (0, 1]")
        get_policy(self.policy, **(self.policy_options or {}).get(self.policy, {}))  # names the known ones
        if self.design not in DESIGNS:
            raise ValueError(f"kvcert.press: design={self.design!r} is unknown; known: {sorted(DESIGNS)}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"kvcert.press: allocator={self.allocator!r} is unknown; known: {sorted(ALLOCATORS)}")
        get_allocator(self.allocator, **(self.allocator_options or {}))
        check_design_defenses(self.design, self.options, who="kvcert.press")  # tail_mix, head_attention_share
        target = check_target(self.design, self.target_error, self.target_delta, self.target_floor)
        floor = None if target is None else (target.floor_at(self.budget) if hasattr(target, "floor_at")
                                             else target.floor)
        if floor is not None and floor > self.budget:
            raise ValueError(f"kvcert.press: target_floor={floor:g} exceeds the cap budget={self.budget:g}")
        if target is not None and self.allocator != "uniform":
            raise ValueError(f"kvcert.press: allocator={self.allocator!r}: a target chooses each KV head's sample "
                             "size itself; drop target_error or the allocator")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"kvcert.press: delta={self.delta!r} must lie in (0, 1)")
        self._target = target
        self._decode_bound = check_decode_bound(self.max_cache_tokens, self.compression_interval, policy=self.policy,
                                                design=self.design, options=self.options,
                                                policy_options=self.policy_options, who="kvcert.press")

    @property
    def _layerwise(self) -> bool:
        """Whether a prompt's layers are compressed one by one during its prefill (module docstring)."""
        return (self._target is None and self.design in ("topk", "poisson") and not self.oracle
                and self._decode_bound is None)

    @contextmanager
    def __call__(self, model) -> Iterator:
        """Inside the block, ``model`` (a transformers causal LM) compresses each prompt it generates from; on exit,
        normal or by exception, it is as it was."""
        previous = model.config._attn_implementation
        if previous is not None and previous.startswith(PRESS_NAME):
            raise RuntimeError("kvcert.press: a press is already applied to this model; nested presses are not "
                               "supported (leave the outer with first)")
        register()
        run = _Run(self, model, AttentionInterface._global_mapping[ATTENTION_NAME])
        name = f"{PRESS_NAME}_{id(run):x}"
        AttentionInterface.register(name, run.attention)
        AttentionMaskInterface.register(name, run.mask)
        handles = []
        try:
            model.set_attn_implementation(name)
            handles.append(model.register_forward_pre_hook(run.before, with_kwargs=True))
            handles.append(model.register_forward_hook(run.after, with_kwargs=True))
            yield model
        finally:
            for handle in handles:
                handle.remove()
            model.set_attn_implementation(previous)
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)
            run.context = run.recording = None

    @property
    def certificate(self) -> AnswerCertificate | None:
        """The last answer's certificate (None before the first answer), built from its recorder when read (read
        while the answer is generated, e.g. from a streamer, it holds the steps so far)."""
        if self._rows is not None and len(self._rows) > 1:
            raise ValueError(f"kvcert.press: the last call was a batch of {len(self._rows)} rows; read "
                             "press.certificates (one per row)")
        if self._answer is None:
            return None
        steps, fields = self._answer
        fields = {k: v() if callable(v) else v for k, v in fields.items()}  # a decode-time bound's counts, as now
        return AnswerCertificate(steps=steps(), eps=self.eps, **fields)

    @property
    def certificates(self) -> list[AnswerCertificate]:
        """One certificate per row of the last call, in row order: a batch's (``model.generate`` on several rows,
        ``answer_batch``), or ``[certificate]`` after one prompt ([] before the first answer). Each row's is the one
        the row's prompt would get alone (its steps end where its answer ends, at its first stop token)."""
        if self._rows is None:
            return [] if self._answer is None else [self.certificate]
        return [AnswerCertificate(steps=steps(), eps=self.eps, **fields) for steps, fields in self._rows]

    def answer_batch(self, model, tokenizer, *, contexts: list[str], questions: list[str] | list[list[str]],
                     answer_prefix: str = "", max_new_tokens: int | None = None,
                     truncate: str = "middle") -> list[list[PressAnswer]]:
        """``answer`` for several documents, decoded together: each document is prefilled and compressed once,
        alone; every (document, question) pair is then one batch row, its question fed on its document's cache, and
        the rows' answers decoded in the same forward passes (``kvcert.batching``). questions: one list asked of
        every document, or one list per document. Returns per document its PressAnswers, in order, each equal to
        ``answer``'s for that document and question (greedy tokens; log-probabilities and certificates up to float
        rounding); ``certificates`` holds one per pair. truncate: ``middle`` cuts the middle of a document longer
        than the model's window (``kvcert.build_prompt``), ``error`` refuses it in one line naming it."""
        from .batching import answer_rows

        per_context = answer_rows(self, model, tokenizer, contexts=contexts, questions=questions,
                                  answer_prefix=answer_prefix, max_new_tokens=max_new_tokens, truncate=truncate)
        self._record_rows([(lambda steps=steps: steps, fields) for answers in per_context
                           for _, _, steps, fields in answers])
        return [[PressAnswer(text, ids, AnswerCertificate(steps=steps, eps=self.eps, **fields))
                 for text, ids, steps, fields in answers] for answers in per_context]

    def _record_rows(self, rows: list[tuple]) -> None:
        """A batch's rows, (steps(), fields) each: ``certificates`` reads them (``certificate`` too, for one row)."""
        self._rows = rows
        self._answer = rows[0] if len(rows) == 1 else None

    @torch.no_grad()
    def answer(self, model, tokenizer, *, context: str, questions: list[str], answer_prefix: str = "",
               max_new_tokens: int | None = None) -> list[PressAnswer]:
        """Several questions about one context, sharing one prefill and one compression (kvpress's pipeline with
        ``questions=[...]``): the context alone is prefilled and compressed (question-agnostic: the ``streaming``
        setting), then each question and its answer attend to the compressed context, greedily, one question at a
        time from the same compressed cache (``max_new_tokens`` None: the model's generation config's). Returns one PressAnswer per question, in order; ``certificate`` is left
        at the last question's. The prompts are built as ``kvcert.generate(setting="streaming")`` builds them, so each
        answer is that call's for the same configuration."""
        if isinstance(questions, str) or not questions:
            raise ValueError("kvcert.press.answer: questions must be a non-empty list of strings")
        max_new_tokens = new_token_limit(model, max_new_tokens)
        limit = model_limit(model, None)
        prompts = [build_prompt(tokenizer, context, q, answer_prefix, setting="streaming",
                                max_new_tokens=max_new_tokens, limit=limit) for q in questions]
        prefix = prompts[0].prefix_ids
        for i, prompt in enumerate(prompts):
            if not torch.equal(prompt.prefix_ids, prefix):
                raise ValueError(f"kvcert.press.answer: question {i} leaves the context cut differently from question "
                                 "0 (the prompt exceeds the model's window): shorten the context")
        needs = prefill_needs([self.policy], self.policy_options)
        state = prefill(model, prefix, None, setting="streaming", observation_window=self.observation_window,
                        **needs, policy_options=self.policy_options)
        selections, choice = configuration_selections(
            state, Configuration(self.policy, self.design, self.budget, self.seed), item_id=self.item_id,
            options=self.options, allocator=self.allocator, allocator_options=self.allocator_options,
            target=self._target)
        if choice is not None and (message := cap_binding_message(choice, self._target, self.budget)):
            warnings.warn(message, TargetNotMetWarning, stacklevel=2)
        retained, cache_bytes, full_bytes, kept_bytes = _footprint(state, selections)
        fields = {"retained_tokens": retained, "context_tokens": state.context_tokens, "cache_bytes": cache_bytes,
                  "full_bytes": full_bytes, "kept_bytes": kept_bytes, "target_choice": choice}
        answers = []
        for prompt in tqdm(prompts, desc="questions", unit="question", disable=len(prompts) < 2):
            asked = dataclasses.replace(state, suffix_ids=prompt.suffix_ids.to(prefix.device))
            decoded, = decode_batch(model, asked, [selections], max_new_tokens=max_new_tokens,
                                    stop_ids=eos_ids(model, tokenizer), certify=self.certify, oracle=self.oracle,
                                    delta=self.delta, randomized=[self.design == "poisson"],
                                    compressor=self._compressor(state))
            fields = {**fields, "peak_cache_tokens": decoded.peak_cache_tokens,
                      "decode_compressions": decoded.decode_compressions}
            self._answer, self._rows = (lambda steps=decoded.steps: steps, fields), None
            answers.append(PressAnswer(tokenizer.decode(decoded.token_ids, skip_special_tokens=True),
                                       decoded.token_ids, self.certificate))
        return answers

    def _compressor(self, state) -> DecodeCompressor | None:
        """A decoding's DecodeCompressor (None without max_cache_tokens), its window seeded by ``state``'s prefill."""
        if self._decode_bound is None:
            return None
        seed = self.seed if self.item_id is None else item_seed(self.seed, self.item_id)
        return DecodeCompressor(self._decode_bound, policy=self.policy, design=self.design, options=self.options,
                                seed=seed, policy_options=self.policy_options, observations=state.observations,
                                window=self.observation_window)

    def _record(self, recorder, randomized: bool, fields: dict) -> None:
        """A new answer has started: its recorder fills while it is generated."""
        self._answer = (lambda: _steps_frame(recorder, 0, self.delta, randomized, _ALL_STEPS), fields)
        self._rows = None


@dataclass(frozen=True)
class PressAnswer:
    """One question's answer from ``Press.answer``: text, token_ids (the generated ids) and its certificate (the
    question's tokens attend to the compressed context too, so its steps start with them)."""

    text: str
    token_ids: list[int]
    certificate: AnswerCertificate


PIPELINE_TASK = "kvcert-text-generation"


class PressPipeline(Pipeline):
    """A transformers pipeline for questions about one document under a press (kvpress's
    ``kv-press-text-generation``): ``pipe(document, questions=[...], press=press)`` or ``question="..."``; keywords
    ``answer_prefix`` and ``max_new_tokens``. Returns ``{"answers": [...], "certificates": [...]}`` for questions,
    ``{"answer": ..., "certificate": ...}`` for one question (``Press.answer``: one prefill and one compression of the
    document). A list of documents gives one such output per document, all decoded together
    (``Press.answer_batch``). Build it as ``PressPipeline(model=model, tokenizer=tokenizer)``, or by name once
    ``register_pipeline()`` has run."""

    def _sanitize_parameters(self, press=None, questions=None, question=None, answer_prefix=None, max_new_tokens=None,
                             **unknown):
        if unknown:
            raise ValueError(f"{PIPELINE_TASK}: unknown keywords {sorted(unknown)}; known: press, questions, question, "
                             "answer_prefix, max_new_tokens")
        given = {"press": press, "questions": questions, "question": question, "answer_prefix": answer_prefix,
                 "max_new_tokens": max_new_tokens}
        return {}, {k: v for k, v in given.items() if v is not None}, {}

    def preprocess(self, context, **_):
        if not isinstance(context, str):
            raise ValueError(f"{PIPELINE_TASK}: the document must be a string; got {type(context).__name__}")
        return {"context": context}

    def _forward(self, model_inputs, press: Press | None = None, questions=None, question=None, answer_prefix="",
                 max_new_tokens=None):
        if not isinstance(press, Press):
            raise ValueError(f"{PIPELINE_TASK}: give press=kvcert.press(...); got {press!r}")
        if (questions is None) == (question is None):
            raise ValueError(f"{PIPELINE_TASK}: give exactly one of questions and question")
        answers = press.answer(self.model, self.tokenizer, context=model_inputs["context"],
                               questions=[question] if question is not None else questions,
                               answer_prefix=answer_prefix, max_new_tokens=max_new_tokens)
        return {"answers": answers, "single": question is not None}

    def __call__(self, inputs, *args, **kwargs):
        """One document (a string), or a list of documents decoded together (``Press.answer_batch``): a list gives
        one output per document, in order."""
        if isinstance(inputs, (list, tuple)):
            return self._batch(list(inputs), *args, **kwargs)
        return super().__call__(inputs, *args, **kwargs)

    def _batch(self, contexts: list, *args, **kwargs) -> list[dict]:
        if args:
            raise ValueError(f"{PIPELINE_TASK}: give the keywords by name (press=..., question=... or questions=...)")
        _, params, _ = self._sanitize_parameters(**kwargs)
        press, question, questions = params.get("press"), params.get("question"), params.get("questions")
        if not isinstance(press, Press):
            raise ValueError(f"{PIPELINE_TASK}: give press=kvcert.press(...); got {press!r}")
        if (questions is None) == (question is None):
            raise ValueError(f"{PIPELINE_TASK}: give exactly one of questions and question")
        for i, context in enumerate(contexts):
            if not isinstance(context, str):
                raise ValueError(f"{PIPELINE_TASK}: document {i} must be a string; got {type(context).__name__}")
        answers = press.answer_batch(self.model, self.tokenizer, contexts=contexts,
                                     questions=[question] if question is not None else questions,
                                     answer_prefix=params.get("answer_prefix", ""),
                                     max_new_tokens=params.get("max_new_tokens"))
        return [self.postprocess({"answers": a, "single": question is not None}) for a in answers]

    def postprocess(self, model_outputs, **_):
        answers = model_outputs["answers"]
        if model_outputs["single"]:
            return {"answer": answers[0].text, "certificate": answers[0].certificate}
        return {"answers": [a.text for a in answers], "certificates": [a.certificate for a in answers]}


def register_pipeline() -> None:
    """Make ``transformers.pipeline("kvcert-text-generation", model=..., tokenizer=...)`` build a PressPipeline
    (once per process; nothing is registered on import)."""
    if PIPELINE_TASK not in PIPELINE_REGISTRY.supported_tasks:
        PIPELINE_REGISTRY.register_pipeline(PIPELINE_TASK, pipeline_class=PressPipeline,
                                            pt_model=AutoModelForCausalLM)


def press(**kwargs) -> Press:
    """A ``Press`` (see there): ``with kvcert.press(policy="snapkv", compression_ratio=0.5)(model):
    model.generate(...)``."""
    return Press(**kwargs)


class _Run:
    """One ``with press(model)``: the context the press's attention function attends with, and the hooks."""

    def __init__(self, press: Press, model, function):
        self.press, self.model, self.function = press, model, function
        self.context: AttentionContext | None = None
        self.recording: PrefillRecording | None = None
        self.cache: PressCache | None = None
        self.batch = None  # kvcert.batching.GenerateBatch while generate decodes a batch
        self.busy = False  # kvcert's own prefill of a batch row runs the model inside a hook
        self.layerwise: _Layerwise | None = None  # during a prefill that compresses each layer as it is run
        self.new_tokens: int | None = None  # generate's max_new_tokens for the prompt being prefilled (None: unknown)

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """kvcert attention bound to this run's current context (none: the model attends as it normally would).
        A batch's rows are told apart by their slots (padding slots have π = 0), so generate's padding mask is
        not needed there."""
        if self.batch is not None:
            attention_mask = None
        out = self.function(module, query, key, value, attention_mask, bound_context=self.context, **kwargs)
        if self.layerwise is not None and not self.busy:
            self.layerwise.compress(module.layer_idx)  # the prefill is done with this layer
        return out

    def mask(self, **kwargs):
        """The mask function of the press's attention: none for a batch's decode (see ``attention``)."""
        return None if self.batch is not None else padding_mask(**kwargs)

    def before(self, module, args, kwargs):
        """At a prompt's prefill (an empty cache), hand the model a PressCache that records the prefill."""
        if self.busy:
            return None
        key = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(key)
        if isinstance(cache, PressCache):
            if self.batch is not None:
                self.batch.fed(kwargs.get("input_ids", args[0] if args else None))
            if self.context is not None and self.context.compressor is not None:  # a decode-time bound
                ids = kwargs.get("input_ids", args[0] if args else None)
                self.context.compressor.before_pass(self.context, ids.shape[-1])
            return None  # a decode step on a compressed cache
        self.batch = self.layerwise = None
        if not isinstance(cache, Cache):
            if kwargs.get("use_cache") is False:
                raise ValueError("kvcert.press: use_cache=False: a press compresses the cache, so generate must keep "
                                 "one (leave use_cache on)")
            self.context = None  # a forward without a cache: plain attention
            return None
        if cache.get_seq_length() != 0:
            raise ValueError(f"kvcert.press: the call continues a cache of {cache.get_seq_length()} tokens; a press "
                             "compresses a whole prompt at its prefill (pass no cache, or an empty one)")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("kvcert.press: the prompt must come as input_ids (inputs_embeds are not supported)")
        mask = kwargs.get("attention_mask")
        if ids.shape[0] != 1 or (isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all())):
            from .batching import GenerateBatch

            self.batch = GenerateBatch.start(self, ids, mask, kwargs)
            self.cache = PressCache(list(self.batch.cache.layers))
            return args, self.batch.stand_in(kwargs, key)
        p = self.press
        from .batching import generation_settings

        self.new_tokens = generation_settings(self.model, ids.shape[-1])[1]
        needs = prefill_needs([p.policy], p.policy_options)
        self.recording = PrefillRecording.start(self.model, ids.shape[-1], observation_window=p.observation_window,
                                                **needs)
        self.cache = PressCache(list(self.recording.context.cache.layers))
        self.context = self.recording.context
        if p._layerwise:
            self.layerwise = _Layerwise(p, self.recording, self.cache, ids.shape[-1], self.new_tokens)
        return args, {**kwargs, key: self.cache}

    def after(self, module, args, kwargs, output):
        """After a prefill: select the retained sets and compress the PressCache in place."""
        if self.busy:
            return None
        if self.batch is not None and self.batch.pending:
            return self.batch.finish(self, output)
        if self.recording is None:
            return None
        recording, self.recording = self.recording, None
        p = self.press
        if self.layerwise is not None:
            layerwise, self.layerwise = self.layerwise, None
            self.context = AttentionContext(self.cache, recorder=new_recorder(self.cache, certify=p.certify,
                                                                              oracle=False))
            p._record(self.context.recorder, p.design == "poisson", layerwise.fields())
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        state = recording.finish(ids, ids[:, :0], output.logits[:, -1].float(), "question_aware", p.policy_options)
        configuration = Configuration(p.policy, p.design, p.budget, p.seed)
        selections, choice = configuration_selections(state, configuration, item_id=p.item_id, options=p.options,
                                                      allocator=p.allocator, allocator_options=p.allocator_options,
                                                      target=p._target)
        compressor = p._compressor(state)
        reserve = decode_reserve(self.new_tokens) if compressor is None else max(
            0, compressor.bound.max_cache_tokens - max(sel.index.shape[-1] for sel in selections))
        self.context = decoding_context(state, [selections], reserve=reserve, certify=p.certify, oracle=p.oracle)
        self.context.compressor = compressor
        if compressor is None:
            for layer in self.context.cache.layers:
                layer.grow_on_demand(self.new_tokens)
        self.cache.layers = self.context.cache.layers  # generate holds this cache: it now holds the kept slots
        if choice is not None and (message := cap_binding_message(choice, p._target, p.budget)):
            warnings.warn(message, TargetNotMetWarning, stacklevel=2)
        retained, cache_bytes, full_bytes, kept_bytes = _footprint(state, selections)
        p._record(self.context.recorder, p.design == "poisson",
                  {"retained_tokens": retained, "context_tokens": state.context_tokens, "cache_bytes": cache_bytes,
                   "full_bytes": full_bytes, "kept_bytes": kept_bytes, "target_choice": choice,
                   **({} if compressor is None else {"peak_cache_tokens": lambda: compressor.peak,
                                                     "decode_compressions": lambda: compressor.compressions})})
        return None


class _Layerwise:
    """One prompt's prefill compressing each layer as soon as the model has run it (``_Run.attention`` calls
    ``compress`` after the layer's attention): the layer's observation is completed, its retained set selected
    (``LayerSelector``: the selections ``configuration_selections`` makes after the whole prefill) and the layer
    replaced, in the prefill's cache and in the PressCache generate holds, by its kept slots (plus
    ``decode_reserve`` slots that grow on demand). What the prefill observed of the layer beyond its queries'
    window is dropped with it."""

    def __init__(self, press: Press, recording: PrefillRecording, cache: PressCache, n: int, new_tokens: int | None):
        seed = press.seed if press.item_id is None else item_seed(press.seed, press.item_id)
        n_layers = len(recording.context.cache.layers)
        self.selector = LayerSelector(n, n_layers, press.policy, press.design, press.budget, seed, press.options,
                                      press.allocator, press.allocator_options, press.policy_options)
        self.recording, self.cache, self.new_tokens = recording, cache, new_tokens
        self.footprints: list[tuple[float, int, int, int]] = []

    def compress(self, i: int) -> None:
        """Layer ``i`` has attended over the whole prompt: replace it by its kept slots."""
        ctx = self.recording.context
        layer, obs = ctx.cache.layers[i], ctx.observations[i]
        self.recording.finish_layer(i)
        selection = self.selector.select(i, layer_view(layer, obs))
        self.footprints.append(layer_footprint(layer, selection))
        compressed = layer.derive([selection], reserve=decode_reserve(self.new_tokens))
        compressed.grow_on_demand(self.new_tokens)
        ctx.cache.layers[i] = self.cache.layers[i] = compressed
        obs.pre_rope_keys = obs.accumulated_attention = None

    def fields(self) -> dict:
        """AnswerCertificate's footprint fields, as ``_footprint`` gives them after the whole prefill."""
        if len(self.footprints) != len(self.cache.layers):
            raise RuntimeError(f"kvcert.press: the prefill compressed {len(self.footprints)} of "
                               f"{len(self.cache.layers)} layers (an attention layer did not run on the prompt)")
        retained, cache_bytes, full_bytes, kept_bytes = zip(*self.footprints)
        return {"retained_tokens": float(np.mean(retained)), "context_tokens": self.recording.n,
                "cache_bytes": sum(cache_bytes), "full_bytes": sum(full_bytes), "kept_bytes": sum(kept_bytes),
                "target_choice": None}


__all__ = ["PIPELINE_TASK", "AnswerCertificate", "Press", "PressAnswer", "PressCache", "PressPipeline", "press",
           "register_pipeline"]
