"""Make ``import fastcl`` and ``import fastcl.kernels`` work from a plain checkout.

An installed fastcl (``pip install -e .``) maps the top-level ``kernels/`` folder to the
subpackage ``fastcl.kernels``. On a machine where the checkout is only copied (no install),
importing this module first does the same mapping by hand:

* the repository root goes on ``sys.path`` if ``fastcl`` cannot be imported otherwise;
* if ``fastcl.kernels`` cannot be found, ``kernels/`` is registered under that name.

Nothing changes when fastcl is installed. Also usable as a pytest plugin
(``PYTHONPATH=bench python -m pytest -p _checkout tests/...``) so that the unit tests run
from the same bare checkout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ensure() -> str:
    """Return how fastcl was found: ``"installed"`` or ``"checkout"``."""
    if importlib.util.find_spec("fastcl") is None:
        sys.path.insert(0, str(ROOT))
    import fastcl

    try:
        found = importlib.util.find_spec("fastcl.kernels") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return "installed"
    kernels = ROOT / "kernels"
    if not (kernels / "__init__.py").exists():
        return "checkout (no kernels/ folder)"
    spec = importlib.util.spec_from_file_location(
        "fastcl.kernels", kernels / "__init__.py", submodule_search_locations=[str(kernels)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fastcl.kernels"] = module
    spec.loader.exec_module(module)
    fastcl.kernels = module
    return "checkout"


HOW = ensure()
