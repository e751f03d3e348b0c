"""Benchmark suites run by benchmarks/run.py: one module per suite (NAME, add_args, run, plot, summary)."""
