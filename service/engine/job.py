"""The batcher's payload: what the engine knows of one distinct image (a key) while it is queued and
encoded. Its own module: the step loop, the writer and the host all read it."""

from __future__ import annotations

from dataclasses import dataclass

from service.media.images import PreparedImage


@dataclass
class EncodeJob:
    """The batcher's payload for one distinct image (a key). Plain host data, no tensors."""

    key: str
    image: PreparedImage
    content_sha256: str | None = None  # of the image's encoded bytes; recorded in the store entry
