"""Stand-ins for rehearsing a scale whose models and data cannot run here.

* Models: random-weight models with the architectures of the paper scale's models (Qwen2.5-7B,
  Llama-3.1-8B, Mistral-7B-v0.3, and the leaderboard study's Qwen3-8B), shrunk: fewer layers and narrower
  heads, but the same model class, the same ratio of query heads to KV heads (GQA), Qwen2's q/k/v biases,
  Qwen3's per-head query/key norms, Llama 3.1's rope scaling, each model's rope base and sliding-window
  setting. They are saved with ``save_pretrained`` in bfloat16, with a real
  tokenizer (the bundled SmolLM2's), as local Hugging Face directories that ``model=hf
  model.name=<dir>`` loads offline. Their answers are nonsense: they exercise the plumbing (shapes,
  dtypes, GQA, biases, rope variants, batching, tables), not the method. Optionally they also stop on
  a random slice of the vocabulary, so that answers have a few tokens, as real ones do.
* LongBench: a LongBench-format copy (JSON lines in the benchmark's record schema, one file per
  subset) of generated prose documents with questions whose answers occur in them, for
  ``data=longbench data.path=<dir>``.

    python -m kvcert.standins --out DIR [--layers 2 --kv-heads 2 --head-dim 16] [--stop-fraction 0.1]
                              [--longbench-tokens 2400] [--tokenizer DIR]

``--tokenizer`` loads the tokenizer from a directory (any stand-in's, which holds one) instead of the bundled
SmolLM2: stand-ins can then be built on a machine that cannot fetch it (a GPU node without network).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

from .architectures import published
from .atomic import new_directory

# Stand-in directory name -> the published architecture it shrinks.
MODELS = {
    "qwen2": "Qwen/Qwen2.5-7B-Instruct",
    "llama": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen3": "Qwen/Qwen3-8B",
}


def shrunk_config(name: str, *, vocab_size: int, layers: int = 2, kv_heads: int = 2, head_dim: int = 16,
                  special_ids: dict[str, int | None] | None = None) -> dict[str, Any]:
    """The published config of ``name`` with the sizes replaced; architectural features kept.

    query heads = kv_heads × the published GQA ratio; hidden size = query heads × head_dim; the MLP keeps
    its published width ratio. Rope settings, biases, norms, activation, window settings and the
    untied output layer are the published ones.
    """
    fields = published(name)
    ratio = fields["num_attention_heads"] // fields["num_key_value_heads"]
    heads = kv_heads * ratio
    hidden = heads * head_dim
    mlp_ratio = fields["intermediate_size"] / fields["hidden_size"]
    fields.update(
        num_hidden_layers=layers, num_key_value_heads=kv_heads, num_attention_heads=heads, hidden_size=hidden,
        head_dim=head_dim, intermediate_size=int(round(hidden * mlp_ratio / 32)) * 32, vocab_size=vocab_size,
    )
    if "max_window_layers" in fields:
        fields["max_window_layers"] = layers
    fields.pop("torch_dtype", None)
    fields.update({k: v for k, v in (special_ids or {}).items() if v is not None})
    return fields


def _tokenizer_ids(tokenizer) -> dict[str, int | None]:
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id}


def stop_ids(tokenizer, fraction: float, seed: int = 0) -> list[int]:
    """The tokenizer's EOS plus a seeded ``fraction`` of the vocabulary, as a stand-in's stop tokens.

    A random-weight model never emits EOS, so every answer would run to the workload's
    ``max_new_tokens`` (128 for some LongBench subsets) where a real model stops after a few tokens;
    stopping on a random slice of the vocabulary gives answers of about 1/fraction tokens instead.
    """
    rng = random.Random(seed)
    vocab = len(tokenizer)
    extra = rng.sample(range(vocab), int(round(fraction * vocab))) if fraction > 0 else []
    return sorted({int(tokenizer.eos_token_id), *extra})


def build_model(name: str, out_dir: str | Path, tokenizer, *, seed: int = 0, stop_fraction: float = 0.0,
                **sizes) -> Path:
    """Build, initialize (seeded) and save one stand-in as a bfloat16 HF directory; returns it.

    stop_fraction: see ``stop_ids`` (0: EOS only). Written to a temporary sibling first and renamed, so
    a directory that exists is complete.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    fields = shrunk_config(MODELS[name], vocab_size=len(tokenizer), special_ids=_tokenizer_ids(tokenizer), **sizes)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = stop_ids(tokenizer, stop_fraction, seed)
    with new_directory(out_dir, replace=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "standin.json").write_text(json.dumps(
            {"shrinks": MODELS[name], "seed": seed, "stop_fraction": stop_fraction,
             "note": "random weights: answers are nonsense"}, indent=2) + "\n")
    return out_dir


