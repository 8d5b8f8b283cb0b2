"""make verify-results' comparison (workflow/scripts/compare_results.py) on two small copies of the tables:
identical passes either way, a float moved by rounding (or by a hundredth of its interval) passes only off the
record's platform, a changed verdict or accuracy fails both, and only the named studies' rows count. Bytes are
demanded only where the record states this machine's numeric platform in every component, and the script
prints which comparison it made and why."""

import importlib.util
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "results" / "smoke-reference"
_spec = importlib.util.spec_from_file_location("compare_results", ROOT / "workflow" / "scripts" / "compare_results.py")
compare_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_results)

# Two rows of the committed results/claims.csv's v3 study and one of another study; the C3 Spearman of the
# issue's AVX512 rerun differed from the record's in the 9th digit, as row "c3" does below.
CLAIMS = """study,prereg,claim,title,component,estimate,ci_low,ci_high,threshold,verdict,paper_verdict,agrees,n
v2,2,c1,Question-aware eviction,"accuracy_change[snapkv,topk,0.25]",-64.86,-68.69,-61.02,-2.0,not supported,supported,no,626
v3,3,c2,Poisson+Hajek costs no accuracy,"poisson_minus_topk[snapkv,0.5]",0.40404040404040403,-1.51,2.3232323232323213,-1.0,inconclusive,supported,n/a,330
v3,3,c3,The certificate covers,coverage,0.97,0.968,0.973,0.95,supported,supported,yes,46
"""
REPRODUCTION = """study,quantity,paper,ours,ci_low,ci_high,note
v3,"Spearman(certificate, true error)",0.943-0.979,0.9258669225,0.92,0.93,
"""
ACCURACY = """study,model,task,setting,policy,design,budget,accuracy,n
v3,smollm2,niah_single,question_aware,full,full,1.0,51.6667,330
"""


def _write(folder: Path, claims=CLAIMS, reproduction=REPRODUCTION, accuracy=ACCURACY) -> Path:
    folder.mkdir(parents=True)
    for name, text in (("claims.csv", claims), ("reproduction.csv", reproduction), ("accuracy.csv", accuracy)):
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def committed(tmp_path):
    return _write(tmp_path / "committed")


@pytest.mark.parametrize("byte_for_byte", [True, False])
def test_identical_tables_pass(committed, tmp_path, byte_for_byte, capsys):
    fresh = _write(tmp_path / "fresh")
    assert compare_results.compare(committed, fresh, ["v3"], byte_for_byte)
    assert capsys.readouterr().out.count("identical" if byte_for_byte else ": equal") == 3


def test_rounding_passes_only_off_the_records_platform(committed, tmp_path):
    # the issue's AVX512 rerun: C2's upper bound in the 16th digit, the Spearman in the 9th
    fresh = _write(tmp_path / "fresh", CLAIMS.replace("2.3232323232323213", "2.323232323232322"),
                   REPRODUCTION.replace("0.9258669225", "0.9258669242"))
    assert not compare_results.compare(committed, fresh, ["v3"], byte_for_byte=True)
    assert compare_results.compare(committed, fresh, ["v3"], byte_for_byte=False)
    # a move beyond the tolerance (2e-4: past rtol and past 1% of the row's interval width, 0.01) is a
    # difference on every platform
    beyond = _write(tmp_path / "beyond", reproduction=REPRODUCTION.replace("0.9258669225", "0.9260669225"))
    assert compare_results.compare_table(committed / "reproduction.csv", beyond / "reproduction.csv", ["v3"], False) \
        == ["v3 Spearman(certificate, true error): ours 0.9258669225 vs 0.9260669225"]


# v3's certificate coverage row of the committed results/reproduction.csv, and the values the AVX512
# verification of 2026-12-01 computed for it (docs/studies/v3.md): 2 of 139,320 indicators apart.
COVERAGE = """study,quantity,paper,ours,ci_low,ci_high,note
v3,certificate coverage,0.969-0.977,{ours},{low},{high},"fraction of (step, layer, head) with true error <= sqrt(trV/0.05)"
"""
RECORD = dict(ours="0.9703057708871662", low="0.9680920485833556", high="0.9729951042040963")
AVX512 = dict(ours="0.9703201263278782", low="0.96810551558753", high="0.9729803835456009")


