"""Benchmarks: one shared harness, one small module per operator or pattern."""
