"""Staging for an offline cluster (kvcert.stage) and model records (kvcert.model_record): which files of the paper's
models are kept, the record's cheap check and its refusals, staging a real stand-in model directory as a hub cache
that transformers loads by name offline, and the disk estimate."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcert import model_record as mr
from kvcert import stage
from kvcert.provenance import sha256_file

FIXTURE = Path(__file__).parent / "fixtures" / "hub_model_files.json"
REPO = Path(__file__).resolve().parent.parent


def _old_digest(directory: Path) -> str:
    """model_fingerprint's digest of a model directory before records existed (kept equal on purpose)."""
    weights = sorted(directory.glob("*.safetensors"))
    return hashlib.sha256(b"".join(sha256_file(w).encode() for w in weights)).hexdigest() if weights else ""


# ----------------------------------------------------------------------------- which files are kept

def test_loading_files_of_the_paper_models():
    listing = json.loads(FIXTURE.read_text())["models"]
    kept = {name: mr.loading_files(files) for name, files in listing.items()}
    assert kept["Qwen/Qwen2.5-7B-Instruct"] == [
        "config.json", "generation_config.json", "merges.txt", *(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)),
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    # Llama: nothing of original/ (its 16 GB consolidated.00.pth, params.json, tokenizer.model)
    assert kept["meta-llama/Llama-3.1-8B-Instruct"] == [
        "config.json", "generation_config.json", *(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)),
        "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    # Mistral: not the duplicate consolidated.safetensors, nor mistral-inference's params.json and tokenizer.model.v3
    assert kept["mistralai/Mistral-7B-Instruct-v0.3"] == [
        "config.json", "generation_config.json", *(f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)),
        "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json", "tokenizer.model",
        "tokenizer_config.json"]
    assert kept["Qwen/Qwen3-8B"] == [
        "config.json", "generation_config.json", "merges.txt", *(f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)),
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    for files in kept.values():
        assert not any(f.endswith((".pth", ".bin", ".gguf", ".md")) or "/" in f for f in files)


def test_loading_files_weights_rules():
    # .bin only where no safetensors exist; gguf and pth never; the chat template and tiktoken files are kept
    assert mr.loading_files(["config.json", "pytorch_model.bin", "model.safetensors", "model.gguf", "w.pth"]) == [
        "config.json", "model.safetensors"]
    assert mr.loading_files(["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json",
                             "training_args.bin", "chat_template.jinja", "qwen.tiktoken"]) == [
        "chat_template.jinja", "config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json",
        "qwen.tiktoken"]
    # an index without its safetensors is not kept, nor a record of ours
    assert mr.loading_files(["model.safetensors.index.json", "consolidated.safetensors", mr.RECORD_NAME]) == []


# ----------------------------------------------------------------------------- records

def _model_dir(root: Path) -> Path:
    directory = root / "model"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model-00001-of-00002.safetensors").write_bytes(os.urandom(4096))
    (directory / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1000))
    (directory / "README.md").write_text("not read by loading")
    return directory


def test_record_is_computed_once_and_keeps_the_old_digest(tmp_path, monkeypatch):
    directory = _model_dir(tmp_path)
    record = mr.ensure_record(directory, name="local", fallback_dir=tmp_path / "fallback")
    assert record["sha256"] == _old_digest(directory) != ""
    assert [f["name"] for f in record["files"]] == ["config.json", "model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors"]
    assert {f["name"]: f["size"] for f in record["files"]}["model-00001-of-00002.safetensors"] == 4096
    assert json.loads((directory / mr.RECORD_NAME).read_text()) == record
    # our own logic: the second check must not read the weights (sha256_file replaced by a failure)
    monkeypatch.setattr(mr, "sha256_file", lambda path: (_ for _ in ()).throw(AssertionError(f"hashed {path}")))
    assert mr.ensure_record(directory, name="local") == record


