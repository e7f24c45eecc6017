"""The one record format of every tier (kvoffload._record): layout, the version-1 disk record kept
byte for byte, every field verified in order, and each tier's mapping of a fault to its kind."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np
import pytest

from kvoffload import _record as record
from kvoffload._record import (
    FINGERPRINT_OFFSET,
    HEADER_CRC_OFFSET,
    KEY_OFFSET,
    PAGE_BYTES,
    RECORD_HEADER,
    RECORD_MAGIC,
    Expected,
    RecordFault,
    pack_header,
    payload_crc,
    verify_record,
)
from kvoffload.disk.config import DiskErrorKind
from kvoffload.disk.format import RecordCodec

U8 = np.ndarray[Any, np.dtype[np.uint8]]
RECORD = 2 * PAGE_BYTES


def payload_of(seed: int = 3) -> U8:
    return np.random.default_rng(seed).integers(0, 256, RECORD, dtype=np.uint8)


def remote(key: bytes = b"key", generation: int = 7, fingerprint: bytes = b"fp") -> tuple[U8, U8]:
    payload = payload_of()
    page = np.empty(PAGE_BYTES, dtype=np.uint8)
    pack_header(page, file_id=0, block=0, generation=generation, crc=payload_crc(payload),
                payload_bytes=RECORD, key=key, fingerprint=fingerprint)
    return page, payload


def remote_check(page: U8, payload: U8, **kw: Any) -> RecordFault | None:
    args: dict[str, Any] = {"payload_bytes": RECORD, "fingerprint": b"fp", "key": b"key",
                            "require_checksum": True} | kw
    return verify_record(page, payload, Expected(**args)).fault


def reseal(page: U8) -> None:
    struct.pack_into("<I", page.data, HEADER_CRC_OFFSET, zlib.crc32(page[:HEADER_CRC_OFFSET].tobytes()))


def v1_disk_header(file_id: int, block: int, generation: int, crc: int, key: bytes, flags: int) -> bytes:
    """A version-1 disk record header as the first release wrote it (the spec, packed by hand)."""
    page = bytearray(PAGE_BYTES)
    struct.pack_into("<8sIIQQQQIH", page, 0, b"KVOFREC1", 1, flags, file_id, block, generation, RECORD,
                     crc, len(key))
    page[54 : 54 + len(key)] = key
    struct.pack_into("<I", page, 4092, zlib.crc32(bytes(page[:4092])))
    return bytes(page)


def test_the_layout_is_the_disk_record_layout_with_the_fingerprint_at_1080() -> None:
    assert RECORD_HEADER.format == "<8sIIQQQQIH" and RECORD_MAGIC == b"KVOFREC1"
    assert (KEY_OFFSET, FINGERPRINT_OFFSET, HEADER_CRC_OFFSET) == (54, 1080, 4092)
    page, _ = remote()
    magic, version, flags, file_id, block, generation, nbytes, _crc, key_len = RECORD_HEADER.unpack_from(page.data)
    assert (magic, version, flags, file_id, block, generation, nbytes, key_len) == (
        b"KVOFREC1", 1, 7, 0, 0, 7, RECORD, 3)
    assert page[KEY_OFFSET : KEY_OFFSET + 3].tobytes() == b"key"
    assert page[FINGERPRINT_OFFSET : FINGERPRINT_OFFSET + 4].tobytes() == b"\x02\x00fp"


@pytest.mark.parametrize("checksum", [True, False])
def test_a_disk_record_is_byte_for_byte_the_version_1_record(checksum: bool) -> None:
    """No version bump: a disk record packed today equals the first release's, and the first
    release's records verify today (an existing tier file stays readable)."""
    codec = RecordCodec(file_id=0xABCDEF, record_bytes=RECORD, path="t")
    payload = payload_of()
    crc = zlib.crc32(payload.tobytes()) if checksum else 0
    page = np.empty(PAGE_BYTES, dtype=np.uint8)
    codec.pack(page, 5, 11, crc, b"k-5", checksum)
    flags = 3 if checksum else 1
    old = v1_disk_header(0xABCDEF, 5, 11, crc, b"k-5", flags)
    assert page.tobytes() == old
    # read by a tier of the same setting (a tier that checks checksums refuses a record without one)
    assert codec.verify(np.frombuffer(old, np.uint8).copy(), 0, payload, 5, True, 11, checksum) is None
    if not checksum:
        assert codec.verify(np.frombuffer(old, np.uint8).copy(), 0, payload, 5, True, 11, True) is not None
    assert codec.parse(np.frombuffer(old, np.uint8), 0) == (flags, 5, 11, crc, b"k-5")


def test_a_record_verifies_and_reports_its_generation() -> None:
    page, payload = remote(generation=42)
    verdict = verify_record(page, payload, Expected(RECORD, fingerprint=b"fp", key=b"key", generation=42))
    assert verdict.fault is None and verdict.generation == 42
    assert remote_check(page, payload) is None


@pytest.mark.parametrize(
    ("damage", "fault"),
    [
        (lambda p, d: p.__setitem__(0, ord("X")), RecordFault.HEADER_INVALID),  # magic
        (lambda p, d: p.__setitem__(100, 1), RecordFault.HEADER_INVALID),  # CRC no longer matches
        (lambda p, d: p.fill(0), RecordFault.HEADER_INVALID),
        (lambda p, d: d.__setitem__(5, d[5] ^ 1), RecordFault.CHECKSUM_MISMATCH),
    ],
)
def test_damage_is_detected(damage: Any, fault: RecordFault) -> None:
    page, payload = remote()
    damage(page, payload)
    assert remote_check(page, payload) is fault


