"""metaq's benchmarks: ``python -m benchmarks`` runs them all (see run_all.py); each bench_*.py also runs alone."""
