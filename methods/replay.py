"""Replay: SeqFT plus the harness's shared replay buffer.

The buffer, its budget (10% of each finished task's training subset by default)
and the mixing policy belong to the harness (`replay.*` in the config), so every
replaying method sees the same examples. TRACE's training/replay.py instead runs
one extra epoch after each task over the first 10% (file order) of every earlier
task plus all of Lima; `--set replay.policy=epoch --set replay.lima=1030`
reproduces that schedule with a seeded (not first-rows) selection.
"""
from cl_bench.method import Method
from cl_bench.registry import register_method


@register_method("replay")
class Replay(Method):
    description = "SeqFT + the shared replay buffer (one replay micro-batch per step by default)"
    lr_family = "full"
    uses_replay = True
