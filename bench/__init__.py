"""Benchmarks (DESIGN.md section 12, "Benchmarks"); see BENCHMARKS.md for how to run them."""