def test_an_indicator_flip_passes_within_a_hundredth_of_the_interval(tmp_path):
    record = _write(tmp_path / "record", reproduction=COVERAGE.format(**RECORD))
    rerun = _write(tmp_path / "rerun", reproduction=COVERAGE.format(**AVX512))
    width = float(RECORD["high"]) - float(RECORD["low"])
    moved = max(abs(float(RECORD[k]) - float(AVX512[k])) for k in RECORD)
    assert moved > compare_results.RTOL * float(RECORD["ours"])  # what rtol alone refused
    assert moved < compare_results.WIDTH_FRACTION * width  # 0.3% of the width
    assert compare_results.compare_table(record / "reproduction.csv", rerun / "reproduction.csv", ["v3"], False) == []
    assert compare_results.compare_table(record / "reproduction.csv", rerun / "reproduction.csv", ["v3"], True)
    # twice the fraction of the width is a difference
    far = dict(RECORD, ours=repr(float(RECORD["ours"]) + 2 * compare_results.WIDTH_FRACTION * width))
    moved_far = _write(tmp_path / "far", reproduction=COVERAGE.format(**far))
    assert compare_results.compare_table(record / "reproduction.csv", moved_far / "reproduction.csv", ["v3"], False) \
        == [f"v3 certificate coverage: ours {float(RECORD['ours'])!r} vs {float(far['ours'])!r}"]
    # a row without an interval keeps rtol alone
    bare = COVERAGE.replace("{low},{high}", ",")
    bare_record = _write(tmp_path / "bare_record", reproduction=bare.format(**RECORD)) / "reproduction.csv"
    bare_rerun = _write(tmp_path / "bare_rerun", reproduction=bare.format(**AVX512)) / "reproduction.csv"
    assert compare_results.compare_table(bare_record, bare_rerun, ["v3"], False) == [
        f"v3 certificate coverage: ours {float(RECORD['ours'])!r} vs {float(AVX512['ours'])!r}"]


def test_a_changed_verdict_or_accuracy_fails_everywhere(committed, tmp_path):
    verdict = _write(tmp_path / "verdict", CLAIMS.replace("0.95,supported,supported,yes", "0.95,inconclusive,supported,n/a"))
    accuracy = _write(tmp_path / "accuracy", accuracy=ACCURACY.replace("51.6667", "51.6668"))
    for byte_for_byte in (True, False):
        assert not compare_results.compare(committed, verdict, ["v3"], byte_for_byte)
        assert not compare_results.compare(committed, accuracy, ["v3"], byte_for_byte)
    assert compare_results.compare_table(committed / "claims.csv", verdict / "claims.csv", ["v3"], False) == [
        "v3 c3: verdict 'supported' vs 'inconclusive'", "v3 c3: agrees 'yes' vs 'n/a'"]


def test_only_the_named_studies_count(committed, tmp_path):
    other = _write(tmp_path / "other", CLAIMS.replace("not supported,supported,no,626", "supported,supported,yes,626"))
    assert compare_results.compare(committed, other, ["v3"], byte_for_byte=True)
    for byte_for_byte in (True, False):
        assert compare_results.compare_table(committed / "claims.csv", other / "claims.csv", ["v2"], byte_for_byte)
    missing = _write(tmp_path / "missing", CLAIMS.rsplit("v3,3,c3", 1)[0])  # v3's c3 row lost
    assert compare_results.compare_table(committed / "claims.csv", missing / "claims.csv", ["v3"], False) == [
        "2 rows vs 1"]
    with pytest.raises(compare_results.CompareError, match="no row of study v9"):
        compare_results.compare_table(committed / "claims.csv", committed / "claims.csv", ["v9"], False)


# Two numeric platforms as kvcert.provenance.numeric_platform states them: the same capability (AVX2), torch and
# transformers on two CPU models, as the committed records and a rerun on another machine were.
HERE = {"machine": "x86_64", "cpu_model": "AMD EPYC", "cpu_isa": "avx avx2 f16c fma pni sse sse2 sse4_1 sse4_2 ssse3",
        "compiler": "c++ (Debian 12.2.0-14+deb12u1) 12.2.0", "cpu_capability": "AVX2", "torch": "2.13.0+cpu",
        "transformers": "5.24.0"}
OTHER_CPU = dict(HERE, cpu_model="Intel(R) Xeon(R) CPU @ 2.20GHz")
# What every committed manifest states of the platform (written before the CPU model was recorded).
COARSE = {"cpu_capability": "AVX2", "torch": "2.13.0+cpu", "transformers": "5.24.0"}


def _manifest(root: Path, study: str, cell: str, platform: dict | None = None, cpu: str = "AVX2") -> None:
    path = root / study / "cells" / cell / "shard-0" / "manifest.json"
    path.parent.mkdir(parents=True)
    manifest = {"cpu_capability": cpu, "packages": {"torch": "2.13.0+cpu", "transformers": "5.24.0"}}
    path.write_text(json.dumps(manifest | ({"numeric_platform": platform} if platform else {})))


