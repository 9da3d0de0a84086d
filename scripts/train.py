#!/usr/bin/env python
"""Train a Kiln recipe: python scripts/train.py recipe=dit_tiny [key=value ...] (also under torchrun)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from recipes import registry  # noqa: E402
from scripts.kiln.launch import main  # noqa: E402

if __name__ == "__main__":
    # The composition root: the table of families is handed to the launcher (torchtitan's train.py takes its
    # TrainSpec from its registry the same way); nothing below the launcher reaches up for it.
    sys.exit(main(sys.argv[1:], registry=registry))
