"""Triton kernels for fastcl, installed as the subpackage ``fastcl.kernels``.

The source lives in the repository's top-level ``kernels/`` folder; pyproject.toml maps
it with ``[tool.setuptools.package-dir] "fastcl.kernels" = "kernels"``, so an installed
(or editable) fastcl imports it as ``import fastcl.kernels``.
"""

import importlib.util
import os
import sys

if __name__ != "fastcl.kernels":
    # Found as a top-level ``kernels``: a checkout's root is on sys.path (``python -m pytest``,
    # ``python train.py``), and that name belongs to another package (Hugging Face's
    # ``kernels``, which transformers probes). Hand the name to the next package that has it,
    # so that this folder never shadows it. Without one, the name becomes what a bare folder
    # on sys.path would be, an empty namespace package: transformers finds the name, imports
    # it and reads "no version, no file" as not installed (raising here instead broke its
    # probe, and with it ``import transformers``'s models).
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _path)
    _module = importlib.util.module_from_spec(
        _spec or importlib.machinery.ModuleSpec(__name__, None, is_package=True))
    sys.modules[__name__] = _module     # the import statement returns what sys.modules holds
    if _spec is not None:
        _spec.loader.exec_module(_module)


def triton_available() -> bool:
    """True when the ``triton`` package can be imported in this environment."""
    return importlib.util.find_spec("triton") is not None
