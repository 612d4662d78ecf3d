"""The method contract's modules import nothing that imports them back: no import
circle, module-level or inside a function, runs through config, registry, method,
errors or data (issue 43). Read from the source with ast, nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cl_bench"
CONTRACT = ("cl_bench.config", "cl_bench.config_fields", "cl_bench.config_values", "cl_bench.config_tuned",
            "cl_bench.registry", "cl_bench.method", "cl_bench.errors", "cl_bench.data")


def _modules() -> dict[str, Path]:
    """Module name -> file, for the package's own modules (not the linked methods/, benchmarks/)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[1] in ("methods", "benchmarks"):
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_circle_runs_through_the_method_contract():
    """Mutation caught: config.build importing the registry again inside the function (or
    method.py importing cl_bench.config, which imports the registry)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles = {m: sorted(n for n in _reaches(graph, m) if m in _reaches(graph, n))
               for m in modules if m.startswith(CONTRACT)}
    assert {m: c for m, c in circles.items() if c} == {}


def test_the_graph_sees_function_level_imports():
    """The check above is not blind: a lazy import inside a function is an edge."""
    modules = _modules()
    assert "cl_bench.tools.tuning.tuned" in _imports("cl_bench.tools.tuning.cli", modules["cl_bench.tools.tuning.cli"],
                                                     modules)


REPORT, TOOLS = "cl_bench.report", "cl_bench.tools"


def _room_breaches(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs against the rooms' rule (docs/ARCHITECTURE.md): the
    front room and the core never import report/ or tools/; report/ never imports
    tools/; of the front room only cli.py imports tools/."""
    bad = []
    for name, targets in graph.items():
        own = name.startswith((REPORT, TOOLS))
        for target in targets:
            if target.startswith(TOOLS) and not name.startswith(TOOLS) and name != "cl_bench.cli":
                bad.append((name, target))
            elif target.startswith(REPORT) and not own and name != "cl_bench.cli":
                bad.append((name, target))
    return sorted(bad)


def test_no_arrow_runs_from_the_core_into_report_or_tools():
    """Mutation caught: the sequencer printing the end-of-run screen through
    report/text itself, or a site page importing a tuning helper from tools/ (both
    were so once)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _room_breaches(graph) == []
    graph["cl_bench.run.sequencer"] = graph["cl_bench.run.sequencer"] | {"cl_bench.report.text"}
    graph["cl_bench.report.site.sensitivity"] = graph["cl_bench.report.site.sensitivity"] | {"cl_bench.tools.tuning.sensitivity"}
    assert _room_breaches(graph) == [("cl_bench.report.site.sensitivity", "cl_bench.tools.tuning.sensitivity"),
                                     ("cl_bench.run.sequencer", "cl_bench.report.text")]