@pytest.mark.parametrize("bit", [8, 1 << 31])
def test_a_flag_the_version_does_not_define_makes_the_header_invalid(bit: int) -> None:
    """(A header with such a bit and a resealed CRC was read as a record; found by fuzzing.)"""
    page, payload = remote()
    flags_offset = 12  # after the magic and the version
    (flags,) = struct.unpack_from("<I", page.data, flags_offset)
    struct.pack_into("<I", page.data, flags_offset, flags | bit)
    reseal(page)
    assert remote_check(page, payload) is RecordFault.HEADER_INVALID
    assert "does not define" in str(record.parse_header(page))


def test_another_version_a_disk_record_or_a_record_without_checksum_is_not_a_remote_record() -> None:
    page, payload = remote()
    struct.pack_into("<I", page.data, 8, 2)
    reseal(page)
    assert remote_check(page, payload) is RecordFault.HEADER_INVALID
    page, payload = remote()
    struct.pack_into("<Q", page.data, 16, 99)  # a disk record's file id
    reseal(page)
    assert remote_check(page, payload) is RecordFault.HEADER_INVALID
    disk = np.frombuffer(v1_disk_header(0, 0, 7, payload_crc(payload), b"key", 3), np.uint8).copy()
    assert remote_check(disk, payload) is RecordFault.HEADER_INVALID  # no fingerprint: not remote
    page, payload = remote()
    struct.pack_into("<I", page.data, 12, record.FLAG_VALID | record.FLAG_FINGERPRINT)
    reseal(page)
    assert remote_check(page, payload) is RecordFault.HEADER_INVALID


def test_a_remote_record_is_never_read_as_a_disk_record() -> None:
    page, payload = remote()
    codec = RecordCodec(file_id=0, record_bytes=RECORD, path="t")
    assert isinstance(codec.parse(page, 0), str)
    error = codec.verify(page, 0, payload, 0, True, 7, True)
    assert error is not None and error.kind == DiskErrorKind.HEADER_INVALID


def test_each_identity_field_is_checked() -> None:
    page, payload = remote()
    assert remote_check(page, payload, fingerprint=b"other") is RecordFault.FINGERPRINT_MISMATCH
    assert remote_check(page, payload, key=b"kez") is RecordFault.KEY_MISMATCH
    assert remote_check(page, payload, generation=8) is RecordFault.GENERATION_MISMATCH
    assert remote_check(page, payload[:PAGE_BYTES]) is RecordFault.SIZE_MISMATCH
    assert remote_check(page, payload, block=3) is RecordFault.BLOCK_MISMATCH


def test_the_disk_tier_maps_faults_to_its_kinds() -> None:
    codec = RecordCodec(file_id=1, record_bytes=RECORD, path="t")
    payload = payload_of()
    page = np.empty(PAGE_BYTES, dtype=np.uint8)
    codec.pack(page, 4, 9, payload_crc(payload), b"", True)
    kinds = {
        "not valid": codec.verify(page, 0, payload, 4, False, 9, True),
        "block": codec.verify(page, 0, payload, 5, True, 9, True),
        "generation": codec.verify(page, 0, payload, 4, True, 10, True),
    }
    assert {k: (e.kind if e else None) for k, e in kinds.items()} == {
        "not valid": DiskErrorKind.NOT_VALID, "block": DiskErrorKind.BLOCK_MISMATCH,
        "generation": DiskErrorKind.GENERATION_MISMATCH}
    payload[0] ^= 1
    error = codec.verify(page, 0, payload, 4, True, 9, True)
    assert error is not None and error.kind == DiskErrorKind.CHECKSUM_MISMATCH
    # a tier with checksum off still checks a record written with one (a crash may have cut it)
    error = codec.verify(page, 0, payload, 4, True, 9, False)
    assert error is not None and error.kind == DiskErrorKind.CHECKSUM_MISMATCH
    codec.pack(page, 4, 9, 0, b"", False)  # written without one: nothing to check the payload by
    assert codec.verify(page, 0, payload, 4, True, 9, False) is None
    assert codec.verify(page, 0, payload, 4, True, 9, True) is not None  # a checking tier refuses it
    other = RecordCodec(file_id=2, record_bytes=RECORD, path="t")
    error = other.verify(page, 0, payload, 4, True, 9, False)
    assert error is not None and error.kind == DiskErrorKind.HEADER_INVALID


def test_pack_header_overwrites_the_whole_page() -> None:
    page = np.full(PAGE_BYTES, 0xFF, dtype=np.uint8)
    payload = np.zeros(RECORD, dtype=np.uint8)
    pack_header(page, file_id=0, block=0, generation=1, crc=payload_crc(payload), payload_bytes=RECORD,
                key=b"k", fingerprint=b"f")
    assert not page[FINGERPRINT_OFFSET + 3 : HEADER_CRC_OFFSET].any()
    assert verify_record(page, payload, Expected(RECORD, fingerprint=b"f", key=b"k", generation=1)).fault is None


def test_the_payload_crc_is_zlibs_crc32_whoever_computes_it() -> None:
    payload = payload_of(9)
    assert payload_crc(payload) == zlib.crc32(payload.tobytes())
    assert record.CRC32_IMPLEMENTATION in ("isal", "zlib")


def test_a_records_fingerprint_that_is_not_utf8_is_refused_by_name() -> None:
    """The disk and remote tiers' one check (each had its own, which raised a bare
    UnicodeEncodeError for a lone surrogate)."""
    from kvoffload.disk.format import check_fingerprint as disk_check
    from kvoffload.errors import InvalidArgumentError
    from kvoffload.remote._args import check_fingerprint as remote_check

    assert disk_check is remote_check
    with pytest.raises(InvalidArgumentError, match=r"fingerprint = '\\ud800' is not valid UTF-8"):
        disk_check("\ud800")
