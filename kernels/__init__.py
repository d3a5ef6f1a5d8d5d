"""Triton kernels for fastcl, installed as the subpackage ``fastcl.kernels``.

The source lives in the repository's top-level ``kernels/`` folder; pyproject.toml maps
it with ``[tool.setuptools.package-dir] "fastcl.kernels" = "kernels"``, so an installed
(or editable) fastcl imports it as ``import fastcl.kernels``.
"""

import importlib.util


def triton_available() -> bool:
    """True when the ``triton`` package can be imported in this environment."""
    return importlib.util.find_spec("triton") is not None
