"""``python -m fastcl.trainer``: the trainer's command line."""

import sys

from .run import main

sys.exit(main(prog="python -m fastcl.trainer"))
