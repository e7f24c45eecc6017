"""MooncakeConfig's checks (no Mooncake package needed): every bad field is a typed error naming it,
raised at construction, before a client is made. Values that reached the client unchecked made its
set-up raise an untyped ``TypeError`` (a size past a C ``size_t``) or retry for minutes holding the
GIL (an unknown protocol)."""

from __future__ import annotations

import socket
import sys
import time
from typing import Any, cast

import numpy as np
import pytest

from kvoffload.errors import InvalidArgumentError, RemoteUnavailableError
from kvoffload.remote import MooncakeConfig
from kvoffload.remote.mooncake import MAX_SIZE_BYTES, PROTOCOLS, MooncakeStore


@pytest.mark.parametrize(("field", "value", "match"), [
    ("local_buffer_bytes", 2**70, r"local_buffer_bytes = .* must be in 0 \.\. "),
    ("global_segment_bytes", 2**64, r"global_segment_bytes = .* must be in 0 \.\. "),
    ("global_segment_bytes", -1, r"global_segment_bytes = -1 must be in 0 \.\. "),
    ("protocol", "bogus", r"protocol = 'bogus' must be one of \('tcp', 'rdma'\)"),
    ("setup_timeout_s", 0, r"setup_timeout_s = 0 must be finite and > 0 seconds"),
    ("setup_timeout_s", -1, r"setup_timeout_s = -1 must be finite and > 0 seconds"),
    ("master_address", "10.0.0.5", r"master_address = '10.0.0.5' must be host:port"),
    ("master_address", "10.0.0.5:0", r"must be host:port"),
    ("master_address", "10.0.0.5:99999", r"must be host:port"),
    ("master_address", ":50051", r"must be host:port"),
    ("master_address", " h :5", r"must be host:port \(a host without spaces"),  # accepted before
    ("master_address", "h:\u0665", r"a port of ASCII digits"),  # an Arabic-Indic 5, accepted before
])
def test_a_bad_field_is_refused_at_construction(field: str, value: Any, match: str) -> None:
    kwargs: dict[str, Any] = {"master_address": "127.0.0.1:50051", field: value}
    with pytest.raises(InvalidArgumentError, match=match):
        MooncakeConfig(**kwargs)


def test_good_values_pass() -> None:
    for protocol in PROTOCOLS:
        MooncakeConfig("127.0.0.1:50051", protocol=protocol, global_segment_bytes=MAX_SIZE_BYTES)
    MooncakeConfig("[::1]:50051")
    MooncakeConfig("mooncake-master.cluster.local:50051", setup_timeout_s=0.5)


def test_an_unreachable_master_is_refused_within_the_set_up_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's set-up holds the GIL for about 90 s against a closed port, so the store checks
    that the master can be reached first, within ``setup_timeout_s``. The client itself is never
    made here: a module standing in for the package would fail the test if it were."""
    class NeverMade:
        def MooncakeDistributedStore(self) -> None:  # noqa: N802 - the package's name
            raise AssertionError("the client was made although the master cannot be reached")

    monkeypatch.setitem(sys.modules, "mooncake", NeverMade())
    monkeypatch.setitem(sys.modules, "mooncake.store", NeverMade())
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match=r"master at 127\.0\.0\.1:\d+ cannot be reached within 2 s"):
        MooncakeStore.create(MooncakeConfig(f"127.0.0.1:{port}", setup_timeout_s=2.0),
                             host_rows=np.zeros((1, 4096), np.uint8), fingerprint="f")
    assert time.monotonic() - began < 2.5


@pytest.mark.parametrize("value", [0, -1, float("nan")])
def test_every_remote_deadline_says_it_must_be_over_zero(value: float) -> None:
    """(A deadline of -1 was told it "must be >= 0" though 0 is refused too.)"""
    from kvoffload.remote import RedisClusterConfig, RemoteConfig
    from kvoffload.testing import MemoryCluster

    with pytest.raises(InvalidArgumentError, match=rf"RemoteConfig\.job_timeout_s = {value!r} must be "
                       r"finite and > 0 seconds"):
        RemoteConfig(store=MemoryCluster().factory, job_timeout_s=value)
    for name in ("socket_timeout_s", "connect_timeout_s", "setup_timeout_s"):
        with pytest.raises(InvalidArgumentError, match=rf"RedisClusterConfig\.{name} = {value!r} must be "
                           r"finite and > 0 seconds"):
            RedisClusterConfig(nodes=[("127.0.0.1", 7000)], **cast(Any, {name: value}))
