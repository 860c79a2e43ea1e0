"""HAProxy's Stream Processing Offload Protocol (SPOP 2.0), the part the route agent speaks: frames, varints and
typed data (HAProxy's doc/SPOE.txt, section 3).

A frame on the wire is a 4-byte big-endian length, then: type (1 byte), flags (4 bytes big-endian; bit 0 FIN,
bit 1 ABORT), stream id and frame id (varints), then the payload: a KV-LIST (HELLO, DISCONNECT), a list of messages
(NOTIFY: name, argument count, KV-LIST) or a list of actions (ACK: set-var / unset-var). Integers use HAProxy's
varint: one byte below 240, else the low 4 bits with 0xF0 set, then 7 bits per byte while the high bit is set.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from enum import IntEnum

VERSION = "2.0"
# The agent handles several frames per connection at once, answering each when its decision is made.
CAPABILITIES = "pipelining,async"
FLAG_FIN = 1
LENGTH = struct.Struct(">I")
FLAGS = struct.Struct(">I")
# Variable scope of a set-var action: the transaction, which the Lua action reads.
SCOPE_TRANSACTION = 2
ACTION_SET_VAR = 1


class FrameType(IntEnum):
    HAPROXY_HELLO = 1
    HAPROXY_DISCONNECT = 2
    NOTIFY = 3
    AGENT_HELLO = 101
    AGENT_DISCONNECT = 102
    ACK = 103


class DataType(IntEnum):
    NULL = 0
    BOOL = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    IPV4 = 6
    IPV6 = 7
    STRING = 8
    BINARY = 9


class Status(IntEnum):
    """SPOP's error codes an agent may send in AGENT-DISCONNECT."""

    NORMAL = 0
    IO = 1
    TIMEOUT = 2
    TOO_BIG = 3
    INVALID = 4
    NO_VSN = 5
    NO_FRAME_SIZE = 6
    NO_CAP = 7
    BAD_VSN = 8
    BAD_FRAME_SIZE = 9
    FRAG_NOT_SUPPORTED = 10
    INTERLACED_FRAMES = 11
    FRAMEID_NOTFOUND = 12
    RES = 13
    UNKNOWN = 99


