"""``kvcert.press``: kvcert around stock ``model.generate``.

Under transformers' own generation loop the press must give what kvcert's own decode gives for the same prompt and
configuration (greedy tokens, retained slots, step table), leave the model exactly as it found it, and refuse bad
input in one line. Most checks run on the tiny random-weight models of ``tests/helpers/tiny_models.py`` (no
download); the agreement with ``kvcert.generate`` on the bundled SmolLM2 is marked ``smollm2``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers.tiny_models import ARCHS, build, prompt
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import kvcert
from kvcert.attention import register
from kvcert.generation import Configuration, decode_configurations, eos_ids
from kvcert.presses import PRESS_NAME, PressCache
from kvcert.policies import get_policy, prefill_needs
from kvcert.targets import check_target
from kvcert.theory import passkey_prompt

DOCS = Path(__file__).resolve().parent.parent / "docs" / "library.md"
STEPS = 5


def _ids(seed: int = 3, n_context: int = 200) -> torch.Tensor:
    context, question = prompt(seed, n_context=n_context)
    return torch.cat([context, question], -1)


def _generate(model, ids: torch.Tensor, **kwargs) -> list[int]:
    """Stock greedy generate of STEPS tokens (no stop token), the new tokens only."""
    kwargs = {"max_new_tokens": STEPS, "do_sample": False, "eos_token_id": None, "pad_token_id": 0, **kwargs}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, ids.shape[-1]:].tolist()


@pytest.mark.parametrize("policy, design, allocator, ratio, target_error", [
    ("snapkv", "poisson", "uniform", 0.6, None),
    ("h2o", "topk", "adakv", 0.6, None),
    ("expected_attention", "poisson", "pyramidkv", 0.6, None),
    ("snapkv", "poisson", "uniform", 0.0, 1.0),  # the target sizes each head below the uncapped budget
])
def test_the_press_under_stock_generate_is_kvcerts_decode(policy, design, allocator, ratio, target_error):
    """Same tokens, retained slots, bytes and step table (certificates) as ``decode_configurations`` on the same
    prompt: the press runs kvcert's selection and certified attention, only the loop is transformers'."""
    _, model, _ = build("llama")
    ids = _ids()
    press = kvcert.press(policy=policy, design=design, compression_ratio=ratio, seed=7, allocator=allocator,
                         target_error=target_error, oracle=True)
    with press(model):
        tokens = _generate(model, ids)
    needs = prefill_needs([policy])
    state = kvcert.prefill(model, ids, **needs)
    target = check_target(design, target_error, None, press.target_floor)
    expected, = decode_configurations(model, state, [Configuration(policy, design, press.budget, 7)],
                                      max_new_tokens=STEPS, stop_ids=set(), oracle=True, allocator=allocator,
                                      target=target)
    assert tokens == expected.token_ids
    cert = press.certificate
    assert cert.retained_tokens == expected.retained_tokens < ids.shape[-1]
    assert (cert.cache_bytes, cert.full_bytes, cert.kept_bytes) == (expected.cache_bytes, expected.full_bytes,
                                                                    expected.kept_bytes)
    assert cert.cache_bytes < cert.full_bytes  # evicted, not masked
    pd.testing.assert_frame_equal(cert.steps, expected.steps)
    assert cert.n_steps == STEPS - 1 and cert.context_tokens == ids.shape[-1]
    assert cert.steps["true_err"].notna().all()  # the oracle ran
    if design == "poisson":
        assert cert.max_rel_cert == pytest.approx(float(expected.steps["rel_cert"].max())) and cert.max_rel_cert > 0
        assert cert.mean_rel_cert == pytest.approx(float(expected.steps["rel_cert"].mean()))
        heads = expected.steps.groupby(["step", "layer"])["rel_cert"].max()
        assert cert.exceeded == [pair for pair, value in heads.items() if value > press.eps]
        assert cert.above(0.0)["rel_cert"].tolist() == heads.tolist()
    else:
        assert cert.steps["rel_cert"].isna().all() and cert.exceeded == []
    assert (cert.target_choice is not None) == (target_error is not None)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_every_tiny_architecture_agrees(arch):
    """Sliding-window layers (Mistral, Qwen2, Gemma3), one KV head, fused projections, partial rotary: the press
    under stock generate still gives kvcert's decode, tokens and step table."""
    _, model, _ = build(arch)
    ids = _ids()
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.6, seed=7)
    with press(model):
        tokens = _generate(model, ids)
    expected, = decode_configurations(model, kvcert.prefill(model, ids),
                                      [Configuration("snapkv", "poisson", press.budget, 7)], max_new_tokens=STEPS,
                                      stop_ids=set())
    assert tokens == expected.token_ids
    pd.testing.assert_frame_equal(press.certificate.steps, expected.steps)
    assert press.certificate.cache_bytes < press.certificate.full_bytes


