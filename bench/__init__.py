"""Benchmarks (run on a GPU machine; results under bench/results/)."""
