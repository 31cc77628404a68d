"""HTTP/1.1 on asyncio streams, as the SGLang client speaks it: one request on a fresh
connection, the answer read whole (Content-Length, chunked, or until close; at most
`MAX_BODY` bytes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from typing import Any

MAX_BODY = 16 << 20


class BadResponse(Exception):
    pass


def encode_request(
    method: str,
    target: str,
    netloc: str,
    payload: dict[str, Any] | None,
    api_key: str | None,
) -> bytes:
    """The request's bytes: `payload` as a JSON body (an empty one on any POST), the API
    key as a bearer token."""
    body = b"" if payload is None else json.dumps(payload).encode()
    head = [
        f"{method} {target} HTTP/1.1",
        f"Host: {netloc}",
        "User-Agent: weightwire",
        "Accept: application/json",
        "Connection: close",
    ]
    if payload is not None or method == "POST":
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def exchange(
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    request: bytes,
    limit: float,
) -> tuple[int, bytes]:
    """Connect, send `request`, read the answer, all within `limit` seconds (else
    TimeoutError); (status, body). The connection is closed either way."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(limit):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context)
            writer.write(request)
            await writer.drain()
            return await read_response(reader)
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    line = await reader.readline()
    parts = line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise BadResponse(f"status line {line[:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    while True:
        raw = await reader.readline()
        if not raw:
            raise asyncio.IncompleteReadError(b"", None)
        if raw in (b"\r\n", b"\n"):
            break
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep:
            raise BadResponse(f"header line {raw[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        total = 0
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise BadResponse(f"chunk size {size_line[:40]!r}") from None
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                break
            total += size
            if total > MAX_BODY:
                raise BadResponse(f"body over {MAX_BODY} bytes")
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
        return status, b"".join(chunks)
    if "content-length" in headers:
        try:
            n = int(headers["content-length"])
        except ValueError:
            raise BadResponse(f"content-length {headers['content-length']!r}") from None
        if not 0 <= n <= MAX_BODY:
            raise BadResponse(f"content-length {n}")
        return status, await reader.readexactly(n)
    body = await reader.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise BadResponse(f"body over {MAX_BODY} bytes")
    return status, body
