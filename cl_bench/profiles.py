"""The profiles: named sets of RunConfig fields (nested as in a config file) that
a run starts from (`--profile`; cl_bench/config.py merges profile <- YAML file <-
flags). Sizes of `cpu` were measured on 2 CPU cores so that SeqFT over paper6 on
SmolLM2 takes about 20 minutes (docs/protocol.md, "Profiles").

The fields in OWN belong to the benchmark a run trains on (`data.benchmark`): they
name its tasks, or read data only TRACE has (Lima). PROFILES holds TRACE's; another
benchmark declares its own per profile (Benchmark.profiles, cl_bench/benchmark.py)
and has the fields' defaults where it declares none.
"""
from __future__ import annotations

from typing import Any

OWN = frozenset({"data.order", "data.n_train_per_task", "data.n_test_per_task", "train.epochs_per_task",
                 "general.lima"})

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {
        "model": "tiny-llama",
        "data": {"order": ["NumGLUE-cm", "Py150", "20Minuten"], "n_train": 8, "n_test": 4},
        "train": {"batch_size": 4, "micro_batch_size": 2, "epochs": 1,
                  "max_prompt_len": 96, "max_answer_len": 16, "truncation_head": 16},
        "eval": {"batch_size": 4, "max_new_tokens_cap": 8},
    },
    "cpu": {
        # Calibrated from the pilot runs in results/calibration/ (docs/results.md, "How
        # the cpu profile was chosen"): bf16 where the CPU has it; a learning rate per method
        # family (full: the smallest at which SeqFT learns 4 of 6 tasks and forgets,
        # BWT <= -5; adapter, expert: the highest learning gain on the eval split);
        # more training examples where steps are cheap (NumGLUE's short answers);
        # test items spent where scoring is cheap (short answers), not on long
        # generations; the zero-shot row and next-task scores for Gain and FWT; the CKA
        # and routing-drift probes on 8 test examples a task (cl_bench/eval/probes/).
        "model": "smollm2-135m",
        "data": {"order": "paper6", "n_train": 128, "n_test": 48,
                 "n_train_per_task": {"MeetingBank": 96, "20Minuten": 96, "NumGLUE-cm": 256,
                                      "NumGLUE-ds": 256},
                 "n_test_per_task": {"MeetingBank": 24, "20Minuten": 32, "NumGLUE-cm": 81,
                                     "NumGLUE-ds": 100, "C-STANCE": 100}},
        "train": {"batch_size": 8, "micro_batch_size": 4, "epochs": 1,
                  "max_prompt_len": 256, "max_answer_len": 96, "truncation_head": 48,
                  "precision": "auto", "lr_by_family": {"full": 3e-4, "adapter": 3e-3, "expert": 3e-4},
                  "checkpoint_every_s": 600},
        "eval": {"batch_size": 16, "max_new_tokens_cap": 64, "zero_shot": True, "next_task": True,
                 "precision": "auto", "cka_probe": 8, "routing_probe": 8},
        # the Lima probe on 64 held-out items at every point: about 5% of a run's time
        # (docs/protocol.md, "The Lima probe"; results/perf/lima-probe-answer-positions-smollm2-fp32.json)
        "general": {"lima": 64},
    },
    "paper": {
        # The upcycling paper's setup (reference/bilevel-reference.md §6): Llama-3.2-1B,
        # full TRACE data, epochs 8,5,5,5,5,5 over paper6, prompt/answer 512/512, DeepSpeed
        # ZeRO-2 in bf16 (configs/paper-deepspeed.yaml adds its seed, lr and DeepSpeed file).
        "model": "meta-llama/Llama-3.2-1B-Instruct",
        "backend": "deepspeed",
        "data": {"order": "paper6", "n_train": None, "n_test": None},
        "train": {"batch_size": 32, "micro_batch_size": 8, "epochs": 5,
                  "epochs_per_task": {"MeetingBank": 8},
                  "max_prompt_len": 512, "max_answer_len": 512, "truncation_head": 64},
        "eval": {"batch_size": 16, "max_new_tokens_cap": 256},
        "general": {"lima": 64},
    },
}

# `cpu` trained three times as long (3 epochs a task, the same items): for the
# flagship's comparison (bilevel-cka, its ablations, upcycle, replay), whose search
# needs 35-70 outer updates a task (issue 15's review) where `cpu`'s 12-32 steps a
# task allow at most one a step. bilevel-cka runs it with min_mask_updates=35: 36-48
# updates a task (scripts/campaigns/issue15.txt).
PROFILES["cpu-long"] = {**PROFILES["cpu"], "train": {**PROFILES["cpu"]["train"], "epochs": 3}}


def split_own(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, own): a profile's fields outside OWN and in it, nested as in a config file."""
    shared: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for section, value in fields.items():
        if not isinstance(value, dict):
            shared[section] = value
            continue
        shared[section] = {k: v for k, v in value.items() if f"{section}.{k}" not in OWN}
        mine = {k: v for k, v in value.items() if f"{section}.{k}" in OWN}
        if mine:
            own[section] = mine
    return shared, own
