"""What an image's raw bytes say before any decoder runs: its format by signature, the size its header
declares, a JPEG's scans (counted from its marker segments), and whether it looks cut short; and whether
bytes look like a video container at all. Cheap and bounded: hostile input is judged here before it costs a
decode (service/media/images.py)."""

from __future__ import annotations

import re
import struct

from service.media.params import ImageLimits


# A plain JPEG of at most this many scans is decoded by simplejpeg (fast, but it cannot be stopped); one of
# more goes through PIL's decode, which is stopped at the deadline. libjpeg's progressive files have 10 scans,
# so they keep the fast path; 16 scans of a 64 MP image cost simplejpeg about 1.3 s.
FAST_JPEG_SCANS = 16
# Any marker but a stuffed 0xFF (0x00), a restart marker (0xD0-0xD7) or a fill byte (0xFF): what ends a scan's
# entropy-coded data, in which every 0xFF is followed by 0x00 or a restart marker.
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def max_jpeg_segments(max_scans: int) -> int:
    """Marker segments jpeg_scans walks at most: a photograph has a few dozen (APPn, DQT, SOF, DHT, SOS, ...),
    a progressive one two per scan (DHT and SOS). Each costs about a microsecond of Python; past this the
    file is refused (a million empty COM segments cost PIL's header parser 3 s)."""
    return 1024 + 8 * max_scans


def most_scans(limits: ImageLimits) -> int:
    """How far a JPEG's scans are counted: past the limit, and past the fast path's (read_header)."""
    return max(limits.max_jpeg_scans, FAST_JPEG_SCANS)


def count_scans(data: bytes, limits: ImageLimits) -> int | None:
    return jpeg_scans(data, most_scans(limits))


def jpeg_scans(data: bytes, most: int) -> int | None:
    """The scans (SOS markers) of a JPEG's first image, walked as libjpeg reads them: a segment's length
    skips its contents (an EXIF thumbnail's scans are not the image's), a scan's entropy-coded data is
    skipped to the next marker (_JPEG_MARKER), and the image ends at EOI (an MPO's other pictures, or a
    video a phone appended, are never decoded). Counting every 0xFF 0xDA pair of the file instead would
    count those of such appended data too (one per 64 KiB of compressed data: the few MB of video of a
    phone's motion photo would make it a scan bomb).
    Stops at `most + 1` (more than `most`); None past max_jpeg_segments(most) segments."""
    pos, scans, segments, cap = 2, 0, 0, max_jpeg_segments(most)  # (after SOI)
    while (m := _JPEG_MARKER.search(data, pos)) is not None:
        segments += 1
        if segments > cap:
            return None
        marker = data[m.start() + 1]
        if marker == 0xD9:  # EOI
            break
        if marker == 0xDA:
            scans += 1
            if scans > most:
                break
        if marker in (0x01, 0xD8):  # TEM, SOI: no length (RSTn, the others, never match _JPEG_MARKER)
            pos = m.end()
            continue
        pos = m.end() + int.from_bytes(data[m.end() : m.end() + 2], "big")  # (a scan's data follows its header)
    return scans


def sniff_format(data: bytes) -> str | None:
    """The supported format whose signature the data starts with, if any."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "WEBP"
    if data.startswith((b"II*\x00", b"MM\x00*")):
        return "TIFF"
    # "BM" alone is too weak (text can start with it): also require the reserved header fields to be 0
    if data.startswith(b"BM") and len(data) >= 14 and data[6:10] == b"\x00\x00\x00\x00":
        return "BMP"
    return None


def looks_like_video(data: bytes) -> bool:
    """Whether the data starts as a video container does: MP4 / MOV (an ISO box `ftyp`), Matroska / WebM (EBML),
    AVI. A guess for a client that was handed a file (`try`); the service reads the header itself."""
    return (data[4:8] == b"ftyp" or data.startswith(b"\x1a\x45\xdf\xa3")
            or (data.startswith(b"RIFF") and data[8:12] == b"AVI "))


def declared_size(fmt: str, data: bytes) -> tuple[int, int] | None:
    """(width, height) from fixed-position header fields, where the format has them."""
    if fmt == "PNG" and len(data) >= 24 and data[12:16] == b"IHDR":
        return struct.unpack(">II", data[16:24])
    if fmt == "GIF" and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if fmt == "WEBP" and len(data) >= 30:  # the canvas size, as PIL's WebP plugin reads it
        chunk = data[12:16]
        if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
            width, height = struct.unpack("<HH", data[26:30])
            return width & 0x3FFF, height & 0x3FFF
        if chunk == b"VP8X":
            return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
        if chunk == b"VP8L" and data[20] == 0x2F:
            bits = int.from_bytes(data[21:25], "little")
            return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def webp_alpha(data: bytes) -> bool | None:
    """Whether a WebP file carries an alpha channel, by its first chunk: VP8X's alpha flag, VP8L's alpha hint
    (what PIL's WebP plugin opens as RGBA); a lossy VP8 has none. None where the chunk is not one of them."""
    if len(data) < 21 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8 ":
        return False
    if chunk == b"VP8X":
        return bool(data[20] & 0x10)
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        return bool(int.from_bytes(data[21:25], "little") >> 28 & 1)
    return None


def looks_truncated(fmt: str, data: bytes) -> bool:
    """Whether the container says the file should be longer than it is (used only to classify failures)."""
    tail = data.rstrip(b"\x00\r\n ")
    if fmt == "PNG":
        return b"IEND" not in data[-64:]
    if fmt == "JPEG":
        return not tail.endswith(b"\xff\xd9")
    if fmt == "GIF":
        return not tail.endswith(b";")
    if fmt == "WEBP":
        return len(data) >= 8 and struct.unpack("<I", data[4:8])[0] + 8 > len(data)
    if fmt == "BMP":
        return len(data) >= 6 and struct.unpack("<I", data[2:6])[0] > len(data)
    if fmt == "TIFF":  # the first IFD (offset at byte 4: 2-byte entry count, 12-byte entries) must fit
        if len(data) < 8:
            return True
        order = "<" if data[:2] == b"II" else ">"
        ifd = struct.unpack(order + "I", data[4:8])[0]
        if ifd + 2 > len(data):
            return True
        (entries,) = struct.unpack(order + "H", data[ifd : ifd + 2])
        return ifd + 2 + 12 * entries + 4 > len(data)
    return False
