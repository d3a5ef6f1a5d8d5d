"""The layers of fastcl and which may import which (docs/architecture.md).

Read from the source with ``ast`` (imports inside functions count too), so a change that
breaks a rule fails here, not in a review.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lower layers never import higher ones. Within a layer, imports are allowed (no cycles).
LAYERS = [
    ("fastcl.common", "fastcl.citations", "fastcl._validation",
     "fastcl.files", "fastcl.layout", "fastcl.spec"),                        # leaves
    ("fastcl.kernels", "fastcl.reference"),                                  # kernels; the oracle
    ("fastcl.tiled",),                                                       # the tiled driver
    ("fastcl.functional",),                                                  # the public losses
    ("fastcl", "fastcl.metrics", "fastcl.modules", "fastcl.encoders",
     "fastcl.augment", "fastcl.distributed", "fastcl.data"),                 # on the losses
    ("fastcl.evaluate", "fastcl.integrations"),                              # eval, adapters
    ("fastcl.trainer",),                                                     # the trainer
]


def _modules():
    """{module name: set of fastcl modules it imports}."""
    out = {}
    for folder, package in ((ROOT / "fastcl", "fastcl"), (ROOT / "kernels", "fastcl.kernels")):
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            name = ".".join([package, *parts])
            here = name if path.name == "__init__.py" else name.rpartition(".")[0]
            deps = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = here.split(".")[:len(here.split(".")) - node.level + 1]
                        module = ".".join(base + ([node.module] if node.module else []))
                    else:
                        module = node.module or ""
                    if module.startswith("fastcl"):
                        if node.module:  # "from . import x" imports x, not the package
                            deps.add(module)
                        deps.update(f"{module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.startswith("fastcl"))
            out[name] = deps
    return {name: {d for d in deps if d in out and d != name} for name, deps in out.items()}


MODULES = _modules()


def layer(name):
    best = None
    for i, members in enumerate(LAYERS):
        for m in members:
            if (name == m or name.startswith(m + ".") and m != "fastcl") and (
                    best is None or len(m) > best[1]):
                best = (i, len(m))
    assert best is not None, f"{name} belongs to no layer: add it to LAYERS and docs/architecture.md"
    return best[0]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_higher_layer(name):
    for dep in MODULES[name]:
        if dep.startswith(name + "."):
            continue  # a package importing its own modules
        assert layer(dep) <= layer(name), f"{name} (layer {layer(name)}) imports {dep} (layer {layer(dep)})"


def test_the_reference_is_a_leaf_only_functional_uses():
    # the shared numerics, the candidate layout's rules, which it applies with its own code,
    # and the loss spec it reads
    assert MODULES["fastcl.reference"] == {"fastcl.common", "fastcl.layout", "fastcl.spec"}
    assert MODULES["fastcl.common"] == set() and MODULES["fastcl.layout"] == set()
    users = sorted(n for n, deps in MODULES.items() if "fastcl.reference" in deps)
    assert users == ["fastcl.functional"]


def test_kernels_know_nothing_of_the_rest():
    # the leaves every path shares: the numerics (EPS: where a norm counts as clamped) and
    # the layout's rules
    for name, deps in MODULES.items():
        if name.startswith("fastcl.kernels"):
            assert deps <= {"fastcl.common", "fastcl.layout", "fastcl.kernels.configs",
                            "fastcl.kernels.contrastive"}, (name, deps)


def test_no_import_cycles():
    state = {}

    def visit(name, path):
        state[name] = "open"
        for dep in MODULES[name]:
            if dep.startswith(name + "."):
                continue
            assert state.get(dep) != "open", "import cycle: " + " -> ".join(path + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in MODULES:
        if name not in state:
            visit(name, [name])


def test_the_trainer_trains_with_the_sentence_transformers_losses_only():
    """The method → loss choice is made once (fastcl.trainer.build picks the
    sentence-transformers loss); the trainer itself calls no loss function."""
    for path in sorted((ROOT / "fastcl" / "trainer").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        for loss in ("infonce(", "focal_infonce(", "dclr_loss(", "escl_loss(", "contrastive("):
            assert f"fastcl.{loss}" not in source and f" {loss}" not in source, (path.name, loss)


def test_the_kernels_folder_never_shadows_another_kernels_package(tmp_path):
    """From a checkout's root (``python -m pytest``, ``python train.py``) the top-level
    ``kernels/`` folder is importable as ``kernels``, the name of Hugging Face's package that
    transformers probes: it hands that name on where that package is installed, and is an empty
    namespace (no file, no version: what transformers reads as absent) where it is not, so that
    transformers answers from the root as it answers anywhere else."""
    import subprocess
    import sys

    def run(code, cwd):
        out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    # without another ``kernels`` on the path: an empty namespace
    alone = "import sys; sys.path[:] = [p for p in sys.path if 'packages' not in p]; import kernels; "
    assert run(alone + "print(getattr(kernels, '__file__', None), vars(kernels).get('__version__'))",
               ROOT) == "None None"
    # with the environment's own: whatever it holds, the answer of transformers' probe
    pytest.importorskip("transformers")
    probe = "from transformers.utils.import_utils import is_kernels_available; print(is_kernels_available())"
    assert run(probe, ROOT) == run(probe, tmp_path)
    found = run("import kernels; print(getattr(kernels, '__file__', None))", ROOT)
    assert found == "None" or not Path(found).resolve().is_relative_to(ROOT)