"""The repository holds product: no lab notebook (results, profiler dumps, patches, probes), no run history in
the product's text (dates of runs, issue numbers: git log and bench/RESULTS.md hold them), files of service/
that fit on a few screens, and unit tests that mirror the modules they test."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
NOTEBOOK = re.compile(r"(^|/)results/|\.top$|\.patch$|(^|/)probe_")
HISTORY = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\bissues? \d+|\bissue #\d+", re.IGNORECASE)


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def test_no_notebook_is_tracked():
    assert [f for f in _tracked() if NOTEBOOK.search(f)] == []


def history_in(paths: list[str], root: Path = ROOT) -> list[str]:
    """'path:line: text' for each run date or issue number in the text files `paths` (under `root`)."""
    found = []
    for rel in paths:
        try:
            text = (root / rel).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        found += [f"{rel}:{n}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]
    return found


def test_no_run_dates_or_issue_numbers_in_the_product():
    product = [f for f in _tracked() if f.startswith(("service/", "kernels/", "docs/")) or f == "README.md"]
    assert history_in(product) == []


def test_the_history_check_finds_a_date_and_an_issue(tmp_path):
    (tmp_path / "a.py").write_text("ok\n# measured 2026-12-03\n# see issue 24\n# 4 issues\n")
    assert [f.split(":")[1] for f in history_in(["a.py"], tmp_path)] == ["2", "3"]


def test_no_file_of_the_product_is_over_the_limit():
    long = [f"{f}: {n}" for f in _tracked() if f.startswith(("service/", "kernels/")) and f.endswith(".py")
            and (n := len((ROOT / f).read_text().splitlines())) > MAX_LINES]
    assert long == []


def test_unit_tests_mirror_the_modules_they_test():
    """tests/unit/<package>/test_<module>[_<more>].py for service/<package>/<module>.py (or a subpackage, or the
    package itself); tests/unit/kernels/ for kernels/qve_kernels/."""
    stray = []
    for test in sorted((ROOT / "tests" / "unit").rglob("test_*.py")):
        rel = test.relative_to(ROOT / "tests" / "unit")
        source = ROOT / "kernels" / "qve_kernels" if rel.parts[0] == "kernels" else ROOT / "service" / Path(*rel.parts[:-1])
        names = {p.stem for p in source.glob("*.py")} | {p.name for p in source.iterdir() if p.is_dir()} | {source.name}
        names |= {"main"} if source.name == "service" else set()  # service/__main__.py
        stem = test.stem.removeprefix("test_")
        if not any(stem == n or stem.startswith(n + "_") for n in names):
            stray.append(str(rel))
    assert stray == []
