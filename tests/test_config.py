"""profile defaults <- YAML file <- CLI flags; typed fields; validation."""
from __future__ import annotations

import pytest

from cl_bench.config import resolve
from cl_bench.profiles import PROFILES
from cl_bench.errors import UserError


def test_precedence_profile_file_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 7\ntrain:\n  epochs: 3\n  batch_size: 8\nmethod_args:\n  lr: 0.001\n")
    c = resolve("smoke", f, {"train": {"epochs": "5"}, "method_args": {"weight_decay": "0.1"}})
    assert c.seed == 7  # file over profile
    assert c.train.epochs == 5  # flag over file, parsed to int
    assert c.train.batch_size == 8
    assert c.train.micro_batch_size == PROFILES["smoke"]["train"]["micro_batch_size"]  # profile
    assert c.method_args == {"lr": 0.001, "weight_decay": "0.1"}  # typed later by the method


def test_profile_named_in_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("profile: smoke\n")
    assert resolve("cpu", f, {}).model == "tiny-llama"


def test_type_errors_name_the_field(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: many\n")
    with pytest.raises(UserError, match="train.epochs='many' is not a valid int"):
        resolve("smoke", f, {})


def test_cross_field_checks():
    with pytest.raises(UserError, match="not a multiple"):
        resolve("smoke", None, {"train": {"batch_size": "5", "micro_batch_size": "2"}})
    with pytest.raises(UserError, match="truncation"):
        resolve("smoke", None, {"train": {"truncation": "middle"}})
    with pytest.raises(UserError, match="eval.sharpness_iters=-1 must be >= 0"):
        resolve("smoke", None, {"eval": {"sharpness_iters": "-1"}})
    with pytest.raises(UserError, match="eval.sharpness_layers=.*0-based"):
        resolve("smoke", None, {"eval": {"sharpness_layers": "[3,-1]"}})
    assert resolve("smoke", None, {"eval": {"sharpness_layers": "[0,2]"}}).eval.sharpness_layers == [0, 2]


def test_order_accepts_a_list_from_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  order: [FOMC, C-STANCE]\n")
    assert resolve("smoke", f, {}).data.order == ["FOMC", "C-STANCE"]


def test_method_args_are_typed_by_the_method():
    from cl_bench import registry

    seqft = registry.get("seqft")
    args = seqft.parse_args({"lr": "3e-4", "beta2": 0.99})
    assert args.lr == 3e-4 and isinstance(args.lr, float) and args.beta2 == 0.99
    with pytest.raises(UserError, match="its arguments: lr"):
        seqft.parse_args({"alpha": 1})


@pytest.mark.slow
def test_cli_profile_flag_beats_the_file_and_the_file_beats_the_default(trace_dir, tmp_path):
    import json

    from helpers import only_run, run_cli

    f = tmp_path / "c.yaml"
    f.write_text(f"profile: smoke\ndata:\n  data_dir: {trace_dir}\n  order: [Py150]\n")
    out = tmp_path / "runs"
    assert run_cli("run", "--config", f, "--output-dir", out, "--no-progress") == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert record["profile"] == "smoke" and record["tasks"] == ["Py150"]
    assert record["config"]["data"]["data_dir"] == str(trace_dir)


@pytest.mark.slow
def test_profile_flag_beats_the_files_profile(trace_dir, tmp_path):
    import json

    from helpers import only_run, run_cli

    f = tmp_path / "c.yaml"
    f.write_text(f"profile: cpu\ndata:\n  data_dir: {trace_dir}\n  order: [Py150]\n")
    out = tmp_path / "runs"
    assert run_cli("run", "--config", f, "--profile", "smoke", "--output-dir", out, "--no-progress") == 0
    record = json.loads((only_run(out) / "run.json").read_text())
    assert record["profile"] == "smoke" and record["model"]["id"] == "tiny-llama"
    assert resolve("cpu", f, {"profile": "smoke"}).eval.max_new_tokens_cap == 8


@pytest.mark.parametrize("overrides, message", [
    ({"train": {"grad_clip": "nan"}}, "train.grad_clip=nan must be a finite number >= 0"),
    ({"train": {"grad_clip": "-0.5"}}, "train.grad_clip=-0.5 must be a finite number >= 0"),
    ({"eval": {"max_new_tokens_cap": "0"}}, "eval.max_new_tokens_cap=0 must be at least 1"),
    ({"run_id": ".."}, "run_id='..' must be one plain folder name"),
    ({"run_id": "x/../../y"}, "must be one plain folder name"),
    ({"run_id": ""}, "must be one plain folder name"),
    ({"train": {"lr_by_family": "{full: !!python/object/apply:os.system [ls]}"}}, "is not a valid YAML value"),
    ({"train": {"lr_by_family": "{full: [}"}}, "is not a valid YAML value"),
    ({"eval": {"sharpness_layers": "[0, {a: 1}]"}}, "not a valid int"),
])
def test_refused_values(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        resolve("smoke", None, overrides)
    assert resolve("smoke", None, {"train": {"grad_clip": "0"}, "eval": {"max_new_tokens_cap": "null"}}).train.grad_clip == 0


def test_set_into_a_value_is_refused():
    from cl_bench.config import set_dotted

    raw = {}
    set_dotted(raw, "train", "3")
    with pytest.raises(UserError, match="'train' is a value, not a section"):
        set_dotted(raw, "train.epochs", "2")


def test_set_one_entry_of_a_mapping_takes_the_entrys_type():
    """`--set data.n_train_per_task.Py150=64` arrives as the string '64' inside the
    mapping: it is coerced to the entry's type (int; lr_by_family: float), and a bad
    entry names its key. Mutation caught: mapping entries left as strings."""
    from cl_bench.config import set_dotted

    raw = {}
    for dotted, text in (("data.n_train_per_task.Py150", "64"), ("train.lr_by_family.full", "1e-4")):
        set_dotted(raw, dotted, text)
    config = resolve("cpu", None, raw)
    assert config.data.n_train_per_task["Py150"] == 64 and config.data.n_train_per_task["NumGLUE-cm"] == 256
    assert config.train.lr_by_family["full"] == 1e-4 and config.train.lr_by_family["adapter"] == 3e-3
    bad = {}
    set_dotted(bad, "data.n_train_per_task.Py150", "many")
    with pytest.raises(UserError, match=r"data.n_train_per_task.Py150='many' is not a valid int"):
        resolve("cpu", None, bad)
    # the whole mapping at once (a YAML flow mapping) gets the same checks
    whole = resolve("cpu", None, {"train": {"lr_by_family": "{full: 1e-4}"}})
    assert whole.train.lr_by_family["full"] == 1e-4
    for text, message in (("{Py150: many}", "Py150='many' is not a valid int"), ("{Py150: 6.5}", "Py150=6.5 must be an int")):
        with pytest.raises(UserError, match=message):
            resolve("cpu", None, {"data": {"n_train_per_task": text}})
