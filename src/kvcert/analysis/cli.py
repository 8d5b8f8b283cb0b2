"""``kvcert-claim``: one pre-registered claim analysis (a Hydra app).

    kvcert-claim claim=c7 'cells=[results/cells/qwen_streaming]' out=results/claims/c7.json

Order of work, so that bad input never leaves partial outputs: verify the pre-registration lock,
check that every input exists, load the tables, compute, draw the figures, then write the JSON
result last (temporary file + rename). Errors end the run with one line on stderr and exit code 2.
Config: ``kvcert/conf/claim/claim.yaml`` (shipped inside the package).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvcert.analysis import claims, data, figures, prereg, registry as analyses
from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.prereg import claim_spec, load_claims, verify_lock
from kvcert.atomic import unwritable_reason, write_json_atomic
from kvcert.provenance import analysis_fingerprint, short

EXIT_BAD_INPUT = 2
# Values of claim.yaml that a caller of run() may leave out.
DEFAULTS = {"cells": [], "figure_dir": "paper_figures", "figures": True, "prereg_root": ".", "scale": "default",
            "n_boot": None, "seed": None, "allow_mixed_code": False, "prereg_version": 1}


def cell_fingerprints(dirs: list[Path]) -> dict[str, str | None]:
    """The code fingerprint each cell's manifest.json records (None: no manifest, or one without it)."""
    out = {}
    for d in dirs:
        manifest = d / "manifest.json"
        try:
            out[str(d)] = json.loads(manifest.read_text()).get("code_fingerprint") if manifest.is_file() else None
        except (OSError, ValueError) as exc:
            raise AnalysisError(f"{manifest}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    return out


def _check_one_code(fingerprints: dict[str, str | None], allowed: bool) -> None:
    """Cells computed by different code must not be pooled silently."""
    by_code: dict[str | None, list[str]] = {}
    for cell, fingerprint in fingerprints.items():
        by_code.setdefault(fingerprint, []).append(cell)
    if len(by_code) > 1 and not allowed:
        groups = "; ".join(f"{short(fp)}: {', '.join(cells[:3])}{' ...' if len(cells) > 3 else ''}"
                           for fp, cells in sorted(by_code.items(), key=lambda kv: str(kv[0])))
        raise AnalysisError(f"the cells were computed by {len(by_code)} different codes ({groups}); rerun them with "
                            "one code, or pass allow_mixed_code=true to pool them anyway")


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


def run(cfg: dict) -> claims.ClaimResult:
    """Run one claim from a plain config dict (the Hydra config, resolved); raises AnalysisError."""
    cfg = {**DEFAULTS, **cfg}
    _check_config(cfg)
    root = Path(cfg.get("prereg_root") or ".")
    number = int(cfg["prereg_version"])
    version_spec = prereg.version(number, root)
    verify_lock(root, number)
    # The version's data names its analysis (kvcert.analysis.registry): a base and any named claim variants.
    registry, run_claim = analyses.analysis(version_spec)
    claim_id = str(cfg["claim"])
    if claim_id not in registry:
        raise AnalysisError(f"claim={claim_id} is not one of {', '.join(sorted(registry))}")
    doc = load_claims(root)
    scales = sorted(doc.get("scales") or {})
    if scales and cfg["scale"] not in scales:
        raise AnalysisError(f"scale={cfg['scale']}: unknown; known: {', '.join(scales)}")
    spec = claim_spec(doc, claim_id)
    needed = registry[claim_id].tables
    dirs = _check_inputs(list(cfg.get("cells") or []), needed)
    fingerprints = cell_fingerprints(dirs)
    _check_one_code(fingerprints, bool(cfg["allow_mixed_code"]))
    _check_writable("out", cfg["out"], Path(cfg["out"]).parent)
    if cfg.get("figures", True):
        _check_writable("figure_dir", cfg["figure_dir"], Path(cfg["figure_dir"]))
    tables = claims.Tables(**{t: data.load_cells(dirs, t) for t in needed})
    opts = claims.options_for(spec, doc["conventions"], scale=str(cfg.get("scale", "default")),
                              n_boot=cfg.get("n_boot"), seed=cfg.get("seed"))
    result = run_claim(claim_id, tables, spec, doc["conventions"], opts)
    result.details["prereg_version"] = number
    result.details["inputs"] = [str(d) for d in dirs]
    result.details["provenance"] = {"cell_code_fingerprints": fingerprints,
                                    "analysis_fingerprint": analysis_fingerprint(root),
                                    "allow_mixed_code": bool(cfg["allow_mixed_code"])}
    by_model = claims_by_model(run_claim, claim_id, dirs, needed, spec, doc["conventions"], opts)
    if by_model:
        result.details["by_model"] = by_model
    if cfg.get("figures", True):
        result.details["figures"] = [str(p) for p in figures.save(result, cfg.get("figure_dir") or "paper_figures")]
    write_json_atomic(result.to_dict(), Path(cfg["out"]))
    return result


BY_MODEL_FIELDS = ("estimate", "ci_low", "ci_high", "threshold", "verdict", "agrees", "n", "component")
# A claim decided per configuration keeps each model's components too (results/claims_by_policy.csv).
BY_MODEL_CONFIGURATION_FIELDS = ("components", "configurations", "verdict_by", "cert_over_true_err_median")


def claims_by_model(run_claim, claim_id: str, dirs: list[Path], needed: tuple[str, ...], spec: dict,
                    conventions: dict, opts: claims.Options) -> dict[str, dict]:
    """The same pre-registered claim on each model's cells alone, when the cells hold several models.

    Cells are split by the ``model`` column of their items table (a cell runs one model; step tables do
    not name the model). A model whose cells cannot carry the claim on their own gets its one-line
    error instead of a result. Returns {} for cells of a single model. ``run_claim`` is the analysis of the
    pre-registration version the claim is run under.
    """
    import pandas as pd

    cells_of: dict[str, list[Path]] = {}
    for d in dirs:
        try:
            names = pd.read_parquet(d / "items.parquet", columns=["model"])["model"].dropna().unique()
        except (KeyError, ValueError, OSError):  # no model column: nothing to split by
            return {}
        for name in names:
            cells_of.setdefault(str(name), []).append(d)
    if len(cells_of) < 2:
        return {}
    out: dict[str, dict] = {}
    for model, model_dirs in sorted(cells_of.items()):
        try:
            tables = claims.Tables(**{t: data.load_cells(model_dirs, t) for t in needed})
            result = run_claim(claim_id, tables, spec, conventions, opts).to_dict()
            out[model] = {k: result[k] for k in BY_MODEL_FIELDS}
            if result["details"].get("scope") == "per_configuration":
                out[model].update({k: result["details"][k] for k in BY_MODEL_CONFIGURATION_FIELDS
                                   if k in result["details"]})
        except (AnalysisError, ValueError) as err:
            out[model] = {"error": " ".join(str(err).split())}
    return out


CONF_DIR = Path(__file__).resolve().parent.parent / "conf" / "claim"


def _check_config(cfg: dict) -> None:
    """Types and values of the claim config; names the key at fault."""
    cells = cfg.get("cells")
    if not isinstance(cells, list):
        raise AnalysisError(f"cells={cells!r}: expected a list of cell directories, e.g. 'cells=[results/cells/a]'")
    for key in ("n_boot", "seed", "prereg_version"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise AnalysisError(f"{key}={value!r}: expected an integer or null")
    if cfg.get("n_boot") is not None and cfg["n_boot"] < 1:
        raise AnalysisError(f"n_boot={cfg['n_boot']}: must be >= 1")
    for key in ("figures", "allow_mixed_code"):
        if not isinstance(cfg.get(key), bool):
            raise AnalysisError(f"{key}={cfg.get(key)!r}: expected true or false")
    for key in ("out", "figure_dir", "prereg_root", "scale"):
        if not isinstance(cfg.get(key), str) or not cfg.get(key):
            raise AnalysisError(f"{key}={cfg.get(key)!r}: expected a non-empty string")


def _check_writable(key: str, value: str, target: Path) -> None:
    """Fail before any computation if ``target`` (a directory to create or use) cannot be written."""
    reason = unwritable_reason(target)
    if reason:
        raise AnalysisError(f"{key}={value}: {reason}")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: compose the config (Hydra overrides), run, print one summary or one error line."""
    from kvcert.errors import UsageError
    from kvcert.hydra_app import check_top_level_keys, compose_or_show

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose_or_show(argv, __doc__, config_name="claim", conf_dir=CONF_DIR)
        if cfg is None:
            return 0
        check_top_level_keys(cfg, conf_dir=CONF_DIR, config_name="claim", groups=())
        if OmegaConf.is_missing(cfg, "claim"):
            raise AnalysisError(f"claim is required: claim=<one of {', '.join(sorted(claims.REGISTRY))}>")
        result = run(OmegaConf.to_container(cfg, resolve=True))
    except (UsageError, OmegaConfBaseException) as exc:  # a bad override or interpolation
        print(f"kvcert-claim: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except AnalysisError as exc:
        print(f"kvcert-claim: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"kvcert-claim: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{result.claim}: {result.verdict} ({result.component} = {result.estimate:.4g}, "
          f"95% CI [{result.ci_low:.4g}, {result.ci_high:.4g}], threshold {result.threshold:g}; "
          f"paper: {result.paper_verdict}) -> {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
