"""General ability and instruction drift, measured inside the run (docs/protocol.md,
"General ability"): the Lima held-out probe (lima.py)."""
