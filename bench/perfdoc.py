"""``--write-docs``: what a benchmark prints, written into docs/performance.md as well.

Each run is one section, dated, with the commit and the machine, under the command that made
it; a later run of the same command replaces its section, so the page holds the latest figures
of every command that was run with ``--write-docs``.  ``PYGGML_PERF_DOC`` names another file.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import io
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Written by the benchmarks (`--write-docs`)"


def add_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--write-docs", action="store_true",
                    help="also write what this run prints into docs/performance.md, dated, under the command that "
                         "made it (replacing what an earlier run of the same command wrote there)")


class _Tee(io.TextIOBase):
    def __init__(self, out) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def start(args: argparse.Namespace) -> None:
    """With ``--write-docs``: keep what the run prints, and write it when the run ends well."""
    if not getattr(args, "write_docs", False):
        return
    command = "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT), *[a for a in sys.argv[1:] if a != "--write-docs"]])
    tee = sys.stdout = _Tee(sys.stdout)
    failed = []
    hook = sys.excepthook

    def excepthook(*exc) -> None:
        failed.append(exc)
        hook(*exc)
    sys.excepthook = excepthook

    def finish() -> None:
        if not failed:
            path = write(command, tee.kept.getvalue())
            print(f"written into {path}", file=sys.stderr)
    atexit.register(finish)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return f"{model}, {os.cpu_count()} cores"


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or "?"


def section(command: str, printed: str, today: datetime.date | None = None) -> str:
    today = today or datetime.date.today()
    return (f"<!-- bench: {command} -->\n### `{command}`\n\n{today.isoformat()}, at {commit()}, on {machine()}.\n\n"
            f"```\n{printed.rstrip()}\n```\n<!-- end bench -->\n")


def write(command: str, printed: str, path: Path | None = None) -> Path:
    """Put the section of ``command`` into the page: in place of its earlier one, or at the end
    of the benchmarks' part (made if missing)."""
    path = Path(path or os.environ.get("PYGGML_PERF_DOC") or ROOT / "docs" / "performance.md")
    text = path.read_text() if path.exists() else "# Performance figures\n"
    new = section(command, printed)
    begin = f"<!-- bench: {command} -->\n"
    if begin in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split("<!-- end bench -->\n", 1)
        text = head + new + tail
    else:
        if HEADING not in text:
            text = text.rstrip("\n") + f"\n\n{HEADING}\n\n"
        text = text.rstrip("\n") + "\n\n" + new
    path.write_text(text)
    return path
