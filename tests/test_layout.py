"""The tests' own layout: no module under tests/ imports a test module (tests/**/test_*.py). What tests share
lives in helper modules (tests/support/: live.py, processes.py, imagedata.py, storedata.py,
...) or conftest.py fixtures: a test module imported by another runs its module-level code and fixtures
twice, ties the two files' edits together, and its tests can be collected under the importer's name."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def imports_of_test_modules(root: Path) -> list[str]:
    """'path:line imports module' for every import of a test module by a module below `root` (a folder
    named tests, as this one). Relative imports are resolved against the importing module's package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        package = ["tests", *path.parent.relative_to(root).parts]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *(node.module.split(".") if node.module else [])])
                # `from tests.x.test_y import f` imports test_y; `from tests.x import test_y` does too
                names = [module] if _is_test_module(module) else [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(root.parent)}:{node.lineno} imports {n}" for n in names if _is_test_module(n)]
    return found


def test_no_module_under_tests_imports_a_test_module():
    assert imports_of_test_modules(TESTS) == []


def test_the_check_finds_each_form_of_import(tmp_path):
    root = tmp_path / "tests"
    (root / "store").mkdir(parents=True)
    (root / "helper.py").write_text("import tests.live\nfrom tests import imagedata\n")
    (root / "test_a.py").write_text("import tests.test_b\nfrom tests.store.test_c import x\n")
    (root / "store" / "test_c.py").write_text("from .test_d import y\nfrom .. import test_a\nfrom . import storedata\n")
    (root / "store" / "test_e.py").write_text("from tests.store import test_c as c\n")
    assert imports_of_test_modules(root) == [
        "tests/store/test_c.py:1 imports tests.store.test_d",
        "tests/store/test_c.py:2 imports tests.test_a",
        "tests/store/test_e.py:1 imports tests.store.test_c",
        "tests/test_a.py:1 imports tests.test_b",
        "tests/test_a.py:2 imports tests.store.test_c",
    ]
