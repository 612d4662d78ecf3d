"""The bilevel-cka decisions and records: at the end of a task t >= 1 each slot
of each candidate layer is decided,

    sigmoid(alpha_e - alpha_r) > 0.5  ->  Expand (the clone joins as a new expert,
                                          with its trained row), else Recycle (dropped),

`finalise` writes the stage's record (run.json "params": decisions, expand
probabilities, CKA, the mask schedule, the deploy check; schema in
docs/methods/bilevel-cka.md, "Records"), and `cl-bench params` counts a run's
parameters from a decision map, an expert count per layer or the upper bound
(every decision Expand: `decisions_for_schedule`).

Source: CKA-guided bilevel MoE upcycling (ICML 2026), as METHODS.md ("bilevel-cka").

Differs from the paper/code (docs/methods/bilevel-cka.md, "Differences"):
- the new expert's row is the clone's own trained row, appended with its group so
  rows stay aligned with experts (the code appends rows at the end while experts
  are inserted in the middle, and gives the new expert mean of old rows + noise);
- the old expert stays, frozen and routable, for old tasks (supernet=mix: the
  clone's weights take its place instead, see supernet.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cl_bench.eval.probes.cka import linear_cka
from cl_bench.errors import UserError
from cl_bench.models.modes import device_of
from cl_bench.models.moe import decoder_layers
from cl_bench.record.schema import rounded

from .guidance import expert_owners
from .search import LayerFeatures, TaskSearch, mean_loss
from .supernet import pair_shares

if TYPE_CHECKING:
    from .args import BilevelCKAArgs


def finalise(model: nn.Module, task: TaskSearch, expand: torch.Tensor, active: dict[int, list[int]],
             features: LayerFeatures, args: BilevelCKAArgs) -> dict[str, Any]:
    """Expand the clones where `expand` (L_c, K) is true, drop the others (each
    candidate layer gets its MoE layer back), update `active` (candidate layer ->
    expert index per slot) and return this stage's record (module docstring)."""
    device = device_of(model)
    reference = features.reference(task, task.replay_batch) if task.replay_batch is not None else None
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    check = list(task.task_batches)  # the deploy check: supernet at pi = decisions vs finalised
    if check:
        task.set_masks(expand.to(device, torch.float32))
        supernet_loss = mean_loss(model, check)
    blocks = decoder_layers(model)
    added = replaced = 0
    for c, (i, net) in enumerate(task.nets.items()):
        layer, clones = net.moe, net.clones
        chosen = expand[c].nonzero().flatten().tolist()  # slots that expand
        if chosen and net.form == "mix":  # the clone takes its expert's place, on its row
            _replace(layer, clones, chosen, active[i])
            replaced += len(chosen)
        elif chosen:
            first = layer.n_experts
            index = torch.tensor(chosen, device=clones.gate.device)
            taken = tuple(w[index].detach().clone() for w in (clones.gate, clones.up, clones.down))
            layer.add_group(lambda dense, k, taken=taken: taken, router_std=0.0, slots=chosen)
            with torch.no_grad():
                layer.groups[-1].router_weight.copy_(clones.router_weight[index])
                layer.groups[-1].router_bias.copy_(clones.router_bias[index])
            for j, slot in enumerate(chosen):
                active[i][slot] = first + j
            added += len(chosen)
        blocks[i].mlp = layer
    deploy = None
    if check:
        deployed_loss = mean_loss(model, check)
        candidates = list(task.nets)
        deploy = {"batches": len(check), "supernet_loss": rounded(supernet_loss),
                  "deployed_loss": rounded(deployed_loss),
                  "loss_gap": round(abs(deployed_loss - supernet_loss), 9),
                  "pair_share": [rounded(x) for x in pair_shares(model, candidates, check)]}
    cka_final = None
    if reference is not None:
        final = features.of(task.replay_batch)
        cka_final = [rounded(linear_cka(final[l], reference[l])) for l in features.layers]
    window = task.every
    probs = None
    if task.logits is not None:
        probs = (task.logits[..., 1] - task.logits[..., 0]).detach().cpu().sigmoid()
        probs = [[rounded(p) for p in row] for row in probs.tolist()]
    return {
        "supernet": args.supernet,
        "mask_init": args.mask_init if task.init is not None else None,
        "init": _init_record(task, expand),
        "trainable": trained,
        "expansion_rate": float(expand.float().mean()),
        "experts_added": added,
        "experts_replaced": replaced,
        "decision_layers": list(task.nets),
        "decisions": expand.int().tolist(),
        "expand_prob": probs,
        "cka_layers": list(features.layers),
        "cka_before": _mean_rows(task.cka[:window]),
        "cka_after": _mean_rows(task.cka[-window:]),
        "cka_final": cka_final,
        "mask_schedule": {"steps": task.n_steps, "mask_every": task.every, "updates": task.updates,
                          "tau0": args.tau0, "tau_decay": task.decay, "tau_end": task.tau,
                          "mask_lr": args.mask_lr, "mask_lr_eff": task.mask_lr,
                          "init_gap": None if task.init_gap is None else rounded(task.init_gap),
                          "mask_reach": args.mask_reach,
                          "reach": None if task.mask_lr is None else rounded(2 * task.updates * task.mask_lr)},
        "deploy_check": deploy,
    }


