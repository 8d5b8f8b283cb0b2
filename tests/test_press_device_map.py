"""A model dispatched by accelerate's ``device_map`` (``kvcert.load_model(..., device_map=...)``) gives the press and
``kvcert.generate`` the answers and certificates of the same model on one device.

On a machine without a GPU the split is the one accelerate allows there: half of SmolLM2's layers on the CPU, the
other half offloaded to disk (their weights on the meta device, streamed in by accelerate's hooks at each forward).
A bug that took a layer's device from its parameters would put that layer's cache on the meta device; one that
assumed one device for every layer would fail where the layers' certificate summaries are gathered. With CUDA the
same comparison runs with half of the layers on the GPU (skipped here without one).
"""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch

import kvcert
from kvcert.errors import ModelLoadError
from kvcert.targets import TargetNotMetWarning
from kvcert.theory import passkey_prompt

NEW_TOKENS = 3


def _split_map(model, first: str, second: str) -> dict[str, str]:
    """SmolLM2's modules: embeddings (tied to the output head), rotary and the first half of the layers on ``first``;
    the rest on ``second``."""
    n = model.config.num_hidden_layers
    placement = {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": second, "lm_head": first}
    placement.update({f"model.layers.{i}": first if i < n // 2 else second for i in range(n)})
    return placement


@pytest.fixture(scope="module")
def single():
    return kvcert.load_model("smollm2", device="cpu")


@pytest.fixture(scope="module")
def prompt(single):
    context, question, _ = passkey_prompt(n_noise=8, seed=5)
    return context, question, " The pass key is"


def _press_answer(model, tokenizer, prompt, **options):
    context, question, prefix = prompt
    ids = tokenizer(context + question + prefix, return_tensors="pt").input_ids.to(model.device)
    press = kvcert.press(policy="snapkv", compression_ratio=0.5, seed=3, **options)
    with press(model):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[-1]:].tolist(), press.certificate, out.past_key_values


def _check_split(single, split, prompt, devices, rtol=1e-5):
    """The press (Poisson, with its certificate) on the split model against the model on one device."""
    model, tokenizer = single
    split_model, _ = split
    assert {str(d) for d in split_model.hf_device_map.values()} == devices
    tokens, cert, _ = _press_answer(model, tokenizer, prompt)
    split_tokens, split_cert, cache = _press_answer(split_model, tokenizer, prompt)
    assert split_tokens == tokens
    assert split_cert.retained_tokens == cert.retained_tokens and split_cert.kept_bytes == cert.kept_bytes
    columns = ["step", "layer", "kv_head", "trace_var", "cert", "rel_cert"]
    a, b = cert.steps[columns], split_cert.steps[columns]
    assert len(a) == len(b) > 0 and split_cert.max_rel_cert > 0
    torch.testing.assert_close(torch.tensor(b.to_numpy()), torch.tensor(a.to_numpy()), rtol=rtol, atol=1e-7)
    # every layer's compressed cache lives where that layer runs, never on the meta device of offloaded weights
    for i, layer in enumerate(cache.layers):
        projection = split_model.model.layers[i].self_attn.k_proj
        hook = getattr(projection, "_hf_hook", None)
        where = torch.device(getattr(hook, "execution_device", None) or projection.weight.device)
        assert layer.keys.device.type == where.type != "meta"
        assert layer.log_pi.device == layer.keys.device


@pytest.mark.smollm2
@pytest.mark.slow  # two loads, two presses and two targeted generates: make test-full
def test_a_cpu_and_disk_split_gives_the_single_device_answer_and_certificate(single, prompt, tmp_path):
    """Layers 0-14 on the CPU, 15-29 offloaded to disk: the press's greedy tokens, retained slots and step table
    (certificates) equal those of the model loaded whole; so does ``kvcert.generate`` with a policy that reads the
    model's rotary tables (expected_attention) under a target error (the per-head search over every layer)."""
    model, tokenizer = single
    split = kvcert.load_model("smollm2", device_map=_split_map(model, "cpu", "disk"), offload_folder=str(tmp_path))
    assert any(p.device.type == "meta" for p in split[0].parameters())  # some weights really are offloaded
    _check_split(single, split, prompt, {"cpu", "disk"})
    context, question, prefix = prompt
    kwargs = dict(context=context, question=question, answer_prefix=prefix, policy="expected_attention",
                  design="poisson", budget=0.5, target_error=0.5, max_new_tokens=NEW_TOKENS, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TargetNotMetWarning)  # some heads keep the cap: the same on both
        whole = kvcert.generate(model, tokenizer, **kwargs)
        parts = kvcert.generate(split[0], tokenizer, **kwargs)
    assert parts.token_ids == whole.token_ids
    pd.testing.assert_frame_equal(parts.target_choice, whole.target_choice, check_exact=False, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(parts.steps["rel_cert"].to_numpy()),
                               torch.tensor(whole.steps["rel_cert"].to_numpy()), rtol=1e-5, atol=1e-7)


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for a GPU/CPU split")
def test_a_gpu_and_cpu_split_gives_the_single_device_answer(single, prompt):
    model, _ = single
    split = kvcert.load_model("smollm2", device_map=_split_map(model, "cuda:0", "cpu"))
    # against the model wholly on the GPU; float32 kernels of two device types: the same greedy tokens,
    # certificates within rounding
    _check_split(kvcert.load_model("smollm2", device="cuda"), split, prompt, {"cuda:0", "cpu"}, rtol=1e-3)


@pytest.mark.parametrize("fields, message", [
    ({"device_map": "everywhere"}, "model.device_map='everywhere' is unknown"),
    ({"device_map": {"model.layers.0": 1.5}}, "model.device_map.model.layers.0=1.5"),
    ({"max_memory": {"cpu": "1GiB"}}, "model.max_memory: only used with model.device_map"),
    ({"offload_folder": "x"}, "model.offload_folder: only used with model.device_map"),
    ({"device_maps": "auto"}, "unknown keyword 'device_maps'"),
])
def test_a_bad_placement_is_refused_in_one_line_before_anything_loads(fields, message):
    with pytest.raises(ModelLoadError, match=message.replace(".", r"\.").replace("(", r"\(")) as err:
        kvcert.load_model("smollm2", **fields)
    assert "\n" not in str(err.value)
