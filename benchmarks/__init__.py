"""Kernel benchmarks: ``python -m benchmarks --help``.

``harness`` holds timing, memory, hardware ceilings, floors, targets, CSV and plots; each
``bench_*`` module declares its ops as :class:`benchmarks.harness.OpSpec` objects.
"""
