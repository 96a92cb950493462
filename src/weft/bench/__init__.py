"""Benchmark harness: layer timings (more modes and the profiler decomposition come later)."""