def test_record_refusals_name_the_file(tmp_path, monkeypatch):
    directory = _model_dir(tmp_path)
    mr.ensure_record(directory, name="local")
    shard = directory / "model-00002-of-00002.safetensors"
    shard.write_bytes(os.urandom(999))
    with pytest.raises(mr.RecordError, match=r"model-00002-of-00002.safetensors: 999 bytes, the model record .* says 1000"):
        mr.ensure_record(directory, name="local")
    shard.unlink()
    with pytest.raises(mr.RecordError, match=r"model-00002-of-00002.safetensors: missing"):
        mr.ensure_record(directory, name="local")
    shard.write_bytes(os.urandom(1000))  # same size, other bytes: the cheap check passes, a re-hash refuses
    assert mr.ensure_record(directory, name="local")["sha256"] != _old_digest(directory)
    with pytest.raises(mr.RecordError, match=r"model-00002-of-00002.safetensors: sha256 \w+, the model record"):
        mr.ensure_record(directory, name="local", rehash=True)
    monkeypatch.setenv("KVCERT_MODEL_REHASH", "1")
    with pytest.raises(mr.RecordError, match="model-00002-of-00002.safetensors: sha256"):
        mr.ensure_record(directory, name="local")
    monkeypatch.delenv("KVCERT_MODEL_REHASH")
    (directory / "model-00003-of-00003.safetensors").write_bytes(b"x")
    with pytest.raises(mr.RecordError, match="model-00003-of-00003.safetensors: a file loading reads that the model "
                                             "record .* does not list"):
        mr.ensure_record(directory, name="local")
    (directory / mr.RECORD_NAME).write_text("{}")
    with pytest.raises(mr.RecordError, match=f"{mr.RECORD_NAME}: not a model record"):
        mr.ensure_record(directory, name="local")


