"""``kvcert-claim``: one pre-registered claim analysis (a Hydra app).

    kvcert-claim claim=c7 'cells=[results/cells/qwen_streaming]' out=results/claims/c7.json

Order of work, so that bad input never leaves partial outputs: verify the pre-registration lock,
check that every input exists, load the tables, compute, draw the figures, then write the JSON
result last (temporary file + rename). Errors end the run with one line on stderr and exit code 2.
Config: ``kvcert/conf/claim/claim.yaml`` (shipped inside the package).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvcert.analysis import claims, data, figures
from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.prereg import claim_spec, load_claims, verify_lock

EXIT_BAD_INPUT = 2


def _check_inputs(cells: list[str], needed: tuple[str, ...]) -> list[Path]:
    if not cells:
        raise AnalysisError("cells=[] is empty: pass the cell directories, e.g. 'cells=[results/cells/a]'")
    dirs = [Path(c) for c in cells]
    for d in dirs:
        if not d.is_dir():
            raise AnalysisError(f"{d}: missing cell directory")
        for table in needed:
            if not (d / f"{table}.parquet").is_file():
                raise AnalysisError(f"{d / (table + '.parquet')}: missing")
    return dirs


def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def run(cfg: dict) -> claims.ClaimResult:
    """Run one claim from a plain config dict (the Hydra config, resolved); raises AnalysisError."""
    root = Path(cfg.get("prereg_root") or ".")
    verify_lock(root)
    claim_id = str(cfg["claim"])
    if claim_id not in claims.REGISTRY:
        raise AnalysisError(f"claim={claim_id} is not one of {', '.join(sorted(claims.REGISTRY))}")
    doc = load_claims(root)
    spec = claim_spec(doc, claim_id)
    needed = claims.REGISTRY[claim_id].tables
    dirs = _check_inputs(list(cfg.get("cells") or []), needed)
    tables = claims.Tables(**{t: data.load_cells(dirs, t) for t in needed})
    opts = claims.options_for(spec, doc["conventions"], scale=str(cfg.get("scale", "default")),
                              n_boot=cfg.get("n_boot"), seed=cfg.get("seed"))
    result = claims.run_claim(claim_id, tables, spec, doc["conventions"], opts)
    result.details["inputs"] = [str(d) for d in dirs]
    if cfg.get("figures", True):
        result.details["figures"] = [str(p) for p in figures.save(result, cfg.get("figure_dir") or "paper_figures")]
    _write_json(Path(cfg["out"]), result.to_dict())
    return result


@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parent.parent / "conf" / "claim"), config_name="claim")
def _app(cfg: DictConfig) -> None:
    try:
        if OmegaConf.is_missing(cfg, "claim"):
            raise AnalysisError(f"claim is required: claim=<one of {', '.join(sorted(claims.REGISTRY))}>")
        result = run(OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as exc:  # a bad override or interpolation: one line, not a traceback
        print(f"kvcert-claim: error: config: {str(exc).splitlines()[0]}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except AnalysisError as exc:
        print(f"kvcert-claim: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    print(f"{result.claim}: {result.verdict} ({result.component} = {result.estimate:.4g}, "
          f"95% CI [{result.ci_low:.4g}, {result.ci_high:.4g}], threshold {result.threshold:g}; "
          f"paper: {result.paper_verdict}) -> {cfg.out}")


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
