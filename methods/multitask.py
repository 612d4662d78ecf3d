"""Multi-task: a reference row, not a continual method.

One stage trains on the shuffled union of every task's training subset (each
task repeated by its epoch count), with SeqFT's settings, then every task is
evaluated once. It is the usual upper bound on Last Acc; BWT is undefined
(baselines.md, "Individual FT and Multi-task").
"""
from cl_bench.method import Method, Stage
from cl_bench.registry import register_method


@register_method("multitask")
class MultiTask(Method):
    description = "Reference: joint training on the union of all tasks, evaluated once"
    lr_family = "full"
    reference = True

    def plan(self, tasks: list) -> list[Stage]:
        return [Stage(0, list(tasks), "all tasks")]
