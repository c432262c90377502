"""docs/configuration.md, written from `Settings`: every setting with its flag, its QVE_ variable, its
default and its description. From the repository root:

    .venv/bin/python -m service.configdoc > docs/configuration.md

tests/unit/test_configdoc.py fails when the committed page differs from what this writes, so a setting added
or changed without the page regenerated is caught. Imports only service.config (pydantic; no torch).
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

from service.config import Settings, default_compile_cache, env_name, is_size
from service.sizes import format_size
from service.flags import setting_groups
from service.store.options import default_store_dir

COMMAND = ".venv/bin/python -m service.configdoc > docs/configuration.md"

# Defaults that depend on the machine (whether /dev/shm is there, the user's home), written the same
# everywhere so that the page does not change with the machine that generates it.
PORTABLE_DEFAULTS = {
    default_store_dir: "`/dev/shm/qwen3vl-encoder-cache` (in `$TMPDIR`, else `/tmp`, where /dev/shm is not writable)",
    default_compile_cache: "`~/.cache/qwen3vl-encoder/compile` (under `$XDG_CACHE_HOME` where it is set)",
}

_INTRO = f"""\
# Configuration

<!-- Generated from service/config.py by `{COMMAND}`; do not edit by hand. -->

Every setting of `qwen3vl-encoder serve` is a flag and an environment variable with the `QVE_` prefix
(`--max-batch-tokens 8192` or `QVE_MAX_BATCH_TOKENS=8192`); a flag wins over the variable. A list is
comma-separated (`--devices cuda:0,cuda:1`); an on/off setting is `--name` / `--no-name` as a flag and
`true` / `false` as a variable. A size is bytes or a number and a unit, as a flag and as a variable alike
(`--store-capacity-bytes 8GiB`, `QVE_MAX_IMAGE_BYTES=1.5MB`): KiB, MiB, GiB, TiB are powers of 1024, KB, MB,
GB, TB powers of 1000. An invalid value stops the service before the model loads, naming the
flag or variable and what is allowed; a `QVE_` variable that is no setting (a typo) is warned about at
start, naming the closest one.

`.venv/bin/qwen3vl-encoder serve --help` lists the same settings, with the defaults of the machine it
runs on. The other commands (`try`, `consume`, `route`) have flags of their own: see their `--help`.
"""


def flag(name: str) -> str:
    field = Settings.model_fields[name]
    f = "--" + name.replace("_", "-")
    return f"`{f}` / `--no-{f[2:]}`" if field.annotation is bool else f"`{f}`"


def default(name: str) -> str:
    """A setting's default, as Markdown."""
    field = Settings.model_fields[name]
    if field.default_factory in PORTABLE_DEFAULTS:
        return PORTABLE_DEFAULTS[field.default_factory]
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return f"`{','.join(map(str, value))}`"
    if is_size(name):
        return f"`{format_size(value)}`"
    return f"`{value}`"


def values(name: str) -> str:
    """What a setting takes: a kind and its bounds (from the field's type and constraints)."""
    field = Settings.model_fields[name]
    kind = field.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `int | None`: unset means the default
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return "comma-separated " + ("integers" if typing.get_args(kind) == (int,) else "list")
    kinds = {bool: "on/off", int: "integer", float: "number", str: "text", Path: "path"}
    text = "size" if is_size(name) else kinds.get(kind, kind.__name__)  # a size: `4GiB` or bytes (the intro says)
    bounds = {attr: getattr(c, attr) for c in field.metadata for attr in ("gt", "ge", "lt", "le")
              if getattr(c, attr, None) is not None}
    if "ge" in bounds and "le" in bounds:
        return f"{text} from {bounds['ge']} to {bounds['le']}"
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    return " ".join([text, *(f"{signs[attr]} {v}" for attr, v in bounds.items())])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def page() -> str:
    """The whole of docs/configuration.md."""
    lines = [_INTRO]
    for title, names in setting_groups():
        lines += [f"## {title}", "", "| flag | variable | default | values | description |",
                  "|---|---|---|---|---|"]
        for name in names:
            description = Settings.model_fields[name].description or ""
            lines.append(f"| {flag(name)} | `{env_name(name)}` | {_cell(default(name))} | {values(name)} | "
                         f"{_cell(description)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(page())
