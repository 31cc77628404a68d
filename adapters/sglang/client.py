"""SGLang's HTTP calls around a weight update, as an async client (`SGLangClient`).

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
HTTP is httpx's (`AsyncClient`, the `[sglang]` extra), one connection per call: a client
holds no connection between calls, so it is usable from any event loop.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlencode, urlsplit

import httpx

from .errors import SGLangError, SGLangTimeout, excerpt, sglang_message

MAX_BODY = 16 << 20  # the most an answer may hold

PauseMode = Literal["abort", "retract", "in_place"]
Selector = Literal["all", "target", "draft"]


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
        self._verify: ssl.SSLContext | bool = ssl_context or True
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
            why = f"answered with a body that is not JSON: {excerpt(body)}"
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
        headers = {"Accept": "application/json", "User-Agent": "weightwire"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = None
        if payload is not None or method == "POST":
            headers["Content-Type"] = "application/json"
            body = b"" if payload is None else json.dumps(payload).encode()
        try:
            async with (
                asyncio.timeout(limit),
                httpx.AsyncClient(timeout=limit, verify=self._verify, trust_env=False) as http,
                http.stream(method, url, content=body, headers=headers) as resp,
            ):
                status, data = resp.status_code, await _read(resp)
        except (TimeoutError, httpx.TimeoutException):
            raise SGLangTimeout(
                call, method, url, None, f"no complete answer within {limit:g} s"
            ) from None
        except (httpx.RemoteProtocolError, httpx.DecodingError, _TooLarge) as exc:
            why = (
                "connection closed mid-answer"
                if "disconnected" in str(exc) or "incomplete" in str(exc).lower()
                else f"broken HTTP answer: {exc}"
            )
            raise SGLangError(call, method, url, None, why) from None
        except httpx.TransportError as exc:
            raise SGLangError(call, method, url, None, f"connection failed: {_root(exc)}") from None
        if not 200 <= status < 300:
            raise SGLangError(call, method, url, status, sglang_message(data))
        return status, data


def _root(exc: BaseException) -> str:
    """The innermost OS error's words ("Connect call failed ('10.0.0.1', 30000)"): httpx
    and anyio wrap it in "All connection attempts failed"."""
    why, seen = str(exc), 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, OSError) and cur.errno is not None:
            why = cur.strerror or str(cur)
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return why


class _TooLarge(Exception):
    pass


async def _read(resp: httpx.Response) -> bytes:
    """The whole body, refusing one over MAX_BODY before holding it."""
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise _TooLarge(f"content-length {declared}, over {MAX_BODY} bytes")
    chunks, total = [], 0
    async for chunk in resp.aiter_bytes():
        total += len(chunk)
        if total > MAX_BODY:
            raise _TooLarge(f"body over {MAX_BODY} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))
