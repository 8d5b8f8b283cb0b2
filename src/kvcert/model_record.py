"""Model records: which files of a Hugging Face model directory loading reads, and their identity, computed once.

A record is a small JSON file (``kvcert-record.json``) beside a model's files::

    {"format": "kvcert-model-record/1", "name": "Qwen/Qwen2.5-7B-Instruct", "revision": "<commit or null>",
     "files": [{"name": "config.json", "size": 663, "sha256": "..."}, ...], "sha256": "<weights digest>"}

``files`` lists exactly the files loading needs (:func:`loading_files`: config, generation config, tokenizer
files, chat template, ``*.safetensors`` and their index; not ``original/``, not ``consolidated.*``, not
``*.pth``/``*.bin``/``*.gguf`` when safetensors exist). ``sha256`` is the weights digest manifests have always
recorded for a model directory: the sha256 of the concatenated hex sha256 of its ``*.safetensors`` files in
name order ("" without safetensors).

Hashing 15-29 GB per job is what a record saves: :func:`ensure_record` checks the record cheaply (every
listed file present with its size, no other loading file beside them) and takes its digest; it re-hashes
every file only on request (``KVCERT_MODEL_REHASH=1``). Any mismatch is refused in one line naming the
file. A directory without a record gets one computed once and kept (atomically: in the directory, or, where
that is read-only, under a fallback folder keyed by the directory's path, where each file's mtime is kept
too so that a rebuilt directory is hashed again).

Imports nothing from kvcert but ``atomic``, ``errors`` and ``provenance``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .atomic import write_json_atomic
from .errors import ModelLoadError
from .provenance import sha256_file

RECORD_NAME = "kvcert-record.json"
FORMAT = "kvcert-model-record/1"
REHASH_ENV = "KVCERT_MODEL_REHASH"
_AGAIN = " (files changed on purpose: remove {where} and the next load records them again)"

# What transformers' from_pretrained reads of a causal LM repository besides the weights.
CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
})
TEMPLATE_FILES = frozenset({"chat_template.jinja", "chat_template.json"})
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


class RecordError(ModelLoadError):
    """A model directory that does not match its record; the message names the file, in one line."""


def _is_safetensors(name: str) -> bool:
    # consolidated.safetensors (Mistral's) holds the same weights in another layout for other runtimes
    return name.endswith(".safetensors") and not name.startswith("consolidated")


def loading_files(names: Iterable[str]) -> list[str]:
    """Of a repository's file names (paths relative to its root), those loading needs, sorted.

    Only top-level files: ``original/`` and any other folder hold other runtimes' copies. Weights are
    ``*.safetensors`` (not ``consolidated.*``) with their index; ``pytorch_model*.bin`` only where no
    safetensors exist; never ``*.pth`` or ``*.gguf``.
    """
    top = [n for n in names if "/" not in n and n != RECORD_NAME]
    has_safetensors = any(_is_safetensors(n) for n in top)
    kept = []
    for name in top:
        if name in CONFIG_FILES or name in TOKENIZER_FILES or name in TEMPLATE_FILES or name.endswith(".tiktoken"):
            kept.append(name)
        elif _is_safetensors(name) or (name == SAFETENSORS_INDEX and has_safetensors):
            kept.append(name)
        elif not has_safetensors and (name == BIN_INDEX or (name.startswith("pytorch_model") and name.endswith(".bin"))):
            kept.append(name)
    return sorted(kept)


def weights_digest(files: Iterable[dict[str, Any]]) -> str:
    """The manifest's weights digest from a record's files: sha256 over their safetensors' hex sha256 in name order."""
    weights = sorted((f for f in files if f["name"].endswith(".safetensors")), key=lambda f: f["name"])
    if not weights:
        return ""
    return hashlib.sha256(b"".join(f["sha256"].encode() for f in weights)).hexdigest()


def directory_files(directory: Path) -> list[str]:
    """The loading files present in a directory (symlinks into a hub cache's blobs count as files)."""
    return loading_files(p.name for p in directory.iterdir() if p.is_file())


def _hash_files(directory: Path, names: list[str], progress: bool) -> list[dict[str, Any]]:
    sizes = {name: (directory / name).stat().st_size for name in names}
    bar = None
    if progress and sum(sizes.values()) > (256 << 20):
        from tqdm import tqdm

        bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc=f"sha256 {directory.name}")
    out = []
    try:
        for name in names:
            out.append({"name": name, "size": sizes[name], "sha256": sha256_file(directory / name)})
            if bar is not None:
                bar.update(sizes[name])
    finally:
        if bar is not None:
            bar.close()
    return out


def build_record(directory: str | Path, *, name: str, revision: str | None = None,
                 files: list[str] | None = None, progress: bool = True) -> dict[str, Any]:
    """Hash a model directory's loading files (or ``files``) into a record; nothing is written."""
    directory = Path(directory)
    names = sorted(files) if files is not None else directory_files(directory)
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise RecordError(f"{directory / missing[0]}: missing (a file the model's record needs)")
    hashed = _hash_files(directory, names, progress)
    return {"format": FORMAT, "name": name, "revision": revision, "files": hashed, "sha256": weights_digest(hashed)}


