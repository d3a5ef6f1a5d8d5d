"""Adapters that plug fastcl's losses into other training libraries.

Each adapter is imported on its own (``import fastcl.integrations.sentence_transformers``)
so that fastcl itself never needs the libraries it adapts to.
"""

from __future__ import annotations

from importlib import metadata


def stack_problem(torch_version: str, transformers_version: str | None) -> str | None:
    """Why this torch and transformers cannot work together (None if they can).
    transformers 5 needs torch 2.6: under an older torch it imports with PyTorch switched
    off, and sentence-transformers then fails deep inside its import. pip cannot tell:
    fastcl admits torch 2.5 and transformers 5, each for the other's newer partner."""
    if transformers_version is None:
        return None
    from packaging.version import Version     # a requirement of transformers
    if Version(transformers_version).major >= 5 and Version(torch_version).release[:2] < (2, 6):
        return (f"transformers {transformers_version} needs torch >= 2.6, and torch "
                f"{torch_version} is installed: install torch >= 2.6, or keep this torch with "
                "pip install 'transformers<5' 'sentence-transformers<6'")
    return None


def check_stack() -> None:
    """Raise ImportError naming the fix where :func:`stack_problem` finds one."""
    import torch
    try:
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = None
    problem = stack_problem(torch.__version__, transformers_version)
    if problem:
        raise ImportError(problem)


check_stack()
