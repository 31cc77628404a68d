"""Benchmarks, each printing its ratio against a baseline measured in the same run."""
