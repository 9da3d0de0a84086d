"""The sections of scripts/bench.py (`make bench`): a module each, `harness` to run Kiln, `report` to write it up.

Each section module has `run(opts) -> report.Section` (external.py: one function per script it runs).
"""
