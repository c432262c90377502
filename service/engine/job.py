"""The batcher's payload: what the engine knows of one distinct image or video (a key) while it is queued
and encoded. Its own module: the step loop, the writer and the host all read it."""

from __future__ import annotations

from dataclasses import dataclass

from service.tracing import Stamps
from service.media.images import PreparedImage
from service.media.video_preprocess import PreparedVideo


@dataclass
class EncodeJob:
    """The batcher's payload for one distinct image or video (a key). Plain host data, no tensors."""

    key: str
    image: PreparedImage | PreparedVideo  # what the runner stages
    content_sha256: str | None = None  # of the encoded bytes; recorded in the store entry
    stamps: Stamps | None = None  # when traced (tracing on, a request's traceparent): its engine spans' times

    @property
    def is_video(self) -> bool:
        return isinstance(self.image, PreparedVideo)
