"""The record: how every tier that stores host records lays one out and verifies it on every read.

One format for the disk tier and the remote tier (docs/design.md §9.1): a 4096-byte header page, then
the payload. Little-endian::

    offset 0      struct "<8sIIQQQQIH": magic "KVOFREC1", format version, flags, file id, block,
                  generation, payload bytes, CRC32 of the payload, key length
    offset 54     the key (at most MAX_KEY_BYTES)
    offset 1080   with flag FINGERPRINT: the fingerprint's length (uint16), then the layout
                  fingerprint, UTF-8 (at most MAX_FINGERPRINT_BYTES); zero without it
    offset 4092   CRC32 of the page's first 4092 bytes
    offset 4096   the payload: the host record, byte for byte

Flags: VALID (the record was written whole), CHECKSUM (the payload CRC is meaningful), FINGERPRINT
(the header carries the layout fingerprint). A disk record names its tier file (file id) and disk
block and leaves the fingerprint to the file header; a remote record has file id and block 0 and
carries the fingerprint, since nothing else on the store says which layout wrote it. Every byte of
the page that is not a field is written as zero and not read (the header's CRC covers it); a flag
bit the version does not define makes the header invalid.

Version 1 is the disk tier's format as first released: the fingerprint field lies in bytes that a
version-1 disk record always wrote as zero and never read, so adding it changed no byte of a disk
record and every existing tier file stays readable (the version stays 1).

:func:`verify_record` checks, in this order: magic, header CRC, version, the flags, file id, payload
size and key length, block, fingerprint, key, generation (each only where the caller expects one),
then the payload's CRC32 (when the record has one and the caller asks). The first that fails names
the :class:`RecordFault` kind; each tier maps it to its own error kind.
"""

from __future__ import annotations

import enum
import importlib
import struct
import zlib
from collections.abc import Callable
from typing import Final, cast

import attrs
import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

from kvoffload.errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "CRC32_IMPLEMENTATION",
    "FINGERPRINT_OFFSET",
    "FLAG_CHECKSUM",
    "FLAG_FINGERPRINT",
    "FLAG_VALID",
    "FORMAT_VERSION",
    "HEADER_CRC_OFFSET",
    "KEY_OFFSET",
    "MAX_FINGERPRINT_BYTES",
    "MAX_KEY_BYTES",
    "PAGE_BYTES",
    "RECORD_HEADER",
    "RECORD_MAGIC",
    "Expected",
    "Header",
    "RecordFault",
    "Verdict",
    "check_fingerprint",
    "has_magic",
    "pack_header",
    "parse_header",
    "payload_crc",
    "verify_record",
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
_KNOWN_FLAGS: Final = FLAG_VALID | FLAG_CHECKSUM | FLAG_FINGERPRINT
_U16: Final = struct.Struct("<H")
_U32: Final = struct.Struct("<I")

assert KEY_OFFSET + MAX_KEY_BYTES <= FINGERPRINT_OFFSET
assert FINGERPRINT_OFFSET + _U16.size + MAX_FINGERPRINT_BYTES <= HEADER_CRC_OFFSET


def _buf(array: U8Array) -> Buffer:
    """A numpy array as a buffer for zlib and struct (numpy's stubs do not declare one)."""
    return cast(Buffer, array)


