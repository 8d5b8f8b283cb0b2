"""A campaign: a long run of one scale that must finish with the code and packages it started with.

A ``git pull`` or a ``pip install -U`` in the middle of a weeks-long run changes the code fingerprint
(``kvcert.provenance.code_fingerprint``), which the workflow uses as a rerun trigger: every finished cell
would silently run again, and cells of two code versions would be pooled if it did not. A campaign records
at its start what it runs with, and each later submission compares the present with that record:

- ``state()``: the present: the code fingerprint, the fingerprint of the library's files alone (so a message
  can say whether our files or a package changed), every installed distribution's version, the git commit
  of the checkout holding the package and whether its package files differ from it, Python's version.
- ``check(record, here)``: None when nothing that decides numbers changed, else one line that names what
  changed (which package from what to what; that the library's files changed, with the old and new
  fingerprint prefixes) and how to go on.
- ``ensure(path, scale, restart=False)``: writes the record at ``path`` when there is none (the start), refuses
  with ``CampaignChanged`` when the present differs, and with ``restart`` appends the present as a new start
  (the earlier starts stay in the file) when it differs. Where the record lives is the caller's business.

The record is JSON: ``{"scale": ..., "starts": [state, ...]}``, the last start in force. This module decides
no numbers (it is outside the code fingerprint, as the scale reader is).
"""

from __future__ import annotations

import json
import platform
import socket
import time
from importlib import metadata
from pathlib import Path

from .atomic import write_json_atomic
from .provenance import PACKAGE, _NOT_CELL_CODE, _NOT_NUMBERS, _digest, _files, code_fingerprint, short, source_checkout

# Packages whose change the message names first (they decide numbers on their own).
KEY_PACKAGES = ("torch", "transformers")
RESTART_HINT = "--config campaign=restart"


class CampaignChanged(Exception):
    """The present differs from the campaign's start; the message is the one line a user sees."""


