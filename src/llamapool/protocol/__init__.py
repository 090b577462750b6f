"""Wire protocol: typed messages and the msgpack codec shared by client, router and worker."""

from llamapool.protocol.codec import ProtocolError, decode, encode
from llamapool.protocol.messages import PROTOCOL_VERSION, ErrorCode, SamplingParams

__all__ = ["PROTOCOL_VERSION", "ErrorCode", "ProtocolError", "SamplingParams", "decode", "encode"]