def _fastest_crc32() -> tuple[Callable[[Buffer], int], str]:
    """ISA-L's CRC32 where the ``isal`` package is installed (the same CRC-32 as zlib's, with
    carry-less multiplication), else zlib's; both release the GIL."""
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
    file_id: int,
    block: int,
    generation: int,
    crc: int,
    payload_bytes: int,
    key: bytes,
    checksum: bool = True,
    fingerprint: bytes | None = None,
) -> None:
    """Write one record's header into ``page`` (``uint8[PAGE_BYTES]``, overwritten whole).

    ``fingerprint`` None leaves the field zero (a disk record); otherwise flag FINGERPRINT is set.
    The caller has checked the key (<= MAX_KEY_BYTES) and fingerprint (1..MAX_FINGERPRINT_BYTES).
    """
    flags = FLAG_VALID | (FLAG_CHECKSUM if checksum else 0) | (FLAG_FINGERPRINT if fingerprint else 0)
    page.fill(0)
    RECORD_HEADER.pack_into(
        _buf(page), 0, RECORD_MAGIC, FORMAT_VERSION, flags, file_id, block, generation,
        payload_bytes, crc, len(key),
    )
    page[KEY_OFFSET : KEY_OFFSET + len(key)] = np.frombuffer(key, dtype=np.uint8)
    if fingerprint:
        _U16.pack_into(_buf(page), FINGERPRINT_OFFSET, len(fingerprint))
        start = FINGERPRINT_OFFSET + _U16.size
        page[start : start + len(fingerprint)] = np.frombuffer(fingerprint, dtype=np.uint8)
    _U32.pack_into(_buf(page), HEADER_CRC_OFFSET, zlib.crc32(_buf(page[:HEADER_CRC_OFFSET])))


@attrs.frozen
class Header:
    """The fields of a header page whose magic, CRC and version checked out."""

    flags: int
    file_id: int
    block: int
    generation: int
    payload_bytes: int
    crc: int
    key: bytes
    fingerprint: bytes | None

    @property
    def valid(self) -> bool:
        """Whether the record was marked written whole."""
        return bool(self.flags & FLAG_VALID)


def has_magic(page: U8Array) -> bool:
    """Whether ``page`` starts like a record header (damaged or not)."""
    return page[: len(RECORD_MAGIC)].tobytes() == RECORD_MAGIC


def parse_header(page: U8Array) -> Header | str:
    """The header of ``page`` (``uint8[PAGE_BYTES]``), or why it is not one (no magic, a damaged
    header, another format version, a key or fingerprint length past its field)."""
    magic, version, flags, file_id, block, generation, nbytes, crc, key_len = (
        RECORD_HEADER.unpack_from(_buf(page), 0)
    )
    if magic != RECORD_MAGIC:
        return "no record header (never written, or not a kvoffload record)"
    (stored,) = _U32.unpack_from(_buf(page), HEADER_CRC_OFFSET)
    if zlib.crc32(_buf(page[:HEADER_CRC_OFFSET])) != stored:
        return "the record header's CRC32 does not match (torn or damaged header)"
    if version != FORMAT_VERSION:
        return f"record format version {version}, this library reads {FORMAT_VERSION}"
    if flags & ~_KNOWN_FLAGS:
        return f"the header's flags {flags:#x} hold bits version {FORMAT_VERSION} does not define"
    if key_len > MAX_KEY_BYTES:
        return f"the header's key length {key_len} exceeds {MAX_KEY_BYTES}"
    fingerprint: bytes | None = None
    if flags & FLAG_FINGERPRINT:
        (fp_len,) = _U16.unpack_from(_buf(page), FINGERPRINT_OFFSET)
        if fp_len > MAX_FINGERPRINT_BYTES:
            return f"the header's fingerprint length {fp_len} exceeds {MAX_FINGERPRINT_BYTES}"
        start = FINGERPRINT_OFFSET + _U16.size
        fingerprint = page[start : start + fp_len].tobytes()
    key = page[KEY_OFFSET : KEY_OFFSET + key_len].tobytes()
    return Header(flags, file_id, block, generation, nbytes, crc, key, fingerprint)


class RecordFault(str, enum.Enum):
    """Why a record did not verify; the values are error kinds both tiers use."""

    HEADER_INVALID = "header_invalid"
    SIZE_MISMATCH = "size_mismatch"
    BLOCK_MISMATCH = "block_mismatch"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    KEY_MISMATCH = "key_mismatch"
    GENERATION_MISMATCH = "generation_mismatch"
    CHECKSUM_MISMATCH = "checksum_mismatch"


