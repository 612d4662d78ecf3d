"""The per-step metric logger (cl_bench/run/metric_log.py): what each backend writes,
read back; rank 0 only; a missing library is one line naming the extra."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from cl_bench.errors import UserError
from cl_bench.run.metric_log import NullLogger, make_logger

STEPS = {0: {"lm": 2.5, "grad_norm": 1.25}, 1: {"lm": 2.0, "grad_norm": 0.75}, 5: {"lm": 1.5, "grad_norm": 0.5}}


def log_all(logger) -> None:
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()


def test_none_and_non_main_ranks_log_nothing(tmp_path):
    for kind in ("none", "tensorboard", "wandb"):
        logger = make_logger(kind, tmp_path / kind, {}, is_main=kind == "none")
        assert isinstance(logger, NullLogger)
        log_all(logger)
        assert not (tmp_path / kind).exists()


def test_unknown_kind_is_named(tmp_path):
    with pytest.raises(UserError, match="unknown metric logger 'tensorbord'; did you mean 'tensorboard'"):
        make_logger("tensorbord", tmp_path, {}, is_main=True)


@pytest.mark.parametrize("kind, modules", [
    ("tensorboard", ("torch.utils.tensorboard", "tensorboardX")),
    ("wandb", ("wandb",)),
])
def test_missing_library_names_the_extra(tmp_path, monkeypatch, kind, modules):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    with pytest.raises(UserError) as info:
        make_logger(kind, tmp_path, {}, is_main=True)
    message = str(info.value)
    assert "\n" not in message and f"pip install 'cl-bench[{kind}]'" in message


def test_tensorboard_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_all(make_logger("tensorboard", tmp_path, {"seed": 1}, is_main=True))
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"lm", "grad_norm"}
    for name in ("lm", "grad_norm"):
        read = [(e.step, e.value) for e in acc.Scalars(name)]
        assert read == [(step, metrics[name]) for step, metrics in STEPS.items()]  # exact in fp32


def wandb_records(path: Path) -> list:
    """The protobuf Records of a .wandb file: a 7-byte header (":W&B", magic, version),
    then LevelDB-log records (crc32, length, type; FULL or FIRST..MIDDLE..LAST chunks)
    in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, chunks, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # block trailer or padding
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


@pytest.mark.slow
def test_wandb_offline_writes_its_run_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    run_dir = tmp_path / "run-1"
    log_all(make_logger("wandb", run_dir, {"seed": 1234, "method": "seqft"}, is_main=True))
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (data,) = offline.glob("run-*.wandb")
    records = wandb_records(data)
    kinds = [r.WhichOneof("record_type") for r in records]
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert len(runs) == 1, kinds
    run = runs[0]
    config = {i.key: json.loads(i.value_json) for i in run.config.update if not i.key.startswith("_")}
    assert config == {"seed": 1234, "method": "seqft"} and run.display_name == "run-1"
    history = {r.history.step.num: {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                    for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"}
    assert {step: {k: v for k, v in row.items() if not k.startswith("_")} for step, row in history.items()} == STEPS
