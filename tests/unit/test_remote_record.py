"""The remote record format: the disk tier's header layout, every field verified, in order."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np
import pytest

from kvoffload.remote import RemoteErrorKind
from kvoffload.remote._record import (
    FINGERPRINT_OFFSET,
    HEADER_CRC_OFFSET,
    KEY_OFFSET,
    PAGE_BYTES,
    RECORD_HEADER,
    RECORD_MAGIC,
    check_record,
    pack_header,
    payload_crc,
)

U8 = np.ndarray[Any, np.dtype[np.uint8]]
RECORD = 2 * PAGE_BYTES


def make(key: bytes = b"key", generation: int = 7, fingerprint: bytes = b"fp") -> tuple[U8, U8]:
    payload = np.random.default_rng(3).integers(0, 256, RECORD, dtype=np.uint8)
    page = np.empty(PAGE_BYTES, dtype=np.uint8)
    pack_header(page, key=key, generation=generation, crc=payload_crc(payload), payload_bytes=RECORD,
                fingerprint=fingerprint)
    return page, payload


def check(page: U8, payload: U8, **kw: Any) -> RemoteErrorKind | None:
    args: dict[str, Any] = {"key": b"key", "fingerprint": b"fp", "expected_generation": None} | kw
    return check_record(page, payload, **args).kind


def reseal(page: U8) -> None:
    struct.pack_into("<I", page.data, HEADER_CRC_OFFSET, zlib.crc32(page[:HEADER_CRC_OFFSET].tobytes()))


def test_the_header_has_the_disk_record_layout() -> None:
    assert RECORD_HEADER.format == "<8sIIQQQQIH" and RECORD_MAGIC == b"KVOFREC1"
    assert (KEY_OFFSET, HEADER_CRC_OFFSET) == (54, 4092)
    page, _ = make()
    magic, version, flags, file_id, block, generation, nbytes, _crc, key_len = RECORD_HEADER.unpack_from(page.data)
    assert (magic, version, flags, file_id, block, generation, nbytes, key_len) == (
        b"KVOFREC1", 1, 7, 0, 0, 7, RECORD, 3)
    assert page[KEY_OFFSET : KEY_OFFSET + 3].tobytes() == b"key"
    assert page[FINGERPRINT_OFFSET : FINGERPRINT_OFFSET + 4].tobytes() == b"\x02\x00fp"


def test_a_record_verifies_and_reports_its_generation() -> None:
    page, payload = make(generation=42)
    result = check_record(page, payload, key=b"key", fingerprint=b"fp", expected_generation=42)
    assert result.kind is None and result.generation == 42
    assert check(page, payload) is None


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        (lambda p, d: p.__setitem__(0, ord("X")), RemoteErrorKind.HEADER_INVALID),  # magic
        (lambda p, d: p.__setitem__(100, 1), RemoteErrorKind.HEADER_INVALID),  # CRC no longer matches
        (lambda p, d: p.fill(0), RemoteErrorKind.HEADER_INVALID),
        (lambda p, d: d.__setitem__(5, d[5] ^ 1), RemoteErrorKind.CHECKSUM_MISMATCH),
    ],
)
def test_damage_is_detected(damage: Any, kind: RemoteErrorKind) -> None:
    page, payload = make()
    damage(page, payload)
    assert check(page, payload) is kind


def test_a_resealed_header_with_another_version_or_origin_is_invalid() -> None:
    page, payload = make()
    struct.pack_into("<I", page.data, 8, 2)
    reseal(page)
    assert check(page, payload) is RemoteErrorKind.HEADER_INVALID
    page, payload = make()
    struct.pack_into("<Q", page.data, 16, 99)  # a disk record's file id
    reseal(page)
    assert check(page, payload) is RemoteErrorKind.HEADER_INVALID


def test_each_identity_field_is_checked() -> None:
    page, payload = make()
    assert check(page, payload, fingerprint=b"other") is RemoteErrorKind.FINGERPRINT_MISMATCH
    assert check(page, payload, key=b"kez") is RemoteErrorKind.KEY_MISMATCH
    assert check(page, payload, expected_generation=8) is RemoteErrorKind.GENERATION_MISMATCH
    assert check(page, payload[:PAGE_BYTES]) is RemoteErrorKind.SIZE_MISMATCH


def test_pack_header_overwrites_the_whole_page() -> None:
    page = np.full(PAGE_BYTES, 0xFF, dtype=np.uint8)
    payload = np.zeros(RECORD, dtype=np.uint8)
    pack_header(page, key=b"k", generation=1, crc=payload_crc(payload), payload_bytes=RECORD, fingerprint=b"f")
    assert not page[FINGERPRINT_OFFSET + 3 : HEADER_CRC_OFFSET].any()
    assert check_record(page, payload, key=b"k", fingerprint=b"f", expected_generation=1).kind is None
