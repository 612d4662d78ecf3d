"""scripts/device_check.sh where it can run here: without CUDA it says so in one
line and exits 0; an interpreter without torch fails at the prerequisites, named."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"


def check(python: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": python, "DEVICE_CHECK_DIR": str(tmp_path)})


def test_without_cuda_one_line_and_exit_0(tmp_path):
    assert not torch.cuda.is_available()
    done = check(sys.executable, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "no CUDA device" in done.stdout and not done.stderr
    assert not list(tmp_path.iterdir())  # nothing run, nothing written


def test_an_interpreter_without_torch_fails_at_the_prerequisites(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    done = check(str(fake), tmp_path / "work")
    assert done.returncode == 1 and "FAILED at prerequisites" in done.stderr
