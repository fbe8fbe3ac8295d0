"""Benchmarks: the JevBench task runner (`semif-bench-tasks`) and the performance report
(`semif-bench-report`). See docs/benchmarks.md."""
