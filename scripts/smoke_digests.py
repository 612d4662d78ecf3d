"""Every method's smoke run, reduced to digests, to show that a refactor changes no
behaviour (issue 14): run it with `--write` before the change and `--check` after.

Each registered method runs the smoke profile (tiny-llama, fp32, seed 1234) on the
TRACE data in one process; the digest covers the R matrix, the zero-shot row, the
predictions (predictions.jsonl byte for byte), the logged training numbers
(metrics.jsonl byte for byte) and the parameter rows of the record.

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


def digest(run_dir: Path) -> dict[str, str]:
    record = json.loads((run_dir / "run.json").read_text())
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
