"""``kvcert-calibrate``: fit the per-layer calibration of a model's certificate (``kvcert.calibration``).

    kvcert-calibrate <kvcert-run overrides> out=<file> [level=...] [unit=row|prompt] [base=paper|design]
    kvcert-calibrate 'cells=[<cell dir>,...]' out=<file>

The first form runs one oracle cell on the calibration prompts (the same model, data and design overrides
as ``kvcert-run``; its tables go to a temporary folder, or to ``out_dir`` where a rerun resumes them) and
fits from it; the second fits from oracle cells run before (they must agree on the model and the design's
knobs). Either way the prompts must be disjoint from those the file will be used on and hold the same mix
of tasks (e.g. ``shard=0 n_shards=2 shard_by=task`` here, ``shard=1 n_shards=2 shard_by=task`` for
``kvcert-run ... calibration=<file>``, which refuses prompts of the calibration set and tasks it never saw).
Bad input ends in one line naming the key, value or file, exit 2, and no file written.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from ..atomic import unwritable_reason
from ..calibration import (Calibration, default_level, design_knobs, fit_calibration, knob_label,
                           model_identity, needed_prompts)
from ..run_schema import CALIBRATE_KEYS, CalibrateConfig
from ..errors import ConfigError, UsageError
from ..hydra_app import check_top_level_keys, compose_or_show, missing_keys, one_line
from ..models import ModelSpec, load_model, model_fingerprint
from ..provenance import code_fingerprint

APP = "kvcert-calibrate"
_OWN_KEYS = CALIBRATE_KEYS  # the fit's own keys, beside the run's


def _options(cfg) -> dict:
    """The fit's own options, checked against the schema (kvcert.run_schema.CalibrateConfig): level (None: the
    default, 1 − delta/5), unit, base, relative_term, never_below_paper."""
    from .config import check_keys

    options = check_keys(CalibrateConfig, cfg, ("level", "unit", "base", "relative_term", "never_below_paper"))
    if options["level"] == 1.0:
        raise ConfigError("level=1.0: must be < 1 (no finite factor covers every row)")
    return options


def _check_out(out: Path) -> None:
    if out.is_dir():
        raise ConfigError(f"out={out}: is a directory; give the calibration file's name, e.g. out={out}/calibration.json")
    reason = unwritable_reason(out.parent)
    if reason:
        raise ConfigError(f"out={out}: cannot write there ({reason})")


def _run_config(cfg):
    """The cell's config: the run keys only, the oracle on, no calibration applied."""
    from omegaconf import OmegaConf

    if cfg.get("calibration") is not None:
        raise ConfigError(f"calibration={cfg.calibration}: {APP} fits a calibration; it does not apply one (drop the key)")
    if cfg.get("oracle") is not True:
        oracle = cfg.get("oracle")
        raise ConfigError(f"oracle={str(oracle).lower() if isinstance(oracle, bool) else repr(oracle)}: calibration "
                          "compares the certificate with the true error; leave oracle=true")
    if cfg.get("certify") is False:
        raise ConfigError("certify=false: there is no certificate to calibrate; leave certify=true")
    if cfg.get("allocator", "uniform") != "uniform":  # a calibration file does not record the allocator
        raise ConfigError(f"allocator={cfg.get('allocator')}: a calibration is fitted under the uniform allocator; "
                          "drop the key")
    plain = OmegaConf.to_container(cfg, resolve=False)
    for key in _OWN_KEYS:
        plain.pop(key, None)
    return OmegaConf.create(plain)


def _knobs(cell) -> dict:
    return design_knobs(cell.options, delta=cell.delta, observation_window=cell.observation_window,
                        policy_options=cell.policy_options)


def _fit_from_run(cfg, options: dict, out: Path):
    """Run the calibration cell (checked like kvcert-run first), then read its tables."""
    from ..data import load_items, shard_items
    from ..models import load_tokenizer
    from .cell import check_out_dir, run_cell
    from .config import validate

    run_cfg = _run_config(cfg)
    cell = validate(run_cfg)
    if not any(c.design == "poisson" for c in cell.configurations()):
        raise ConfigError(f"designs={list(cell.designs)}: no configuration has a certificate to calibrate; "
                          "include poisson")
    spec = ModelSpec.parse(cell.model)
    items = load_items(cell.data.get("name"), cell.data, load_tokenizer(spec), cell.n_items)
    n_prompts = len(shard_items(items, cell.shard, cell.n_shards, cell.shard_by))
    level = options["level"] or default_level(cell.delta)
    need = needed_prompts(level, options["unit"], cell.delta)
    if n_prompts < need:
        raise ConfigError(f"n_items={cell.n_items}: shard {cell.shard} of {cell.n_shards} gives {n_prompts} calibration "
                          f"prompts; unit={options['unit']} at level {level:g} needs at least {need}")
    keep = cfg.get("out_dir")
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=f".{out.name}.cell-", dir=out.parent))
    try:
        if keep:
            check_out_dir(work)
        run_cfg.out_dir = str(work)
        run_cell(run_cfg, work)
        return _read_cells([work]), spec, cell
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _read_cells(cells: list[Path]):
    """(steps, items, configs) of finished cells, or a ConfigError naming the missing file."""
    import pandas as pd
    import yaml

    steps, items, configs = [], [], []
    for cell in cells:
        for name in ("steps.parquet", "items.parquet", "config.yaml"):
            if not (cell / name).is_file():
                raise ConfigError(f"{cell / name}: missing (cells= takes finished kvcert-run directories)")
        steps.append(pd.read_parquet(cell / "steps.parquet"))
        items.append(pd.read_parquet(cell / "items.parquet"))
        configs.append(yaml.safe_load((cell / "config.yaml").read_text()))
    return (pd.concat(steps, ignore_index=True), pd.concat(items, ignore_index=True), configs)


