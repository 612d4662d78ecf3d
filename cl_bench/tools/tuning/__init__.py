"""The tuning protocol (`cl-bench tune`): every ranked method's arguments chosen by a
rule written before the runs, on the eval split, and the tuned leaderboard beside
the shared-rate one. docs/tuning.md describes it for users.

- grid.py: the grid file (configs/tuning/<profile>.yaml; another benchmark's under
  configs/tuning/<benchmark>/): its benchmark, the tuning order, each method's
  learning rates and its strength, the rule's name; the plan line of each grid
  point, always on the eval split.
- plan.py: the plan of tuning runs for `cl-bench campaign` (a committed record that
  fits a point is named instead of re-run), and the finals plan from the tuned file.
- rule.py: the rule, applied to finished tuning runs; writes the tuned file of the grid's
  benchmark: configs/tuned/<profile>.yaml for TRACE, configs/tuned/<benchmark>/<profile>.yaml
  for another.
- tuned.py: the runs that make the tuned (or the shared-rate) leaderboard. The file
  is read back by cl_bench/config_tuned.py (`cl-bench run --tuned`, and here).
- sensitivity.py: Last Acc and BWT at each grid value, and the rank-order verdict
  between two leaderboards.
"""