def test_the_cache_generate_holds_is_physically_compressed():
    """return_dict_in_generate hands back the cache: a PressCache whose every KV head holds its kept slots and the
    generated tokens, fewer than the prompt's."""
    _, model, _ = build("llama")
    ids = _ids()
    press = kvcert.press(policy="snapkv", design="topk", budget=0.25)
    with press(model):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    assert isinstance(out.cache, PressCache)
    kept = kvcert.retained_count(0.25, ids.shape[-1])
    for layer in out.cache.layers:
        assert layer.keys.shape[-2] == kept + 2  # the kept prompt slots and the two tokens fed after the prompt
        assert layer.get_seq_length() == ids.shape[-1] + 2  # positions continue the prompt's
    assert press.certificate.retained_tokens == kept


def test_sampling_eos_and_streamers_run_under_the_press():
    """Sampling draws from torch's generator as stock generate does; an eos token stops the answer (and its
    certificate); a streamer receives the tokens; a second answer replaces the first's certificate."""
    reference, model, _ = build("llama")
    ids = _ids()
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.5, seed=1)

    class Tokens:
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value.reshape(-1).tolist())

        def end(self):
            self.seen.append("end")

    streamer = Tokens()
    with press(model):
        torch.manual_seed(0)
        sampled = _generate(model, ids, do_sample=True, top_k=0, max_new_tokens=8, streamer=streamer)
        greedy = _generate(model, ids, max_new_tokens=8)
        stop = greedy[3]
        stopped = _generate(model, ids, max_new_tokens=8, eos_token_id=stop)
    assert streamer.seen[0] == ids[0].tolist() and streamer.seen[-1] == "end"
    assert [t for chunk in streamer.seen[1:-1] for t in chunk] == sampled
    assert sampled != greedy  # the random weights give a flat distribution: 8 draws do not all hit the argmax
    assert stopped == greedy[: greedy.index(stop) + 1]
    assert press.certificate.n_steps == len(stopped) - 1


def _snapshot(model) -> dict:
    return {"attn": model.config._attn_implementation, "config": model.config.to_dict(),
            "hooks": (dict(model._forward_pre_hooks), dict(model._forward_hooks)),
            "modules": [(name, type(m), dict(m._forward_pre_hooks), dict(m._forward_hooks))
                        for name, m in model.named_modules()],
            "forward": type(model).forward, "own": sorted(vars(model)),
            "registered": (sorted(AttentionInterface._global_mapping), sorted(AttentionMaskInterface._global_mapping))}


def test_outside_the_with_the_model_is_untouched():
    """After the with (normal exit, or an exception inside it) the model's attributes, config, hooks, modules and
    the attention registries are as before, and generate's tokens and logits are the stock model's."""
    reference, model, _ = build("llama")
    ids = _ids()
    register()  # the press registers kvcert's function once per process, as attach does
    before = _snapshot(model)
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.5)
    with press(model):
        assert model.config._attn_implementation.startswith(PRESS_NAME)
        _generate(model, ids)
    assert _snapshot(model) == before
    with pytest.raises(RuntimeError, match="boom"):
        with press(model):
            raise RuntimeError("boom")
    assert _snapshot(model) == before
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)
    assert _generate(model, ids) == _generate(reference, ids)


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 0.5, "compression_ratio": 0.5}, r"exactly one of budget and compression_ratio \(got both\)"),
    ({}, r"exactly one of budget and compression_ratio \(got neither\)"),
    ({"compression_ratio": 1.0}, r"compression_ratio=1.0 must lie in \[0, 1\)"),
    ({"compression_ratio": -0.1}, r"compression_ratio=-0.1 must lie in \[0, 1\)"),
    ({"budget": 0.0}, r"budget=0.0 must lie in \(0, 1\]"),
    ({"budget": 0.5, "policy": "snap"}, r"policy='snap' is unknown; known: \[.*'snapkv'"),
    ({"budget": 0.5, "allocator": "ada"}, r"allocator='ada' is unknown; known: \['adakv', 'pyramidkv', 'uniform'\]"),
    ({"budget": 0.5, "design": "top"}, r"design='top' is unknown; known: \['clt', 'poisson', 'topk'\]"),
    ({"budget": 0.5, "design": "topk", "target_error": 0.1}, "needs design 'poisson'"),
])
def test_bad_keywords_get_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as caught:
        kvcert.press(**kwargs)
    assert "\n" not in str(caught.value)


