"""Every method's smoke run, reduced to digests, to show that a refactor changes no
behaviour (issue 14): run it with `--write` before the change and `--check` after.

Each registered method runs the smoke profile (tiny-llama, fp32, seed 1234) on the
TRACE data in one process; the digest covers the R matrix, the zero-shot row, the
predictions (predictions.jsonl byte for byte), the logged training numbers
(metrics.jsonl byte for byte) and the parameter rows of the record.

The parameter rows are hashed in the form records had before the typed record
(schema_version 1: `{"stage": b, **method.param_report()}`), so digests taken
before it still check runs after it. From schema_version 2 on, `pre_typed_row`
normalises each row of `params` by exactly two steps, and nothing else:
  1. the keys under "diagnostics" (every key a method reports beyond the fields
     ParamReport declares) are merged back into the row, and "diagnostics" goes;
  2. "expansion_rate", a declared field written null where the method reports
     none, is dropped where it is null in every row of the run: the methods that
     report it give a number from stage 1 on, the others never had the key.
     (Where this guess is wrong the check reports a difference; it never hides one.)
Every value is hashed as written; a record of schema_version 1 is hashed as is.

    python scripts/smoke_digests.py --write tests/data/smoke_digests.json
    python scripts/smoke_digests.py --check tests/data/smoke_digests.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

from cl_bench import registry
from cl_bench.cli import main as cl_bench

RECORD_KEYS = ("matrix", "zero_shot", "params")
FILES = ("predictions.jsonl", "metrics.jsonl")


def pre_typed_row(row: dict, run_reports_expansion: bool) -> dict:
    """One params row of schema_version >= 2 in its schema_version-1 form (module docstring)."""
    flat = {**{k: v for k, v in row.items() if k != "diagnostics"}, **row.get("diagnostics", {})}
    if not run_reports_expansion and flat.get("expansion_rate", 0) is None:
        del flat["expansion_rate"]
    return flat


def pre_typed_params(record: dict) -> list[dict] | None:
    rows = record.get("params")
    if record.get("schema_version", 1) < 2 or rows is None:
        return rows
    reports = any(r.get("expansion_rate") is not None for r in rows)
    return [pre_typed_row(r, reports) for r in rows]


def digest(run_dir: Path) -> dict[str, str]:
    record = json.loads((run_dir / "run.json").read_text())
    record["params"] = pre_typed_params(record)
    out = {name: hashlib.sha256((run_dir / name).read_bytes()).hexdigest()[:16] for name in FILES}
    for key in RECORD_KEYS:
        text = json.dumps(record.get(key), sort_keys=True)
        out[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def digests(methods: list[str], data_dir: str | None) -> dict[str, dict[str, str]]:
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in methods:
            argv = ["run", "--profile", "smoke", "--method", name, "--output-dir", tmp, "--run-id", name,
                    "--no-progress", "--set", "train.precision=fp32", "--set", "eval.precision=fp32"]
            if data_dir:
                argv += ["--data-dir", data_dir]
            if cl_bench(argv) != 0:
                raise SystemExit(f"{name}: the smoke run failed")
            found[name] = digest(Path(tmp) / name)
            print(f"{name}: {found[name]}", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", type=Path)
    what.add_argument("--check", type=Path)
    p.add_argument("--methods", default=None, help="comma-separated (default: every registered method)")
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    methods = args.methods.split(",") if args.methods else sorted(registry.available())
    found = digests(methods, args.data_dir)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        return 0
    expected = json.loads(args.check.read_text())
    changed = {m: [k for k in found[m] if found[m][k] != expected.get(m, {}).get(k)] for m in methods}
    changed = {m: keys for m, keys in changed.items() if keys}
    for m, keys in changed.items():
        print(f"{m}: differs in {', '.join(keys)}")
    print(f"{len(methods) - len(changed)}/{len(methods)} methods give the same smoke run")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
