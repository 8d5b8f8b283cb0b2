"""``kvcert-fetch-model [model=… model.name=…] [--out FILE]``: fetch and convert a model once.

Takes the same model overrides as ``kvcert-run``; ``--out`` receives the model's fingerprint (JSON). The
workflow runs it where the network is (a local rule on SLURM).
"""

from __future__ import annotations

import json
import sys

from ..atomic import write_text_atomic
from ..errors import ModelLoadError, UsageError
from ..hydra_app import compose
from ..models import ModelSpec, load_model, model_fingerprint


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    if "--out" in argv:
        at = argv.index("--out")
        if at + 1 >= len(argv):
            print("kvcert-fetch-model: error: --out needs a file name", file=sys.stderr)
            return 2
        out = argv[at + 1]
        del argv[at : at + 2]
    try:
        from omegaconf import OmegaConf

        cfg = compose([a for a in argv if a.startswith(("model", "+model"))] + ["out_dir=unused"])
        spec = ModelSpec.parse(OmegaConf.to_container(cfg.model, resolve=True))
        if spec.kind == "hf":  # download only: the fetching host may have no GPU and little memory (kvcert.hub)
            from ..hub import fetch

            described = fetch(str(spec.name))
        else:
            model, _ = load_model(spec)
            described = {"parameters": sum(p.numel() for p in model.parameters()), "architecture": type(model).__name__}
        fingerprint = model_fingerprint(spec)
    except (UsageError, ModelLoadError, ValueError, OSError) as err:
        print(f"kvcert-fetch-model: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    fingerprint["parameters"] = described["parameters"]
    fingerprint["architecture"] = described["architecture"]
    text = json.dumps(fingerprint, indent=2, sort_keys=True)
    if out:
        write_text_atomic(text + "\n", out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
