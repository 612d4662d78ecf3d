"""`cl-bench campaign` (cl_bench/tools/campaign/): a plan's runs skipped when complete,
resumed when interrupted, left alone while running, started otherwise, each from a
clone of its commit; auto precision refused on a CPU without bf16; a bad plan is
one line; each run's state and hours, and the total (the Slurm launcher:
test_campaign_slurm.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cl_bench.record import io as results
from cl_bench.run import checkpoint
from cl_bench.tools.campaign import code as pinning
from cl_bench.tools.campaign import estimate
from cl_bench.tools.campaign import launch
from cl_bench.tools.campaign.plan import Entry, planned, read_plan, recorded
from cl_bench.errors import UserError
from campaign_setup import ROOT, campaign, here, table_rows


def test_dry_run_says_skip_resume_start_and_refuses_auto_without_bf16(plan, monkeypatch, capsys):
    """Mutations caught: a complete run started again, an interrupted one started
    afresh, auto precision let through on a CPU without bf16."""
    path, out = plan
    assert campaign(*here(str(path))) == 0
    said = capsys.readouterr().out
    assert table_rows(said) == [["done", f"{out}/a/done"], ["left", f"{out}/b/cut"], ["left", f"{out}/new"]]
    assert "(resume," in said.splitlines()[2] and "(start," in said.splitlines()[3]

    (out / "locked").mkdir()  # a start that died before its record: only a lock file
    (out / "locked" / results.LOCK_FILE).write_text("")
    path.write_text(path.read_text() + f"{out}/locked: --profile smoke --method seqft\n"
                    f"{out}/auto: --profile smoke --method seqft --set train.precision=auto\n")
    monkeypatch.setattr("cl_bench.run.precision.native_bf16", lambda device: True)
    assert campaign(*here(str(path))) == 0
    assert table_rows(capsys.readouterr().out)[3] == ["left", f"{out}/locked"]
    monkeypatch.setattr("cl_bench.run.precision.native_bf16", lambda device: False)
    assert campaign(*here(str(path))) == 2
    assert f"{path}: lines 7 ask for precision auto or bf16" in capsys.readouterr().err
    assert campaign(*here(str(path), "--allow-fp32")) == 0
    path.write_text(path.read_text() + f"{out}/bf16: --profile smoke --method seqft --set eval.precision=bf16\n")
    assert campaign(*here(str(path), "--allow-fp32")) == 2  # emulated bf16: never


def test_a_run_whose_lock_is_held_is_shown_running_and_not_launched(plan, capsys):
    """Mutation caught: a running run resumed a second time (its lock makes that fail)."""
    path, out = plan
    with results.lock_run(out / "b" / "cut"):
        assert campaign(*here(str(path))) == 0
    assert table_rows(capsys.readouterr().out)[1] == ["running", f"{out}/b/cut"]


@pytest.mark.slow
def test_a_run_another_process_runs_holds_a_slot_until_it_ends(plan, tmp_path):
    """With --slots 1 and the interrupted run held by another process (an earlier
    campaign's), the new run starts only once that lock is released. Mutation caught:
    the slots counting only this process's runs (the new run starts at once)."""
    path, out = plan
    path.write_text("".join(line for line in path.read_text().splitlines(keepends=True) if "/a/done" not in line))
    released = []

    def hold():
        with results.lock_run(out / "b" / "cut"):
            time.sleep(8)
            released.append((out / "new").exists())  # not started while the slot was taken

    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(0.5)
    try:
        # the held run is skipped (it is running); the new one waits for its slot
        assert campaign(str(path), "--slots", "1", "--code", str(ROOT), root=tmp_path) == 0
    finally:
        holder.join()
    started = json.loads((out / "new" / "run.json").read_text())
    assert started["status"] == "complete" and released == [False]


def test_a_second_campaign_on_the_clone_adds_slots_without_launching_the_first_ones_runs(tmp_path, monkeypatch,
                                                                                           capsys):
    """Two campaigns over one clone (the second started to add a slot): at launch time a
    run the survey found left is skipped when the other is running it (its slot counted),
    is launching it (holds its claim; its process has not locked the folder yet) or has
    finished it. Mutations caught: launching what the survey listed without looking
    again (a second `run` on a held or finished folder, which fails); the claim not
    taken (both campaigns launch a run they look at in the same seconds)."""
    monkeypatch.setattr(launch, "command", lambda entry, resume: [
        sys.executable, "-c", f"open({str(tmp_path / ('launched-' + entry.run_id))!r}, 'w')"])
    entries = [Entry(Path(f"out/{n}"), ["--profile", "smoke"], i) for i, n in enumerate("abcd")]
    todo = [(entry, "start", tmp_path) for entry in entries]
    done = tmp_path / "out" / "b"
    done.mkdir(parents=True)
    (done / "run.json").write_text(json.dumps({"status": "complete", "config": {"train": {"precision": "bf16"},
                                                                               "eval": {"precision": "bf16"}}}))
    (tmp_path / "out" / "a").mkdir()
    other = launch._claim(entries[3], tmp_path)  # the other campaign, launching d
    with results.lock_run(tmp_path / "out" / "a"):
        assert launch.run_local(todo, tmp_path, 3, 1) == 0
    other.close()
    assert sorted(p.name for p in tmp_path.glob("launched-*")) == ["launched-c"]
    said = capsys.readouterr().out
    assert "skip out/a: running in another campaign" in said and "skip out/b: finished by another campaign" in said
    assert "skip out/d: running in another campaign" in said
    assert launch._claim(entries[2], tmp_path) is not None  # c's claim went with its process


def test_a_campaigns_runs_are_given_its_records(trace_dir, tmp_path, monkeypatch):
    """Each launched run's environment names the campaign's records (--records, under
    its root), which the estimate at the run's start reads (estimate.for_run). Mutation
    caught: the records not handed to the launcher (the run reads those of its commit's
    clone)."""
    seen = tmp_path / "seen"
    monkeypatch.setattr(launch, "command", lambda entry, resume: [
        sys.executable, "-c", f"import os; open({str(seen)!r}, 'w').write(os.environ.get({estimate.RECORDS_ENV!r}, ''))"])
    path = tmp_path / "plan.txt"
    path.write_text(f"{tmp_path}/out/new: --profile smoke --data-dir {trace_dir} --method seqft\n")
    (tmp_path / "mine").mkdir()
    assert campaign(str(path), "--code", str(ROOT), "--records", "mine", root=tmp_path) == 0
    assert seen.read_text() == str((tmp_path / "mine").resolve())


def test_a_run_folder_without_its_stage_checkpoint_is_shown_stuck_and_not_launched(plan, monkeypatch, capsys):
    """A record of 2 finished stages whose checkpoint/ is gone (git ignores it, so a
    clone or the next machine has none): `stuck`, the reason on stderr naming the plan
    line, and not handed to the launcher, which would have it refused. Mutation caught:
    the stranded check dropped from the survey (shown `left` and launched), the
    campaign ending 0 as if nothing needed a hand, the stuck run counted as left."""
    path, out = plan
    cut = out / "b" / "cut"
    record = json.loads((cut / "run.json").read_text())
    (cut / "run.json").write_text(json.dumps({**record, "stages_done": 2}))
    checkpoint.remove_checkpoint(cut, checkpoint.CHECKPOINT_DIR)
    launched = []
    monkeypatch.setattr(launch, "run_local", lambda todo, *rest: launched.extend(e.run_dir for e, _, _ in todo) or 0)
    assert campaign(str(path), "--code", str(ROOT)) == 1  # the others launched; this one needs a hand
    said = capsys.readouterr()
    assert table_rows(said.out) == [["done", f"{out}/a/done"], ["stuck", f"{out}/b/cut"], ["left", f"{out}/new"]]
    assert f"{path}:3: {cut}/run.json: stages_done is 2" in said.err and "total left: 1 runs" in said.out
    assert "and 1 stuck, not launched" in said.out and launched == [Path(f"{out}/new")]


def _budgeted_run(monkeypatch, tmp_path, hours_per_real_s: float) -> None:
    """run_local over a plan of five runs, a (0.5 h), b (5 h), c (0.4 h), d (no estimate), e (0.9 h),
    with --hours 1 and one slot; each run a 0.3 s process; the campaign's clock runs
    `hours_per_real_s` hours a real second."""
    real = launch.clock
    t0 = real()
    monkeypatch.setattr(launch, "clock", lambda: t0 + (real() - t0) * hours_per_real_s * 3600)
    monkeypatch.setattr(launch, "command", lambda entry, resume: [sys.executable, "-c", "import time; time.sleep(0.3)"])
    todo = [(Entry(Path(f"out/{n}"), ["--profile", "smoke"], i), "start", tmp_path) for i, n in enumerate("abcde")]
    budget = launch.Budget(1.0, {Path("out/a"): 0.5, Path("out/b"): 5.0, Path("out/c"): 0.4, Path("out/d"): None,
                                 Path("out/e"): 0.9})
    assert launch.run_local(todo, tmp_path, 1, 1, budget=budget) == 0


def test_hours_starts_a_run_only_while_its_estimate_fits_what_is_left(tmp_path, monkeypatch, capsys):
    """--hours 1, one slot: a (0.5 h) starts; b (5 h), d (no estimate) and e (0.9 h,
    over the hour with the margin) never do; c (0.4 h), later in the plan, takes the
    slot after a while it still fits, and not once a's run has used up the rest.
    Mutations caught: the budget ignored (b starts), the margin dropped (e starts),
    the time already spent not counted (c starts on the fast clock), a run that does
    not fit blocking the later ones (c never starts on the still clock)."""
    for per_s, started in ((0.0, ["out/a", "out/c"]), (3.0, ["out/a"])):
        _budgeted_run(monkeypatch, tmp_path, per_s)
        said = capsys.readouterr().out.splitlines()
        assert [line.split()[2] for line in said if line.split()[1] == "start"] == started, said
        skipped = {line.split()[3]: line for line in said if " not started " in line}
        assert set(skipped) == {"out/a", "out/b", "out/c", "out/d", "out/e"} - set(started)
        assert "(needs 5.00 h, 5.75 h with the margin; " in skipped["out/b"] and "(no estimate; " in skipped["out/d"]
        monkeypatch.undo()


@pytest.mark.parametrize("flags, says", [
    (["--hours", "0"], "--hours 0 must be a number of hours > 0"),
    (["--hours", "2", "--launcher", "slurm", "--slurm", "x.yaml"], "--hours is for the local launcher"),
])
def test_bad_hours_are_one_message(plan, capsys, flags, says):
    path, _ = plan
    assert campaign(str(path), *flags, "--dry-run") == 2
    assert says in capsys.readouterr().err


def test_two_campaigns_started_together_make_the_clone_once(tmp_path, monkeypatch):
    """Two campaigns started at once (one a plan) both need HEAD's clone: the second
    waits for the first's and uses it, and no half-made clone is left. Mutation
    caught: the lock dropped (the second clones beside the first, and its rename onto
    the finished clone fails; before the lock it removed the first's clone midway).
    A killed attempt's half-made clone is removed; a clone that cannot be made is one
    message and leaves nothing."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text('[tool.setuptools.package-dir]\npkg = "pkg"\n')
    for argv in (["init", "--quiet"], ["add", "pyproject.toml"],
                 ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "one"]):
        pinning.git(repo, *argv)
    head = pinning.git(repo, "rev-parse", "HEAD")
    real = pinning.link_packages

    def slow(code):  # the first clone is still being made when the second campaign looks
        time.sleep(1.0)
        real(code)

    monkeypatch.setattr(pinning, "link_packages", slow)
    (repo / ".campaign" / f"code-{head[:12]}.partial-killed").mkdir(parents=True)  # an attempt killed midway
    made, errors = [], []

    def one():
        try:
            made.append(pinning.checkout(repo, head))
        except Exception as e:  # noqa: BLE001 - any failure fails the test below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and made == [repo / ".campaign" / f"code-{head[:12]}"] * 2, errors
    assert sorted(p.name for p in (repo / ".campaign").iterdir() if p.is_dir()) == [f"code-{head[:12]}"]
    with pytest.raises(UserError, match="cannot make the clone of 000000000000"):  # one line, nothing left
        pinning.checkout(repo, "0" * 40)
    assert sorted(p.name for p in (repo / ".campaign").iterdir() if p.is_dir()) == [f"code-{head[:12]}"]


def test_a_resumed_run_takes_the_commit_it_started_from_and_says_what_the_line_changed(plan, capsys):
    """Mutations caught: resuming with HEAD's code (two versions in one run), a run
    from an unknown commit resumed anyway, a changed line passed over in silence (its
    method arguments; its launch flags, which the resume takes from the line)."""
    path, out = plan
    record = out / "b" / "cut" / "run.json"
    data = json.loads(record.read_text())
    first = pinning.git(ROOT, "rev-list", "--max-parents=0", "HEAD").splitlines()[0]  # any commit of the repository
    record.write_text(json.dumps({**data, "git_commit": first}))
    entries = read_plan(path)
    assert pinning.commit_of(entries[1], recorded(entries[1], ROOT), ROOT) == first
    record.write_text(json.dumps({**data, "git_commit": "0" * 40}))
    with pytest.raises(UserError, match="not a commit of this repository; resume it by hand"):
        pinning.commit_of(entries[1], recorded(entries[1], ROOT), ROOT)

    path.write_text(path.read_text().replace("lr=1e-3\n", "lr=1e-2 --keep-checkpoint\n", 2))
    assert campaign(*here(str(path))) == 0
    said = capsys.readouterr().err
    assert "is resumed as recorded, though the line now asks for method_args.lr 0.001 -> 0.01" in said
    # a launch flag, which the resume takes from the line (plan.launch_drift)
    assert "b/cut: its resume takes the line's --keep-checkpoint, where it last ran with none" in said


def test_a_resumed_run_is_launched_as_its_line_launches_it():
    """The line's --nproc and --keep-checkpoint, which its record's config does not hold,
    reach the resume (errors.launch_flags), or a preempted run of N ranks would go on
    in one process (Slurm requeues through this command too). Mutation caught: the
    resume's command without them."""
    entry = Entry(Path("results/x"), ["--profile", "smoke", "--backend", "deepspeed", "--zero", "3", "--nproc", "8",
                                      "--keep-checkpoint", "--set", "train.epochs=2"], line=1)
    assert launch.command(entry, resume=True)[-6:] == ["--resume", "results/x", "--nproc", "8", "--keep-checkpoint",
                                                      "--no-progress"]
    assert launch.command(entry, resume=False)[5:5 + len(entry.flags)] == entry.flags


@pytest.mark.parametrize("line, says", [
    ("results/x --profile smoke", "write '<output dir>/<run id>: <cl-bench run flags>'"),
    ("results/x: --profile smoke --run-id=y", "drop --run-id"),
    ("results/x: --profile smoke --set 'a=b", "cannot split the flags (No closing quotation)"),
    ("results/x: --profile smoke --method nope", "unknown method 'nope'"),
    ("results/x: --profile smoke --no-such-flag", "these are not `cl-bench run` flags"),
    # flags `run` refuses before loading anything are refused here too, not at launch
    ("results/x: --profile smoke --method-arg lr=-1", "method_args.lr=-1.0 must be a finite number > 0"),
    ("results/x: --profile smoke --order nope", "nope"),
    ("../../../x: --profile smoke", "'../../../x' has a '.' or '..' part; name the run folder plainly"),
    ("results/..: --profile smoke", "'results/..' has a '.' or '..' part"),
])
def test_a_bad_plan_line_is_one_message_naming_the_line(tmp_path, capsys, line, says):
    path = tmp_path / "plan.txt"
    path.write_text(f"# header\n{line}\n")
    before = sorted(p for p in tmp_path.rglob("*"))
    assert campaign(*here(str(path))) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: {path}:2: ") and says in err and "Traceback" not in err
    assert sorted(p for p in tmp_path.rglob("*")) == before and not (tmp_path / "x").exists()


def test_runs_of_the_same_id_in_two_folders_log_apart(tmp_path):
    """a/x and b/x are two runs: two logs (mutation caught: logs keyed by the run id)."""
    path = tmp_path / "plan.txt"
    path.write_text("results/a/x: --profile smoke\nresults/b/x: --profile smoke\n/abs/c/x: --profile smoke\n")
    logs = [e.log_path(tmp_path) for e in read_plan(path)]
    assert [p.name for p in logs] == ["results__a__x.log", "results__b__x.log", "abs__c__x.log"]
    assert {p.parent for p in logs} == {tmp_path / ".campaign" / "logs"}


def test_an_unreadable_record_is_one_message(plan, capsys):
    path, out = plan
    (out / "b" / "cut" / "run.json").write_text("{")
    assert campaign(*here(str(path))) == 2
    assert f"{out}/b/cut/run.json: not a readable run record" in capsys.readouterr().err


@pytest.mark.parametrize("content, says", [
    ("partition: [unclosed", "cannot read the Slurm settings"),
    ("partitoin: cpu\n", "unknown Slurm setting(s) ['partitoin']"),
    ("time_min: 0\n", "time_min=0 must be a number > 0"),
    ("executor: pbs\n", "executor='pbs' must be slurm, local or debug"),
])
def test_bad_slurm_settings_are_one_message(plan, tmp_path, capsys, content, says):
    path, _ = plan
    settings = tmp_path / "slurm.yaml"
    settings.write_text(content)
    assert campaign(str(path), "--launcher", "slurm", "--slurm", str(settings), "--code", str(ROOT)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and str(settings) in err[0]


# ---- estimates -----------------------------------------------------------------------

def _record(tmp, name, method, seconds_per_step, token_s, prec="bf16", model="m", train=(8, 4, 256, 96),
            benchmark=None, **fields):
    """A complete record: two stages of tasks A and B, 10 steps each, 100 budget tokens
    each; `train`: batch, micro-batch, prompt and answer lengths; `fields`: more of the
    record (machine, resumes); `benchmark`: the config's data.benchmark (records from
    before benchmarks were plugins have none: TRACE)."""
    folder = tmp / name
    folder.mkdir(parents=True)
    config = {"model": model, "train": dict(zip(("batch_size", "micro_batch_size", "max_prompt_len",
                                                 "max_answer_len"), train))}
    if benchmark:
        config["data"] = {"benchmark": benchmark}
    stages = [{"stage": b, "train_s": 10 * s, "eval_s": 100 * token_s, "steps": 10}
              for b, s in enumerate(seconds_per_step)]
    (folder / "run.json").write_text(json.dumps({
        "status": "complete", "method": method, "config": config, "backend": {"precision": {"train": prec}},
        "stages": [{"tasks": ["A"]}, {"tasks": ["B"]}], "timing": {"stages": stages, "zero_shot_s": 0.0},
        "task_metrics": [{"n": 10, "max_new_tokens": 10}, {"n": 10, "max_new_tokens": 10}], **fields}))


def _calibrated(gflops, prec="bf16"):
    """A record's `machine` whose matmul ran at `gflops`."""
    return {"cpu": "test", "threads": 1, "matmul": {"precision": prec, "shape": [1024, 576, 1536], "gflops": gflops}}


@pytest.fixture
def rate_here(monkeypatch):
    """This machine's calibration pinned: bf16 100 GFLOP/s, fp32 50, native bf16; each
    measurement's precision and torch threads noted in the returned list. The tests
    run at two threads, so a measurement at the run's threads is caught."""
    measured = []

    def rate(precision_name, m, k=576, n=1536, repeats=5):
        measured.append((precision_name, torch.get_num_threads(), (m, k, n)))
        return {"bf16": 100.0, "fp32": 50.0}[precision_name]

    monkeypatch.setattr("cl_bench.run.machine.matmul_rate", rate)
    monkeypatch.setattr("cl_bench.run.precision.native_bf16", lambda device: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield measured
    torch.set_num_threads(threads)


def test_a_records_seconds_scale_by_its_machines_rate_over_this_ones(tmp_path, rate_here):
    """A record from a machine twice as fast as this one (200 GFLOP/s against 100) takes
    twice its seconds here; a resumed stage scales by its resume's machine; a record
    without a machine is used as it is and marked `~`; this machine is measured once per
    precision, at one thread, at the calibration's shape. Mutations caught: no scaling,
    the ratio inverted, the resume's machine ignored, the mark dropped, a measurement at
    the run's threads or per record."""
    _record(tmp_path, "fast", "seqft", [1.0, 2.0], 0.01, machine=_calibrated(200.0))
    _record(tmp_path, "resumed", "lora", [1.0, 2.0], 0.01, machine=_calibrated(200.0),
            resumes=[{"at_stage": 1, "machine": _calibrated(50.0)}])
    _record(tmp_path, "old", "replay", [1.0, 2.0], 0.01)
    _record(tmp_path, "fast-fp32", "seqft", [3.0, 3.0], 0.03, prec="fp32", machine=_calibrated(25.0, "fp32"))
    timings = estimate.Timings(tmp_path)
    at = ("m", "bf16", 8, 4, 256, 96, "trace")

    fast = timings.rates("seqft", at)
    assert fast.step_s == pytest.approx({"A": 2.0, "B": 4.0}) and fast.token_s == pytest.approx(0.02)
    assert not fast.rough and fast.source == "fast"
    resumed = timings.rates("lora", at)  # stage A on the 200 GFLOP/s machine, B on the 50 one
    assert resumed.step_s == pytest.approx({"A": 2.0, "B": 1.0}) and resumed.token_s == pytest.approx(0.0125)
    old = timings.rates("replay", at)
    assert old.step_s == {"A": 1.0, "B": 2.0} and old.rough and old.source == "old; machine unrecorded"
    slow = timings.rates("seqft", ("m", "fp32", 8, 4, 256, 96, "trace"))  # 25 GFLOP/s there, 50 here: half
    assert slow.step_s == pytest.approx({"A": 1.5, "B": 1.5}) and not slow.rough
    assert timings.rates("seqft", at).step_s == fast.step_s
    assert rate_here == [("bf16", 1, (1024, 576, 1536)), ("fp32", 1, (1024, 576, 1536))]
    assert torch.get_num_threads() == 2


def test_a_process_parses_each_record_once_while_it_is_unchanged(tmp_path, monkeypatch):
    """Every run's start estimates from the records (18 MB committed): a second estimate
    in the same process parses no unchanged record, keeps only the fields estimates
    read, and reads a record rewritten since anew; a file that is JSON but no object is
    skipped. Mutations caught: no cache (every record parsed again); the file's stamp
    not compared (the rewritten record's old seconds)."""
    _record(tmp_path, "a", "seqft", [1.0, 2.0], 0.01, probes={"big": [0.0] * 100})
    _record(tmp_path, "b", "lora", [1.0, 2.0], 0.01)
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "run.json").write_text("[]")
    parsed = []
    loads = json.loads
    monkeypatch.setattr(estimate.json, "loads", lambda text: parsed.append(1) or loads(text))
    at = ("m", "bf16", 8, 4, 256, 96, "trace")
    assert estimate.Timings(tmp_path).rates("seqft", at).step_s == {"A": 1.0, "B": 2.0} and len(parsed) == 3
    assert "probes" not in estimate._read(tmp_path / "a" / "run.json")
    assert estimate.Timings(tmp_path).rates("seqft", at).step_s == {"A": 1.0, "B": 2.0} and len(parsed) == 3
    shutil.rmtree(tmp_path / "a")
    _record(tmp_path, "a", "seqft", [3.0, 4.0], 0.01)  # rewritten: another size and time
    assert estimate.Timings(tmp_path).rates("seqft", at).step_s == {"A": 3.0, "B": 4.0} and len(parsed) == 4


def test_a_method_measured_on_a_named_machine_leaves_its_unrecorded_records_out(tmp_path, rate_here):
    """Where a method has records at a shape both with and without a machine, the
    estimate is of those with one (scaled), unmarked, and says what it left out; a
    method with unrecorded records only still gets them, marked. Mutation caught: the
    two kinds pooled (an unrecorded record from a faster machine or more threads
    pulls the estimate down: MoFO's tuning runs took 2.4x the 0.18 h estimated from
    its machine-unrecorded paper6 record)."""
    _record(tmp_path, "named", "mofo", [1.0, 2.0], 0.01, machine=_calibrated(200.0))
    _record(tmp_path, "unnamed", "mofo", [0.2, 0.2], 0.001)
    _record(tmp_path, "only-unnamed", "ogd", [0.5, 0.5], 0.005)
    timings = estimate.Timings(tmp_path)
    at = ("m", "bf16", 8, 4, 256, 96, "trace")
    mofo = timings.rates("mofo", at)
    assert mofo.step_s == pytest.approx({"A": 2.0, "B": 4.0}) and mofo.token_s == pytest.approx(0.02)
    assert not mofo.rough and mofo.source == "named; 1 more whose machine is unrecorded left out"
    ogd = timings.rates("ogd", at)
    assert ogd.step_s == pytest.approx({"A": 0.5, "B": 0.5}) and ogd.rough
    assert ogd.source == "only-unnamed; machine unrecorded"


def test_estimates_come_from_the_same_methods_records_else_are_scaled_and_marked(tmp_path):
    """Per-task step rates and the per-token rate of the method's own records; a
    method measured only at another shape scales as its family does there (the
    MoE family, not SeqFT, for an MoE method); otherwise SeqFT's rates, marked.
    Mutations caught: rates pooled across methods, scaled by the baseline where the
    family was measured, the mark dropped."""
    _record(tmp_path, "seqft-bf16", "seqft", [1.0, 2.0], 0.01)
    _record(tmp_path, "seqft-fp32", "seqft", [2.0, 4.0], 0.02, prec="fp32")
    _record(tmp_path, "upcycle-bf16", "upcycle", [3.0, 3.0], 0.03)
    _record(tmp_path, "upcycle-fp32", "upcycle", [1.0, 1.0], 0.01, prec="fp32")
    _record(tmp_path, "btx-fp32", "btx", [5.0, 7.0], 0.05, prec="fp32")
    timings = estimate.Timings(tmp_path)
    at = ("m", "bf16", 8, 4, 256, 96, "trace")
    work = estimate.Work(steps=[{"A": 4}, {"B": 6}], budget=[50, 80], zero_shot=20, at=at)

    own = timings.rates("seqft", at)
    assert not own.scaled and own.step_s == {"A": 1.0, "B": 2.0} and own.token_s == pytest.approx(0.01)
    assert work.seconds(own) == pytest.approx(4 * 1 + 6 * 2 + 150 * 0.01)
    assert work.seconds(own, from_stage=1, zero_shot_done=True) == pytest.approx(6 * 2 + 80 * 0.01)

    btx = timings.rates("btx", at)  # upcycle is 3x dearer a step and a token in bf16 than in fp32
    assert btx.scaled and "expert family" in btx.source and "upcycle" in btx.source
    assert btx.step_s == pytest.approx({"A": 15.0, "B": 21.0}) and btx.token_s == pytest.approx(0.15)

    other = timings.rates("multitask", at)
    assert other.scaled and other.source.startswith("scaled: seqft's rates") and other.step_s == own.step_s
    assert timings.rates("seqft", ("other model", "bf16", 8, 4, 256, 96, "trace")) is None


def test_a_benchmarks_runs_are_priced_by_its_own_records_only(tmp_path):
    """Another benchmark's prompts and answer budgets are its own, so TRACE's records do
    not price a long-sequence run (no estimate until one of its runs is committed), and
    once one is, its method's family scales from it. Mutation caught: the benchmark left
    out of the step shape (TRACE's seqft prices long-sequence's)."""
    _record(tmp_path, "seqft-trace", "seqft", [1.0, 2.0], 0.01)
    _record(tmp_path, "lora-trace", "lora", [0.5, 1.0], 0.005)
    long_at = ("m", "bf16", 8, 4, 256, 96, "long-sequence")
    assert estimate.Timings(tmp_path).rates("seqft", long_at) is None
    _record(tmp_path, "seqft-long", "seqft", [0.25, 0.25], 0.02, benchmark="long-sequence")
    timings = estimate.Timings(tmp_path)
    assert timings.rates("seqft", long_at).step_s == {"A": 0.25, "B": 0.25}
    lora = timings.rates("lora", long_at)  # seqft's ratio between them: a step (1/4 + 1/8) / 2, a token 2x
    assert lora.scaled and lora.step_s == pytest.approx({"A": 0.5 * 0.1875, "B": 1.0 * 0.1875})
    assert lora.token_s == pytest.approx(0.01)


def test_a_method_with_no_family_measured_scales_by_the_median_of_the_methods_measured_at_both(tmp_path):
    """CaRE (no MoE method measured on long-sequence) scales from TRACE by the median
    ratio of every method measured at both, so one slow record (SeqFT's, 4x dearer a
    step on long-sequence, where LoRA and Replay are 1x and 1.5x) does not set it.
    Mutations caught: the baseline's ratio alone (4x), the mean (2.17x)."""
    long_at = ("m", "bf16", 8, 4, 256, 96, "long-sequence")
    for method, trace, long in (("seqft", 1.0, 4.0), ("lora", 1.0, 1.0), ("replay", 2.0, 3.0)):
        _record(tmp_path, f"{method}-trace", method, [trace, trace], 0.01)
        _record(tmp_path, f"{method}-long", method, [long, long], 0.02, benchmark="long-sequence")
    _record(tmp_path, "care-trace", "care", [2.0, 3.0], 0.01)
    care = estimate.Timings(tmp_path).rates("care", long_at)
    assert care.scaled and care.step_s == pytest.approx({"A": 2.0 * 1.5, "B": 3.0 * 1.5})
    assert care.token_s == pytest.approx(0.02)
    assert "median ratio between the shapes of the methods measured at both (lora, replay, seqft)" in care.source


def test_dry_run_prints_the_scale_and_marks_an_unscaled_estimate(trace_dir, tmp_path, rate_here, capsys):
    """The dry run's rows: SeqFT's from a record of a machine twice as fast (fp32: 100
    GFLOP/s there, 50 here), twice its seconds, unmarked; LoRA's from a record without a
    machine, unscaled, marked `~`; then the scale line. Mutations caught: no scale line,
    the hours unscaled, the unrecorded estimate unmarked."""
    flags = f"--profile smoke --data-dir {trace_dir} --set train.precision=fp32 --set eval.precision=fp32"
    path = tmp_path / "plan.txt"
    path.write_text(f"{tmp_path}/out/seqft: {flags} --method seqft\n{tmp_path}/out/lora: {flags} --method lora\n")
    config, method_args = planned(read_plan(path)[0])
    work = estimate.planned_work(config, method_args)
    model, prec, *train = work.at
    records = tmp_path / "records"
    _record(records, "fast", "seqft", [100.0, 100.0], 1.0, prec, model, train, machine=_calibrated(100.0, "fp32"))
    _record(records, "old", "lora", [100.0, 100.0], 1.0, prec, model, train)
    assert campaign(*here(str(path)), "--records", str(records)) == 0
    said = capsys.readouterr().out.splitlines()
    once = work.seconds(estimate.Rates({"A": 100.0}, 1.0, "")) / 3600
    assert said[1].split()[:2] == ["left", f"{2 * once:.2f}"] and said[1].endswith(f"; {records / 'fast'})")
    assert said[2].split()[:3] == ["left", "~", f"{once:.2f}"]
    assert said[2].endswith(f"; {records / 'old'}; machine unrecorded)")
    assert said[3].startswith("scale: this machine's 1024x576x1536 product at one thread: fp32 50.0 GFLOP/s (load ")
    assert said[3].endswith("of 2 records read, 1 scaled by their machine's rate over this one (seconds x "
                            "2.00-2.00), 1 unscaled (machine unrecorded: their estimates marked ~)")
    assert said[4].startswith("total left: 2 runs, ")


@pytest.mark.slow
def test_status_shows_hours_from_the_committed_records_and_the_total(plan, tmp_path, capsys):
    path, out = plan
    assert campaign(str(path), "--status", "--code", str(ROOT), "--records", str(out / "a")) == 0
    said = capsys.readouterr().out.splitlines()
    took = json.loads((out / "a" / "done" / "run.json").read_text())["timing"]["total_s"] / 3600
    assert said[1].split()[:2] == ["done", f"{took:.2f}"]
    for line in said[2:4]:  # measured from the complete record (smoke runs: a few seconds, 0.00 h)
        assert line.split()[:2] == ["left", "0.00"] and line.endswith(f"; {out / 'a' / 'done'})")
    assert said[-1] == "total left: 2 runs, 0.0 h at one thread a run (0.0 h on 2 slots)"


@pytest.mark.slow
def test_a_campaign_runs_a_clones_code_finishes_every_run_and_leaves_the_complete_one_alone(
        plan, tmp_path, monkeypatch):
    """The runs import every package from the clone, methods included, and record
    its commit. Mutations caught: the live tree imported (no -P, or methods/ not
    linked), the complete run re-run, the interrupted run started afresh."""
    path, out = plan
    code = tmp_path / "code"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(code)], check=True)
    marker = tmp_path / "imported"
    with open(code / "methods" / "__init__.py", "a") as f:  # each run notes where its methods came from
        f.write("import os\nif os.environ.get('CAMPAIGN_MARKER'):\n"
                "    open(os.environ['CAMPAIGN_MARKER'], 'a').write(__file__ + '\\n')\n")
    subprocess.run(["git", "-C", str(code), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-am",
                    "marker"], check=True)  # a clean clone: its runs record its commit
    monkeypatch.setenv("CAMPAIGN_MARKER", str(marker))
    before = (out / "a" / "done" / "run.json").read_bytes()
    assert campaign(str(path), "--slots", "2", "--code", str(code), root=tmp_path) == 0
    assert (out / "a" / "done" / "run.json").read_bytes() == before
    records = {name: json.loads((out / name / "run.json").read_text()) for name in ("b/cut", "new")}
    assert all(r["status"] == "complete" for r in records.values())
    assert [r["at_stage"] for r in records["b/cut"]["resumes"]] == [1]
    assert not records["new"].get("resumes")
    assert records["new"]["git_commit"] == pinning.git(code, "rev-parse", "HEAD")
    imported = marker.read_text().splitlines()
    assert len(imported) == 2 and all(Path(p).resolve().is_relative_to(code.resolve()) for p in imported)
