"""``kvcert-run``: the Hydra app that runs one cell.

Configs are composed with Hydra's compose API from the package's ``conf/`` (``configs/`` at the
repository root), so overrides work as in any Hydra app (``data=jsonl data.path=f.jsonl``,
``'budgets=[0.25,0.5]'``) while every failure ends in one line naming the key, value or file.
``--cfg`` prints the composed config and exits.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class UsageError(ValueError):
    """Bad command-line overrides."""


def compose(overrides: list[str], config_name: str = "run"):
    """Compose a config from the package's conf directory; Hydra errors become one-line UsageErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        message = " ".join(str(err).split())
        raise UsageError(message) from None


def _missing_keys(cfg, prefix="") -> list[str]:
    from omegaconf import DictConfig, OmegaConf

    missing = []
    for key in cfg:
        path = f"{prefix}{key}"
        if OmegaConf.is_missing(cfg, key):
            missing.append(path)
        elif isinstance(cfg[key], DictConfig):
            missing.extend(_missing_keys(cfg[key], path + "."))
    return missing


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print((CONF_DIR / "run.yaml").read_text())
        return 0
    show = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    try:
        cfg = compose(argv)
        if show:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfg))
            return 0
        missing = _missing_keys(cfg)
        if missing:
            raise UsageError(f"missing value for {', '.join(missing)} (set it on the command line, e.g. {missing[0]}=...)")
        from .cell import run_cell

        out = run_cell(cfg, cfg.out_dir)
    except KeyboardInterrupt:
        print("kvcert-run: interrupted; finished items are kept and a rerun resumes", file=sys.stderr)
        return 130
    except (UsageError, ValueError, FileNotFoundError, RuntimeError, KeyError) as err:
        print(f"kvcert-run: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"kvcert-run: wrote {out}/items.parquet and {out}/steps.parquet", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