class CampaignRecordError(Exception):
    """The campaign record cannot be read; the message names the file."""


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed_packages() -> dict[str, str]:
    """{normalized distribution name: version} of every distribution this Python imports from (first on the path wins)."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name") if dist.metadata else None
        if name and _normalized(name) not in out:
            out[_normalized(name)] = dist.version
    return dict(sorted(out.items()))


def library_fingerprint(package: Path = PACKAGE) -> str:
    """sha256 (hex) of the package files the code fingerprint covers, without the package versions it adds."""
    return _digest([(p.relative_to(package).as_posix(), p.read_bytes())
                    for p in _files(package, _NOT_CELL_CODE + _NOT_NUMBERS)])


def state(package: Path = PACKAGE) -> dict:
    """What a campaign records at its start and compares at every submission (see the module's docstring)."""
    checkout = source_checkout(package)
    return {
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "code_fingerprint": code_fingerprint(package),
        "library_fingerprint": library_fingerprint(package),
        "commit": checkout["commit"],
        "dirty": checkout["dirty"],
        "python": platform.python_version(),
        "packages": installed_packages(),
    }


def package_changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """'name old -> new' for each changed, added ('(none)') or removed ('(removed)') package; torch and
    transformers first, then by name."""
    names = sorted(set(old) | set(new), key=lambda n: (n not in KEY_PACKAGES, n))
    return [f"{n} {old.get(n, '(none)')} -> {new.get(n, '(removed)')}" for n in names if old.get(n) != new.get(n)]


def check(record: dict, here: dict, where: str = "campaign") -> str | None:
    """None when ``here`` (a ``state()``) runs what the campaign's start ``record`` ran, else the one-line refusal."""
    start = record["starts"][-1]
    if start.get("code_fingerprint") == here["code_fingerprint"] and start.get("packages") == here["packages"]:
        return None
    changed, pin = [], []
    moved = package_changes(start.get("packages") or {}, here["packages"])
    if moved:
        shown = ", ".join(moved[:6]) + (f" and {len(moved) - 6} more" if len(moved) > 6 else "")
        changed.append(f"packages changed ({shown})")
        pins = [m.split()[0] + "==" + m.split()[1] for m in moved[:3] if m.split()[1] != "(none)"]
        pin.append("reinstall the environment it started with (the lock file"
                   + (f", or pip install {' '.join(pins)}" if pins else "") + ")")
    if start.get("library_fingerprint") != here["library_fingerprint"]:
        old_fp = start.get("code_fingerprint")
        commit = start.get("commit")
        at = f"commit {commit[:12]}{' with uncommitted changes' if start.get('dirty') else ''}" if commit else "no git commit"
        changed.append(f"the library's files changed (code fingerprint {short(old_fp)} at the start, "
                       f"{short(here['code_fingerprint'])} now; started at {at})")
        pin.append(f"git checkout {commit[:12]}" if commit else "restore the library's files")
    if not changed:  # the fingerprint moved without a package or file we compare (a record of another format)
        changed.append(f"the code fingerprint changed ({short(start.get('code_fingerprint'))} at the start, "
                       f"{short(here['code_fingerprint'])} now)")
        pin.append("reinstall what it started with")
    effect = ("every cell would run again" if start.get("code_fingerprint") != here["code_fingerprint"]
              else "cells computed from now on would be pooled with cells of the old packages")
    return (f"{where} started {start.get('started_utc', '?')} on other code: {'; '.join(changed)}; {effect}. "
            f"Pin back ({'; '.join(pin)}) and resubmit, or recompute deliberately with "
            f"{RESTART_HINT} (records a new start, keeps the old one)")


def read(path: str | Path) -> dict | None:
    """The record at ``path``, or None when there is none."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CampaignRecordError(f"{path}: not a readable campaign record ({err}); restore it, or move it away "
                                  "to start the campaign again") from None
    if not isinstance(record, dict) or not isinstance(record.get("starts"), list) or not record["starts"] \
            or not all(isinstance(s, dict) and "code_fingerprint" in s and "packages" in s for s in record["starts"]):
        raise CampaignRecordError(f"{path}: not a campaign record (expected starts: a list of recorded states); "
                                  "restore it, or move it away to start the campaign again")
    return record


def ensure(path: str | Path, scale: str, restart: bool = False, here: dict | None = None) -> str:
    """Start, continue or deliberately restart the campaign recorded at ``path``; returns what happened
    ("started", "continued", "restarted"). Raises CampaignChanged (one line) when the present differs and
    ``restart`` is not set, CampaignRecordError for an unreadable record."""
    path = Path(path)
    record = read(path)
    here = state() if here is None else here
    if record is None:
        write_json_atomic({"scale": scale, "starts": [here]}, path)
        return "started"
    refusal = check(record, here, where=f"the campaign of {path}")
    if refusal is None:
        return "continued"
    if not restart:
        raise CampaignChanged(refusal)
    write_json_atomic({**record, "starts": [*record["starts"], {**here, "restart_of": len(record["starts"]) - 1}]}, path)
    return "restarted"


def summary(path: str | Path) -> str:
    """One line on the campaign in force at ``path`` (for logs)."""
    record = read(path)
    if record is None:
        return f"{path}: no campaign"
    start = record["starts"][-1]
    return (f"{path}: scale {record.get('scale')}, start {len(record['starts'])} of {start.get('started_utc')} "
            f"(code {short(start.get('code_fingerprint'))}, commit {(start.get('commit') or 'none')[:12]}, "
            f"torch {start['packages'].get('torch', 'absent')}, transformers {start['packages'].get('transformers', 'absent')}, "
            f"Python {start.get('python')})")


__all__ = ["CampaignChanged", "CampaignRecordError", "check", "ensure", "installed_packages", "library_fingerprint",
           "package_changes", "read", "state", "summary"]
