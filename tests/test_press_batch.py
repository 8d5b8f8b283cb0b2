"""Batches under a press (``kvcert.batching``): several prompts of different lengths decoded together, each with its
own compressed per-head cache, give the answers and certificates each prompt gets alone.

The agreement on the bundled SmolLM2 (GQA: 9 query heads share 3 KV heads) is marked ``smollm2`` and loads the model
through the session's fixture; the layout, the stop tokens and the refusals run on the tiny random-weight models of
``tests/helpers/tiny_models.py`` (no download).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from helpers.tiny_models import build, prompt

import kvcert
from kvcert.attention import register
from kvcert.batching import BatchedLayer
from kvcert.generation import eos_ids
from kvcert.presses import PressCache
from kvcert.theory import passkey_prompt

CERT_COLUMNS = ["trace_var", "cert", "rel_cert", "out_norm", "tail_ess"]


def _left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, n) ids and mask of (1, n_r) prompts, padded on the left as a left-padding tokenizer pads them."""
    n = max(p.shape[-1] for p in prompts)
    ids = torch.stack([F.pad(p[0], (n - p.shape[-1], 0), value=pad) for p in prompts])
    mask = torch.stack([F.pad(torch.ones_like(p[0]), (n - p.shape[-1], 0)) for p in prompts])
    return ids, mask


def _greedy(model, ids, mask, new_tokens: int, **kwargs):
    """Stock greedy generate: (new token ids per row, log-probability of each chosen token per row)."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_scores=True, **kwargs)
    new = out.sequences[:, ids.shape[-1]:]
    logprobs = torch.stack([torch.log_softmax(s.float(), -1).gather(-1, new[:, i: i + 1])[:, 0]
                            for i, s in enumerate(out.scores)], -1)
    return new, logprobs


def _same_certificate(batched, alone, design: str) -> None:
    """The same steps, layers and heads, retained slots and bytes; the certificate columns within float rounding
    (the batch's attention reduces over padded rows in other shapes)."""
    assert batched.steps[["step", "layer", "kv_head"]].equals(alone.steps[["step", "layer", "kv_head"]])
    assert (batched.retained_tokens, batched.cache_bytes, batched.kept_bytes, batched.context_tokens) == (
        alone.retained_tokens, alone.cache_bytes, alone.kept_bytes, alone.context_tokens)
    pd.testing.assert_frame_equal(batched.steps[CERT_COLUMNS], alone.steps[CERT_COLUMNS], check_exact=False,
                                  rtol=1e-3, atol=1e-6)
    if design == "poisson":
        assert batched.max_rel_cert == pytest.approx(alone.max_rel_cert, rel=1e-3) and alone.max_rel_cert > 0
        assert batched.exceeded == alone.exceeded
    else:
        assert batched.steps["rel_cert"].isna().all()


@pytest.mark.slow  # SmolLM2 batches against each prompt alone, four presses (about 250 CPU-seconds): make test-full
@pytest.mark.smollm2
@pytest.mark.parametrize("policy, design", [("snapkv", "poisson"), ("snapkv", "topk"), ("knorm", "poisson"),
                                            ("knorm", "topk")])
def test_a_padded_batch_under_stock_generate_answers_as_each_prompt_alone(smollm2, policy, design):
    """SmolLM2, three prompts of different lengths, left-padded as a decoder's tokenizer pads them: stock greedy
    generate under the press gives each row the tokens it gives the prompt alone, the same log-probabilities and
    certificates up to float rounding, and a cache with one row per prompt, each holding its own kept slots."""
    model, tokenizer = smollm2
    new_tokens = 5
    prompts = []
    for noise, seed in ((6, 1), (12, 2), (9, 3)):
        context, question, _ = passkey_prompt(n_noise=noise, n_needles=1, seed=seed)
        prompts.append(kvcert.build_prompt(tokenizer, context, question, " The pass key is",
                                           max_new_tokens=new_tokens).prefix_ids)
    stop = sorted(eos_ids(model, tokenizer))
    press = kvcert.press(policy=policy, design=design, compression_ratio=0.6, seed=3)
    alone = []
    with press(model):
        for ids in prompts:
            tokens, logprobs = _greedy(model, ids, torch.ones_like(ids), new_tokens, eos_token_id=stop,
                                       pad_token_id=tokenizer.pad_token_id)
            alone.append((tokens[0].tolist(), logprobs[0], press.certificate))
        ids, mask = _left_padded(prompts, tokenizer.pad_token_id)
        tokens, logprobs = _greedy(model, ids, mask, new_tokens, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)
        certificates = press.certificates
    assert model.config._attn_implementation == "sdpa"
    assert len(certificates) == len(prompts) and len({p.shape[-1] for p in prompts}) == len(prompts)
    for r, (want_tokens, want_logprobs, want_certificate) in enumerate(alone):
        assert tokens[r].tolist() == want_tokens
        torch.testing.assert_close(logprobs[r], want_logprobs, rtol=0, atol=1e-4)
        _same_certificate(certificates[r], want_certificate, design)
        assert certificates[r].cache_bytes < certificates[r].full_bytes  # evicted per row
    with pytest.raises(ValueError, match="the last call was a batch of 3 rows; read press.certificates"):
        press.certificate


@pytest.mark.slow  # the pipeline on a batch of documents against each alone (about 50 CPU-seconds): make test-full
@pytest.mark.smollm2
def test_the_pipeline_with_a_list_of_documents_answers_as_each_document_alone(smollm2):
    """``pipe([doc, doc], questions=[...])``: every document prefilled and compressed once, every (document,
    question) pair one row of one decode, each answer and certificate ``Press.answer``'s for its document."""
    from transformers import pipeline

    from kvcert.presses import PIPELINE_TASK, register_pipeline

    model, tokenizer = smollm2
    register_pipeline()
    pipe = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer)
    documents = [passkey_prompt(n_noise=noise, n_needles=1, seed=seed)[0] for noise, seed in ((5, 4), (10, 5))]
    questions = ["What is the pass key?", "Repeat the pass key."]
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.5, seed=11)
    passes = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: passes.append(kwargs["input_ids"].shape),
                                             with_kwargs=True)
    try:
        outputs = pipe(documents, questions=questions, press=press, max_new_tokens=4)
    finally:
        handle.remove()
    assert len(outputs) == 2 and len(press.certificates) == 4
    prefills = [shape for shape in passes if shape[-1] > 40]
    assert len(prefills) == 2  # one prefill per document, not per question
    assert max(shape[0] for shape in passes) == 4  # the four pairs decode in one batch
    for document, output in zip(documents, outputs):
        alone = press.answer(model, tokenizer, context=document, questions=questions, max_new_tokens=4)
        assert output["answers"] == [a.text for a in alone]
        for got, want in zip(output["certificates"], alone):
            _same_certificate(got, want.certificate, "poisson")


