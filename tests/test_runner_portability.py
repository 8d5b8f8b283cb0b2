"""Workloads no one here wrote, and models of other architectures, run through ``kvcert-run`` unchanged.

A JSON-lines workload in the documented schema (``tests/helpers/workload.py``: logs, a recipe, German /
Japanese / Greek / emoji text; metrics string_match_part, qa_f1, string_match_all and the default; missing
optional keys; an integer id) is written to a temporary directory and run, in a fresh process of the
installed ``kvcert-run`` with nothing but command-line overrides, on

* tiny random-weight GGUF files of other architectures (``tests/helpers/tiny_gguf.py``): Qwen2 (q/k/v
  biases, GQA 4/2) and Gemma3 (q/k norms, 6 layers of which 5 use a 32-token sliding window), plus — marked
  ``slow`` — Qwen2 with one KV head (MQA), Phi-3 (fused qkv) and StableLM (LayerNorm, partial rotary);
* a tiny Gemma3 saved with ``save_pretrained`` (sliding + full layers, one KV head) through ``model=hf``;
* the bundled SmolLM2 (``model=smollm2``, marked ``smollm2``),

in both settings, with every policy and both designs. Each cell must have the documented tables, one row per
item × configuration (one full-cache row per item), finite non-negative certificates on Poisson rows and step
rows for every layer and KV head of the model. For the tiny models the converted weights must give the source
model's logits, and each full-cache row must be the model's own greedy answer (its stock attention and
cache), so a mishandled architecture cannot pass by producing well-formed garbage. The tiny GGUFs are
converted into a temporary KVCERT_CACHE. Gemma2-style attention-logit soft-capping, which the estimator does
not model, must be refused with one error line.

``threads=1``: on a 2-core machine shared with other jobs torch's default thread count oversubscribes the
cores (a cell took ~10x longer); the thread count changes no result.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvcert

from helpers.cells import check_cell, expected_configurations, run_cell
from helpers.tiny_gguf import converted_dir, shared_kvcert_cache, shared_tiny_gguf, write_tiny_gguf
from helpers.tokenizer import byte_level_tokenizer
from helpers.workload import max_new_tokens, write_workload

POLICIES = sorted(kvcert.POLICIES)  # every registered policy, so a new one is run on every architecture
DESIGNS = ["topk", "poisson"]
SETTINGS = ["question_aware", "streaming"]
GRID = [f"policies=[{','.join(POLICIES)}]", f"designs=[{','.join(DESIGNS)}]", "budgets=[0.5]", "seeds=[0]"]
CONFIGURATIONS = expected_configurations(POLICIES, DESIGNS, [0.5], [0])


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path, records = write_workload(tmp_path_factory.mktemp("workload") / "foreign_items.jsonl")
    return path, records


def _run_and_check(out_dir: Path, workload, model_overrides, setting, num_layers, num_kv_heads, env=None, n_items=None):
    path, records = workload
    records = records[:n_items] if n_items else records
    run_cell(["data=jsonl", f"data.path={path}", *model_overrides, *GRID, f"setting={setting}",
              f"n_items={len(records)}", "threads=1", f"out_dir={out_dir}"], env=env)
    return check_cell(out_dir, item_ids=[str(r["id"]) for r in records], configurations=CONFIGURATIONS,
                      setting=setting, num_layers=num_layers, num_kv_heads=num_kv_heads,
                      max_new_tokens=max_new_tokens(records))


def _check_conversion(tiny, cache: Path, tolerance: float = 1e-4) -> None:
    """The copy kvcert converted and cached holds the source model's weights (same logits)."""
    from transformers import AutoModelForCausalLM

    converted = converted_dir(cache, tiny.path)
    assert (converted / "model.safetensors").is_file(), f"no converted copy in {converted}"
    loaded = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert type(loaded).__name__ == type(tiny.model).__name__
    ids = torch.randint(0, tiny.model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = tiny.model(ids).logits, loaded(ids).logits
    assert torch.allclose(expected, got, atol=tolerance, rtol=tolerance), (expected - got).abs().max()


@torch.no_grad()
def _stock_greedy(model, ids: torch.Tensor, max_new_tokens: int, stop: set[int]) -> tuple[list[int], float]:
    """Greedy tokens with the model's own attention and cache (no kvcert) and the first token's log-probability."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    tokens, first = [], None
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
        token = int(torch.argmax(logprobs))
        first = float(logprobs[token]) if first is None else first
        tokens.append(token)
        if token in stop:
            break
        ids = torch.tensor([[token]])
    return tokens, first


def _check_full_rows_match_stock_model(model, tokenizer, items, workload, tolerance=1e-3) -> None:
    """The full-cache row of every item is what the model generates greedily with its own attention.

    A kvcert attention path that mishandled an architecture (sliding windows, biases, fused projections,
    partial rotary, one KV head) would change the full-cache prediction, not only the compressed ones.
    """
    from kvcert.data.jsonl import read_jsonl_items
    from kvcert.generation import eos_ids
    from kvcert.runner.cell import item_prompt

    path, _ = workload
    stop = eos_ids(model, tokenizer)
    full = items[items["policy"] == "full"].set_index("item_id")
    for item in read_jsonl_items(path):
        if item.id not in full.index:
            continue
        ids = item_prompt(tokenizer, item, "question_aware", 1 << 30, "middle").prefix_ids
        tokens, first = _stock_greedy(model, ids, item.max_new_tokens, stop)
        row = full.loc[item.id]
        assert row["prediction"] == tokenizer.decode(tokens, skip_special_tokens=True), item.id
        assert row["new_tokens"] == len(tokens)
        assert abs(row["logprob_first"] - first) <= tolerance, (item.id, row["logprob_first"], first)


def _gguf_cell(tmp_path, tmp_path_factory, workload, arch, setting):
    tiny = shared_tiny_gguf(tmp_path_factory, arch)
    cache = shared_kvcert_cache(tmp_path_factory)
    items, steps, manifest = _run_and_check(
        tmp_path / "cell", workload, ["model=gguf", f"model.path={tiny.path}"], setting,
        tiny.num_layers, tiny.num_kv_heads, env={"KVCERT_CACHE": str(cache)},
    )
    assert manifest["model"]["kind"] == "gguf" and manifest["model"]["file"] == tiny.path.name
    assert (items["model"] == tiny.path.stem).all()
    _check_conversion(tiny, cache)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_dir(cache, tiny.path))
    _check_full_rows_match_stock_model(tiny.model, tokenizer, items, workload)
    return tiny, items, steps


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
@pytest.mark.slow  # make test-full: keeps make test near 12 minutes
def test_foreign_workload_on_gguf_of_other_architectures(tmp_path, tmp_path_factory, workload, arch, setting):
    tiny, items, steps = _gguf_cell(tmp_path, tmp_path_factory, workload, arch, setting)
    if tiny.sliding_layers:
        # Gemma3: sliding-window and global layers both compress and certify.
        assert set(steps["layer"]) >= set(tiny.sliding_layers) | {tiny.num_layers - 1}
    assert set(items["metric"]) == {"string_match_part", "qa_f1", "string_match_all"}
    assert set(items["task"]) == {"ops", "foreign_items"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_mqa", "phi3", "stablelm"])
def test_foreign_workload_on_more_gguf_architectures(tmp_path, tmp_path_factory, workload, arch):
    tiny, items, steps = _gguf_cell(tmp_path, tmp_path_factory, workload, arch, "streaming")
    if arch == "qwen2_mqa":
        assert set(steps["kv_head"]) == {0}


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_first_load_of_a_gguf_tokenizes_as_every_later_load(tmp_path, monkeypatch, workload, arch):
    """The first load converts the GGUF file; later loads read the converted copy. Both must give the same
    prompt ids, or a cell's answers would depend on whether the copy existed (a Qwen2 tokenizer built from
    GGUF fields and the same tokenizer saved and reloaded split digits differently)."""
    from kvcert.data.jsonl import read_jsonl_items
    from kvcert.models import load_model, load_tokenizer
    from kvcert.runner.cell import item_prompt

    tiny = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    monkeypatch.setenv("KVCERT_CACHE", str(tmp_path / "cache"))
    spec = {"kind": "gguf", "path": str(tiny.path)}
    _, first = load_model(spec)
    assert converted_dir(tmp_path / "cache", tiny.path).is_dir()
    later = [load_model(spec)[1], load_tokenizer(spec)]
    path, _ = workload
    for item in read_jsonl_items(path):
        expected = item_prompt(first, item, "question_aware", 1 << 30, "middle").prefix_ids.tolist()
        for tokenizer in later:
            assert item_prompt(tokenizer, item, "question_aware", 1 << 30, "middle").prefix_ids.tolist() == expected, item.id


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    """A Gemma3 text model saved with save_pretrained: a sliding and a global layer, one KV head (MQA)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import kvcert

    tokenizer = byte_level_tokenizer()  # built here: no model download
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("tiny-gemma3-hf")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, config


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.slow  # make test-full: keeps make test near 12 minutes
def test_foreign_workload_on_hf_directory_with_sliding_window_and_mqa(tmp_path, workload, tiny_gemma3_dir, setting):
    directory, config = tiny_gemma3_dir
    items, steps, manifest = _run_and_check(
        tmp_path / "cell", workload, ["model=hf", f"model.name={directory}"], setting,
        config.num_hidden_layers, config.num_key_value_heads,
    )
    assert manifest["model"]["kind"] == "hf" and manifest["model"]["sha256"]
    assert (items["model"] == str(directory)).all()
    resolved = (tmp_path / "cell" / "config.yaml").read_text()
    assert "dtype: bfloat16" in resolved  # model=hf's default dtype, run unchanged
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    _check_full_rows_match_stock_model(model, AutoTokenizer.from_pretrained(directory), items, workload,
                                       tolerance=0.05)


