"""Decoding the google.rpc.Status the daemon puts in a failed call's trailers.

The client depends on grpcio and protobuf only. googleapis-common-protos
(where google.rpc.Status and ErrorInfo usually come from) arrives with
grpcio-status, which this package does not require; so the two messages are
declared here with the same field numbers, in a descriptor pool of their own.
A private pool never clashes with googleapis-common-protos' google.rpc types
when a program has both loaded, and the wire format knows no message names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

STATUS_TRAILER = "grpc-status-details-bin"
ERROR_INFO_TYPE = "google.rpc.ErrorInfo"

_F = descriptor_pb2.FieldDescriptorProto


def _field(
    name: str, number: int, kind: int, *, repeated: bool = False, type_name: str = ""
) -> descriptor_pb2.FieldDescriptorProto:
    field = _F(name=name, number=number)
    field.type = kind  # type: ignore[assignment]
    field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    if type_name:  # set only for messages: an empty one still counts as set
        field.type_name = type_name
    return field


def _messages() -> tuple[Any, Any]:
    """The classes of Status {code = 1, message = 2, repeated Any details = 3}
    and ErrorInfo {reason = 1, domain = 2, map<string, string> metadata = 3}."""
    file = descriptor_pb2.FileDescriptorProto(
        name="memory_sidecar_client/status.proto", package="memory_sidecar_client", syntax="proto3"
    )
    detail = file.message_type.add(name="Detail")  # google.protobuf.Any's layout
    detail.field.extend([_field("type_url", 1, _F.TYPE_STRING), _field("value", 2, _F.TYPE_BYTES)])
    status = file.message_type.add(name="Status")
    status.field.extend(
        [
            _field("code", 1, _F.TYPE_INT32),
            _field("message", 2, _F.TYPE_STRING),
            _field(
                "details",
                3,
                _F.TYPE_MESSAGE,
                repeated=True,
                type_name=".memory_sidecar_client.Detail",
            ),
        ]
    )
    info = file.message_type.add(name="ErrorInfo")
    entry = info.nested_type.add(name="MetadataEntry")
    entry.options.map_entry = True
    entry.field.extend([_field("key", 1, _F.TYPE_STRING), _field("value", 2, _F.TYPE_STRING)])
    info.field.extend(
        [
            _field("reason", 1, _F.TYPE_STRING),
            _field("domain", 2, _F.TYPE_STRING),
            _field(
                "metadata",
                3,
                _F.TYPE_MESSAGE,
                repeated=True,
                type_name=".memory_sidecar_client.ErrorInfo.MetadataEntry",
            ),
        ]
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("memory_sidecar_client.Status")),
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("memory_sidecar_client.ErrorInfo")
        ),
    )


_Status, _ErrorInfo = _messages()


def error_info(
    trailers: Iterable[tuple[str, str | bytes]] | None,
) -> tuple[str, str, dict[str, str]]:
    """(reason, domain, metadata) of the first ErrorInfo in the trailers;
    empty when there is none (a cut connection, a proxy's answer)."""
    for key, value in trailers or ():
        if key != STATUS_TRAILER or not isinstance(value, bytes):
            continue
        status = _Status.FromString(value)
        for detail in status.details:
            if detail.type_url.rpartition("/")[2] == ERROR_INFO_TYPE:
                info = _ErrorInfo.FromString(detail.value)
                return info.reason, info.domain, dict(info.metadata)
    return "", "", {}
