"""The base Method's optimiser contract (Method.optimizer_for_stage): the optimiser
and its moments carry across stages, as TRACE's single engine keeps them, for
every method that does not override it."""
from __future__ import annotations

import torch
from torch import nn

from cl_bench.config import RunConfig
from cl_bench.method import Method, MethodArgs, MethodContext, Stage
from helpers import distinct_stages, encode, make_method, run_steps


def test_seqft_over_two_stages_is_one_uninterrupted_adamw_run():
    """Catches: the optimiser state reset at each stage in the base
    Method.optimizer_for_stage (a fresh optimiser, or fresh moments, per stage).

    SeqFT trains 3 steps on task 0, then 3 on task 1, through the hooks; a plain
    AdamW with the method's settings over the same 6 batches, never rebuilt, ends
    at bit-identical weights (both fused: the harness's AdamW on the CPU). Stage 1 gets the very optimiser stage 0 used, its
    step count continuing at 4. With moments reset, stage 1's first update is
    lr·sign(g) again (Adam's bias correction from step 1) and the weights differ."""
    method = make_method("seqft", lr=1e-3)
    twin = make_method("seqft", lr=1e-3)  # the same seed: the same weights
    first, second = distinct_stages(2)
    batches = [encode(method, s.tasks[0].train[:4]) for s in (first, second)]
    method.model.eval(), twin.model.eval()  # no dropout: both runs compute the same gradients

    optimizer = None
    for stage, batch in zip((first, second), batches):
        method.before_task(stage)
        previous = optimizer
        optimizer = run_steps(method, stage, batch, 3, optimizer)
        if previous is not None:
            assert optimizer is previous
        method.after_task(stage)
    a = twin.args
    adam = torch.optim.AdamW([p for p in twin.model.parameters() if p.requires_grad], lr=a.lr,
                             betas=(a.beta1, a.beta2), weight_decay=a.weight_decay, fused=True)
    for batch in batches:
        for _ in range(3):
            adam.zero_grad(set_to_none=True)
            twin.loss(batch, 0)[0].backward()
            adam.step()
    p0 = next(p for p in method.model.parameters() if p.requires_grad)
    assert optimizer.state[p0]["step"] == 6
    for (n, p), q in zip(method.model.named_parameters(), twin.model.parameters()):
        assert torch.equal(p, q), f"{n} differs from the uninterrupted AdamW run"


def test_adamw_runs_the_fused_kernel_unless_asked_for_the_loop_before_it():
    """The harness's AdamW runs torch's fused kernel on the CPU (issue 53: 3.7x the
    per-parameter loop torch picks there); `per_parameter_adamw()` gives the loop back,
    for `perf loss-path --before`, and only within. Mutations caught: fused dropped from
    Method.make_optimizer, the context ignored, or left on after it."""
    from cl_bench.method import per_parameter_adamw

    method = make_method("seqft", lr=1e-3)
    stage = distinct_stages(1)[0]
    method.before_task(stage)
    assert method.optimizer_for_stage(stage, None).defaults["fused"] is True
    with per_parameter_adamw():
        assert not method.optimizer_for_stage(stage, None).defaults["fused"]
    assert method.optimizer_for_stage(stage, None).defaults["fused"] is True


def test_a_changed_trainable_set_gets_a_new_optimiser_carrying_the_kept_parameters_state():
    """Catches: the state of persisting parameters dropped when the trainable set
    changes (a new optimiser with empty state).

    Two linear layers train a step together; then the second is frozen (the
    trainable set changes, so the harness's next optimiser is a new one over the
    first alone). The first layer's moments and step count are the old ones, and
    its next step equals the one a never-rebuilt AdamW over it would take."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    twin = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    twin.load_state_dict(model.state_dict())
    method = Method(MethodArgs(lr=0.1), MethodContext(RunConfig(), torch.device("cpu"), None))
    method.setup(model)
    x = torch.randn(5, 4)

    def step(net, opt):
        opt.zero_grad(set_to_none=True)
        net(x).square().sum().backward()
        opt.step()

    opt0 = method.optimizer_for_stage(Stage(0, [], "a"), None)
    step(model, opt0)
    model[1].requires_grad_(False)
    opt1 = method.optimizer_for_stage(Stage(1, [], "b"), opt0)
    assert opt1 is not opt0 and [p for g in opt1.param_groups for p in g["params"]] == list(model[0].parameters())
    for p in model[0].parameters():
        assert opt1.state[p]["step"] == 1 and torch.equal(opt1.state[p]["exp_avg"], opt0.state[p]["exp_avg"])
    step(model, opt1)

    a = method.args
    ref0 = torch.optim.AdamW(twin.parameters(), lr=a.lr, betas=(a.beta1, a.beta2), weight_decay=a.weight_decay,
                             fused=True)  # as the harness's on the CPU
    step(twin, ref0)
    twin[1].requires_grad_(False)
    step(twin, ref0)  # the frozen layer has no gradient: AdamW leaves it
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_stage_steps_count_the_steps_the_sequencer_batches():
    """What a method plans with (MethodContext.stage_steps) is the number of steps
    the sequencer makes of a multi-task stage: each epoch's rows batched together
    (a: 5 rows for 3 epochs, b: 3 rows for 1, batch 2: 4 + 3 + 3 steps), not each
    task's steps summed (3 x 3 + 2)."""
    from types import SimpleNamespace

    from cl_bench.config import TrainConfig
    from cl_bench.data.encode import Encoder, steps
    from cl_bench.models.loading import byte_tokenizer
    from cl_bench.run.sequencer import epoch_rows

    example = SimpleNamespace(prompt="p", answer="a")
    tasks = [SimpleNamespace(name="a", train=[example] * 5), SimpleNamespace(name="b", train=[example] * 3)]
    config = RunConfig(train=TrainConfig(batch_size=2, micro_batch_size=1, epochs=1, epochs_per_task={"a": 3}))
    stage = Stage(0, tasks, "a+b")
    run = SimpleNamespace(config=config, encoder=Encoder(byte_tokenizer(), 8, 4, "head_tail", 2), cache_dir=None)
    made = sum(len(list(steps(rows, list(range(len(rows))), 2, 1, 0))) for rows in epoch_rows(run, stage))
    assert MethodContext(config, torch.device("cpu"), None).stage_steps(stage) == made == 10
