"""Benchmark suites; each module registers itself with :func:`tools.bench.registry.register` when imported."""
