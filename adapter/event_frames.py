"""SageMaker's response stream, played locally: a container answer framed as
InvokeEndpointWithResponseStream delivers it, so boto3's `sagemaker-runtime` client pointed
at a local `serve` (`endpoint_url`) streams unchanged, as its InvokeEndpoint already does
through `/endpoints/{name}/invocations`.

The stream is AWS's binary event stream (`application/vnd.amazon.eventstream`): a run of
messages, each a prelude (total length and headers length, big-endian uint32, then the
CRC32 of those 8 bytes), the headers (name length, name, type 7 = string, value length,
value), the payload, and the CRC32 of everything before it. Each piece of the container's
body becomes a `PayloadPart` event whose payload is the raw bytes (its one member, `Bytes`,
is the event payload), and the container's content type travels in the answer's
`X-Amzn-SageMaker-Content-Type`. Pure: the HTTP layer imports it without llama.cpp.
"""

from __future__ import annotations

import binascii
import struct
from collections.abc import Mapping

MEDIA_TYPE = "application/vnd.amazon.eventstream"
CONTENT_TYPE_HEADER = "x-amzn-sagemaker-content-type"
_STRING = 7  # the header value type of a string


def frame(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One event-stream message."""
    encoded = b"".join(
        struct.pack("!B", len(name))
        + name.encode()
        + struct.pack("!BH", _STRING, len(value))
        + value.encode()
        for name, value in headers.items()
    )
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack("!II", total, len(encoded))
    message = prelude + struct.pack("!I", binascii.crc32(prelude)) + encoded + payload
    return message + struct.pack("!I", binascii.crc32(message))


def payload_part(data: bytes) -> bytes:
    """A piece of the container's answer as a `PayloadPart` event."""
    headers = {
        ":event-type": "PayloadPart",
        ":message-type": "event",
        ":content-type": "application/octet-stream",
    }
    return frame(headers, data)