def test_a_nested_press_beam_search_or_no_cache_is_refused_and_the_model_left_as_it_was():
    _, model, _ = build("llama")
    ids = _ids()
    register()
    before = _snapshot(model)
    outer = kvcert.press(policy="snapkv", budget=0.5)
    inner = kvcert.press(policy="knorm", budget=0.5)
    with pytest.raises(RuntimeError, match="a press is already applied to this model; nested presses"):
        with outer(model):
            with inner(model):
                pass
    assert _snapshot(model) == before
    with pytest.raises(ValueError, match=r"cannot be reordered or expanded \(beam search"):  # batches: test_press_batch
        with outer(model):
            _generate(model, ids, num_beams=2)
    with pytest.raises(ValueError, match="use_cache=False: a press compresses the cache"):
        with outer(model):
            _generate(model, ids, use_cache=False)
    assert _snapshot(model) == before


def test_the_documented_custom_policy_runs():
    """docs/library.md's "Your own policy" example, run as written; its press then compresses by value norm."""
    block = DOCS.read_text().split("## Your own policy", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {}
    try:
        exec(compile(code, str(DOCS), "exec"), namespace)
        assert "value_norm" in kvcert.POLICIES
        _, model, _ = build("llama")
        ids = _ids()
        press = namespace["press"]
        with press(model):
            _generate(model, ids)
        state = kvcert.prefill(model, ids)
        view = state.layer_views()[0]
        torch.testing.assert_close(get_policy("value_norm").score(view), view.values.norm(dim=-1))
        assert press.certificate.n_steps == STEPS - 1 and press.certificate.max_rel_cert > 0
    finally:
        kvcert.POLICIES.pop("value_norm", None)


def test_several_questions_share_one_prefill_and_each_is_generates_streaming_answer():
    """``Press.answer``: one prefill and one compression of the context, then each question; every answer (tokens,
    step table with the question's positions) is ``kvcert.generate(setting="streaming")``'s for that question."""
    from helpers.tiny_models import COMMON
    from helpers.tokenizer import byte_level_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})).eval()
    context = "the sky is blue. " * 30 + "the key is 4711. " + "grass is green. " * 30
    questions = ["what is the key?", "what colour is the sky?"]
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.6, seed=5)
    prefills = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: prefills.append(kwargs["input_ids"].shape),
                                             with_kwargs=True)
    try:
        answers = press.answer(model, tokenizer, context=context, questions=questions, max_new_tokens=4)
    finally:
        handle.remove()
    longest_question = max(len(tokenizer(q).input_ids) for q in questions)
    assert [shape[-1] > longest_question for shape in prefills].count(True) == 1  # the context ran once
    assert len(prefills) == 1 + 2 * 4  # then per question: the question, and the 3 tokens fed after it
    for question, answer in zip(questions, answers):
        expected = kvcert.generate(model, tokenizer, context=context, question=question, policy="snapkv",
                                   design="poisson", budget=press.budget, seed=5, setting="streaming", oracle=False,
                                   max_new_tokens=4)
        assert answer.token_ids == expected.token_ids and answer.text == expected.text
        pd.testing.assert_frame_equal(answer.certificate.steps, expected.steps)
        assert answer.certificate.max_rel_cert > 0 and answer.certificate.cache_bytes == expected.cache_bytes
    assert press.certificate.steps.equals(answers[-1].certificate.steps)
    with pytest.raises(ValueError, match="questions must be a non-empty list"):
        press.answer(model, tokenizer, context=context, questions="what is the key?")