@attrs.frozen
class Expected:
    """What a reader expects of a record; None for a field it does not check.

    ``fingerprint`` None means the record must carry none (a disk record); bytes, that it carries
    exactly these. ``check_payload`` False skips the payload CRC (a tier written without checksums);
    ``require_checksum`` refuses a record written without one.
    """

    payload_bytes: int
    file_id: int = 0
    block: int = 0
    fingerprint: bytes | None = None
    key: bytes | None = None
    generation: int | None = None
    check_payload: bool = True
    require_checksum: bool = False


@attrs.frozen
class Verdict:
    """What :func:`verify_record` found: ``fault`` None and the record's generation, or why not."""

    fault: RecordFault | None
    message: str = ""
    generation: int = 0


def verify_record(page: U8Array, payload: U8Array, expected: Expected) -> Verdict:
    """Verify a record read back into ``page`` (its header) and ``payload`` (a host row), in the
    order of the module docstring. Reads only; zero-filling a failed row is the caller's part."""
    header = parse_header(page)
    invalid = RecordFault.HEADER_INVALID
    if isinstance(header, str):
        return Verdict(invalid, header)
    if not header.valid:
        return Verdict(invalid, "the record is not marked valid")
    if expected.require_checksum and not header.flags & FLAG_CHECKSUM:
        return Verdict(invalid, "the record was written without a payload checksum")
    if (header.fingerprint is None) != (expected.fingerprint is None) or header.file_id != expected.file_id:
        what = "a remote record" if expected.fingerprint is not None else "a record of this tier file"
        return Verdict(invalid, f"not {what} (flags {header.flags:#x}, file id {header.file_id})")
    if header.payload_bytes != expected.payload_bytes or header.payload_bytes != payload.shape[0]:
        return Verdict(
            RecordFault.SIZE_MISMATCH,
            f"the record holds {header.payload_bytes} payload bytes, a host record of this layout has "
            f"{expected.payload_bytes}",
        )
    if header.block != expected.block:
        return Verdict(
            RecordFault.BLOCK_MISMATCH,
            f"the record header names block {header.block}, not {expected.block} (another block's data)",
        )
    if header.fingerprint != expected.fingerprint:
        assert header.fingerprint is not None and expected.fingerprint is not None
        return Verdict(
            RecordFault.FINGERPRINT_MISMATCH,
            f"the record was written with layout fingerprint {header.fingerprint[:64]!r}, this "
            f"layout's is {expected.fingerprint[:64]!r}",
        )
    if expected.key is not None and header.key != expected.key:
        return Verdict(RecordFault.KEY_MISMATCH, f"the record header names key {header.key[:64]!r}")
    if expected.generation is not None and header.generation != expected.generation:
        return Verdict(
            RecordFault.GENERATION_MISMATCH,
            f"the record is generation {header.generation}, the reader expects {expected.generation}",
        )
    if expected.check_payload and header.flags & FLAG_CHECKSUM:
        actual = payload_crc(payload)
        if actual != header.crc:
            return Verdict(
                RecordFault.CHECKSUM_MISMATCH,
                f"payload CRC32 {actual:#010x} does not match the header's {header.crc:#010x}",
            )
    return Verdict(None, generation=header.generation)


def check_fingerprint(fingerprint: object) -> bytes:
    """The layout fingerprint a record carries (``DeviceLayout.fingerprint``), as UTF-8 bytes.

    Raises:
        ArgumentTypeError: not a str.
        InvalidArgumentError: not valid UTF-8, or not 1..:data:`MAX_FINGERPRINT_BYTES` bytes of it.
    """
    if not isinstance(fingerprint, str):
        raise ArgumentTypeError(
            f"fingerprint must be a str (DeviceLayout.fingerprint), got {type(fingerprint).__name__}"
        )
    try:
        encoded = fingerprint.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"fingerprint = {fingerprint!r:.80} is not valid UTF-8 ({exc.reason} at {exc.start})"
        ) from None
    if not 1 <= len(encoded) <= MAX_FINGERPRINT_BYTES:
        raise InvalidArgumentError(
            f"fingerprint must be 1..{MAX_FINGERPRINT_BYTES} bytes of UTF-8, got {len(encoded)}"
        )
    return encoded
