"""kvpress's token ids of prompts, from its pipeline's own preprocessing: run in the peer environment (`make peers`).

    python kvpress_prompts.py TOKENIZER_DIR < items.json > ids.json

items.json: a list of {"context", "question", "answer_prefix"}; ids.json: one [context_ids, question_ids] pair per
item, what ``KVPressTextGenerationPipeline.preprocess`` gives (kvpress prefills the first and compresses it, then
feeds the second). The pipeline is not built (that needs a model): its ``preprocess`` reads only ``self.tokenizer``.
Imports nothing from kvcert.
"""

from __future__ import annotations

import json
import sys
import types

from kvpress.pipeline import KVPressTextGenerationPipeline
from transformers import AutoTokenizer


def main() -> int:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    holder = types.SimpleNamespace(tokenizer=tokenizer)
    out = []
    for item in json.load(sys.stdin):
        ids = KVPressTextGenerationPipeline.preprocess(holder, item["context"], [item["question"]],
                                                       item["answer_prefix"], 1 << 30)
        out.append([ids["context_ids"][0].tolist(), ids["questions_ids"][0][0].tolist()])
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
