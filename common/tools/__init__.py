"""Offline tools behind the CLIs in scripts/: the layout planner, profiler-trace merging and the step
report, serving launchers, the subprocess launcher tests and benchmarks share, the offline stand-ins of a
user's inputs (fixtures.py: a VAE folder, an ImageFolder) that scripts/gpu_check.py and the tests build.

Nothing here runs inside a training step; the runtime in common/ imports a tool only at the end of a
profiled run (merging its traces). Tools may import the runtime, never the other way round.
"""
