"""Data URLs (service/api/parse.py): what a client is told about base64 that does not decode."""

import base64

import pytest

from service.api.parse import _decode_data_url
from service.errors import RequestError
from tests.support.errors import raises_code

DATA = bytes(range(256)) * 2 + b"xy"  # any bytes (not a multiple of 3: the text ends in padding)
GOOD = base64.b64encode(DATA).decode()


def _message(payload: str, video: bool = False) -> str:
    with raises_code(RequestError, "bad_request") as e:
        _decode_data_url(f"data:image/jpeg;base64,{payload}", 3, 1 << 20, video=video)
    return e.value.message


def test_good_base64_decodes():
    assert _decode_data_url(f"data:image/jpeg;base64,{GOOD}", 0, 1 << 20) == DATA


@pytest.mark.parametrize("payload, says", [
    # Issue 23's finding: a missing '=' padding read "Non-base64 digit found".
    (GOOD.rstrip("="), "is not a multiple of 4: is its '=' padding missing? (standard base64 with padding)"),
    (GOOD[:40] + "-" + GOOD[41:], "character '-' at position 40 (URL-safe base64: use + and /)"),
    (GOOD[:40] + "_" + GOOD[41:], "character '_' at position 40 (URL-safe base64: use + and /)"),
    (GOOD[:76] + "\n" + GOOD[76:], "character '\\n' at position 76 (whitespace is not allowed)"),
    ("é" + GOOD, "character 'é' at position 0 (not a base64 character)"),
    (GOOD[:8] + "=" + GOOD[9:], "'=' padding before its end"),
])
def test_bad_base64_is_a_400_that_says_what_to_fix(payload, says):
    message = _message(payload)
    assert message.startswith("images[3].image_url.url has invalid base64 data: "), message
    assert message.endswith(says), message
    assert "Non-base64 digit" not in message
