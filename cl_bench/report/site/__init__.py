"""`cl-bench site`: the leaderboard and every run as a static web site (build.py)."""