def _replace(layer, clones, chosen: list[int], active: list[int]) -> None:
    """supernet=mix's Expand: expert active[c]'s weights become clone c's, for c in `chosen`."""
    owner = expert_owners(layer)
    with torch.no_grad():
        for c in chosen:
            group, j = owner[active[c]]
            for name in ("gate", "up", "down"):
                getattr(group, name)[j].copy_(getattr(clones, name)[c])


def _init_record(task: TaskSearch, expand: torch.Tensor) -> dict[str, Any] | None:
    """Where the search started and what it changed: the initial gap alpha_e - alpha_r per
    slot (the tensor the mask logits were made from), the decisions its sign gives, how
    many final decisions differ from it, and how many slots the task's reach 2 U lr could
    carry across 0.5 (|gap| < reach); the guided init's inputs (guidance.py) with it."""
    if task.init is None:
        return None
    gap = (task.init[..., 1] - task.init[..., 0]).cpu()
    reach = 2 * task.updates * task.mask_lr if task.mask_lr is not None else 0.0
    return {"gap": [[rounded(x) for x in row] for row in gap.tolist()],
            "decisions": (gap > 0).int().tolist(),
            "changed": int(((gap > 0) != expand.cpu()).sum()),
            "within_reach": int((gap.abs() < reach).sum()),
            "slots": gap.numel(),
            **({"guidance": task.guidance} if task.guidance is not None else {})}


def decisions_for_schedule(decisions: list | None, experts_per_layer: float | None, n_tasks: int,
                           n_moe: int, n_cand: int, K: int) -> tuple[list | None, str]:
    """For `cl-bench params` (BilevelCKA.param_schedule): the decision map to count
    (None: every decision Expand, the upper bound) and the row's "bound" label."""
    if experts_per_layer is not None:
        return (spread_decisions(experts_per_layer, n_tasks, n_moe, n_cand, K),
                f"{experts_per_layer:g} experts per MoE layer after the last task "
                f"(expansions spread evenly over tasks and layers)")
    if decisions is not None:
        return _check_decisions(decisions, n_tasks, n_cand, K), "the given decisions"
    return None, "upper: every decision Expand"


def spread_decisions(experts_per_layer: float, n_tasks: int, n_moe: int, n_cand: int, K: int) -> list:
    """A decision map [task 1..T-1][candidate layer][slot] with round((X - K) * n_moe)
    Expands, X = `experts_per_layer` the mean over the n_moe MoE layers after the
    last task (K each at task 0): filled layer by layer, then task by task, then
    slot by slot, so layers differ by at most one expert and tasks by at most one
    per layer. Only the last stage's count is fixed by X; the spread over tasks is
    this choice."""
    n = round((experts_per_layer - K) * n_moe)
    cap = (n_tasks - 1) * n_cand * K
    if not 0 <= n <= cap:
        top = K + cap / n_moe
        raise UserError(f"--experts-per-layer {experts_per_layer:g}: over {n_tasks} tasks a layer holds "
                        f"{K} (every decision Recycle) to {top:g} experts on average (every decision Expand) "
                        f"after the last task; give a value in that range")
    maps = [[[0] * K for _ in range(n_cand)] for _ in range(n_tasks - 1)]
    for p in range(n):
        rest = p // n_cand
        maps[rest % (n_tasks - 1)][p % n_cand][rest // (n_tasks - 1)] = 1
    return maps


def _check_decisions(decisions: list, n_tasks: int, n_cand: int, K: int) -> list:
    """The map for tasks 1..T-1 (a leading null or empty task 0 dropped), checked."""
    if len(decisions) == n_tasks and not decisions[0]:
        decisions = decisions[1:]
    if len(decisions) != n_tasks - 1:
        raise UserError(f"decision map: {len(decisions)} tasks of decisions for --tasks {n_tasks}; give one "
                        f"[layer][slot] map per stage 2..{n_tasks} (a leading null for stage 1 may stand first)")
    for t, task in enumerate(decisions, start=1):
        ok = (isinstance(task, list) and len(task) == n_cand
              and all(isinstance(row, list) and len(row) == K and all(v in (0, 1) for v in row) for row in task))
        if not ok:
            raise UserError(f"decision map, stage {t + 1}: expected {n_cand} candidate layers x {K} slots of 0/1")
    return decisions


def _mean_rows(rows: list[list[float]]) -> list[float] | None:
    return [rounded(sum(col) / len(col)) for col in zip(*rows)] if rows else None
