"""Kernel benchmarks: ``python -m benchmarks --help``.

``harness`` holds timing, memory, hardware ceilings, floors, targets and the CSV; ``plots``
draws a run's CSV; each ``bench_*`` module declares its ops as
:class:`benchmarks.harness.OpSpec` objects.
"""