def _ids(seed: int, n_context: int) -> torch.Tensor:
    context, question = prompt(seed, n_context=n_context)
    return torch.cat([context, question], -1)


def test_rows_keep_their_own_slots_draws_and_stop_tokens():
    """Tiny Llama: the cache holds one BatchedLayer row per prompt (its kept slots, then padding slots of π = 0,
    positions continuing the prompt's own); a row's draw does not depend on its neighbours; a row that stops early
    ends its certificate at its stop token while its neighbour decodes on, as each would alone."""
    _, model, _ = build("llama")
    a, b, c = _ids(3, 200), _ids(4, 120), _ids(5, 260)
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.6, seed=7)
    with press(model):
        alone = model.generate(input_ids=a, attention_mask=torch.ones_like(a), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, a.shape[-1]:].tolist()
        stop = alone[2]
        alone_stopped = model.generate(input_ids=a, attention_mask=torch.ones_like(a), max_new_tokens=6,
                                       do_sample=False, eos_token_id=stop, pad_token_id=0)[0, a.shape[-1]:].tolist()
        want = press.certificate
        ids, mask = _left_padded([a, b], 0)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=stop,
                             pad_token_id=0, return_dict_in_generate=True)
        first = press.certificates
        ids2, mask2 = _left_padded([a, c], 0)
        model.generate(input_ids=ids2, attention_mask=mask2, max_new_tokens=6, do_sample=False, eos_token_id=stop,
                       pad_token_id=0)
        second = press.certificates
    assert alone_stopped == alone[:3] and out.sequences[0, ids.shape[-1]:][:3].tolist() == alone_stopped
    assert first[0].n_steps == want.n_steps == 2  # the stop token is never fed on its own row's account
    assert first[1].n_steps > 2 or stop in out.sequences[1, ids.shape[-1]:].tolist()
    _same_certificate(first[0], want, "poisson")
    pd.testing.assert_frame_equal(first[0].steps, second[0].steps)  # neighbours b and c: the same draw for a
    assert isinstance(out.cache, PressCache)
    kept = [[], []]
    for layer in out.cache.layers:
        assert isinstance(layer, BatchedLayer) and layer.keys.shape[0] == 2
        prefix = layer.log_pi[:, :, : layer.n_prefix_slots]
        for r in range(2):
            kept[r].append(torch.isfinite(prefix[r]).sum(-1).float())
        assert not torch.isfinite(prefix[1]).all()  # b, the shorter prompt, has padding slots: π = 0
        # the slots appended while decoding continue each prompt's own positions
        assert layer.positions[0, 0, layer.n_prefix_slots].item() == a.shape[-1]
        assert layer.positions[1, 0, layer.n_prefix_slots].item() == b.shape[-1]
    for r in range(2):  # each row holds the slots its prompt keeps alone
        assert float(torch.cat(kept[r]).mean()) == pytest.approx(first[r].retained_tokens)


