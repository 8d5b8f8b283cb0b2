"""Workload loaders by name: ``load_items("ruler" | "longbench" | "jsonl", cfg, tokenizer, n_items)``."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from .item import Item

Loader = Callable[[Mapping[str, Any], Any, "int | None"], list[Item]]


def _plain(value: Any) -> Any:
    """Recursively turn config containers (OmegaConf, MappingProxy, tuples) into dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    # OmegaConf containers are Mapping/Sequence subclasses, handled above.
    return value


def take_first(items: list[Item], n_items: int | None, source: str) -> list[Item]:
    """The first ``n_items`` items; an error naming both numbers if there are fewer."""
    if n_items is None:
        return items
    if n_items < 0:
        raise ValueError(f"n_items must be >= 0, got {n_items}")
    if n_items > len(items):
        raise ValueError(f"{source}: n_items={n_items} requested but only {len(items)} items are available")
    return items[:n_items]


def _load_ruler(cfg: Mapping[str, Any], tokenizer: Any, n_items: int | None) -> list[Item]:
    from .ruler import load_ruler

    return load_ruler(cfg, tokenizer, n_items)


def _load_longbench(cfg: Mapping[str, Any], tokenizer: Any, n_items: int | None) -> list[Item]:
    from .longbench import load_longbench

    return load_longbench(cfg, tokenizer, n_items)


def _load_jsonl(cfg: Mapping[str, Any], tokenizer: Any, n_items: int | None) -> list[Item]:
    from .jsonl import load_jsonl

    items = load_jsonl(cfg, tokenizer, n_items)
    return take_first(items, n_items, f"data=jsonl ({cfg.get('path')})")


# Loaders import their module lazily so that, say, the ruler generator never imports `datasets`.
WORKLOADS: dict[str, Loader] = {
    "ruler": _load_ruler,
    "longbench": _load_longbench,
    "jsonl": _load_jsonl,
}


def register_workload(name: str, loader: Loader) -> None:
    """Add a workload loader ``loader(cfg, tokenizer, n_items) -> list[Item]`` under ``name``."""
    if name in WORKLOADS:
        raise ValueError(f"workload {name!r} is already registered")
    WORKLOADS[name] = loader


def load_items(name: str, cfg: Mapping[str, Any] | None, tokenizer: Any, n_items: int | None = None) -> list[Item]:
    """Load the items of workload ``name`` configured by ``cfg``.

    ``tokenizer`` is any Hugging Face tokenizer (used to fit and truncate prompts to token
    budgets). ``n_items=None`` means every item of a finite dataset, or the config's
    ``n_items`` for a generator.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(sorted(WORKLOADS))}")
    plain = _plain(cfg or {})
    if n_items is None and plain.get("n_items") is not None and name != "ruler":
        n_items = int(plain["n_items"])
    return WORKLOADS[name](plain, tokenizer, n_items)
