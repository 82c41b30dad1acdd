"""Request bodies read under a size cap and a silence timeout.

The cap is checked against `Content-Length` before a byte is read (413 at once), and again while
the body streams in, so a chunked body cannot grow past it either. A body that stalls for
`read_timeout` seconds between two pieces gets 408. A client that leaves while it uploads gets a
499 nobody reads (the connection is gone): a clean close, not an unhandled error. (Request headers
have their own deadline: server/http_protocol.py; a body still arriving when a shutdown's grace
period ends gets 503: server/shutdown.py.)
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from server.errors import body_timeout, body_too_large, client_closed, invalid_request


async def read_body(request: Request, max_bytes: int, read_timeout: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise invalid_request(f"Invalid Content-Length header: {declared!r}.", "content-length")
        if int(declared) > max_bytes:
            raise body_too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    pieces = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(pieces.__anext__(), read_timeout)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise body_timeout(read_timeout) from None
        except ClientDisconnect:
            raise client_closed() from None
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)