def test_attention_logit_softcapping_is_refused_in_one_line(tmp_path, workload, capsys):
    """Gemma2 caps attention logits (tanh); the kvcert estimator does not, so the run must refuse, not mis-compute.
    kvcert-run's main in this process (a fresh process would import torch again for one refusal)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from kvcert.runner import cli

    tokenizer = byte_level_tokenizer()  # built here: no model download
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, attn_logit_softcapping=50.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    directory = tmp_path / "tiny-gemma2"
    Gemma2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    path, _ = workload
    threads = torch.get_num_threads()
    try:
        rc = cli.main(["progress=false", "data=jsonl", f"data.path={path}", "model=hf", f"model.name={directory}",
                       "policies=[snapkv]", "designs=[poisson]", "budgets=[0.5]", "n_items=1", "threads=1",
                       f"out_dir={tmp_path / 'cell'}"])
    finally:
        torch.set_num_threads(threads)
    stderr = capsys.readouterr().err
    assert rc == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("kvcert-run: error:")]
    assert len(errors) == 1 and "soft-capping" in errors[0], stderr[-2000:]
    assert "Traceback" not in stderr
    assert not (tmp_path / "cell" / "items.parquet").exists()


@pytest.mark.smollm2
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.slow  # make test-full: keeps make test near 12 minutes
def test_foreign_workload_on_bundled_smollm2(tmp_path, workload, setting):
    # Two items (the log and the multilingual one) keep the 30-layer model's two cells near 30 s each.
    items, steps, manifest = _run_and_check(tmp_path / "cell", workload, ["model=smollm2"], setting, 30, 3, n_items=2)
    assert manifest["model"]["kind"] == "smollm2"
    assert manifest["model"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert json.loads((tmp_path / "cell" / "manifest.json").read_text())["dataset_sha256"]