def test_the_records_platform_is_read_from_its_manifests(tmp_path):
    _manifest(tmp_path, "v3", "qa")
    _manifest(tmp_path, "v3", "streaming")
    assert compare_results.record_platform(tmp_path, ["v3"]) == COARSE  # what an old manifest states
    _manifest(tmp_path, "v2", "qa", cpu="AVX512")
    assert compare_results.record_platform(tmp_path, ["v2", "v3"]) is None  # mixed: no byte-for-byte claim
    assert compare_results.record_platform(tmp_path, ["v1"]) is None
    _manifest(tmp_path, "v4", "qa", HERE)
    _manifest(tmp_path, "v4", "streaming", HERE)
    assert compare_results.record_platform(tmp_path, ["v4"]) == HERE  # a new manifest's numeric_platform
    _manifest(tmp_path, "v5", "qa", HERE)
    _manifest(tmp_path, "v5", "streaming", OTHER_CPU)
    assert len(compare_results.record_platforms(tmp_path, ["v5"])) == 2  # two CPU models: no one platform


def test_bytes_are_demanded_only_on_the_records_platform_in_every_component():
    byte_for_byte, line = compare_results.choose_comparison(dict(HERE), HERE)
    assert byte_for_byte and line.endswith(": byte for byte")
    byte_for_byte, line = compare_results.choose_comparison(OTHER_CPU, HERE)
    assert not byte_for_byte
    assert "(cpu_model: 'Intel(R) Xeon(R) CPU @ 2.20GHz' in the record, 'AMD EPYC' here)" in line
    assert line.endswith(f"other numbers within {compare_results.TOLERANCE}")
    # equal in every component it states, but it states too few: the tolerance, naming what is missing
    byte_for_byte, line = compare_results.choose_comparison(COARSE, HERE)
    assert not byte_for_byte and "cpu_model: not recorded (here 'AMD EPYC')" in line
    assert "cpu_capability" not in line  # equal components are not reasons
    assert compare_results.choose_comparison(None, HERE, "the record's cell manifests state 2 different platforms") \
        [1].startswith("verify-results: this machine's numeric platform is not proven to be the record's (the "
                       "record's cell manifests state 2 different platforms)")


def _rerun_on(monkeypatch, platform: dict) -> None:
    """This machine's platform as the script sees it (a stand-in: the decision is the script's own logic)."""
    monkeypatch.setattr(compare_results, "numeric_platform", lambda: dict(platform))