def _fit_from_cells(cfg, options: dict):
    """Fit from cells run before; they must agree on the model and on every knob the factors depend on."""
    from omegaconf import OmegaConf

    from .config import validate

    cells = cfg.cells
    if isinstance(cells, str) or not cells:
        raise ConfigError(f"cells={cells!r}: expected a non-empty list of cell directories, e.g. 'cells=[results/a]'")
    cells = [Path(str(c)) for c in cells]
    for c in cells:
        if not c.is_dir():
            raise ConfigError(f"{c}: missing cell directory")
    tables = _read_cells(cells)
    first = None
    for path, config in zip(cells, tables[2]):
        cell = validate(OmegaConf.create(config))
        if not config.get("oracle"):
            raise ConfigError(f"{path}: ran with oracle=false; calibration needs the true errors")
        if cell.allocator != "uniform":
            raise ConfigError(f"{path}: ran with allocator={cell.allocator}; a calibration is fitted under uniform")
        spec = ModelSpec.parse(config["model"])
        here = {"model": spec, **_knobs(cell)}
        if first is None:
            first = (path, here, spec, cell)
            continue
        for key, value in here.items():
            if value != first[1][key]:
                raise ConfigError(f"{path}: {knob_label(key)}={value} but {first[0]} has {first[1][key]}; "
                                  "cells of one calibration must share the model and the design's knobs")
    return tables, first[2], first[3]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose_or_show(argv, __doc__, config_name="calibrate")
        if cfg is None:
            return 0
        check_top_level_keys(cfg, config_name="calibrate")
        missing = [k for k in missing_keys(cfg) if k != "out_dir"]
        if missing:
            raise UsageError(f"missing value for {', '.join(missing)} (set it on the command line, e.g. {missing[0]}=...)")
        options = _options(cfg)
        out = Path(str(cfg.out))
        _check_out(out)
        if cfg.get("cells") is not None:
            (steps, items, _), spec, cell = _fit_from_cells(cfg, options)
        else:
            (steps, items, _), spec, cell = _fit_from_run(cfg, options, out)
        model, _ = load_model(spec)
        identity = {**model_identity(model), "name": spec.name or spec.path or spec.kind,
                    "fingerprint": model_fingerprint(spec)}
        prompts = items[["item_id", "task"]].astype(str).drop_duplicates("item_id")
        item_ids = sorted(prompts["item_id"])
        tasks = {str(t): int(n) for t, n in sorted(prompts["task"].value_counts().items())}
        fitted_on = {"items": len(item_ids), "item_ids": item_ids, "tasks": tasks, "settings": sorted(set(items["setting"])),
                     "data": sorted(set(items["data"].astype(str))), "code_fingerprint": code_fingerprint()}
        calibration = fit_calibration(steps, model=identity, design=_knobs(cell), fitted_on=fitted_on, **options)
        calibration.save(out)
    except KeyboardInterrupt:
        print(f"{APP}: interrupted; nothing written (with out_dir=..., a rerun resumes the cell)", file=sys.stderr)
        return 130
    except (UsageError, ValueError, OSError, RuntimeError, KeyError) as err:
        print(f"{APP}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug, not bad input
        traceback.print_exc(file=sys.stderr)
        print(f"{APP}: error: internal error ({type(err).__name__}: {one_line(err)}); please report it with the "
              "traceback above", file=sys.stderr)
        return 1
    _report(calibration, out)
    return 0


def _report(calibration: Calibration, out: Path) -> None:
    for (setting, policy, design, budget), stratum in sorted(calibration.strata.items()):
        factors = [f for f in stratum["factors"] if f is not None]
        print(f"{APP}: {setting} {policy} {design} budget {budget}: {stratum['prompts']} prompts, factors "
              f"{min(factors):.3g}-{max(factors):.3g} over {len(factors)} layers", file=sys.stderr)
    options = {"level": calibration.level, "unit": calibration.unit, "never_below_paper": calibration.never_below_paper}
    print(f"{APP}: wrote {out} ({json.dumps(options)})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
