"""`cl-bench leaderboard`: run records -> tables (Markdown, CSV, LaTeX), mean ± std over seeds.

Reads `<runs_dir>/**/run.json` (files.load_runs, any schema version), groups runs by
(benchmark, method, method arguments, model id, profile, precision, task order, reference) and
aggregates them with intervals and marks (rows.py), and formats the rows (table.py).
Where one method appears with several argument sets (a sweep), its rows are labelled
with the arguments that differ. Two more views of the same rows: forms.py (BWT as
answer form + content) and winners.py (the best row on each score and cost).
Runs of different benchmarks never share a table (table.per_benchmark: one per benchmark).
The summaries shown, and their labels, come from cl_bench/metrics/cl.py's table.
"""

from cl_bench.report.leaderboard.files import load_runs, update_readme
from cl_bench.report.leaderboard.forms import build_forms_table, format_forms_table
from cl_bench.report.leaderboard.rows import MARKS, PARAMS, SCORES, build_rows, build_table, by_benchmark
from cl_bench.report.leaderboard.table import (MISSING, display_rows, format_table, humanise, method_labels,
                                               per_benchmark, render_tables)
from cl_bench.report.leaderboard.winners import build_winners_table, format_winners_table

__all__ = ["MARKS", "MISSING", "PARAMS", "SCORES", "build_forms_table", "build_rows", "build_table",
           "build_winners_table", "by_benchmark", "display_rows", "format_forms_table", "format_table",
           "format_winners_table", "humanise", "load_runs", "method_labels", "per_benchmark", "render_tables",
           "update_readme"]
