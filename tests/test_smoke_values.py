"""Every registered method's smoke run, in the machine-independent form of
scripts/smoke_digests.py (`--values`): a refactor that changes any method's
behaviour (what it logs while training, its R matrix, its parameter rows or its
predicted texts) fails here. On the synthetic TRACE tree, fp32, seed 1234; the
expected values are tests/data/smoke_values.json, taken with
    python scripts/smoke_digests.py --values --synthetic --write tests/data/smoke_values.json
(a change of behaviour on purpose: take them again, and say why in the commit)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cl_bench import registry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from smoke_digests import smoke_runs, values_differ  # noqa: E402

EXPECTED = json.loads((ROOT / "tests" / "data" / "smoke_values.json").read_text())
# The built-in methods, read at collection: other tests register throwaway methods later.
METHODS = sorted(registry.available())


def test_every_method_has_expected_values():
    assert sorted(EXPECTED) == METHODS


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_smoke_run_behaves_as_recorded(name, trace_dir):
    from smoke_digests import values

    found = smoke_runs([name], str(trace_dir), values)[name]
    differ = values_differ(found, EXPECTED[name])
    assert not differ, f"{name}: the smoke run differs in {', '.join(differ)}"


def test_only_tie_decided_values_are_left_out_of_the_comparison():
    """CaRE's task identification is an argmin over near-tied entropies on the tiny
    model, so the CPU decides it, and the gap it makes between two CEs; nothing else is
    exempt. Mutations caught: the exemption dropped (the first case differs), oracle_gap
    not exempt (the third), or widened to every key (the second and the fourth)."""
    from smoke_digests import values_differ

    row = {"lm": 5.5, "task_id_acc": 0.5}
    assert values_differ({"metrics": [row]}, {"metrics": [{**row, "task_id_acc": 0.625}]}) == []
    assert values_differ({"metrics": [row]}, {"metrics": [{**row, "lm": 5.6}]}) == ["metrics"]
    stage = {"answer_ce": {"Py150": 5.596063}, "oracle_gap": -1.6e-05}  # CaRE's, on a Zen 3 EPYC and AVX-512
    assert values_differ({"params": [stage]}, {"params": [{**stage, "oracle_gap": -2.9e-05}]}) == []
    assert values_differ({"params": [stage]}, {"params": [{**stage, "answer_ce": {"Py150": 5.7}}]}) == ["params"]
