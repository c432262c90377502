"""Every Settings field as a command-line flag (`max_batch_tokens` -> `--max-batch-tokens`), in the groups
of setting_groups(), each help saying the default and the QVE_ variable. `serve` takes these flags, and
so does the soak, which reads a `serve` command line to learn what the server it starts will run with."""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path

from service.config import Settings, env_name, format_size, is_size, setting_groups


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field on `parser`, an argument group per heading of setting_groups(). A flag
    not given is left out of the parsed namespace only if `parser` has argument_default=SUPPRESS (as
    `serve` does, so that Settings applies the environment and its own defaults)."""
    for title, names in setting_groups():
        group = parser.add_argument_group(title)
        for name in names:
            _add_setting(group, name)


def _flag_kind(name: str, field) -> tuple[type, list[str] | None, str | None]:
    """argparse's type, choices and metavar for a Settings field. The metavar is short (SIZE, N, SECONDS),
    so that most help texts start on the flag's own line."""
    base = field.annotation
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(base) if a is not type(None)]  # `int | None` -> int
        if set(args) == {Path, str}:  # a path or a URL (--store): Settings tells which
            return str, None, "DIR|URL"
        base = args[0]
    if is_size(name):
        return str, None, "SIZE"  # `4GiB` as well as bytes: Settings parses it (config.parse_size)
    if typing.get_origin(base) is typing.Literal:
        return str, list(typing.get_args(base)), None
    if typing.get_origin(base) is list:
        return str, None, "LIST"  # comma-separated; Settings splits it
    if name.endswith("_s") or name.endswith("_ms"):
        return base, None, "SECONDS" if name.endswith("_s") else "MS"
    if base in (int, float):
        return base, None, "N"
    if base is Path:
        return base, None, "DIR"
    return str, None, name.rsplit("_", 1)[-1].upper()  # store_group -> GROUP


def _default_text(name: str) -> str:
    """A setting's default as one would type it."""
    value = Settings.model_fields[name].get_default(call_default_factory=True)
    if is_size(name):
        return format_size(value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == []:
        return "none"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _add_setting(group, name: str) -> None:
    """The flag of one Settings field, its help saying the default and the QVE_ variable."""
    field = Settings.model_fields[name]
    flag = "--" + name.replace("_", "-")
    help_ = f"{field.description or ''} (default: {_default_text(name)}; env {env_name(name)})".strip()
    help_ = help_.replace("%", "%%")  # argparse %-formats help strings
    if field.annotation is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
        return
    type_, choices, metavar = _flag_kind(name, field)
    group.add_argument(flag, type=type_, choices=choices, help=help_, metavar=metavar)