def test_the_pipeline_task_answers_as_press_answer():
    """``pipeline("kvcert-text-generation")`` after ``register_pipeline()``: the answers and certificates of
    ``Press.answer``; a pipeline without a press, or with an unknown keyword, is refused in one line."""
    from helpers.tiny_models import COMMON
    from helpers.tokenizer import byte_level_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, pipeline
    from transformers.pipelines import PIPELINE_REGISTRY

    from kvcert.presses import PIPELINE_TASK, PressPipeline, register_pipeline

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})).eval()
    registered = PIPELINE_TASK in PIPELINE_REGISTRY.supported_tasks
    register_pipeline()
    try:
        pipe = pipeline(PIPELINE_TASK, model=model, tokenizer=tokenizer)
        assert isinstance(pipe, PressPipeline)
        context = "the sky is blue. " * 30 + "the key is 4711. " + "grass is green. " * 30
        questions = ["what is the key?", "what colour is the sky?"]
        press = kvcert.press(policy="snapkv", compression_ratio=0.6, seed=5)
        out = pipe(context, questions=questions, press=press, max_new_tokens=3)
        expected = press.answer(model, tokenizer, context=context, questions=questions, max_new_tokens=3)
        assert out["answers"] == [a.text for a in expected]
        for got, want in zip(out["certificates"], expected):
            pd.testing.assert_frame_equal(got.steps, want.certificate.steps)
        single = pipe(context, question=questions[0], press=press, max_new_tokens=3)
        assert single["answer"] == expected[0].text
        with pytest.raises(ValueError, match="give press=kvcert.press"):
            pipe(context, question=questions[0])
        with pytest.raises(ValueError, match=r"unknown keywords \['temperature'\]"):
            pipe(context, question=questions[0], press=press, temperature=0.5)
    finally:
        if not registered:
            PIPELINE_REGISTRY.supported_tasks.pop(PIPELINE_TASK, None)


def test_generate_serves_by_default_and_the_runner_passes_the_studys_settings():
    """``kvcert.generate`` without oracle or max_new_tokens: no true error, the model's generation config's token
    limit, the model's own dtype; the cell runner names oracle, certify, delta and max_new_tokens at its one decode
    call, so no default of the library reaches a cell."""
    import ast
    import inspect

    from helpers.tiny_models import COMMON
    from helpers.tokenizer import byte_level_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvcert.runner.cell as cell

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})).eval().to(torch.bfloat16)
    model.generation_config.max_new_tokens = 3
    model.generation_config.eos_token_id = None
    result = kvcert.generate(model, tokenizer, context="the sky is blue. " * 40, question="what colour is the sky?",
                             policy="snapkv", design="poisson", budget=0.5)
    assert len(result.token_ids) == 3
    assert result.steps["true_err"].isna().all() and result.steps["cert"].notna().all()
    from kvcert.run_schema import DELTA  # the certificate of each row: √(tr V̂ / δ), computed in float32 or wider

    assert (result.steps["trace_var"] > 0).any()
    assert result.steps["cert"].to_numpy() == pytest.approx((result.steps["trace_var"].to_numpy() / DELTA) ** 0.5,
                                                            rel=1e-12)
    assert model.dtype == torch.bfloat16 and result.attention_path["path"] == "pytorch"  # no float32 cast
    defaults = inspect.signature(kvcert.generate).parameters
    assert defaults["oracle"].default is False and defaults["max_new_tokens"].default is None
    calls = [node for node in ast.walk(ast.parse(inspect.getsource(cell)))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "decode_configurations"]
    assert len(calls) == 1
    assert {"oracle", "certify", "delta", "max_new_tokens"} <= {k.arg for k in calls[0].keywords}


@pytest.mark.smollm2
def test_on_smollm2_the_press_gives_kvcert_generates_answer_and_certificates(smollm2):
    """The bundled model: stock greedy generate under the press and ``kvcert.generate`` on the same prompt (built by
    ``kvcert.build_prompt``) give the same tokens and the same step table, oracle errors included."""
    model, tokenizer = smollm2
    context, question, _ = passkey_prompt(n_noise=4, n_needles=1, seed=1)
    prefix, new_tokens = " The pass key is", 4
    result = kvcert.generate(model, tokenizer, context=context, question=question, answer_prefix=prefix,
                             policy="snapkv", design="poisson", budget=0.5, seed=3, oracle=True,
                             max_new_tokens=new_tokens)
    ids = kvcert.build_prompt(tokenizer, context, question, prefix, max_new_tokens=new_tokens).prefix_ids
    press = kvcert.press(policy="snapkv", design="poisson", compression_ratio=0.5, seed=3, oracle=True)
    with press(model):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=sorted(eos_ids(model, tokenizer)))
    assert out[0, ids.shape[-1]:].tolist() == result.token_ids
    pd.testing.assert_frame_equal(press.certificate.steps, result.steps)
    assert press.certificate.max_rel_cert > 0 and result.steps["true_err"].notna().all()
    assert press.certificate.cache_bytes == result.cache_bytes < result.full_bytes
    assert model.config._attn_implementation == "sdpa"
