"""Stand-ins for the rehearsal: random-weight models with the paper models' architectures (shrunk), saved
as bfloat16 Hugging Face directories with the bundled tokenizer, and a LongBench-format copy that the
LongBench loader reads offline at both of the rehearsal's lengths."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvcert.architectures import PUBLISHED
from kvcert.standins import MODELS, build_longbench, build_model, shrunk_config, stop_ids

pytestmark = pytest.mark.smollm2  # the bundled tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from kvcert import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def built(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("standins")
    return {name: build_model(name, root / name, tokenizer, seed=i, stop_fraction=0.1)
            for i, name in enumerate(MODELS)}


@pytest.mark.parametrize("name", list(MODELS))
def test_shrunk_configs_keep_the_published_architecture(name):
    published = PUBLISHED[MODELS[name]]
    fields = shrunk_config(MODELS[name], vocab_size=1000, layers=2, kv_heads=2, head_dim=8)
    ratio = published["num_attention_heads"] // published["num_key_value_heads"]
    assert fields["model_type"] == published["model_type"]
    assert fields["num_attention_heads"] == 2 * ratio and fields["num_key_value_heads"] == 2
    assert fields["hidden_size"] == fields["num_attention_heads"] * 8 == fields["num_attention_heads"] * fields["head_dim"]
    for key in ("rope_theta", "rope_scaling", "sliding_window", "use_sliding_window", "tie_word_embeddings",
                "rms_norm_eps", "hidden_act", "max_position_embeddings"):
        assert fields.get(key) == published.get(key), key


def test_built_models_load_and_keep_their_features(built, tokenizer):
    from kvcert import load_model

    for name, path in built.items():
        config = json.loads((path / "config.json").read_text())
        assert config["dtype"] == "bfloat16"
        model, tok = load_model({"kind": "hf", "name": str(path), "dtype": "bfloat16", "device": "cpu"})
        assert next(model.parameters()).dtype == torch.bfloat16
        assert tok.get_vocab() == tokenizer.get_vocab()
        text = model.config.get_text_config(decoder=True)
        published = PUBLISHED[MODELS[name]]
        assert text.num_attention_heads // text.num_key_value_heads == (
            published["num_attention_heads"] // published["num_key_value_heads"])
        names = {n for n, _ in model.named_parameters()}
        has_bias = any(n.endswith("self_attn.q_proj.bias") for n in names)
        assert has_bias == (published["model_type"] == "qwen2")  # Qwen2's q/k/v biases
        assert text.rope_parameters["rope_theta"] == published["rope_theta"]
        if name == "llama":
            assert text.rope_parameters["rope_type"] == "llama3"
        assert set(model.generation_config.eos_token_id) == set(stop_ids(tokenizer, 0.1, list(MODELS).index(name)))
        assert tokenizer.eos_token_id in model.generation_config.eos_token_id


def test_a_standin_runs_through_generate(built, tokenizer):
    from kvcert import generate, load_model

    model, tok = load_model({"kind": "hf", "name": str(built["qwen2"]), "dtype": "bfloat16", "device": "cpu"})
    result = generate(model, tok, context="The grass is green. " * 40, question=" What is green?",
                      budget=0.5, design="poisson", setting="streaming", max_new_tokens=4)
    from kvcert.run_schema import DELTA

    steps = result.steps
    assert len(result.token_ids) >= 1 and len(steps) > 0
    # One row per step, layer and KV head, each with its certificate √(tr V̂ / δ) and that relative to ‖ô‖.
    config = model.config
    assert len(steps) == steps["step"].nunique() * config.num_hidden_layers * config.num_key_value_heads
    assert (steps["trace_var"] >= 0).all() and (steps["trace_var"] > 0).any()
    np.testing.assert_allclose(steps["cert"], np.sqrt(steps["trace_var"].to_numpy(float) / DELTA), rtol=1e-5)
    np.testing.assert_allclose(steps["rel_cert"], steps["cert"] / steps["out_norm"], rtol=1e-5)


def test_longbench_copy_loads_offline_at_both_lengths(tmp_path, tokenizer):
    from kvcert.data import load_items

    path = build_longbench(tmp_path / "lb", tokenizer, per_subset=2, tokens=900, seed=3)
    subsets = sorted(p.stem for p in path.glob("*.jsonl"))
    assert subsets == sorted(["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"])
    record = json.loads((path / "qasper.jsonl").read_text().splitlines()[0])
    assert record["answers"][0] in record["context"]
    for limit in (400, 800):
        items = load_items("longbench", {"name": "longbench", "path": str(path), "max_context_tokens": limit},
                           tokenizer, 12)
        assert len(items) == 12 and {i.task for i in items} == set(subsets)
        assert all(i.meta["prompt_tokens"] <= limit for i in items)
        assert any(i.meta["truncated"] for i in items)


def test_fetching_a_model_reads_headers_not_weights(built, tmp_path):
    """kvcert-fetch-model for model=hf describes the model from its files (no load, no GPU needed)."""
    from kvcert import load_model
    from kvcert.hub import FetchError, fetch

    described = fetch(str(built["llama"]))
    model, _ = load_model({"kind": "hf", "name": str(built["llama"]), "dtype": "bfloat16", "device": "cpu"})
    assert described["parameters"] == sum(p.numel() for p in model.parameters())
    assert described["architecture"] == type(model).__name__
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(FetchError, match=r"model.name=.*broken: cannot fetch"):
        fetch(str(broken))


def test_standins_build_from_a_tokenizer_directory(built, tmp_path, capsys):
    """``--tokenizer DIR``: a stand-in's own directory holds a tokenizer, and a new stand-in built from it (as on
    a machine that cannot fetch the bundled SmolLM2) has the same vocabulary; a directory without one is refused
    in one line naming it, and nothing is written."""
    from transformers import AutoTokenizer

    from kvcert.standins import main

    source = built["llama"]
    assert main(["--out", str(tmp_path / "new"), "--models", "qwen2", "--longbench-tokens", "0",
                 "--tokenizer", str(source)]) == 0
    made = AutoTokenizer.from_pretrained(tmp_path / "new" / "models" / "qwen2")
    assert made.get_vocab() == AutoTokenizer.from_pretrained(source).get_vocab()
    capsys.readouterr()
    assert main(["--out", str(tmp_path / "bad"), "--tokenizer", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer" in err[0] and "nowhere" in err[0]
    assert not (tmp_path / "bad").exists()
