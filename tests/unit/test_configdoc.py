"""docs/configuration.md is what service/configdoc.py writes from Settings now: a setting added, removed,
regrouped or redescribed without the page regenerated fails here, saying how to regenerate it."""

import os
import subprocess
import sys
from pathlib import Path

from service import configdoc
from service.config import Settings, env_name
from service.flags import setting_groups

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
STALE = f"docs/configuration.md does not match service/config.py; regenerate it from the repository root: {configdoc.COMMAND}"


def test_the_committed_page_is_what_the_generator_writes_now():
    assert PAGE.read_text() == configdoc.page(), STALE


def test_the_command_writes_the_page_without_importing_torch():
    code = "import runpy, sys; runpy.run_module('service.configdoc', run_name='__main__'); " \
           "assert 'torch' not in sys.modules, 'service.configdoc imported torch'"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == PAGE.read_text(), STALE


def test_every_setting_is_on_the_page_once_with_its_flag_variable_and_a_description():
    page = configdoc.page()
    for name, field in Settings.model_fields.items():
        assert field.description, f"Settings.{name} has no description: --help and docs/configuration.md need one"
        rows = [line for line in page.splitlines() if line.startswith(f"| `--{name.replace('_', '-')}`")]
        assert len(rows) == 1, (name, rows)
        assert f"`{env_name(name)}`" in rows[0]


def test_the_page_does_not_depend_on_the_machine(monkeypatch, tmp_path):
    before = configdoc.page()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert configdoc.page() == before
    assert str(tmp_path) not in before


def test_the_sections_are_the_settings_headings_as_serve_help_groups_them():
    headings = [line.removeprefix("## ") for line in configdoc.page().splitlines() if line.startswith("## ")]
    assert headings == [title for title, _ in setting_groups()]
    assert headings[0] == "Model and device" and "Security: API keys and image URLs" in headings
