"""``python -m fastcl.trainer``: the trainer's command line."""

import sys

from .loop import main

sys.exit(main(prog="python -m fastcl.trainer"))
