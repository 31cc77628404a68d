"""SGLang's HTTP calls around a weight update, as an async client, and the whole sequence.

The endpoints, methods and payloads are SGLang 0.5.23's
(``sglang/srt/entrypoints/http_server.py``, request structs in
``sglang/srt/managers/io_struct.py``):

- ``POST /pause_generation`` ``{"mode": "abort"|"retract"|"in_place"}``
  -> 200 ``{"message", "status": "ok"}``
- ``POST /flush_cache?timeout=<s>`` (how long SGLang may wait for idle; no body)
  -> 200 text, or 400 text saying why not
- ``POST /begin_weight_update`` ``{"selector": "all"|"target"|"draft"}``
  -> 200/400 ``{"success", "message"}``
- ``POST /end_weight_update`` ``{}`` -> 200/400 ``{"success", "message"}``
- ``POST /update_weight_version`` ``{"new_version": str, "abort_all_requests": bool}``
  -> 200/400 ``{"success", "message"}``
- ``POST /continue_generation`` ``{"torch_empty_cache": bool}``
  -> 200 ``{"message", "status": "ok"}``
- ``GET /model_info`` -> 200 JSON with ``weight_version``; ``GET /health`` -> 200

Admin keys: ``Authorization: Bearer <key>`` (SGLang's ``--admin-api-key``, or ``--api-key``
when only that is set). Every call has a timeout; every failure raises `SGLangError` (a
`WeightwireError`) naming the call, the method and URL, the HTTP status and SGLang's own
message (or why no answer came: connection refused, timeout, a broken response).
Standard library only: asyncio streams, HTTP/1.1, one connection per call.

`update_weights` runs the sequence LMSYS published for P2P weight sync around one
weightwire version, on any number of SGLang servers at once::

    pause_generation -> flush_cache -> begin_weight_update -> transfer (the caller's:
    returns once the version has landed everywhere) -> end_weight_update
    -> update_weight_version -> continue_generation

and on any failure closes the weight-update session, continues generation and re-raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlencode, urlsplit

from weightwire.protocol.errors import ErrorCode, WeightwireError

PauseMode = Literal["abort", "retract", "in_place"]
Selector = Literal["all", "target", "draft"]
MAX_BODY = 16 << 20


class SGLangError(WeightwireError):
    """An SGLang HTTP call failed. `call` (e.g. "begin_weight_update"), `url`, `status`
    (None when no HTTP answer came) and `reason` (SGLang's message, or what went wrong)."""

    code = ErrorCode.INTERNAL

    def __init__(
        self,
        call: str,
        method: str,
        url: str,
        status: int | None,
        reason: str,
        *,
        code: ErrorCode | None = None,
    ) -> None:
        self.call, self.method, self.url, self.status, self.reason = (
            call,
            method,
            url,
            status,
            reason,
        )
        what = f"HTTP {status}: {reason}" if status is not None else reason
        if code is None and status is not None:
            code = (
                ErrorCode.UNAUTHORIZED
                if status in (401, 403)
                else ErrorCode.INVALID
                if 400 <= status < 500
                else ErrorCode.INTERNAL
            )
        super().__init__(f"SGLang {call} failed: {method} {url} -> {what}", code=code)


class SGLangTimeout(SGLangError):
    """An SGLang call gave no complete answer within its timeout."""

    code = ErrorCode.TIMEOUT


class SGLangClient:
    """One SGLang server's HTTP API (``url``: ``http://host:port``, optionally a path prefix).

    `timeout_s` is every call's default limit (connect, send, the whole answer); each
    method takes its own `timeout_s` too.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path.rstrip("/")
        self._netloc = parts.netloc.rpartition("@")[2]
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._ssl = ssl_context or ssl.create_default_context()
        self.api_key, self.timeout_s = api_key, timeout_s

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    # --- the calls ---------------------------------------------------------------------

    async def pause_generation(
        self, mode: PauseMode = "abort", *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Stop scheduling. "abort": abort and return every request (SGLang's default);
        "retract": running requests go back to the waiting queue (their KV cache is
        recomputed after); "in_place": requests stay where they are, with their KV cache
        (flush_cache then fails while any is running)."""
        return await self._json(
            "pause_generation", "POST", "/pause_generation", {"mode": mode}, timeout_s
        )

    async def flush_cache(self, *, wait_s: float = 0.0, timeout_s: float | None = None) -> str:
        """Flush the radix (prefix) cache; `wait_s` is SGLang's ``timeout`` query: how
        long it may wait for running requests to finish. Returns SGLang's text."""
        query = {"timeout": _num(wait_s)}
        _, body = await self._call("flush_cache", "POST", "/flush_cache", None, query, timeout_s)
        return body.decode(errors="replace").strip()

    async def begin_weight_update(
        self, selector: Selector = "all", *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Open the weight-update session (restores in-place-packed weights so that
        writes from outside land in the loadable layout)."""
        return await self._session(
            "begin_weight_update", "/begin_weight_update", {"selector": selector}, timeout_s
        )

    async def end_weight_update(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Close the session: post_load_weights (derived tensors, e.g. MLA w_kc/w_vc) when
        no load_weights ran in it, then every quant method's post-processing."""
        return await self._session("end_weight_update", "/end_weight_update", {}, timeout_s)

    async def update_weight_version(
        self,
        new_version: str | int,
        *,
        abort_all_requests: bool = True,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Set the weight version SGLang reports (`model_info`, and in responses).
        `abort_all_requests` is SGLang's default (True): it aborts every request first,
        retracted or paused ones included; `update_weights` sends False."""
        payload = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return await self._session(
            "update_weight_version", "/update_weight_version", payload, timeout_s
        )

    async def continue_generation(
        self, *, torch_empty_cache: bool = True, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Resume scheduling (first returning cached CUDA blocks to the driver, by default)."""
        payload = {"torch_empty_cache": torch_empty_cache}
        return await self._json(
            "continue_generation", "POST", "/continue_generation", payload, timeout_s
        )

    async def model_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """GET /model_info: model path, ``weight_version``, ..."""
        return await self._json("model_info", "GET", "/model_info", None, timeout_s)

    async def health(self, *, timeout_s: float | None = None) -> None:
        """GET /health: returns once the server answers 200."""
        await self._call("health", "GET", "/health", None, None, timeout_s)

    # --- plumbing ----------------------------------------------------------------------

    async def _session(
        self, call: str, path: str, payload: dict[str, Any], timeout_s: float | None
    ) -> dict[str, Any]:
        """A call answering {"success", "message"}: success false is a failure too."""
        url = self._url(path, None)
        reply = await self._json(call, "POST", path, payload, timeout_s)
        if reply.get("success") is False:
            raise SGLangError(call, "POST", url, 200, str(reply.get("message") or reply))
        return reply

    async def _json(
        self,
        call: str,
        method: str,
        path: str,
        payload: dict[str, Any] | None,
        timeout_s: float | None,
    ) -> dict[str, Any]:
        status, body = await self._call(call, method, path, payload, None, timeout_s)
        try:
            reply = json.loads(body) if body.strip() else {}
        except ValueError:
            why = f"answered with a body that is not JSON: {_excerpt(body)}"
            raise SGLangError(call, method, self._url(path, None), status, why) from None
        return reply if isinstance(reply, dict) else {"reply": reply}

    def _url(self, path: str, query: Mapping[str, str] | None) -> str:
        return f"{self.url}{path}" + (f"?{urlencode(query)}" if query else "")

    async def _call(
        self,
        call: str,
        method: str,
        path: str,
        payload: dict[str, Any] | None,
        query: Mapping[str, str] | None,
        timeout_s: float | None,
    ) -> tuple[int, bytes]:
        """One request on a fresh connection; (status, body) of a 2xx answer."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        url = self._url(path, query)
        target = f"{self._prefix}{path}" + (f"?{urlencode(query)}" if query else "")
        body = b"" if payload is None else json.dumps(payload).encode()
        head = [
            f"{method} {target} HTTP/1.1",
            f"Host: {self._netloc}",
            "User-Agent: weightwire",
            "Accept: application/json",
            "Connection: close",
        ]
        if payload is not None or method == "POST":
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(limit):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, ssl=self._ssl
                )
                writer.write(request)
                await writer.drain()
                status, resp = await _read_response(reader)
        except TimeoutError:
            raise SGLangTimeout(
                call, method, url, None, f"no complete answer within {limit:g} s"
            ) from None
        except _BadResponse as exc:
            raise SGLangError(call, method, url, None, f"broken HTTP answer: {exc}") from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            why = (
                "connection closed mid-answer"
                if isinstance(exc, asyncio.IncompleteReadError)
                else f"connection failed: {exc.strerror or exc}"
            )
            raise SGLangError(call, method, url, None, why) from None
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)
        if not 200 <= status < 300:
            raise SGLangError(call, method, url, status, _sglang_message(resp))
        return status, resp


class _BadResponse(Exception):
    pass


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    line = await reader.readline()
    parts = line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise _BadResponse(f"status line {line[:80]!r}")
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
            raise _BadResponse(f"header line {raw[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        total = 0
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise _BadResponse(f"chunk size {size_line[:40]!r}") from None
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                break
            total += size
            if total > MAX_BODY:
                raise _BadResponse(f"body over {MAX_BODY} bytes")
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
        return status, b"".join(chunks)
    if "content-length" in headers:
        try:
            n = int(headers["content-length"])
        except ValueError:
            raise _BadResponse(f"content-length {headers['content-length']!r}") from None
        if not 0 <= n <= MAX_BODY:
            raise _BadResponse(f"content-length {n}")
        return status, await reader.readexactly(n)
    body = await reader.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise _BadResponse(f"body over {MAX_BODY} bytes")
    return status, body


def _excerpt(body: bytes, n: int = 300) -> str:
    text = body.decode(errors="replace").strip()
    return text if len(text) <= n else text[:n] + "..."


def _sglang_message(body: bytes) -> str:
    """SGLang's own words from an error answer: JSON "message" / "error" / FastAPI's
    "detail" (validation errors listed), else the text itself."""
    text = body.decode(errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return _excerpt(body, 2000) or "(empty answer)"
    if isinstance(obj, dict):
        for key in ("message", "error", "detail"):
            value = obj.get(key)
            if isinstance(value, str) and value:
                return value
            if isinstance(value, dict) and isinstance(value.get("message"), str):
                return str(value["message"])
            if isinstance(value, list) and value:
                return "; ".join(
                    f"{'.'.join(str(x) for x in d.get('loc', []))}: {d.get('msg')}"
                    if isinstance(d, dict)
                    else str(d)
                    for d in value
                )
    return _excerpt(body, 2000)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# --------------------------------------------------------------------------- the sequence
@dataclass
class UpdateReport:
    """What `update_weights` did: the transfer's result and each step's seconds."""

    version: str
    result: Any = None
    seconds: dict[str, float] = field(default_factory=dict)
    paused_s: float = 0.0  # from pausing until generation continued


async def update_weights(
    engines: Sequence[SGLangClient],
    version: int | str,
    transfer: Callable[[], Awaitable[Any]],
    *,
    pause_mode: PauseMode = "abort",
    flush: bool | None = None,
    flush_wait_s: float = 0.0,
    weight_version: str | None = None,
    resume_on_failure: bool = True,
) -> UpdateReport:
    """One weight update on every engine: pause -> flush -> begin -> `transfer()` -> end ->
    update_weight_version -> continue, each step on all engines at once.

    `transfer` returns once `version` has landed in every engine rank: for weightwire,
    once every trainer rank's `publish(version)` has returned (each returns when all its
    writes landed), e.g. ``lambda: asyncio.to_thread(trainer.publish, step)``.
    `flush`: None = flush unless `pause_mode` is "in_place" (SGLang refuses to flush under
    requests paused in place). `weight_version`: default ``str(version)``.

    On a failure at any step it ends the weight-update session where one was opened
    (SGLang post-processes what landed), continues generation on every engine (unless
    `resume_on_failure` is False: they stay paused for a retry) and re-raises the first
    error; what went wrong in that cleanup is added to it as notes. After a failed
    transfer the engines serve whatever part of the version landed until a later version
    succeeds.
    """
    report = UpdateReport(version=weight_version or str(version))
    engines = list(engines)
    if not engines:
        raise ValueError("update_weights needs at least one engine")
    do_flush = pause_mode != "in_place" if flush is None else flush
    opened: set[int] = set()  # engines whose weight-update session is open
    t_pause = time.perf_counter()

    async def step(name: str, fn: Callable[[SGLangClient], Awaitable[Any]]) -> None:
        t0 = time.perf_counter()
        await _on_all(engines, fn)
        report.seconds[name] = time.perf_counter() - t0

    try:
        await step("pause_generation", lambda e: e.pause_generation(pause_mode))
        if do_flush:
            await step("flush_cache", lambda e: e.flush_cache(wait_s=flush_wait_s))

        async def begin(e: SGLangClient) -> None:
            await e.begin_weight_update()
            opened.add(id(e))

        await step("begin_weight_update", begin)
        t0 = time.perf_counter()
        report.result = await transfer()
        report.seconds["transfer"] = time.perf_counter() - t0

        async def end(e: SGLangClient) -> None:
            await e.end_weight_update()
            opened.discard(id(e))

        await step("end_weight_update", end)
        await step(
            "update_weight_version",
            lambda e: e.update_weight_version(report.version, abort_all_requests=False),
        )
        await step("continue_generation", lambda e: e.continue_generation())
    except BaseException as exc:
        still_open = [e for e in engines if id(e) in opened]
        if still_open:
            await _cleanup(exc, still_open, lambda e: e.end_weight_update())
        if resume_on_failure:
            await _cleanup(exc, engines, lambda e: e.continue_generation())
        raise
    report.paused_s = time.perf_counter() - t_pause
    return report


async def _on_all(
    engines: Sequence[SGLangClient], fn: Callable[[SGLangClient], Awaitable[Any]]
) -> None:
    """`fn` on every engine at once; the first failure is raised, the others as its notes."""
    results = await asyncio.gather(*(fn(e) for e in engines), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        first = errors[0]
        for other in errors[1:]:
            first.add_note(f"also: {other}")
        raise first


async def _cleanup(
    exc: BaseException,
    engines: Sequence[SGLangClient],
    fn: Callable[[SGLangClient], Awaitable[Any]],
) -> None:
    results = await asyncio.gather(*(fn(e) for e in engines), return_exceptions=True)
    for e, r in zip(engines, results, strict=True):
        if isinstance(r, BaseException):
            exc.add_note(f"while recovering on {e.url}: {r}")
