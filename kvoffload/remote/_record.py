"""The record a remote store holds under a key: one 4096-byte header page, then the host record.

The header page has the byte layout of the disk tier's record header (same struct, magic, version,
flags and CRC placement), so one record format serves both tiers::

    offset 0      struct "<8sIIQQQQIH": magic "KVOFREC1", format version, flags, file id, block,
                  generation, payload bytes, CRC32 of the payload, key length
    offset 54     the key (at most MAX_KEY_BYTES)
    offset 1080   fingerprint length (uint16), then the layout fingerprint, UTF-8
                  (at most MAX_FINGERPRINT_BYTES; zero in a disk record, whose file header holds it)
    offset 4092   CRC32 of the page's first 4092 bytes
    offset 4096   the payload: the host record, byte for byte

A remote record sets the flags VALID, CHECKSUM and FINGERPRINT, and file id and block 0 (it belongs
to no file and no disk slot). Every byte of the page that is not a field is zero.

:func:`check_record` verifies, in this order: magic, header CRC, version, flags, file id and block,
payload size, fingerprint, key, generation (when the caller expects one), then the payload's CRC32.
"""

from __future__ import annotations

import importlib
import struct
import zlib
from collections.abc import Callable
from typing import Final, cast

import attrs
import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

from kvoffload.remote._types import RemoteErrorKind

__all__ = [
    "FINGERPRINT_OFFSET",
    "FLAG_CHECKSUM",
    "FLAG_FINGERPRINT",
    "FLAG_VALID",
    "CRC32_IMPLEMENTATION",
    "FORMAT_VERSION",
    "HEADER_CRC_OFFSET",
    "KEY_OFFSET",
    "MAX_FINGERPRINT_BYTES",
    "MAX_KEY_BYTES",
    "PAGE_BYTES",
    "RECORD_HEADER",
    "RECORD_MAGIC",
    "RecordCheck",
    "check_record",
    "pack_header",
    "payload_crc",
]

U8Array = npt.NDArray[np.uint8]

#: Size of the header page, and the alignment of a host record.
PAGE_BYTES: Final = 4096
FORMAT_VERSION: Final = 1
RECORD_MAGIC: Final = b"KVOFREC1"
#: magic, version, flags, file_id, block, generation, payload bytes, payload crc, key length
RECORD_HEADER: Final = struct.Struct("<8sIIQQQQIH")
KEY_OFFSET: Final = RECORD_HEADER.size
MAX_KEY_BYTES: Final = 1024
FINGERPRINT_OFFSET: Final = 1080
MAX_FINGERPRINT_BYTES: Final = 2048
HEADER_CRC_OFFSET: Final = PAGE_BYTES - 4
FLAG_VALID: Final = 1
FLAG_CHECKSUM: Final = 2
FLAG_FINGERPRINT: Final = 4
_REMOTE_FLAGS: Final = FLAG_VALID | FLAG_CHECKSUM | FLAG_FINGERPRINT
_U16: Final = struct.Struct("<H")
_U32: Final = struct.Struct("<I")

assert KEY_OFFSET + MAX_KEY_BYTES <= FINGERPRINT_OFFSET
assert FINGERPRINT_OFFSET + _U16.size + MAX_FINGERPRINT_BYTES <= HEADER_CRC_OFFSET


def _buf(array: U8Array) -> Buffer:
    """A numpy array as a buffer for zlib and struct (numpy's stubs do not declare one)."""
    return cast(Buffer, array)


def _fastest_crc32() -> tuple[Callable[[Buffer], int], str]:
    """ISA-L's CRC32 where the ``isal`` package is installed (the same CRC-32 as zlib's, about ten
    times faster with carry-less multiplication), else zlib's."""
    try:
        isal_zlib = importlib.import_module("isal.isal_zlib")  # an optional accelerator
    except ImportError:
        return zlib.crc32, "zlib"
    crc = cast(Callable[[Buffer], int], isal_zlib.crc32)
    probe = bytes(range(256)) * 17
    return (crc, "isal") if crc(probe) == zlib.crc32(probe) else (zlib.crc32, "zlib")


_PAYLOAD_CRC32, CRC32_IMPLEMENTATION = _fastest_crc32()


def payload_crc(payload: U8Array) -> int:
    """CRC32 of a host record (``CRC32_IMPLEMENTATION`` says whose: ``"isal"`` or ``"zlib"``)."""
    return _PAYLOAD_CRC32(_buf(payload))


