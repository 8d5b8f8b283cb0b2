"""A byte-level BPE tokenizer trained on the fly, so that model-free tests need no model download.

It is built the way SmolLM2's is (byte-level BPE; ``<|endoftext|>`` = 0 unknown, ``<|im_start|>`` = 1 BOS,
``<|im_end|>`` = 2 EOS and padding), trained with the ``tokenizers`` package on a small corpus of the
project's own text (the RULER haystack's wording, the test workloads, a few lines of prose, digits).
Any text tokenizes, since every byte is in the initial alphabet. ``gguf_fields`` gives the same tokenizer
as the ``tokenizer.*`` keys of a GGUF file, for ``tests/helpers/tiny_gguf.py``.
"""

from __future__ import annotations

import functools
import json
from typing import Any

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 1024


def _corpus() -> list[str]:
    from helpers.workload import items

    from kvcert.data.haystack import COMMON_WORDS, NOISE_TEXT

    lines = [NOISE_TEXT] * 4 + [" ".join(COMMON_WORDS)]
    lines += [json.dumps(record, ensure_ascii=False) for record in items()]
    lines += [
        "The special pass key is 51326. What is the special pass key? The special pass key is",
        "Operations log: the backup rotated, the cache warmed and the queue drained before dawn.",
        "Passage 1: The harbour town kept a ledger of every ship that docked there.",
        " ".join(str(i) for i in range(200)),
    ]
    return lines


@functools.lru_cache(maxsize=1)
def _trained():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def byte_level_tokenizer():
    """A ``PreTrainedTokenizerFast`` (a fresh object each call; the training runs once per process)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_trained(), bos_token=SPECIALS[1], eos_token=SPECIALS[2],
                                   unk_token=SPECIALS[0], pad_token=SPECIALS[2], clean_up_tokenization_spaces=False)


def gguf_fields() -> tuple[tuple[str, Any, Any, Any], ...]:
    """``(key, value, vtype, sub_type)`` of the ``tokenizer.*`` GGUF keys of the same tokenizer."""
    from gguf import GGUFValueType as T

    state = json.loads(_trained().to_str())
    vocab = state["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert tokens[: len(SPECIALS)] == list(SPECIALS)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    token_type = [3 if t in SPECIALS else 1 for t in tokens]  # 3: control, 1: normal
    return (
        ("tokenizer.ggml.model", "gpt2", T.STRING, None),
        ("tokenizer.ggml.pre", "smollm", T.STRING, None),
        ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
        ("tokenizer.ggml.token_type", token_type, T.ARRAY, T.INT32),
        ("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING),
        ("tokenizer.ggml.bos_token_id", 1, T.UINT32, None),
        ("tokenizer.ggml.eos_token_id", 2, T.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", 0, T.UINT32, None),
        ("tokenizer.ggml.padding_token_id", 2, T.UINT32, None),
    )