def test_the_script_prints_its_comparison_and_why(committed, tmp_path, monkeypatch, capsys):
    # a rerun that moved floats by rounding only (the rerun on another CPU model)
    rounded = _write(tmp_path / "fresh", CLAIMS.replace("2.3232323232323213", "2.323232323232322"),
                     REPRODUCTION.replace("0.9258669225", "0.9258669242"))
    args = ["--committed", str(committed), "--fresh", str(rounded), "v3"]
    _manifest(committed, "v3", "qa")  # a committed record's manifest: no CPU model
    _rerun_on(monkeypatch, HERE)
    assert compare_results.main(args) == 0
    first, *tables = capsys.readouterr().out.splitlines()
    assert "cpu_model: not recorded (here 'AMD EPYC')" in first and "not proven to be the record's" in first
    assert tables == [f"verify-results: claims.csv (v3): equal, floats within {compare_results.TOLERANCE}",
                      f"verify-results: reproduction.csv (v3): equal, floats within {compare_results.TOLERANCE}",
                      "verify-results: accuracy.csv (v3): equal"]
    # the record's platform from a file (the smoke reference's platform.json), on the same machine: bytes
    record = tmp_path / "platform.json"
    record.write_text(json.dumps(HERE))
    assert compare_results.main([*args, "--record-platform", str(record)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(": byte for byte") and "claims.csv (v3): DIFFERS" in out
    # the same file, read on another CPU model: the tolerance, and why
    _rerun_on(monkeypatch, OTHER_CPU)
    assert compare_results.main([*args, "--record-platform", str(record)]) == 0
    assert "(cpu_model: 'AMD EPYC' in the record, 'Intel(R) Xeon(R) CPU @ 2.20GHz' here)" in capsys.readouterr().out


def test_the_smoke_reference_compares_its_two_tables(tmp_path, capsys):
    """The smoke reference holds claims.csv and reproduction.csv only; --tables names them."""
    fresh = tmp_path / "smoke"
    fresh.mkdir()
    for name in ("claims.csv", "reproduction.csv"):
        shutil.copy(REFERENCE / name, fresh / name)
    studies = sorted(set(pd.read_csv(REFERENCE / "claims.csv")["study"]))
    assert compare_results.main(["--committed", str(REFERENCE), "--record-platform", str(REFERENCE / "platform.json"),
                                 "--tables", "claims.csv", "reproduction.csv", "--fresh", str(fresh), *studies]) == 0
    out = capsys.readouterr().out.splitlines()
    # the committed platform.json predates the CPU model: never proven this machine's platform
    assert "cpu_model: not recorded" in out[0]
    assert [line.split(":")[1] for line in out[1:]] == [" claims.csv (v1, v2)", " reproduction.csv (v1, v2)"]


def test_the_committed_v3_record_compared_with_itself(tmp_path, capsys):
    """The command make verify-results runs, on a copy of the committed tables (no recomputation)."""
    fresh = tmp_path / "verify"
    fresh.mkdir()
    for name in compare_results.TABLES:
        shutil.copy(ROOT / "results" / name, fresh / name)
    assert compare_results.main(["--committed", str(ROOT / "results"), "--fresh", str(fresh), "v3"]) == 0
    out = capsys.readouterr().out
    assert "byte for byte" in out or "within rtol" in out  # it says which comparison it made
    assert out.count("verify-results: ") == 4


def test_an_unknown_study_is_one_line(capsys):
    assert compare_results.main(["--check", "v3", "v9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["verify-results: error: STUDIES=v9: unknown study; known (configs/scales/default.yaml): "
                   + ", ".join(compare_results.known_studies())]
    assert compare_results.main(["--check", "v3"]) == 0
    assert set(compare_results.known_studies()) == set(pd.read_csv(ROOT / "results" / "claims.csv")["study"])


def test_columns_are_compared_by_name_not_by_order(tmp_path):
    # The default scale's accuracy.csv puts allocator and head_fraction last (study v1's table, first, lacks them);
    # study v5 recomputed by its own scale writes them where v5's table has them (make verify-results STUDIES=v5
    # on 2026-12-07 failed a correct rerun on this order alone).
    record = ("study,model,task,setting,policy,design,budget,accuracy,n,allocator,head_fraction\n"
              "v5,smollm2,niah_multikey_2_512,question_aware,leverage,poisson,0.25,90.3226,31,uniform,0.8\n")
    rerun = ("study,model,task,setting,policy,allocator,design,head_fraction,budget,accuracy,n\n"
             "v5,smollm2,niah_multikey_2_512,question_aware,leverage,uniform,poisson,0.8,0.25,90.3226,31\n")
    committed, fresh = _write(tmp_path / "record", accuracy=record), _write(tmp_path / "rerun", accuracy=rerun)
    for byte_for_byte in (True, False):
        assert compare_results.compare_table(committed / "accuracy.csv", fresh / "accuracy.csv", ["v5"],
                                             byte_for_byte) == []
    # a value that differs is still found, named by its column, in either comparison
    moved = _write(tmp_path / "moved", accuracy=rerun.replace("0.8,0.25", "0.95,0.25"))
    assert compare_results.compare_table(committed / "accuracy.csv", moved / "accuracy.csv", ["v5"], False) == [
        "v5 smollm2 niah_multikey_2_512 question_aware leverage poisson 0.25 uniform 0.8: head_fraction 0.8 vs 0.95"]
    assert compare_results.compare_table(committed / "accuracy.csv", moved / "accuracy.csv", ["v5"], True)
    # other columns are not an order: a missing or an extra column is a difference
    fewer = _write(tmp_path / "fewer", accuracy=rerun.replace(",head_fraction", "").replace(",0.8,", ","))
    assert compare_results.compare_table(committed / "accuracy.csv", fewer / "accuracy.csv", ["v5"], False)[0] \
        .startswith("columns ")


def test_a_differing_accuracy_is_stated_in_items_and_names_its_whole_row(tmp_path):
    # Study v5's rows differ only in model, design, budget, allocator or share, so the row's name carries them all,
    # and a differing accuracy says how many of its items it moved (one of an item's three draws: a third).
    header = "study,model,task,setting,policy,design,budget,accuracy,n,allocator,head_fraction\n"
    record = header + "v5,smollm2,niah_multikey_2_512,question_aware,leverage,poisson,0.25,90.3226,31,uniform,0.8\n"
    rerun = record.replace("90.3226", "91.3978")
    committed, fresh = _write(tmp_path / "record", accuracy=record), _write(tmp_path / "rerun", accuracy=rerun)
    for byte_for_byte in (True, False):
        assert not compare_results.compare(committed, fresh, ["v5"], byte_for_byte, tables=("accuracy.csv",))
    assert compare_results.compare_table(committed / "accuracy.csv", fresh / "accuracy.csv", ["v5"], False) == [
        "v5 smollm2 niah_multikey_2_512 question_aware leverage poisson 0.25 uniform 0.8: "
        "accuracy 90.3226 vs 91.3978 (net 0.33 of 31 items)"]
