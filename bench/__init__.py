"""Benchmarks; see BENCHMARKS.md for how to run them and what they show."""
