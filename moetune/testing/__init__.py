"""Tiny-model builders and plain-torch references shared by tests and benchmarks."""
