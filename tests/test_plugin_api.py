"""The import paths and names an outside method package uses, and the entry-point
group it registers through: they must keep working whatever moves inside cl_bench
(issue 43, "What must not change"). The list is frozen here, not derived from the
code: a rename or a move without a shim fails this test."""
from __future__ import annotations

import importlib
import textwrap

import pytest

from cl_bench import registry
from cl_bench.method import Method

# module -> the names a plugin imports from it (the built-in methods import the same)
PLUGIN_API = {
    "cl_bench.method": ["Method", "MethodArgs", "MethodContext", "Phase", "Stage", "lm_loss", "trainable_groups",
                        "prune_optimizer"],
    "cl_bench.registry": ["register_method", "get", "available", "ENTRY_POINT_GROUP"],
    "cl_bench.errors": ["UserError"],
    "cl_bench.data": ["IGNORE", "Encoder", "collate", "tokenize_train"],
    "cl_bench.data.encode": ["IGNORE", "Encoder", "collate", "tokenize_train"],
    "cl_bench.data.gradients": ["batch_gradients"],
    "cl_bench.data.replay": ["sample_rows"],
    "cl_bench.losses": ["distillation_kl"],
    "cl_bench.eval.probes.cka": ["linear_cka"],
    "cl_bench.run.precision": ["autocast"],
    "cl_bench.models.balancing": ["balancing_losses"],
    "cl_bench.models.expert_init": ["ExpertInit", "drop_upcycle_init", "slice_experts"],
    "cl_bench.models.lora_adapters": ["LoRAAdapterArgs", "inject_lora", "lora_parameters", "merged_adapter_report"],
    "cl_bench.models.modes": ["device_of", "eval_mode", "forward_readers", "substituted"],
    "cl_bench.models.moe": ["ExpertGroup", "UpcycledMoE", "decoder_layers", "group_sizes", "moe_layers", "rebuild",
                            "upcycle_model"],
    "cl_bench.models.params": ["count"],
    "cl_bench.models.prompt_pool": ["DECODE", "PromptPool", "first_tokens", "masked_mean", "prompt_mask",
                                    "prompt_tokens"],
    "cl_bench.models.upcycling": ["MoEArgs", "as_moe", "grow_groups", "grown_param_report", "lm_and_balancing",
                                  "moe_everywhere", "moe_settings", "train_newest_group", "train_routers"],
}
# The hooks the harness calls on a method (docs/ARCHITECTURE.md, cl_bench/method.py).
HOOKS = ["setup", "plan", "before_task", "phases", "before_phase", "make_optimizer", "optimizer_for_stage", "loss",
         "replay_loss", "step_passes", "step_batches", "before_step", "idle_units", "idle_parameters", "after_step",
         "after_task", "state_dict", "load_state_dict",
         "param_report", "param_schedule", "parse_args", "check_run", "args_for", "arg_table"]


@pytest.mark.parametrize("module", sorted(PLUGIN_API))
def test_a_plugins_import_paths_and_names_work(module):
    """Mutation caught: a name moved or renamed without its shim (e.g. cl_bench/data/__init__.py
    no longer re-exporting collate)."""
    loaded = importlib.import_module(module)
    missing = [name for name in PLUGIN_API[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lacks {missing}"


def test_the_data_package_re_exports_encode_itself():
    from cl_bench import data
    from cl_bench.data import encode

    assert all(getattr(data, n) is getattr(encode, n) for n in PLUGIN_API["cl_bench.data"])


def test_the_method_hooks_are_there():
    assert [h for h in HOOKS if not callable(getattr(Method, h, None))] == []


def test_a_plugin_registers_through_the_entry_point_group(tmp_path, monkeypatch):
    """An installed distribution declaring [cl_bench.methods] is found by discovery, in
    this process (the slow tests in test_registry.py run one through `cl-bench`).
    Mutation caught: ENTRY_POINT_GROUP changed (the plugin is not found)."""
    assert registry.ENTRY_POINT_GROUP == "cl_bench.methods"
    (tmp_path / "clb_api_plugin.py").write_text(textwrap.dedent("""
        from cl_bench.method import Method

        class Outside(Method):
            description = "an outside plugin for the API test"
    """))
    info = tmp_path / "clb_api_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: clb-api-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[cl_bench.methods]\napi-outside = clb_api_plugin:Outside\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_DISCOVERED", False)  # discover again, now with the plugin on the path
    assert registry.get("api-outside").description == "an outside plugin for the API test"
