"""The sections of scripts/bench.py (`make bench`): a module each, `harness` to run Kiln, `report` to write it up.

Each section module has `run(opts) -> report.Section`: its tables, targets (with `met` booleans), notes and raw
numbers (`section.data`). A section that needs processes of its own (pipeline stages, loading's per-rank memory,
training runs, the server) starts them itself and gets their results back as data (a queue, JSON files, HTTP).
"""
