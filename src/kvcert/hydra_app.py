"""What every kvcert command-line app shares: composing a Hydra config from the package's ``conf/``
(``configs/run/`` at the repository root) with the compose API, and turning every Hydra/OmegaConf failure
into one line that names the key at fault (with a did-you-mean hint). The run and calibrate configs are
the structured configs of ``kvcert.run_schema`` (registered in Hydra's ConfigStore as ``run_schema`` and
``calibrate_schema``); ``--help`` prints their keys with defaults and meaning, other apps' config file;
``--cfg`` prints the composed, resolved config. Imports only ``kvcert.errors`` and ``kvcert.run_schema``.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from .run_schema import CalibrateConfig, RunConfig, yaml_lines
from .errors import UsageError

CONF_DIR = Path(__file__).resolve().parent / "conf"
# The structured config of each app's primary config (``conf/<name>.yaml`` lists it first in its defaults).
SCHEMAS = {"run": RunConfig, "calibrate": CalibrateConfig}
# Keys that were renamed: an old name gets a line saying so instead of a plain "unknown key".
RENAMED = {"window": "observation_window"}


def _register_schemas(typed: bool = True) -> None:
    """``run_schema`` and ``calibrate_schema`` in Hydra's ConfigStore; ``typed=False`` stores the same keys and
    defaults without their types, so that a value of the wrong type reaches the validation (which names the
    key and value in its own words) instead of failing the composition."""
    import dataclasses

    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        node = _editable(OmegaConf.structured(schema)) if typed else OmegaConf.to_container(
            OmegaConf.create(dataclasses.asdict(schema())))
        store.store(name=f"{name}_schema", node=node)


def _editable(node):
    """``node`` with the read-only flag that OmegaConf gives a frozen dataclass (``design_options``: the library's
    immutable DesignOptions) lifted, so that the command line and the config files can set its keys; the types
    still hold."""
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, None)
    for key in node:
        if isinstance(node._get_node(key), DictConfig):
            _editable(node[key])
    return node


def _primary_keys(conf_dir: Path, config_name: str) -> dict:
    """The primary config's keys (and nested mappings): its schema's, or its YAML file's."""
    import dataclasses

    import yaml

    if conf_dir == CONF_DIR and config_name in SCHEMAS:
        return dataclasses.asdict(SCHEMAS[config_name]())
    return yaml.safe_load((conf_dir / f"{config_name}.yaml").read_text()) or {}


def known_keys(conf_dir: Path, config_name: str) -> list[str]:
    """Dotted keys of the primary config and of every option of its groups (for did-you-mean hints)."""
    import yaml

    def walk(node, prefix):
        for key, value in (node or {}).items():
            if key in ("defaults", "hydra"):
                continue
            yield f"{prefix}{key}"
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")

    keys = set(walk(_primary_keys(conf_dir, config_name), ""))
    for group in conf_dir.iterdir():
        if group.is_dir():
            keys.add(group.name)
            for option in group.glob("*.yaml"):
                keys.update(walk(yaml.safe_load(option.read_text()), f"{group.name}."))
    return sorted(keys)


def did_you_mean(key: str, known: list[str]) -> str:
    if key in RENAMED:
        return f" (renamed {RENAMED[key]})"
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
        return f"{key}: unknown key{did_you_mean(key, known_keys(conf_dir, config_name))}; `--help` lists the keys"
    return message


def compose(overrides: list[str], config_name: str = "run", conf_dir: Path = CONF_DIR):
    """Compose a config from ``conf_dir``; Hydra errors become one-line UsageErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException, ValidationError

    def attempt():
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides)

    _register_schemas()
    try:
        try:
            return attempt()
        except HydraException as err:
            if not isinstance(err.__cause__, ValidationError):
                raise
            _register_schemas(typed=False)  # the validation will name the key and the value
            try:
                return attempt()
            finally:
                _register_schemas()
    except (HydraException, OmegaConfBaseException) as err:
        raise UsageError(explain_hydra_error(str(err), conf_dir, config_name)) from None


def check_top_level_keys(cfg, conf_dir: Path = CONF_DIR, config_name: str = "run", groups=("data", "model")) -> None:
    """Reject keys added with ``+key=...`` that the app does not read (they would be silently ignored)."""
    known = (set(_primary_keys(conf_dir, config_name)) - {"defaults"}) | set(groups)
    for key in cfg:
        if key not in known:
            raise UsageError(f"{key}: unknown key{did_you_mean(str(key), sorted(known))}; `--help` lists the keys")


def missing_keys(cfg, prefix="") -> list[str]:
    """Dotted keys still set to ``???`` (required on the command line)."""
    from omegaconf import DictConfig, OmegaConf

    missing = []
    for key in cfg:
        path = f"{prefix}{key}"
        if OmegaConf.is_missing(cfg, key):
            missing.append(path)
        elif isinstance(cfg[key], DictConfig):
            missing.extend(missing_keys(cfg[key], path + "."))
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
        if conf_dir == CONF_DIR and config_name in SCHEMAS:
            print("\n".join(yaml_lines(SCHEMAS[config_name])))
        else:
            print((conf_dir / f"{config_name}.yaml").read_text())
        return None
    cfg = compose([a for a in argv if a != "--cfg"], config_name=config_name, conf_dir=conf_dir)
    if "--cfg" in argv:
        from omegaconf import OmegaConf

        try:  # resolved, so that the defaults show as values; a config with required keys left open cannot be
            print(OmegaConf.to_yaml(cfg, resolve=True))
        except Exception:  # noqa: BLE001 - e.g. an interpolation of a required key: print it unresolved
            print(OmegaConf.to_yaml(cfg))
        return None
    return cfg


__all__ = [
    "CONF_DIR", "SCHEMAS", "UsageError", "check_top_level_keys", "compose", "compose_or_show", "did_you_mean",
    "explain_hydra_error", "known_keys", "missing_keys", "one_line",
]
