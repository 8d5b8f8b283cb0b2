"""Checks of a rehearsal run (workflow/slurm/rehearse-paper.sh): what went to SLURM, and what came out.

    python workflow/slurm/check_rehearsal.py --log results/rehearse/snakemake.log --out results/rehearse

Reads the sbatch commands the SLURM executor logged (snakemake --verbose) and checks them against the
profile (workflow/profiles/slurm) and the scale: account and partition from KVCERT_SLURM_*, a GPU
request exactly when KVCERT_SLURM_CELL_GPUS > 0, memory and runtime from the scale's resources within
the profile's per-submission caps, cells grouped as the profile says and the analysis tail in one
job, local rules never submitted, every job COMPLETED. Then the outputs: claims pooled over every
model of the scale with a result (or a one-line error) per model, the tables, figures and notebooks.
Prints one line per failed check and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yte

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
from kvcert.scales import load_scale, override_value, scales_folder, studies, study_cells  # noqa: E402

CLAIMS = [f"c{i}" for i in range(1, 8)]
LOCAL_RULES = {"fetch_model", "fetch_longbench", "verify_preregistration"}
class Checks:
    def __init__(self):
        self.failed: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
        return ok


def submissions(log: str) -> list[dict]:
    """One dict per logged sbatch command: its flags and the jobs (rule, wildcards) it runs."""
    out = []
    for line in log.splitlines():
        match = re.match(r'^sbatch call: (sbatch .*?) --wrap="(.*)"$', line)
        if not match:
            continue
        flags = shlex.split(match.group(1))
        parsed: dict = {"flags": flags, "targets": re.findall(r"'(\w+):([^']*)'", match.group(2))}
        for i, flag in enumerate(flags):
            if flag in ("-A", "-p", "-t", "--mem", "--comment") and i + 1 < len(flags):
                parsed[flag] = flags[i + 1]
            elif flag.startswith(("--gpus=", "--cpus-per-task=", "--cpus-per-gpu=", "--gres=")):
                key, _, value = flag.partition("=")
                parsed[key] = value
        out.append(parsed)
    return out


def _eval_profile_value(value):
    """A profile resource as Snakemake reads it: strings are Python expressions."""
    if isinstance(value, str):
        try:
            return eval(value, {"__builtins__": __builtins__}, {})  # noqa: S307 - our own profile
        except Exception:  # noqa: BLE001 - a plain string resource
            return value
    return value


def check_submissions(c: Checks, log: str, profile: dict, scale: dict, cells: dict) -> list[str]:
    subs = submissions(log)
    c.check(bool(subs), "no sbatch command in the log (run snakemake with --verbose)")
    env = os.environ
    account = env.get("KVCERT_SLURM_ACCOUNT") or env.get("SBATCH_ACCOUNT")
    partition = env.get("KVCERT_SLURM_PARTITION") or env.get("SBATCH_PARTITION")
    gpu_partition = env.get("KVCERT_SLURM_GPU_PARTITION") or partition
    cell_gpus = int(env.get("KVCERT_SLURM_CELL_GPUS", "1"))
    caps = profile.get("resources", {})
    group_size = profile["group-components"][profile["groups"]["cell"]]
    cell_res = scale.get("resources", {}).get("cell", {})
    set_res = profile.get("set-resources", {})
    seen_cells: list[str] = []
    post_subs = []
    for s in subs:
        rules = {rule for rule, _ in s["targets"]}
        name = ",".join(sorted(rules)) or "?"
        c.check(not (rules & LOCAL_RULES), f"submission of {name}: local rules must not go to SLURM")
        if account:
            c.check(s.get("-A") == account, f"submission of {name}: account {s.get('-A')!r}, expected {account!r}")
        if rules == {"cell"}:
            c.check(s.get("-p") == gpu_partition, f"cell submission: partition {s.get('-p')!r}, expected {gpu_partition!r}")
            if cell_gpus > 0:
                c.check(s.get("--gpus") == str(cell_gpus), f"cell submission: --gpus={s.get('--gpus')}, expected {cell_gpus}")
            else:
                c.check("--gpus" not in s and "--gres" not in s, "cell submission asks for GPUs with KVCERT_SLURM_CELL_GPUS=0")
            n = len(s["targets"])
            c.check(1 <= n <= group_size, f"cell submission runs {n} cells (group-components: {group_size})")
            mem, runtime = int(s.get("--mem", 0)), int(s.get("-t", 0))
            per_mem, per_time = int(cell_res.get("mem_mb", 0)), int(cell_res.get("runtime", 0))
            c.check(per_mem > 0 and mem % per_mem == 0 and per_mem <= mem <= min(n * per_mem, int(caps.get("mem_mb", mem))),
                    f"cell submission of {n} cells: --mem {mem} is not k x {per_mem} within the profile's cap")
            parallel = mem // per_mem if per_mem else 1
            c.check(runtime == math.ceil(n / max(parallel, 1)) * per_time,
                    f"cell submission of {n} cells, {parallel} at a time: -t {runtime}, expected "
                    f"{math.ceil(n / max(parallel, 1)) * per_time}")
            seen_cells.extend(w for _, w in s["targets"])
        else:
            post_rules = {rule for rule, group in profile["groups"].items() if group == profile["groups"]["claim"]}
            c.check(rules <= post_rules, f"submission of {name}: not a rule the profile groups")
            c.check(s.get("-p") == partition, f"submission of {name}: partition {s.get('-p')!r}, expected {partition!r}")
            c.check("--gpus" not in s, f"submission of {name} asks for GPUs")
            wanted = max(int(_eval_profile_value((set_res.get(r) or {}).get("mem_mb", 0)) or 0) for r in rules)
            c.check(wanted <= int(s.get("--mem", 0)) <= int(caps.get("mem_mb", 1 << 30)),
                    f"submission of {name}: --mem {s.get('--mem')} outside [{wanted}, cap]")
            post_subs.append(s)
    expected_cells = {f"study={study},cell={cell},shard={shard}" for (study, cell), spec in cells.items()
                      for shard in range(spec["shards"])}
    c.check(sorted(seen_cells) == sorted(expected_cells),
            f"cells submitted: {len(seen_cells)} ({len(set(seen_cells))} distinct), expected each of {len(expected_cells)} once")
    c.check(len([s for s in subs if {r for r, _ in s['targets']} == {'cell'}]) == math.ceil(len(expected_cells) / group_size),
            f"cell submissions are not ceil({len(expected_cells)}/{group_size}): groups did not fill")
    post_targets = sorted(r for s in post_subs for r, _ in s["targets"])
    n_studies = len([st for st in studies(scale).values() if not st["archived"]])
    c.check(len(post_subs) == 1 and post_targets.count("claim") == len(CLAIMS) * n_studies
            and {"aggregate", "notebook_claims", "notebook_certificates"} <= set(post_targets),
            f"the analysis tail ran as {len(post_subs)} submission(s) ({post_targets}), expected one with every claim, "
            "the tables and the notebooks")
    jobids = re.findall(r"has been submitted with SLURM jobid (\d+) \(log: ", log)
    c.check(len(jobids) == len(subs), f"{len(subs)} sbatch commands but {len(jobids)} SLURM job ids")
    all_done = c.check(re.search(r"(\d+) of \1 steps \(100%\) done", log) is not None,
                       "snakemake did not report every step done")
    purged = 0
    for jobid in jobids:
        info = subprocess.run(["scontrol", "show", "job", jobid], capture_output=True, text=True).stdout
        if not info.strip() and all_done:
            purged += 1  # forgotten by slurmctld after MinJobAge; snakemake saw it finish
            continue
        state = " ".join(re.findall(r"(?:JobState|ExitCode)=\S+", info)) or "unknown to slurmctld"
        c.check("JobState=COMPLETED" in info and "ExitCode=0:0" in info, f"SLURM job {jobid}: {state}")
    if purged:
        print(f"check_rehearsal: {purged} SLURM job(s) already purged by slurmctld (MinJobAge); "
              "their completion is snakemake's", file=sys.stderr)
    return jobids


def check_outputs(c: Checks, out: Path, scale: dict, cells: dict) -> dict:
    # The claims pool the models of the scale's one claims study (its exploratory studies' models are not read).
    (study,) = [name for name, st in studies(scale).items() if not st["archived"]]
    models = {str(override_value(list(scale["models"][spec["model"]]), "model.name"))
              for spec in studies(scale)[study]["cells"].values()}
    for (owner, cell), spec in cells.items():
        for shard in range(spec["shards"]):
            path = out / owner / "cells" / cell / f"shard-{shard}" / "items.parquet"
            if c.check(path.is_file(), f"{path}: missing"):
                got = set(pd.read_parquet(path, columns=["model"])["model"])
                want = str(override_value(list(scale["models"][spec["model"]]), "model.name"))
                c.check(got == {want}, f"{path}: model {sorted(got)}, expected {want}")
    summary = {}
    for claim in CLAIMS:
        path = out / study / "claims" / f"{claim}.json"
        if not c.check(path.is_file(), f"{path}: missing"):
            continue
        result = json.loads(path.read_text())
        pooled = result.get("details", {}).get("model")
        if pooled is not None:
            c.check(set(pooled) == models, f"{claim}: pooled over models {pooled}, expected {sorted(models)}")
        by_model = result.get("details", {}).get("by_model") or {}
        c.check(set(by_model) == models, f"{claim}: details.by_model names {sorted(by_model)}, expected {sorted(models)}")
        for model, entry in by_model.items():
            c.check("verdict" in entry or bool(entry.get("error")), f"{claim}: by_model[{model}] has neither a verdict nor an error")
        summary[claim] = {"verdict": result.get("verdict"),
                          "by_model": {m: e.get("verdict") or "error" for m, e in by_model.items()}}
    for name, spec in (scale.get("exploratory") or {}).items():
        if spec.get("analysis") != "accuracy":
            continue
        path = out / name / "accuracy.csv"
        if c.check(path.is_file(), f"{path}: missing"):
            table = pd.read_csv(path)
            want = {str(v) for o in [*spec["base"], *(x for v in spec["variants"].values() for x in v)]
                    if o.startswith("allocator=") for v in [o.split("=", 1)[1]]} | {"uniform"}
            c.check(set(table.get("allocator", pd.Series(["uniform"]))) == want,
                    f"{path}: allocators {sorted(set(table.get('allocator', [])))}, expected {sorted(want)}")
    claims_csv = out / "claims.csv"
    if c.check(claims_csv.is_file(), f"{claims_csv}: missing"):
        c.check(sorted(pd.read_csv(claims_csv)["claim"]) == CLAIMS, f"{claims_csv}: not one row per claim")
    by_model_csv = out / "claims_by_model.csv"
    if c.check(by_model_csv.is_file(), f"{by_model_csv}: missing"):
        table = pd.read_csv(by_model_csv)
        c.check(len(table) == len(CLAIMS) * len(models) and set(table["model"]) == models,
                f"{by_model_csv}: {len(table)} rows over models {sorted(set(table['model']))}")
    for name in ("claims.md", "claims.tex", "reproduction.csv", "notebooks/claims_summary.md",
                 "notebooks/certificates_by_layer.csv"):
        c.check((out / name).is_file() and (out / name).stat().st_size > 0, f"{out / name}: missing or empty")
    figures = Path(scale["figure_dir"]) / study
    for claim in CLAIMS:
        for ext in ("png", "pdf"):
            c.check((figures / f"{claim}.{ext}").is_file(), f"{figures / f'{claim}.{ext}'}: missing")
    for notebook in ("claims.ipynb", "certificates.ipynb"):
        path = out / "notebooks" / notebook
        if c.check(path.is_file(), f"{path}: missing"):
            cells_run = [x for x in json.loads(path.read_text())["cells"] if x["cell_type"] == "code"]
            c.check(any(x.get("outputs") for x in cells_run), f"{path}: no executed output")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scale", default="rehearse")
    parser.add_argument("--profile", type=Path, default=REPO / "workflow" / "profiles" / "slurm" / "config.yaml")
    args = parser.parse_args(argv)
    scale = load_scale(args.scale, scales_folder(REPO))
    cells = study_cells(scale)
    profile = yte.process_yaml(args.profile.read_text())  # evaluates ?expressions as Snakemake does
    c = Checks()
    log = args.log.read_text(errors="replace")
    jobids = check_submissions(c, log, profile, scale, cells)
    summary = check_outputs(c, args.out, scale, cells)
    for line in c.failed:
        print(f"check_rehearsal: FAIL: {line}", file=sys.stderr)
    print(f"check_rehearsal: {c.passed} checks passed, {len(c.failed)} failed; {len(jobids)} SLURM jobs; "
          f"claims: {json.dumps(summary)}", file=sys.stderr)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
