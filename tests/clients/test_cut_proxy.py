"""The proxy the client libraries' tests cut connections with: a cut write
has committed but its caller hears UNAVAILABLE; a cut stream breaks."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from tests.clients.cut_proxy import cut_proxy
from tests.conftest import CALL_SECONDS, Running

SCOPE = pb.Scope(agent_id="agent", user_id="user")
# The clients' own bound (clients/README.md: 4 attempts).
RETRIES = 4
T = TypeVar("T")


def test_a_cut_answer_reaches_no_client_but_the_write_is_stored(sidecar: Running) -> None:
    with cut_proxy(sidecar.addresses.api) as proxy, grpc.insecure_channel(proxy.address) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        request = pb.AddMemoryRequest(scope=SCOPE, content="uses uv", idempotency_key="k1")
        proxy.arm("headers")
        with pytest.raises(grpc.RpcError) as cut:
            stub.AddMemory(request, timeout=CALL_SECONDS)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proxy.cuts == 1
        retried = _retried(lambda: stub.AddMemory(request, timeout=CALL_SECONDS))
        assert not retried.created
        assert proxy.cuts == 1
    stored = sidecar.list(scope=SCOPE)
    assert [m.content for m in stored.memories] == ["uses uv"]


def _retried(call: Callable[[], T]) -> T:
    """The call again, as a client retries it: the channel may send the
    first retry on the cut connection before it has seen it close
    ("Stream removed"), which is UNAVAILABLE again, and the next on a new one."""
    for _ in range(RETRIES - 1):
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
    return call()


def test_a_cut_stream_breaks_after_what_was_sent(sidecar: Running) -> None:
    for n in range(3):
        sidecar.add(f"note {n}", scope=SCOPE)
    with cut_proxy(sidecar.addresses.api) as proxy, grpc.insecure_channel(proxy.address) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        proxy.arm("data")
        stream = stub.ExportMemories(pb.ExportMemoriesRequest(scope=SCOPE), timeout=CALL_SECONDS)
        with pytest.raises(grpc.RpcError) as cut:
            list(stream)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_control_socket_arms_and_counts(sidecar: Running) -> None:
    with cut_proxy(sidecar.addresses.api) as proxy:
        host, _, port = proxy.control_address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=CALL_SECONDS) as control:
            lines = control.makefile("rw", encoding="ascii", newline="\n")
            for command, answer in (("arm headers 1", "ok"), ("cuts", "0"), ("nonsense", "error")):
                lines.write(command + "\n")
                lines.flush()
                assert lines.readline().startswith(answer)
        channel = grpc.insecure_channel(proxy.address)
        with channel:
            stub = pb_grpc.MemoryServiceStub(channel)
            with pytest.raises(grpc.RpcError):
                stub.GetMemories(pb.GetMemoriesRequest(scope=SCOPE), timeout=CALL_SECONDS)
        assert proxy.cuts == 1
