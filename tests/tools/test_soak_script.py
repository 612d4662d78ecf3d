"""scripts/soak_interrupts.py refuses an --out that already holds an earlier
soak's runs, in one line, before it starts any run: their run ids would collide
(mutation caught: the check removed, the soak starts its twins in the old
folder)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak_interrupts.py"


def test_an_out_folder_with_earlier_runs_is_refused_in_one_line(tmp_path):
    (tmp_path / "twins" / "seqft-1").mkdir(parents=True)
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--runs", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--out" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["seqft-1", "twins"]  # nothing started
