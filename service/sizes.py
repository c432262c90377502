"""Sizes as a user writes them, `4GiB`, `512MiB`, `1.5GB` or plain bytes, for every byte-count setting and
flag: parse_size reads one, format_size writes one back (--help, docs/configuration.md), `Bytes` is the
setting type that reads it."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator

# NOTE: a unit is spelled out: `4G` is refused rather than guessed (docker reads it as GiB, pydantic's ByteSize
# as gigabits), and a binary unit (KiB, MiB, GiB, TiB) is told from a decimal one (KB, MB, GB, TB).
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE_UNIT_BY_LOWER = {u.lower(): u for u in _SIZE_UNITS}
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)", re.IGNORECASE)
SIZE_HINT = ("bytes, or a number and a unit: KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (of 1000), "
             "e.g. 4GiB or 1.5GB")


def parse_size(value: object) -> object:
    """A size as a user writes it (`4GiB` = 4 * 1024**3, `1.5GB` = 1.5e9, `4096`) -> bytes, rounded down.
    Anything but such a string is left to the field's int validation, so plain ints in code and tests pass."""
    if not isinstance(value, str) or re.fullmatch(r"\s*[-+]?\d+\s*", value):
        return value  # a plain integer, or not text: int validation says what is wrong (`greater than 0`)
    m = _SIZE_RE.fullmatch(value.strip())
    unit = _SIZE_UNIT_BY_LOWER.get(m.group(2).lower()) if m else None
    if unit is None:
        raise ValueError(f"not a size; give {SIZE_HINT}")
    whole, _, fraction = m.group(1).partition(".")
    # In integers, not floats: `1.5GB` is exactly 1500000000.
    return (int(whole or 0) * 10 ** len(fraction) + int(fraction or 0)) * _SIZE_UNITS[unit] // 10 ** len(fraction)


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that holds them exactly (`4GiB`), else the plain number: how --help
    and docs/configuration.md show a size; parse_size reads it back to the same value."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % _SIZE_UNITS[unit] == 0:
            return f"{n // _SIZE_UNITS[unit]}{unit}"
    return str(n)


# A byte-count setting: parse_size first, then int validation (so `gt=0` and the like still apply), and a
# plain int in the end, whichever way the value came.
Bytes = Annotated[int, BeforeValidator(parse_size)]
