"""``kvcert-run``: the Hydra app that runs one cell.

Configs are composed with Hydra's compose API from the package's ``conf/`` (``configs/`` at the
repository root), so overrides work as in any Hydra app (``data=jsonl data.path=f.jsonl``,
``'budgets=[0.25,0.5]'``) while every failure ends in one line naming the key, value or file.
``--cfg`` prints the composed config and exits.
"""

from __future__ import annotations

import difflib
import re
import sys
import traceback
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# Top-level keys of a run config besides those of run.yaml (config groups).
_GROUPS = ("data", "model")


class UsageError(ValueError):
    """Bad command-line overrides."""


def _known_keys(conf_dir: Path, config_name: str) -> list[str]:
    """Dotted keys of the primary config and of every option of its groups (for did-you-mean hints)."""
    import yaml

    def walk(node, prefix):
        for key, value in (node or {}).items():
            if key in ("defaults", "hydra"):
                continue
            yield f"{prefix}{key}"
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")

    keys = set(walk(yaml.safe_load((conf_dir / f"{config_name}.yaml").read_text()), ""))
    for group in conf_dir.iterdir():
        if group.is_dir():
            keys.add(group.name)
            for option in group.glob("*.yaml"):
                keys.update(walk(yaml.safe_load(option.read_text()), f"{group.name}."))
    return sorted(keys)


def did_you_mean(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def explain_hydra_error(message: str, conf_dir: Path = CONF_DIR, config_name: str = "run") -> str:
    """One line for a Hydra/OmegaConf override error: the key at fault, a suggestion, no search path."""
    message = " ".join(message.split())
    message = re.sub(r" ?Config search path:.*$", "", message)
    unknown = re.match(r"Could not override '([^']+)'\. To append to your config use \+", message) or re.search(
        r"Key '([^']+)' is not in struct", message
    )
    missing_option = re.search(r"Could not find '([^'/]+)/([^']+)' Available options in '[^']+': (.*)$", message)
    if missing_option:
        group, option, known = missing_option.groups()
        return f"{group}={option}: unknown {group}; known: {', '.join(known.split())}"
    if unknown:
        key = unknown.group(1)
        full = re.search(r"full_key: (\S+)", message)
        key = full.group(1) if full else key
        return f"{key}: unknown key{did_you_mean(key, _known_keys(conf_dir, config_name))}; `--help` lists the keys"
    return message


def compose(overrides: list[str], config_name: str = "run", conf_dir: Path = CONF_DIR):
    """Compose a config from the package's conf directory; Hydra errors become one-line UsageErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise UsageError(explain_hydra_error(str(err), conf_dir, config_name)) from None


def check_top_level_keys(cfg, conf_dir: Path = CONF_DIR, config_name: str = "run", groups=_GROUPS) -> None:
    """Reject keys added with ``+key=...`` that the app does not read (they would be silently ignored)."""
    import yaml

    base = yaml.safe_load((conf_dir / f"{config_name}.yaml").read_text()) or {}
    known = (set(base) - {"defaults"}) | set(groups)
    for key in cfg:
        if key not in known:
            raise UsageError(f"{key}: unknown key{did_you_mean(str(key), sorted(known))}; `--help` lists the keys")


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


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line (OSErrors name their file)."""
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in str(err.args):
        text = f"{err.filename}: {err.strerror or err}"
    else:
        text = str(err) if str(err) else type(err).__name__
    if isinstance(err, KeyError) and len(err.args) == 1:
        text = f"missing key {err.args[0]!r}"
    return " ".join(text.split())


def compose_or_show(argv: list[str], doc: str, config_name: str = "run", conf_dir: Path = CONF_DIR):
    """Handle ``--help`` and ``--cfg`` (print and return None), else return the composed config."""
    if "-h" in argv or "--help" in argv:
        print(doc)
        print((conf_dir / f"{config_name}.yaml").read_text())
        return None
    cfg = compose([a for a in argv if a != "--cfg"], config_name=config_name, conf_dir=conf_dir)
    if "--cfg" in argv:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return None
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose_or_show(argv, __doc__)
        if cfg is None:
            return 0
        check_top_level_keys(cfg)
        missing = _missing_keys(cfg)
        if missing:
            raise UsageError(f"missing value for {', '.join(missing)} (set it on the command line, e.g. {missing[0]}=...)")
        from .cell import run_cell

        out = run_cell(cfg, cfg.out_dir)
    except KeyboardInterrupt:
        print("kvcert-run: interrupted; finished items are kept and a rerun resumes", file=sys.stderr)
        return 130
    except (UsageError, ValueError, OSError, RuntimeError, KeyError) as err:
        print(f"kvcert-run: error: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug, not bad input: keep the traceback, but still end on one line
        traceback.print_exc(file=sys.stderr)
        print(f"kvcert-run: error: internal error ({type(err).__name__}: {one_line(err)}); "
              "please report it with the traceback above", file=sys.stderr)
        return 1
    print(f"kvcert-run: wrote {out}/items.parquet and {out}/steps.parquet", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
