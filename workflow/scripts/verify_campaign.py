"""Verify a finished campaign before reading its tables (the runbook's last step, `make verify-campaign`).

A scale computed on a cluster has no committed record to be compared with: what can go wrong there is that its
cells were made by different code or packages, that a table was changed or cut after its manifest was written, or
that a cell is missing. This checks, for the scale's outdir:

1. every shard the scale plans has a manifest (none missing);
2. every manifest's outputs (config.yaml, items.parquet, steps.parquet, ...) still have the sha256 it records;
3. every manifest names one code fingerprint and one package set: the campaign's last start
   (``<outdir>/campaign.json``, kvcert.campaign) where there is one, else the first manifest's;
4. with ``--lock``: the package versions the manifests record equal the lock's pins (what `make install` installs);
5. the claims table holds all seven claims (a scale with claims).

One line per check, PASS or FAIL with what differs (the first few shards named); exit 0 when all pass, 1 when one
fails, 2 on bad input. Reads files only: no model, no network.

    python workflow/scripts/verify_campaign.py --scale paper [--outdir results/paper] [--lock requirements/lock-cuda.txt]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

from kvcert.provenance import sha256_file
from kvcert.scales import ScaleError, load_scale, scales_folder, shard_list, studies, study_cells

REPO = Path(__file__).resolve().parents[2]
CLAIMS = [f"c{i}" for i in range(1, 8)]
SHOWN = 3  # shards named per failing check
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def lock_pins(path: Path) -> dict[str, str]:
    """{normalized name: version} of a pip-compile lock's ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        if (match := PIN.match(line)) is not None:
            pins[normalized(match[1])] = match[2]
    if not pins:
        raise ValueError(f"--lock {path}: no 'name==version' line; is it a lock file?")
    return pins


def named(shards: list[str], what: str) -> str:
    return f"{len(shards)} {what}: " + ", ".join(shards[:SHOWN]) + (" ..." if len(shards) > SHOWN else "")


def verify(scale_name: str, outdir: Path | None, lock: Path | None) -> list[tuple[bool, str]]:
    scale = load_scale(scale_name, scales_folder(REPO))
    out = outdir or REPO / scale["outdir"]
    if not out.is_dir():
        raise ValueError(f"{out}: no such folder; the scale {scale_name} has not run there (--outdir)")
    shards = [out / study / "cells" / cell / f"shard-{shard}" for (study, cell), shard in shard_list(study_cells(scale))]
    results: list[tuple[bool, str]] = []

    manifests, missing = {}, []
    for shard in shards:
        try:
            manifests[shard] = json.loads((shard / "manifest.json").read_text())
        except (OSError, ValueError):
            missing.append(str(shard.relative_to(out)))
    results.append((not missing, f"{len(manifests)} of {len(shards)} planned shards have a manifest"
                    + (f"; {named(missing, 'missing')}" if missing else "")))

    changed = []
    for shard, manifest in manifests.items():
        for name, digest in (manifest.get("outputs_sha256") or {}).items():
            path = shard / name
            if not path.is_file() or sha256_file(path) != digest:
                changed.append(f"{shard.relative_to(out)}/{name}")
    results.append((not changed, "every output has the sha256 its manifest records"
                    if not changed else named(changed, "outputs differ from their manifests")))

    record_path = out / "campaign.json"
    start = json.loads(record_path.read_text())["starts"][-1] if record_path.is_file() else None
    first = next(iter(manifests.values()), {})
    want_code = start["code_fingerprint"] if start else first.get("code_fingerprint")
    source = "the campaign's start (campaign.json)" if start else "the first manifest (no campaign.json)"
    other_code = [str(s.relative_to(out)) for s, m in manifests.items() if m.get("code_fingerprint") != want_code]
    results.append((not other_code, f"every cell ran the code of {source}, {str(want_code)[:12]}"
                    if not other_code else named(other_code, f"cells ran other code than {source}")))
    want_packages = {normalized(k): v for k, v in ((start or {}).get("packages") or first.get("packages") or {}).items()}
    other_packages = []
    for shard, manifest in manifests.items():
        recorded = {normalized(k): v for k, v in (manifest.get("packages") or {}).items()}
        if any(want_packages.get(k, v) != v for k, v in recorded.items() if k != "kvcert"):
            other_packages.append(str(shard.relative_to(out)))
    results.append((not other_packages, f"every cell ran the packages of {source}"
                    if not other_packages else named(other_packages, f"cells ran other packages than {source}")))

    if lock is not None:
        pins = lock_pins(lock)
        off = sorted({f"{k} {v} (lock {pins[k]})" for m in manifests.values()
                      for k, v in ((normalized(a), b) for a, b in (m.get("packages") or {}).items())
                      if k in pins and pins[k] != v})
        results.append((not off, f"the manifests' package versions are {lock.name}'s" if not off
                        else f"the manifests' packages differ from {lock.name}: " + ", ".join(off[:6])))

    if any(not spec.get("archived") for spec in studies(scale).values()):  # a computed study has claims
        claims = out / "claims.csv"
        try:
            with claims.open(newline="") as handle:
                found = {row.get("claim") for row in csv.DictReader(handle)}
        except OSError:
            found = set()
        absent = [c for c in CLAIMS if c not in found]
        results.append((not absent, "claims.csv holds all seven claims" if not absent
                        else f"{claims.relative_to(out.parent) if claims.exists() else claims}: "
                             f"no row for {', '.join(absent)}"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", required=True, help="the scale the campaign ran (configs/scales/<scale>.yaml)")
    parser.add_argument("--outdir", type=Path, help="where it ran (default: the scale's outdir)")
    parser.add_argument("--lock", type=Path, help="the lock the environment was installed from")
    args = parser.parse_args(argv)
    try:
        if args.lock is not None and not args.lock.is_file():
            raise ValueError(f"--lock {args.lock}: no such file")
        results = verify(args.scale, args.outdir, args.lock)
    except (ScaleError, ValueError) as err:
        print(f"verify-campaign: {err}", file=sys.stderr)
        return 2
    for ok, line in results:
        print(f"verify-campaign: {'PASS' if ok else 'FAIL'}: {line}")
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