def test_fallback_record_is_stale_once_a_file_changes(tmp_path, monkeypatch):
    """A record kept outside the directory is keyed by its path and trusted only while the files' mtimes hold."""
    directory = _model_dir(tmp_path)
    fallback = tmp_path / "fallback"
    real_write = mr.write_json_atomic

    def refuse_beside(payload, path):  # our own logic: the directory behaves as read-only for the record
        if Path(path).parent == directory:
            raise PermissionError(f"{path}: read-only")
        real_write(payload, path)

    monkeypatch.setattr(mr, "write_json_atomic", refuse_beside)
    first = mr.ensure_record(directory, name="local", fallback_dir=fallback)
    assert not (directory / mr.RECORD_NAME).exists() and len(list(fallback.iterdir())) == 1
    shard = directory / "model-00002-of-00002.safetensors"
    shard.write_bytes(os.urandom(1000))  # rebuilt in place, same size: the kept record must not be reused
    os.utime(shard, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    second = mr.ensure_record(directory, name="local", fallback_dir=fallback)
    assert second["sha256"] == _old_digest(directory) != first["sha256"]


def test_model_fingerprint_of_a_local_directory(tmp_path):
    from kvcert.models import model_fingerprint

    directory = _model_dir(tmp_path)
    fingerprint = model_fingerprint({"kind": "hf", "name": str(directory)})
    assert fingerprint == {"kind": "hf", "name": str(directory), "sha256": _old_digest(directory)}
    (directory / "config.json").write_text("{}")
    with pytest.raises(mr.RecordError, match="config.json: 2 bytes"):
        model_fingerprint({"kind": "hf", "name": str(directory)})


@pytest.mark.smollm2
def test_bundled_model_digest_unchanged():
    from kvcert.models import BUNDLED, model_fingerprint

    assert model_fingerprint("smollm2") == {"kind": "smollm2", "file": BUNDLED["smollm2"].file,
                                            "sha256": BUNDLED["smollm2"].sha256}


# ----------------------------------------------------------------------------- planning and the disk estimate

class _Api:
    """A stand-in for the hub's listing API (our own logic under test: the plan made from a listing)."""

    def __init__(self, listings):
        self.listings = listings

    def model_info(self, name, files_metadata=False):
        if name not in self.listings:
            from huggingface_hub.errors import RepositoryNotFoundError

            err = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
            Exception.__init__(err, f"404 Client Error. Repository Not Found for url: .../api/models/{name}")
            raise err
        siblings = [SimpleNamespace(rfilename=n, size=s, lfs=None) for n, s in self.listings[name].items()]
        return SimpleNamespace(sha="a" * 40, siblings=siblings)


def test_disk_estimate_counts_only_kept_files(tmp_path):
    # sizes here are the test's own numbers, not the hub's
    listing = {"org/model": {"config.json": 700, "model-00001-of-00002.safetensors": 4_000_000_000,
                             "model-00002-of-00002.safetensors": 1_000_000_000, "model.safetensors.index.json": 20_000,
                             "consolidated.safetensors": 5_000_000_000, "original/consolidated.00.pth": 5_000_000_000,
                             "tokenizer.json": 9_000_000, "README.md": 5000}}
    plan = stage.plan_hub_model("org/model", api=_Api(listing))
    assert plan.revision == "a" * 40
    assert sum(plan.sizes.values()) == 700 + 5_000_000_000 + 20_000 + 9_000_000
    assert plan.skipped == ["README.md", "consolidated.safetensors", "original/consolidated.00.pth"]
    lines, left = stage.describe([plan], None, None, tmp_path / "out", tmp_path / "out" / "hub")
    assert left == 5_009_020_700
    assert lines[0].startswith("kvcert-stage: needs 5.01 GB on ") and "5.01 GB left to fetch" in lines[0]
    # a resumed staging counts what is in place already
    snapshot = stage.repo_folder(tmp_path / "out" / "hub", "org/model") / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes(b"t" * 9_000_000)
    assert stage.describe([plan], None, None, tmp_path / "out", tmp_path / "out" / "hub")[1] == left - 9_000_000


def test_unknown_model_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    original = stage.plan_hub_model
    monkeypatch.setattr(stage, "plan_hub_model", lambda name: original(name, api=_Api({})))
    out = tmp_path / "stage"
    assert stage.main(["--model", "org/no-such-model", "--out", str(out), "--wheels", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvcert-stage: error: model org/no-such-model: the hub does not know it (RepositoryNotFoundError: "
                   "404 Client Error. Repository Not Found for url: .../api/models/org/no-such-model)"]
    assert not out.exists()


def test_bad_inputs_are_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "stage"
    assert stage.main(["--subsets", "qasper,no_such_subset", "--longbench-from", str(tmp_path), "--out", str(out),
                       "--wheels", "none"]) == 2
    assert "unknown LongBench subset 'no_such_subset'" in capsys.readouterr().err
    assert stage.main(["--model-dir", f"org/m={tmp_path / 'absent'}", "--out", str(out), "--wheels", "none"]) == 2
    assert f"--model-dir org/m={tmp_path / 'absent'}: no such directory" in capsys.readouterr().err
    lock = tmp_path / "lock.txt"
    lock.write_text("tqdm==4.66.0 \\\n    --hash=sha256:" + "0" * 64 + "\nrequests>=2\n")
    assert stage.main(["--model-dir", f"org/m={tmp_path}", "--lock", str(lock), "--out", str(out)]) == 2
    assert f"{lock}: requests>=2 is not pinned with ==" in capsys.readouterr().err
    assert stage.main(["--model-dir", f"org/m={tmp_path}", "--out", str(out), "--wheels", "none"]) == 2
    assert "no weights transformers loads" in capsys.readouterr().err
    assert stage.main(["--model-dir", f"org/m={tmp_path}", "--out", str(out), "--wheels", "none", "--bundled", "nope"]) == 2
    assert "--bundled nope: unknown bundled model; known: smollm2, gemma3 (or none)" in capsys.readouterr().err
    assert not out.exists()


def test_read_lock_joins_continued_lines(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("# a comment\n--extra-index-url x\ntqdm==4.66.0 \\\n    --hash=sha256:" + "1" * 64 +
                    "\n    # via kvcert\npyyaml==6.0.2 ; python_version >= '3.10' \\\n    --hash=sha256:" + "2" * 64 + "\n")
    assert stage.read_lock(lock) == [f"tqdm==4.66.0 --hash=sha256:{'1' * 64}",
                                     f"pyyaml==6.0.2 ; python_version >= '3.10' --hash=sha256:{'2' * 64}"]


def test_paper_scale_needs_four_hub_models_and_six_subsets():
    names, subsets = stage.scale_needs("paper", REPO)
    assert sorted(names) == ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct",
                             "mistralai/Mistral-7B-Instruct-v0.3"]
    assert subsets == ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique"]


# ----------------------------------------------------------------------------- staging a real model directory

@pytest.mark.smollm2
def test_stage_a_standin_as_a_hub_cache_loadable_by_name_offline(tmp_path, capsys):
    from kvcert import load_tokenizer
    from kvcert.standins import build_longbench, build_model

    tokenizer = load_tokenizer("smollm2")
    source = build_model("qwen2", tmp_path / "standin", tokenizer, seed=3)
    longbench = build_longbench(tmp_path / "longbench", tokenizer, subsets=["qasper"], per_subset=1, tokens=200)
    out = tmp_path / "stage"
    argv = ["--model-dir", f"Qwen/Qwen2.5-7B-Instruct={source}", "--subsets", "qasper", "--longbench-from",
            str(longbench), "--out", str(out), "--wheels", "none", "--bundled", "none"]
    assert stage.main(argv) == 0
    captured = capsys.readouterr()
    assert f"source {out / stage.ENV_FILE}" in captured.out and f"HF_HUB_CACHE={out / 'hub'}" in captured.out
    kept = mr.loading_files(p.name for p in source.iterdir())
    needed = sum((source / n).stat().st_size for n in kept)
    assert f"kvcert-stage: needs {needed / 1e9:.2f} GB on {out}" in captured.err and needed >= 10**7

    folder = out / "hub" / "models--Qwen--Qwen2.5-7B-Instruct"
    revision = (folder / "refs" / "main").read_text()
    snapshot = folder / "snapshots" / revision
    record = json.loads((snapshot / mr.RECORD_NAME).read_text())
    assert record["revision"] == revision and record["name"] == "Qwen/Qwen2.5-7B-Instruct"
    assert [f["name"] for f in record["files"]] == kept and "standin.json" not in kept
    for entry in record["files"]:
        assert entry["size"] == (source / entry["name"]).stat().st_size
        assert entry["sha256"] == sha256_file(source / entry["name"])
        assert (snapshot / entry["name"]).is_symlink()  # hub cache layout: snapshot links into blobs/
    assert record["sha256"] == _old_digest(source)
    assert (out / "longbench" / "qasper.jsonl").read_text() == (longbench / "qasper.jsonl").read_text()
    summary = json.loads((out / "stage.json").read_text())
    assert summary["models"][0]["revision"] == revision and summary["longbench"]["subsets"] == ["qasper"]

    # a rerun resumes: nothing is hashed into a new record
    before = (snapshot / mr.RECORD_NAME).stat().st_mtime_ns
    assert stage.main(argv) == 0
    assert (snapshot / mr.RECORD_NAME).stat().st_mtime_ns == before

    # the env file, sourced by bash, makes from_pretrained("Qwen/Qwen2.5-7B-Instruct") load the staged copy offline,
    # and a cell's manifest fingerprint carries its revision and the record's digest
    script = (
        "from transformers import AutoConfig, AutoTokenizer\n"
        "import json, os\n"
        "from kvcert.models import model_fingerprint\n"
        "config = AutoConfig.from_pretrained('Qwen/Qwen2.5-7B-Instruct')\n"
        "tok = AutoTokenizer.from_pretrained('Qwen/Qwen2.5-7B-Instruct')\n"
        "print(json.dumps({'type': config.model_type, 'vocab': len(tok), 'offline': os.environ['HF_HUB_OFFLINE'],"
        " 'fp': model_fingerprint('hf:Qwen/Qwen2.5-7B-Instruct')}))\n")
    proc = subprocess.run(["bash", "-c", f"source {out / stage.ENV_FILE} && {sys.executable} -c \"$0\"", script],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("HF_")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["type"] == "qwen2" and seen["vocab"] == len(tokenizer) and seen["offline"] == "1"
    assert seen["fp"] == {"kind": "hf", "name": "Qwen/Qwen2.5-7B-Instruct", "sha256": record["sha256"],
                          "revision": revision}


def test_too_little_disk_and_dry_run_write_nothing(tmp_path, monkeypatch, capsys):
    directory = _model_dir(tmp_path)
    out = tmp_path / "stage"
    argv = ["--model-dir", f"org/m={directory}", "--out", str(out), "--wheels", "none", "--bundled", "none"]
    assert stage.main([*argv, "--dry-run"]) == 0
    needed = sum(f.stat().st_size for f in directory.iterdir() if f.name != "README.md")
    assert f"kvcert-stage: needs {needed / 1e6:.2f} MB on" in capsys.readouterr().err and not out.exists()
    monkeypatch.setattr(stage, "_free_bytes", lambda path: 1000)  # our own logic: a full disk
    assert stage.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"kvcert-stage: error: {out}: 0.00 MB free, {needed / 1e6:.2f} MB needed")
    assert not out.exists()
