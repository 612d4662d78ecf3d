"""The method registry: decorator, errors, isolation of broken plugins, entry points."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cl_bench import registry
from cl_bench.errors import UserError
from cl_bench.method import Method

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "cl_bench.cli"]  # the venv's cl-bench, whatever PATH holds


def test_duplicate_name_is_refused():
    class A(Method):
        description = "a"

    registry.register_method("zz-test-dup")(A)

    class B(Method):
        description = "b"

    with pytest.raises(ValueError, match="already registered"):
        registry.register_method("zz-test-dup")(B)


@pytest.mark.slow
def test_a_method_one_test_registers_is_gone_in_the_next(tmp_path):
    """Two tests in a pytest session of their own, under this suite's conftest.py: the
    first registers a method, the second must not see it. Mutation caught: the
    autouse fixture in tests/conftest.py removed (the name leaks into the next test)."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_leak.py").write_text(textwrap.dedent("""
        from cl_bench import registry
        from cl_bench.method import Method

        def test_registers():
            registry.register_method("zz-test-leak")(type("Leak", (Method,), {}))
            assert "zz-test-leak" in registry.available()

        def test_sees_it_gone():
            assert "zz-test-leak" not in registry.available()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout[-2000:]


def test_only_method_subclasses_register():
    with pytest.raises(TypeError):
        registry.register_method("zz-test-type")(object)


def test_unknown_method_suggests_and_lists():
    with pytest.raises(UserError, match=r"did you mean 'seqft'\? available: .*individual"):
        registry.get("seqtf")


@pytest.mark.slow
def test_get_imports_only_the_chosen_builtin():
    code = ("import sys; from cl_bench import registry; registry.get('seqft'); "
            "print(sorted(m for m in sys.modules if m.startswith('cl_bench.methods.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['cl_bench.methods.seqft']"


def _plugin_dist(root: Path, name: str, module_source: str, target: str) -> dict:
    """A minimal installed distribution (dist-info + module) on a PYTHONPATH entry."""
    (root / f"{name}.py").write_text(textwrap.dedent(module_source))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[cl_bench.methods]\n{target}\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    return env


OUTSIDE = """
from cl_bench.method import Method

class Frozen(Method):
    '''Trains only the LM head: an outside plugin for the tests.'''
    description = "outside plugin: trains only the output head"

    def setup(self, model):
        super().setup(model)
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("lm_head")
"""


@pytest.mark.slow
def test_outside_plugin_is_found_and_runs(tmp_path, trace_dir):
    (tmp_path / "site").mkdir()
    env = _plugin_dist(tmp_path / "site", "clb_outside", OUTSIDE, "head-only = clb_outside:Frozen")
    listed = subprocess.run([*CLI, "list"], capture_output=True, text=True, env=env, check=True)
    assert "head-only" in listed.stdout and "outside plugin" in listed.stdout
    out = tmp_path / "runs"
    subprocess.run([*CLI, "run", "--profile", "smoke", "--method", "head-only", "--data-dir",
                    trace_dir, "--output-dir", out, "--no-progress", "--order", "NumGLUE-cm"],
                   env=env, check=True, capture_output=True)
    (record,) = [json.loads(p.read_text()) for p in out.glob("*/run.json")]
    assert record["method"] == "head-only" and record["status"] == "complete"
    params = record["params"][0]
    assert 0 < params["trainable"] < params["total"]


@pytest.mark.slow
def test_broken_plugin_never_breaks_list(tmp_path):
    (tmp_path / "site").mkdir()
    env = _plugin_dist(tmp_path / "site", "clb_broken", "raise ImportError('needs libfoo')",
                       "broken-one = clb_broken")
    listed = subprocess.run([*CLI, "list"], capture_output=True, text=True, env=env)
    assert listed.returncode == 0
    assert "seqft" in listed.stdout and "(broken)" in listed.stdout and "needs libfoo" in listed.stdout
    chosen = subprocess.run([*CLI, "run", "--profile", "smoke", "--method", "broken-one"],
                            capture_output=True, text=True, env=env)
    assert chosen.returncode == 2
    assert "failed to load" in chosen.stderr and "needs libfoo" in chosen.stderr
    assert "Traceback" not in chosen.stderr


@pytest.mark.slow
def test_list_verbose_shows_typed_arguments():
    out = subprocess.run([*CLI, "list", "--verbose"], capture_output=True, text=True, check=True)
    assert "lr: float = 1e-05" in out.stdout
