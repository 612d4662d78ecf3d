"""The data a run trains on: encoding and batching (encode.py), the replay buffer
(replay.py) and gradients over a task's examples (gradients.py).

`from cl_bench.data import IGNORE, Encoder, collate` keeps working for outside method
packages: the names of encode.py that methods use are re-exported here."""
from cl_bench.data.encode import IGNORE, Encoder, Step, collate, epoch_order, steps, tokenize_train

__all__ = ["IGNORE", "Encoder", "Step", "collate", "epoch_order", "steps", "tokenize_train"]
