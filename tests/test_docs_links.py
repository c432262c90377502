"""README.md and docs/*.md point at things that exist: every relative link (and its #anchor) and every
file of the repository they name, so a page that still names a moved or renamed file fails here."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path into the repository as the pages write it: `service/engine/pool.py`, tests/unit/lm/test_chat.py, ...
REPO_PATH = re.compile(r"(?<![\w./-])((?:service|tests|bench|docs|docker|kernels|\.ci)/[\w./-]*[\w/])")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_and_named_files_exist(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name} links to {target}: no such heading in {linked.name}"
    for name in REPO_PATH.findall(text):
        assert (ROOT / name).exists(), f"{page.name} names {name}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_path_of_a_development_machine(page):
    text = page.read_text()
    for pattern in (r"/work/", r"\.\./shared", r"/root/", r"/home/\w", r"/Users/\w"):
        assert not re.search(pattern, text), f"{page.name} names a path outside the repository ({pattern})"


def test_the_readme_stays_a_page_for_a_user():
    """At most 12 KiB: what a user needs first; the rest lives in docs/ (issue 19)."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes; move detail to docs/"
