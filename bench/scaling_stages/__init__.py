"""Stages for the worker-scaling benchmark: the real decompose of a fixed checkpoint, the rest no-ops.

Decompose is the CPU-bound stage whose throughput the benchmark measures; every other stage
is the no-op of `bench.noop_stages`, so nothing else competes for the cores.
"""
