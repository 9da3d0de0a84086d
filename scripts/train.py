#!/usr/bin/env python
"""Train a Kiln recipe: python scripts/train.py recipe=dit_tiny [key=value ...] (also under torchrun)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from common.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