def read_record(path: str | Path) -> dict[str, Any]:
    """A record file, checked for its keys (one-line error naming the file otherwise)."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RecordError(f"{path}: not a readable model record ({type(err).__name__}: {err})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("files"), list):
        raise RecordError(f"{path}: not a model record (expected format {FORMAT!r} with a list of files)")
    for entry in record["files"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str)):
            raise RecordError(f"{path}: file entry {entry!r} needs name, size and sha256")
    return record


def check_record(directory: str | Path, record: dict[str, Any], *, rehash: bool = False,
                 where: str | Path | None = None) -> None:
    """Refuse (RecordError, one line naming the file) a directory that does not match its record.

    The cheap check: every listed file exists with its recorded size, and no other loading file sits beside
    them. rehash: also sha256 every file against the record (reads every byte).
    """
    directory = Path(directory)
    where = where or directory / RECORD_NAME
    listed = {f["name"]: f for f in record["files"]}
    for name, entry in sorted(listed.items()):
        path = directory / name
        if not path.is_file():
            raise RecordError(f"{path}: missing; the model record {where} lists it{_AGAIN.format(where=where)}")
        size = path.stat().st_size
        if size != entry["size"]:
            raise RecordError(f"{path}: {size} bytes, the model record {where} says {entry['size']}"
                              f"{_AGAIN.format(where=where)}")
    extra = [n for n in directory_files(directory) if n not in listed]
    if extra:
        raise RecordError(f"{directory / extra[0]}: a file loading reads that the model record {where} does not list"
                          f"{_AGAIN.format(where=where)}")
    if record.get("sha256") != weights_digest(record["files"]):
        raise RecordError(f"{where}: its sha256 is not the digest of its files' sha256")
    if rehash:
        for name, entry in sorted(listed.items()):
            digest = sha256_file(directory / name)
            if digest != entry["sha256"]:
                raise RecordError(f"{directory / name}: sha256 {digest[:12]}, the model record {where} says "
                                  f"{entry['sha256'][:12]}{_AGAIN.format(where=where)}")


def rehash_requested() -> bool:
    """Whether KVCERT_MODEL_REHASH asks every record check to re-hash the files."""
    return os.environ.get(REHASH_ENV, "").strip().lower() in ("1", "true", "yes")


def _fallback_path(directory: Path, fallback_dir: Path) -> Path:
    key = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:24]
    return fallback_dir / f"{key}.json"


def _mtimes(directory: Path, names: Iterable[str]) -> dict[str, int]:
    return {n: (directory / n).stat().st_mtime_ns for n in names}


def ensure_record(directory: str | Path, *, name: str, revision: str | None = None,
                  fallback_dir: str | Path | None = None, rehash: bool | None = None,
                  progress: bool = True) -> dict[str, Any]:
    """The checked record of a model directory, computed and kept once where there is none.

    The record beside the files wins; a kept fallback record (``fallback_dir``) is used only while the
    directory's loading files keep the mtimes it saw, else the files are hashed again. rehash: None reads
    KVCERT_MODEL_REHASH.
    """
    directory = Path(directory)
    rehash = rehash_requested() if rehash is None else rehash
    beside = directory / RECORD_NAME
    if beside.is_file():
        record = read_record(beside)
        check_record(directory, record, rehash=rehash, where=beside)
        return record
    fallback = _fallback_path(directory, Path(fallback_dir)) if fallback_dir is not None else None
    if fallback is not None and fallback.is_file():
        record = read_record(fallback)
        names = [f["name"] for f in record["files"]]
        if (record.get("path") == str(directory.resolve()) and directory_files(directory) == sorted(names)
                and all((directory / n).is_file() for n in names)
                and record.get("mtime_ns") == _mtimes(directory, names)):
            check_record(directory, record, rehash=rehash, where=fallback)
            return _public(record)
    record = build_record(directory, name=name, revision=revision, progress=progress)
    try:
        write_json_atomic(record, beside)
    except OSError:
        if fallback is not None:
            kept = {**record, "path": str(directory.resolve()),
                    "mtime_ns": _mtimes(directory, [f["name"] for f in record["files"]])}
            try:
                write_json_atomic(kept, fallback)
            except OSError:
                pass  # nowhere to keep it: the next job hashes again
    return record


def _public(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("path", "mtime_ns")}


def hub_snapshot(name: str) -> tuple[Path, str] | None:
    """The local snapshot folder and revision of hub model ``name`` in the Hugging Face cache, offline; None if
    it is not cached. Reads only the cache (``HF_HUB_CACHE``), never the network."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        folder = Path(snapshot_download(repo_id=name, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return folder, folder.name


__all__ = ["RECORD_NAME", "RecordError", "build_record", "check_record", "directory_files", "ensure_record",
           "hub_snapshot", "loading_files", "read_record", "rehash_requested", "weights_digest"]
