"""Freeze, verify and render the pre-registration (``kvcert-prereg lock|verify|render``).

The lock (``preregistration/prereg.lock``, JSON) records the sha256 of claims.yaml and of every
analysis module that defines the statistics (``FROZEN_FILES``), plus when it was made. Any claim
analysis calls ``verify_lock(root)`` first: a missing lock, a missing frozen file, a different file
list or a changed hash raises ``PreregistrationError`` and nothing is computed. Presentation code
(figures, tables, CLI) is deliberately not frozen. PREREGISTRATION.md is generated from
claims.yaml by ``render`` so the two can never disagree.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import sys
from pathlib import Path

import yaml

from kvcert.analysis.errors import AnalysisError, PreregistrationError
from kvcert.atomic import write_text_atomic

PREREG_DIR = "preregistration"
CLAIMS_FILE = f"{PREREG_DIR}/claims.yaml"
LOCK_FILE = f"{PREREG_DIR}/prereg.lock"
RENDERED_FILE = f"{PREREG_DIR}/PREREGISTRATION.md"
# The files whose content decides a verdict: thresholds, population filters, statistics, rules.
FROZEN_FILES = (
    CLAIMS_FILE,
    "src/kvcert/analysis/stats.py",
    "src/kvcert/analysis/data.py",
    "src/kvcert/analysis/verdicts.py",
    "src/kvcert/analysis/replay.py",
    "src/kvcert/analysis/claims.py",
)
CLAIM_KEYS = ("id", "title", "hypothesis", "population", "metric", "test", "decision", "paper_verdict", "paper_number")
PAPER_VERDICTS = ("supported", "not supported")


def frozen_files(root: str | Path) -> list[str]:
    """Every file a lock under ``root`` freezes, and the locks themselves (repository-relative paths)."""
    return [*FROZEN_FILES, LOCK_FILE]


# --- paths and hashes --------------------------------------------------------------------------


def find_root(start: str | Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: cwd) that contains preregistration/."""
    here = Path(start or os.getcwd()).resolve()
    for d in (here, *here.parents):
        if (d / PREREG_DIR).is_dir():
            return d
    raise PreregistrationError(f"no {PREREG_DIR}/ directory at or above {here}: pass --root")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def _hashes(root: Path) -> dict[str, str]:
    out = {}
    for rel in FROZEN_FILES:
        path = root / rel
        if not path.is_file():
            raise PreregistrationError(f"{rel} is missing (it is one of the frozen pre-registration files)")
        out[rel] = sha256(path)
    return out


# --- lock / verify -------------------------------------------------------------------------------


def write_lock(root: str | Path, force: bool = False) -> Path:
    """Write preregistration/prereg.lock (refuses to overwrite an existing lock unless forced)."""
    root = Path(root)
    load_claims(root)  # never lock a file that does not parse
    lock = root / LOCK_FILE
    if lock.exists() and not force:
        raise PreregistrationError(f"{LOCK_FILE} already exists: the pre-registration is frozen (use --force only before any result exists)")
    payload = {
        "version": 1,
        "algorithm": "sha256",
        "locked_at_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "files": list(FROZEN_FILES),
        "sha256": _hashes(root),
    }
    write_text_atomic(json.dumps(payload, indent=2) + "\n", lock)
    return lock


