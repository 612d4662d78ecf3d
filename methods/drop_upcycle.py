"""Drop-Upcycling, continual form (Nakamura et al., ICLR 2025; METHODS.md).

Standard upcycling (methods/upcycle.py: same layer, groups, freezing, loss and
resume) except how each new expert is made, at task 0 and for every later
group: in each slice expert, one random set of floor(r*h) of its h neurons
(r = 0.5) is re-initialised, shared by its gate rows, up rows and down columns
(the paper; the authors' code draws a set per matrix), from N(mu, sigma) of the
entries being replaced, per matrix (as the code). The paper's aux coefficient
is 0.02 and its router init uniform with std 0.02; cl-bench keeps the family's
0.01 and N(0, 0.02) so the two methods differ only in the experts' init.
"""
from __future__ import annotations

from dataclasses import dataclass

from cl_bench.errors import UserError
from cl_bench.methods.upcycle import Upcycle, UpcycleArgs
from cl_bench.models.moe import ExpertInit, drop_upcycle_init
from cl_bench.registry import register_method


@dataclass
class DropUpcycleArgs(UpcycleArgs):
    drop_ratio: float = 0.5  # r: share of each new expert's neurons re-initialised

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.drop_ratio <= 1.0:
            raise UserError(f"method_args.drop_ratio={self.drop_ratio} must be in [0, 1]")


@register_method("drop-upcycle")
class DropUpcycle(Upcycle):
    description = "Drop-Upcycling: as upcycle, half of each new expert's neurons re-initialised"
    Args = DropUpcycleArgs

    def expert_init(self) -> ExpertInit:
        return drop_upcycle_init(self.args.drop_ratio)
