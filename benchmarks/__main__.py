"""``python -m benchmarks [--quick] [--only NAME] ...``: run every benchmark, write RESULTS.md, the chart
and the README table (see run_all.py)."""
import sys

from benchmarks import run_all

sys.exit(run_all.main(prog="python -m benchmarks"))
