"""fastcl.integrations.sentence_transformers as a package: one loss per module, each with
sentence-transformers' docstring sections and a ``citation``, its examples running as
written, its public names unchanged, and its imports free of deprecation warnings on the
installed sentence-transformers and on the older layout it falls back to."""

import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import minilm_path, needs_st6, tiny_sentence_transformer

st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")

import fastcl.integrations.sentence_transformers as fst  # noqa: E402
from fastcl import citations  # noqa: E402

PACKAGE = "fastcl.integrations.sentence_transformers"
LOSSES = {  # class: (module, the BibTeX key of its paper)
    "FastInfoNCELoss": ("infonce", "gao2021simcse"),
    "FastFocalInfoNCELoss": ("focal_infonce", "hou2023focal"),
    "FastDCLRLoss": ("dclr", "zhou2022debiased"),
    "FastESCLLoss": ("escl", "liu2023equivariant"),
    "CachedFastInfoNCELoss": ("cached_infonce", "gao2021simcse"),
    "CachedFastFocalInfoNCELoss": ("cached_focal_infonce", "hou2023focal"),
    "CachedFastDCLRLoss": ("cached_dclr", "zhou2022debiased"),
    "CachedFastESCLLoss": ("cached_escl", "liu2023equivariant"),
    "FastGISTEmbedLoss": ("gist", "solatorio2024gistembed"),
    "CachedFastGISTEmbedLoss": ("cached_gist", "solatorio2024gistembed"),
}
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what the examples load


def test_public_names_are_those_of_the_single_module():
    assert fst.__all__ == ["FastInfoNCELoss", "FastFocalInfoNCELoss", "FastDCLRLoss", "FastESCLLoss",
                           "FastGISTEmbedLoss", "CachedFastInfoNCELoss", "CachedFastFocalInfoNCELoss",
                           "CachedFastDCLRLoss", "CachedFastESCLLoss", "CachedFastGISTEmbedLoss",
                           "AugmentedPositives", "SentEvalSTSEvaluator"]
    from fastcl.integrations.sentence_transformers_evaluation import SentEvalSTSEvaluator
    assert fst.SentEvalSTSEvaluator is SentEvalSTSEvaluator
    assert fst.GRADCACHE_BASE is not None


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_one_loss_per_module(name):
    module_name, _ = LOSSES[name]
    module = importlib.import_module(f"{PACKAGE}.{module_name}")
    cls = getattr(fst, name)
    assert cls.__module__ == module.__name__ and module.__all__ == [name]
    public = [n for n, v in vars(module).items()
              if inspect.isclass(v) and v.__module__ == module.__name__ and not n.startswith("_")]
    assert public == [name]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_docstring_has_sentence_transformers_sections(name):
    doc = inspect.getdoc(getattr(fst, name))
    assert not re.search(r"\{(inputs|example|cached_args)\}", doc), name  # every shared part written
    for section in ("Args:", "Inputs:", "Relations:", "References:", "Example:"):
        assert f"\n{section}\n" in doc, (name, section)
    assert ".. math::" in doc, name                       # the formula
    assert "| Texts" in doc and "| Labels |" in doc, name  # the Inputs table
    assert "Loss``" in doc.split("Relations:")[1].split("References:")[0], name  # what it replaces
    example = doc.split("Example:")[1]
    assert f"import {name}" in example and "SentenceTransformerTrainer" in example, name


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_citation_is_a_property_with_the_papers_bibtex(name):
    cls = getattr(fst, name)
    assert isinstance(inspect.getattr_static(cls, "citation"), property)
    loss = cls.__new__(cls)  # citation reads no state
    _, key = LOSSES[name]
    assert key in loss.citation
    assert ("gao2021scaling" in loss.citation) == name.startswith("Cached")
    assert loss.citation.strip().startswith("@")
    if name.startswith("Cached"):  # the plain loss's paper, then GradCache's
        plain = getattr(fst, name[len("Cached"):])
        assert loss.citation == plain.__new__(plain).citation + citations.GRADCACHE


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_docstring_example_runs(name, tmp_path, monkeypatch, one_thread):
    """Each example trains the tiny random BERT in place of the model it names, but
    FastInfoNCELoss's, which trains the packaged copy of that model."""
    path = minilm_path() if name == "FastInfoNCELoss" else tiny_sentence_transformer()
    doc = inspect.getdoc(getattr(fst, name))
    code = textwrap.dedent(doc.split("Example:\n    ::\n", 1)[1])
    assert MODEL_ID in code
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(code.replace(MODEL_ID, path), f"{name} docstring example", "exec"), namespace)
    assert isinstance(namespace["loss"], getattr(fst, name))
    assert namespace["trainer"].state.global_step > 0
    # the steps trained the model: most of its tensors moved from the saved weights
    from safetensors.torch import load_file
    start = load_file(os.path.join(path, "model.safetensors"))
    trained = namespace["model"][0].auto_model.state_dict()
    moved = [k for k, v in start.items() if k in trained and not torch.equal(trained[k], v)]
    assert len(moved) > len(start) // 2, f"only {len(moved)} of {len(start)} tensors changed"


WARNINGS_AS_ERRORS = ["-W", "error::DeprecationWarning", "-W", "error::PendingDeprecationWarning",
                      "-W", "error::FutureWarning"]
IMPORT_ALL = ("import fastcl.integrations.sentence_transformers as fst\n"
              "import fastcl.integrations.sentence_transformers_evaluation\n"
              "import fastcl.integrations.sentence_transformers._gradcache\n"
              "print(fst.GRADCACHE_BASE.__module__)\n")
# sentence-transformers before 6 / 5.7 / 5.4: no merged forward, no CachedLossMixin, no model
# module of its own (the top-level name only); fastcl falls back to what those releases have
OLDER_LAYOUT = ("import sys\n"
                "for name in [n for n in sys.modules if n.startswith('fastcl.integrations')]:\n"
                "    del sys.modules[name]\n"
                "for name in ('sentence_transformers.base.losses.merged_forward',\n"
                "             'sentence_transformers.base.losses',\n"
                "             'sentence_transformers.sentence_transformer.model'):\n"
                "    sys.modules[name] = None\n")


@needs_st6
def test_importing_the_integration_raises_no_deprecation_warning():
    """A fresh interpreter, warnings as errors: fastcl imports sentence-transformers from its
    current module layout (a deprecated path warns on first import). Then, in the same
    interpreter, the older layout: each fallback imports without a warning too."""
    code = (IMPORT_ALL + OLDER_LAYOUT + IMPORT_ALL +
            "import sentence_transformers\n"
            "from fastcl.integrations.sentence_transformers import _base\n"
            "assert _base.SentenceTransformer is sentence_transformers.SentenceTransformer\n")
    out = subprocess.run([sys.executable, *WARNINGS_AS_ERRORS, "-c", code], capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["sentence_transformers.base.losses.gradcache", f"{PACKAGE}._gradcache"]
