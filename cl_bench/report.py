"""The end-of-run screen: the stage x task matrix and the CL summary."""
from __future__ import annotations

from tabulate import tabulate


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def format_matrix(record: dict) -> str:
    tasks = record["tasks"]
    rows = []
    if record.get("zero_shot") is not None:
        rows.append(["zero-shot", *map(_fmt, record["zero_shot"])])
    for stage, row in zip(record["stages"], record["matrix"]):
        rows.append([f"{stage['index'] + 1}: {stage['label']}", *map(_fmt, row)])
    table = tabulate(rows, headers=["after stage", *tasks], tablefmt="github", disable_numparse=True)
    summary = record.get("summary") or {}
    names = {"last_acc": "Last Acc", "stage_acc": "Stage Acc", "bwt": "BWT", "fwt": "FWT",
             "forgetting": "Forgetting"}
    parts = [f"{label} {_fmt(summary.get(key))}" for key, label in names.items()
             if summary.get(key) is not None]
    title = f"{record['method']} on {record['model']['id']} ({record['profile']} profile, seed {record['seed']})"
    return f"{title}\n{table}\n" + " | ".join(parts)