class FrameError(ValueError):
    """A frame that does not decode; the agent answers AGENT-DISCONNECT with `status`."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


Value = None | bool | int | str | bytes
_FIXED = {DataType.IPV4: 4, DataType.IPV6: 16}


def encode_varint(value: int) -> bytes:
    if value < 240:
        return bytes((value,))
    out = bytearray(((value | 0xF0) & 0xFF,))
    value = (value - 240) >> 4
    while value >= 128:
        out.append((value | 0x80) & 0xFF)
        value = (value - 128) >> 7
    out.append(value)
    return bytes(out)


def decode_varint(data: bytes | memoryview, offset: int) -> tuple[int, int]:
    """The value at `offset`, and the offset after it."""
    try:
        value = data[offset]
        offset += 1
        if value < 240:
            return value, offset
        shift = 4
        while True:
            byte = data[offset]
            offset += 1
            value += byte << shift
            shift += 7
            if byte < 128:
                return value, offset
            if shift > 70:
                raise FrameError(Status.INVALID, "varint too long")
    except IndexError:
        raise FrameError(Status.INVALID, "truncated varint") from None


def encode_string(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return encode_varint(len(raw)) + raw


def decode_bytes(data: bytes | memoryview, offset: int) -> tuple[bytes, int]:
    if offset < len(data) and data[offset] < 240:  # every short string: its length in one byte
        length, offset = data[offset], offset + 1
    else:
        length, offset = decode_varint(data, offset)
    end = offset + length
    if end > len(data):
        raise FrameError(Status.INVALID, "string beyond the frame")
    return bytes(data[offset:end]), end


def encode_value(value: Value) -> bytes:
    """Typed data: NULL, BOOL (its value in the type byte's flag bits), UINT32/INT64, STRING or BINARY."""
    if value is None:
        return bytes((DataType.NULL,))
    if isinstance(value, bool):
        return bytes((DataType.BOOL | (0x10 if value else 0),))
    if isinstance(value, int):
        kind = DataType.UINT32 if 0 <= value < 2**32 else DataType.INT64
        return bytes((kind,)) + encode_varint(value if value >= 0 else value + 2**64)
    if isinstance(value, str):
        return bytes((DataType.STRING,)) + encode_string(value)
    return bytes((DataType.BINARY,)) + encode_string(value)


def decode_value(data: bytes | memoryview, offset: int) -> tuple[Value, int]:
    """One typed value: strings and binaries as bytes, addresses as raw bytes, integers as int."""
    if offset >= len(data):
        raise FrameError(Status.INVALID, "truncated typed data")
    type_byte = data[offset]
    kind = type_byte & 0x0F
    offset += 1
    if kind == DataType.STRING or kind == DataType.BINARY:
        return decode_bytes(data, offset)
    if kind == DataType.NULL:
        return None, offset
    if kind == DataType.BOOL:
        return bool(type_byte & 0x10), offset
    if kind in (DataType.INT32, DataType.UINT32, DataType.INT64, DataType.UINT64):
        value, offset = decode_varint(data, offset)
        if kind in (DataType.INT32, DataType.INT64) and value >= 2**63:
            value -= 2**64
        return value, offset
    if kind in _FIXED:
        end = offset + _FIXED[DataType(kind)]
        if end > len(data):
            raise FrameError(Status.INVALID, "address beyond the frame")
        return bytes(data[offset:end]), end
    raise FrameError(Status.INVALID, f"unknown data type {kind}")


def decode_kv_list(data: bytes | memoryview) -> dict[str, Value]:
    """Every name/value pair of `data`."""
    items: dict[str, Value] = {}
    offset = 0
    while offset < len(data):
        name, offset = decode_bytes(data, offset)
        items[name.decode("latin-1")], offset = decode_value(data, offset)
    return items


def encode_kv_list(items: dict[str, Value]) -> bytes:
    return b"".join(encode_string(name) + encode_value(value) for name, value in items.items())


@dataclass(frozen=True, slots=True)
class Frame:
    kind: int
    flags: int
    stream_id: int
    frame_id: int
    payload: bytes


def decode_frame(frame: bytes) -> Frame:
    """A frame without its length prefix."""
    if len(frame) < 7:
        raise FrameError(Status.INVALID, "frame shorter than its metadata")
    (flags,) = FLAGS.unpack_from(frame, 1)
    stream_id, offset = decode_varint(frame, 5)
    frame_id, offset = decode_varint(frame, offset)
    return Frame(frame[0], flags, stream_id, frame_id, frame[offset:])


_FIN_FLAGS = FLAGS.pack(FLAG_FIN)


def encode_frame(kind: FrameType, stream_id: int, frame_id: int, payload: bytes) -> bytes:
    ids = encode_varint(stream_id) + encode_varint(frame_id)
    return b"".join((LENGTH.pack(5 + len(ids) + len(payload)), bytes((kind,)), _FIN_FLAGS, ids, payload))


def decode_messages(payload: bytes | memoryview) -> dict[str, dict[str, Value]]:
    """A NOTIFY's messages: name -> its arguments by name."""
    messages: dict[str, dict[str, Value]] = {}
    offset = 0
    while offset < len(payload):
        name, offset = decode_bytes(payload, offset)
        if offset >= len(payload):
            raise FrameError(Status.INVALID, "message without its argument count")
        count = payload[offset]
        offset += 1
        arguments: dict[str, Value] = {}
        for _ in range(count):
            arg_name, offset = decode_bytes(payload, offset)
            arguments[arg_name.decode("latin-1")], offset = decode_value(payload, offset)
        messages[name.decode("latin-1")] = arguments
    return messages


@functools.cache
def _set_var_head(name: str) -> bytes:
    return bytes((ACTION_SET_VAR, 3, SCOPE_TRANSACTION)) + encode_string(name)


def set_var_actions(variables: dict[str, Value]) -> bytes:
    """An ACK's payload: a set-var action in the transaction's scope per variable (None values are left out)."""
    return b"".join(_set_var_head(name) + encode_value(value) for name, value in variables.items() if value is not None)
