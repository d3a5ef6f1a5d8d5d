#!/usr/bin/env python
"""Train a sentence encoder with one of fastcl's contrastive objectives.

The trainer is :mod:`fastcl.trainer` (installed as ``fastcl-train``); this script runs it
from a checkout: ``python train.py --help``.
"""

import sys

from fastcl.trainer import main

if __name__ == "__main__":
    sys.exit(main(prog="train.py"))