def pack_header(
    page: U8Array,
    *,
    key: bytes,
    generation: int,
    crc: int,
    payload_bytes: int,
    fingerprint: bytes,
) -> None:
    """Write a remote record's header into ``page`` (``uint8[PAGE_BYTES]``, overwritten whole).

    The caller has checked the key (<= MAX_KEY_BYTES) and fingerprint (1..MAX_FINGERPRINT_BYTES).
    """
    page.fill(0)
    RECORD_HEADER.pack_into(
        _buf(page), 0, RECORD_MAGIC, FORMAT_VERSION, _REMOTE_FLAGS, 0, 0, generation,
        payload_bytes, crc, len(key),
    )
    page[KEY_OFFSET : KEY_OFFSET + len(key)] = np.frombuffer(key, dtype=np.uint8)
    _U16.pack_into(_buf(page), FINGERPRINT_OFFSET, len(fingerprint))
    start = FINGERPRINT_OFFSET + _U16.size
    page[start : start + len(fingerprint)] = np.frombuffer(fingerprint, dtype=np.uint8)
    _U32.pack_into(_buf(page), HEADER_CRC_OFFSET, zlib.crc32(_buf(page[:HEADER_CRC_OFFSET])))


@attrs.frozen
class RecordCheck:
    """What :func:`check_record` found: ``kind`` None and the record's generation, or why not."""

    kind: RemoteErrorKind | None
    message: str = ""
    generation: int = 0


def check_record(
    page: U8Array,
    payload: U8Array,
    *,
    key: bytes,
    fingerprint: bytes,
    expected_generation: int | None,
) -> RecordCheck:
    """Verify a record read back into ``page`` (its header) and ``payload`` (a host row).

    The checks run in the order of the module docstring; the first that fails names the kind. It
    reads only; zero-filling a failed row is the caller's part.
    """
    magic, version, flags, file_id, block, generation, nbytes, crc, key_len = (
        RECORD_HEADER.unpack_from(_buf(page), 0)
    )
    invalid = RemoteErrorKind.HEADER_INVALID
    if magic != RECORD_MAGIC:
        return RecordCheck(invalid, "no record header (the value is not a kvoffload record)")
    (stored,) = _U32.unpack_from(_buf(page), HEADER_CRC_OFFSET)
    if zlib.crc32(_buf(page[:HEADER_CRC_OFFSET])) != stored:
        return RecordCheck(invalid, "the record header's CRC32 does not match (damaged header)")
    if version != FORMAT_VERSION:
        return RecordCheck(invalid, f"record format version {version}, expected {FORMAT_VERSION}")
    if flags & _REMOTE_FLAGS != _REMOTE_FLAGS or file_id != 0 or block != 0:
        return RecordCheck(invalid, f"not a remote record (flags {flags:#x}, file id {file_id}, block {block})")
    if nbytes != payload.shape[0]:
        return RecordCheck(
            RemoteErrorKind.SIZE_MISMATCH,
            f"the record holds {nbytes} payload bytes, this layout's host record has {payload.shape[0]}",
        )
    if key_len > MAX_KEY_BYTES:
        return RecordCheck(invalid, f"the header's key length {key_len} exceeds {MAX_KEY_BYTES}")
    (fp_len,) = _U16.unpack_from(_buf(page), FINGERPRINT_OFFSET)
    start = FINGERPRINT_OFFSET + _U16.size
    stored_fp = page[start : start + min(fp_len, MAX_FINGERPRINT_BYTES)].tobytes()
    if stored_fp != fingerprint:
        return RecordCheck(
            RemoteErrorKind.FINGERPRINT_MISMATCH,
            f"the record was written with layout fingerprint {stored_fp[:64]!r}, this layout's is "
            f"{fingerprint[:64]!r}",
        )
    stored_key = page[KEY_OFFSET : KEY_OFFSET + key_len].tobytes()
    if stored_key != key:
        return RecordCheck(
            RemoteErrorKind.KEY_MISMATCH, f"the record header names key {stored_key[:64]!r}"
        )
    if expected_generation is not None and generation != expected_generation:
        return RecordCheck(
            RemoteErrorKind.GENERATION_MISMATCH,
            f"the record is generation {generation}, the caller expects {expected_generation}",
        )
    actual = payload_crc(payload)
    if actual != crc:
        return RecordCheck(
            RemoteErrorKind.CHECKSUM_MISMATCH,
            f"payload CRC32 {actual:#010x} does not match the header's {crc:#010x}",
        )
    return RecordCheck(None, generation=generation)
