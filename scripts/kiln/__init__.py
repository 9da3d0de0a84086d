"""The entry layer: what composes a training run (launch.py, with the registry handed in), serves an export
(serving.py), plans a layout (planner.py), merges profiler traces (traces.py) and starts scripts/train.py as a
user does (processes.py). It imports recipes/, data/ and common/; nothing below imports it."""