def test_num_return_sequences_share_one_prefill():
    """Identical rows (num_return_sequences with sampling) are prefilled once and keep the same retained slots."""
    _, model, _ = build("llama")
    a = _ids(3, 200)
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.6, seed=7)
    prefills = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: prefills.append(kwargs["input_ids"].shape),
                                             with_kwargs=True)
    try:
        with press(model):
            torch.manual_seed(0)
            out = model.generate(input_ids=a, attention_mask=torch.ones_like(a), max_new_tokens=4, do_sample=True,
                                 top_k=0, num_return_sequences=3, eos_token_id=None, pad_token_id=0)
    finally:
        handle.remove()
    assert out.shape[0] == 3
    # generate's call on the three rows (which the press answers from its own prefills), then one prefill of a
    assert [shape for shape in prefills if shape[-1] == a.shape[-1]] == [(3, a.shape[-1]), (1, a.shape[-1])]
    retained = {c.retained_tokens for c in press.certificates}
    assert len(press.certificates) == 3 and len(retained) == 1


def _snapshot(model) -> dict:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return {"attn": model.config._attn_implementation, "config": model.config.to_dict(),
            "hooks": (dict(model._forward_pre_hooks), dict(model._forward_hooks)),
            "registered": (sorted(AttentionInterface._global_mapping), sorted(AttentionMaskInterface._global_mapping))}


def test_bad_batches_get_one_line_and_leave_the_model_as_it_was():
    """A row beyond the model's window (naming the row and its lengths), a right-padded row, the oracle, beam
    search, compression during decoding, and a document beyond the window with truncate=error: one line each; the
    model is as before."""
    from helpers.tiny_models import COMMON
    from helpers.tokenizer import byte_level_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    _, model, _ = build("llama")
    register()
    before = _snapshot(model)
    window = model.config.max_position_embeddings
    short, long = _ids(3, 100), _ids(4, window - 30)
    press = kvcert.press(policy="snapkv", budget=0.5)
    cases = [
        ([short, long], {}, rf"row 1 of the batch: {long.shape[-1]} prompt tokens \+ 40 new tokens = "
                            rf"{long.shape[-1] + 40} > the model's window of {window} tokens"),
        ([short, _ids(5, 150)], {"right": True}, r"row 0 of the batch is not left-padded"),
        ([short, _ids(5, 150)], {"num_beams": 2}, r"cannot be reordered or expanded \(beam search"),
    ]
    for prompts, options, message in cases:
        ids, mask = _left_padded(prompts, 0)
        if options.pop("right", False):
            ids, mask = ids.flip(-1), mask.flip(-1)
        with pytest.raises(ValueError, match=message) as caught:
            with press(model):
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                               eos_token_id=None, pad_token_id=0, **options)
        assert "\n" not in str(caught.value)
        assert _snapshot(model) == before
    ids, mask = _left_padded([short, short[:, 10:]], 0)
    with pytest.raises(ValueError, match="oracle=True measures one prompt at a time"):
        with kvcert.press(policy="snapkv", budget=0.5, oracle=True)(model):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match=r"max_cache_tokens=128 \(compression during decoding\) runs one prompt"):
        with kvcert.press(policy="snapkv", budget=0.5, max_cache_tokens=128, compression_interval=16)(model):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
    assert _snapshot(model) == before

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    small = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})).eval()
    documents = ["the sky is blue. " * 10, " ".join(str(1000 * i + 7) for i in range(600))]
    with pytest.raises(ValueError, match=r"answer_batch: context 1: prompt \+ answer need \d+ tokens > "
                                         rf"max_context_tokens={window}") as caught:
        press.answer_batch(small, tokenizer, contexts=documents, questions=["what colour?"], max_new_tokens=3,
                           truncate="error")
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"2 lists of questions for 3 contexts"):
        press.answer_batch(small, tokenizer, contexts=documents + documents[:1], questions=[["a"], ["b"]])
