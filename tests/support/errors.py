"""`raises_code(Family, "code")`: pytest.raises for one code of an error family (service/errors.py: a code is
data, so a test names the code it expects, not only the family)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest


@contextmanager
def raises_code(family: type[BaseException], code: str, match: str | None = None):
    with pytest.raises(family, match=match) as info:
        yield info
    assert info.value.code == code, f"{type(info.value).__name__} {info.value.code!r}, expected {code!r}: {info.value}"
