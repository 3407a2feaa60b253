"""The Python examples of the README and docs/ run as written (all but those that need servers
running)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [b for doc in DOCS for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)]


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 3


NEEDS_SERVERS = ("OpenAI(", "127.0.0.1:")


@pytest.mark.parametrize("code", [b for b in BLOCKS if not any(s in b for s in NEEDS_SERVERS)],
                         ids=lambda b: b.splitlines()[0][:40])
def test_readme_example_runs(code):
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()  # every example prints what it computed