def read_lock(root: str | Path) -> dict:
    path = Path(root) / LOCK_FILE
    if not path.is_file():
        raise PreregistrationError(f"{LOCK_FILE} is missing: the pre-registration must be locked (kvcert-prereg lock) before any claim is analysed")
    try:
        lock = json.loads(path.read_text())
        files, hashes = list(lock["files"]), dict(lock["sha256"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PreregistrationError(f"{LOCK_FILE} is not a valid lock file ({type(exc).__name__}: {exc})") from None
    return {**lock, "files": files, "sha256": hashes}


def verify_lock(root: str | Path) -> None:
    """Raise PreregistrationError unless every frozen file matches the lock."""
    root = Path(root)
    lock = read_lock(root)
    if lock["files"] != list(FROZEN_FILES):
        extra = sorted(set(lock["files"]) ^ set(FROZEN_FILES))
        raise PreregistrationError(f"{LOCK_FILE} freezes a different file list than this analysis code (differs in: {', '.join(extra) or 'order'})")
    current = _hashes(root)
    for rel in FROZEN_FILES:
        old, new = lock["sha256"].get(rel, ""), current[rel]
        if old != new:
            raise PreregistrationError(f"{rel} changed since the lock (sha256 {new[:12]} != locked {old[:12]}): the pre-registration is frozen")


# --- claims.yaml ---------------------------------------------------------------------------------


def load_claims(root: str | Path) -> dict:
    """Parse and check claims.yaml; errors name the claim and key."""
    path = Path(root) / CLAIMS_FILE
    if not path.is_file():
        raise AnalysisError(f"{CLAIMS_FILE} is missing under {Path(root)}")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise AnalysisError(f"{CLAIMS_FILE}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("claims"), list) or "conventions" not in doc:
        raise AnalysisError(f"{CLAIMS_FILE}: needs top-level 'conventions' and a 'claims' list")
    seen = set()
    for i, c in enumerate(doc["claims"]):
        missing = [k for k in CLAIM_KEYS if k not in c]
        if missing:
            raise AnalysisError(f"{CLAIMS_FILE}: claim #{i + 1} ({c.get('id', '?')}) lacks key(s) {', '.join(missing)}")
        if c["id"] in seen:
            raise AnalysisError(f"{CLAIMS_FILE}: claim id {c['id']} appears twice")
        seen.add(c["id"])
        if c["paper_verdict"] not in PAPER_VERDICTS:
            raise AnalysisError(f"{CLAIMS_FILE}: {c['id']}.paper_verdict={c['paper_verdict']!r} is not one of {PAPER_VERDICTS}")
        for name, rule in (c["decision"].get("components") or {}).items():
            if not isinstance(rule, dict) or "threshold" not in rule:
                raise AnalysisError(f"{CLAIMS_FILE}: {c['id']}.decision.components.{name} lacks a threshold")
    return doc


def claim_spec(doc: dict, claim_id: str) -> dict:
    for c in doc["claims"]:
        if c["id"] == claim_id:
            return c
    raise AnalysisError(f"{CLAIMS_FILE}: no claim with id {claim_id!r} (have {', '.join(c['id'] for c in doc['claims'])})")


# --- render --------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_fmt(x)}" for k, x in v.items())
    return str(v)


def render(doc: dict) -> str:
    """PREREGISTRATION.md text from the parsed claims.yaml (deterministic)."""
    p = doc.get("paper", {})
    out = [
        "# Pre-registration",
        "",
        "<!-- Generated from preregistration/claims.yaml by `kvcert-prereg render`; do not edit. -->",
        "",
        f"Reproduction of \"{p.get('title', '')}\" ({p.get('author', '')}, {p.get('year', '')}, arXiv {p.get('arxiv', '')}).",
        "Thresholds, populations, statistics and decision rules below were fixed before any result existed; "
        "`kvcert-prereg lock` freezes them together with the analysis code, and every claim analysis refuses "
        "to run if either changed.",
        "",
        "## Decision thresholds",
        "",
        "| claim | component | hypothesis side | threshold | null margin | paper's verdict |",
        "|---|---|---|---|---|---|",
    ]
    for c in doc["claims"]:
        for name, rule in c["decision"]["components"].items():
            side = ">" if rule.get("direction", "greater") == "greater" else "<"
            each = f" (each {rule['for_each']})" if "for_each" in rule else ""
            out.append(f"| {c['id']} | {name}{each} | {side} | {rule['threshold']:g} | "
                       f"{float(rule.get('null_margin', 0)):g} | {c['paper_verdict']} |")
    out += ["", "## Conventions", ""]
    out += [f"- **{k}**: {_fmt(v)}" for k, v in doc["conventions"].items()]
    out += ["", "## Scales", "", "| scale | models | data | context tokens | items | purpose |", "|---|---|---|---|---|---|"]
    for name, s in (doc.get("scales") or {}).items():
        out.append(f"| {name} | {_fmt(s.get('models', ''))} | {_fmt(s.get('data', ''))} | "
                   f"{_fmt(s.get('context_tokens', ''))} | {_fmt(s.get('n_items', ''))} | {s.get('purpose', '')} |")
    for c in doc["claims"]:
        out += ["", f"## {c['id'].upper()}: {c['title']}", "", f"**Hypothesis.** {c['hypothesis']}", "",
                "**Population.**", ""]
        pop = c["population"]
        out += [f"- {k}: {_fmt(v)}" for k, v in pop.items() if k != "scales"]
        for scale, over in (pop.get("scales") or {}).items():
            out.append(f"- at scale {scale}: {_fmt(over)}")
        out += ["", f"**Metric.** {c['metric']}", "", "**Test.**", ""]
        out += [f"- {k}: {_fmt(v)}" for k, v in c["test"].items()]
        out += ["", "**Decision.**", ""]
        for name, rule in c["decision"]["components"].items():
            out.append(f"- {name}: {_fmt(rule)}")
        if c.get("secondary"):
            out += ["", "**Secondary (reported, not tested).**", ""]
            out += [f"- {k}: {_fmt(v)}" for k, v in c["secondary"].items()]
        out += ["", f"**Paper's verdict:** {c['paper_verdict']}. {c['paper_number']}"]
    return "\n".join(out) + "\n"


# --- CLI -----------------------------------------------------------------------------------------


def _cmd_lock(args) -> str:
    return f"wrote {write_lock(args.root, force=args.force)}"


def _cmd_verify(args) -> str:
    verify_lock(args.root)
    lock = read_lock(args.root)
    return f"pre-registration lock OK ({len(lock['files'])} files, locked {lock.get('locked_at_utc', '?')})"


def _cmd_render(args) -> str:
    text = render(load_claims(args.root))
    target = Path(args.root) / RENDERED_FILE
    if args.check:
        if not target.is_file() or target.read_text() != text:
            raise AnalysisError(f"{RENDERED_FILE} differs from the render of {CLAIMS_FILE}: run kvcert-prereg render")
        return f"{RENDERED_FILE} is up to date"
    write_text_atomic(text, target)
    return f"wrote {target}"


COMMANDS = {"lock": _cmd_lock, "verify": _cmd_verify, "render": _cmd_render}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcert-prereg", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="repository root (default: nearest parent with preregistration/)")
    sub = parser.add_subparsers(dest="command", required=True)
    lock = sub.add_parser("lock", help="freeze claims.yaml and the analysis code")
    lock.add_argument("--force", action="store_true", help="overwrite an existing lock")
    sub.add_parser("verify", help="check the frozen files against the lock")
    rend = sub.add_parser("render", help="write PREREGISTRATION.md from claims.yaml")
    rend.add_argument("--check", action="store_true", help="only check that PREREGISTRATION.md is up to date")
    args = parser.parse_args(argv)
    try:
        args.root = Path(args.root) if args.root else find_root()
        print(COMMANDS[args.command](args))
    except AnalysisError as exc:
        print(f"kvcert-prereg: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
