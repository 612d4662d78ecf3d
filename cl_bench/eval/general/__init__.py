"""General ability and instruction drift, measured inside the run (docs/protocol.md,
"General ability and instruction drift"): the Lima held-out probe (lima.py), lm-eval
tasks and TRACE's ΔG (lm_eval_tasks.py), and their text, comparisons and leaderboard
columns (report.py)."""