# ----------------------------------------------------------------------------- LongBench-format copy

def _document(rng: random.Random, tokenizer, tokens: int, facts: list[str]) -> str:
    """Prose of about ``tokens`` tokens with the fact sentences spread through it."""
    from .data.haystack import prose_sentences

    sentences: list[str] = []
    while len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) < tokens:
        sentences.extend(prose_sentences(rng, 64))
    for fact in facts:
        sentences.insert(rng.randrange(len(sentences) + 1), fact)
    return " ".join(sentences)


def longbench_records(tokenizer, subsets: list[str], per_subset: int, tokens: int, seed: int = 0) -> dict[str, list[dict]]:
    """``per_subset`` records per subset in LongBench's schema, documents of about ``tokens`` tokens.

    Each record asks where a named object was left; the answer (a place) is stated once in the
    document. Lengths vary from 0.75× to 1.25× ``tokens`` so that truncation cuts some and not others.
    """
    from .data.haystack import ADJECTIVES, NOUNS

    rng = random.Random(seed)
    out: dict[str, list[dict]] = {}
    for subset in subsets:
        records = []
        for i in range(per_subset):
            thing = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
            place = f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
            fact = f"Everyone agreed that the {thing} had been left beside {place}."
            length = int(tokens * rng.uniform(0.75, 1.25))
            context = _document(rng, tokenizer, length, [fact])
            records.append({
                "input": f"Where had the {thing} been left?", "context": context, "answers": [place],
                "length": len(context.split()), "dataset": subset, "language": "en", "all_classes": None,
                "_id": f"standin-{subset}-{i:04d}",
            })
        out[subset] = records
    return out


def build_longbench(out_dir: str | Path, tokenizer, *, subsets: list[str] | None = None, per_subset: int = 4,
                    tokens: int = 2400, seed: int = 0) -> Path:
    """Write the LongBench-format copy (``{subset}.jsonl`` per subset) as one complete directory."""
    from .data.longbench import DEFAULTS, write_copy

    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a rebuilt copy replaces the old one
    records = longbench_records(tokenizer, list(subsets or DEFAULTS["subsets"]), per_subset, tokens, seed)
    return write_copy(records, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcert.standins", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for models/<name>/ and longbench/")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--longbench-tokens", type=int, default=2400, help="typical document length (0: no copy)")
    parser.add_argument("--longbench-per-subset", type=int, default=4)
    parser.add_argument("--stop-fraction", type=float, default=0.0,
                        help="also stop on this seeded fraction of the vocabulary (answers of ~1/fraction tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a directory holding the tokenizer (default: the bundled SmolLM2's)")
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        print(f"kvcert.standins: error: --models: {unknown[0]!r} is unknown; known: {', '.join(MODELS)}",
              file=sys.stderr)
        return 2
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer_config.json").is_file():
        print(f"kvcert.standins: error: --tokenizer {args.tokenizer}: no tokenizer_config.json there", file=sys.stderr)
        return 2
    from .models import load_tokenizer

    tokenizer = load_tokenizer("smollm2" if args.tokenizer is None else f"hf:{args.tokenizer}")
    for i, name in enumerate(names):
        path = build_model(name, args.out / "models" / name, tokenizer, seed=args.seed + i, layers=args.layers,
                           kv_heads=args.kv_heads, head_dim=args.head_dim, stop_fraction=args.stop_fraction)
        print(f"kvcert.standins: wrote {path} (random weights, shape of {MODELS[name]})", file=sys.stderr)
    if args.longbench_tokens > 0:
        path = build_longbench(args.out / "longbench", tokenizer, per_subset=args.longbench_per_subset,
                               tokens=args.longbench_tokens, seed=args.seed)
        print(f"kvcert.standins: wrote {path} (LongBench format)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
