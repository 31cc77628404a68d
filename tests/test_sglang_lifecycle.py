"""The SGLang lifecycle client (weightwire.adapters.sglang.lifecycle) over real sockets.

A full SGLang server cannot run on these machines, neither the CPU CI machine nor the GPU
ones (/work/shared/ENVIRONMENT.md: its CUDA kernels do not fit what can be carried there),
so the server side here is a recording stand-in: a real asyncio HTTP/1.1 server that
implements the endpoints the client calls by SGLang 0.5.23's paths, methods, payloads and
answers (sglang/srt/entrypoints/http_server.py and the request structs in
sglang/srt/managers/io_struct.py: status codes, JSON or text bodies, FastAPI's 422 for an
invalid body, 401 from the API-key middleware, the weight-update session's "already open" /
"not open" refusals). It records every call in order, and can be told to fail a call or to
hang. tests/sglang/test_sglang_lifecycle_payloads.py (in .venv-sglang) holds the recorded
requests against SGLang's own route table and request structs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from weightwire.adapters.sglang.lifecycle import (
    SGLangClient,
    SGLangError,
    SGLangTimeout,
    update_weights,
)
from weightwire.protocol.errors import ErrorCode, WeightwireError

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


@dataclass
class Call:
    server: str
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    headers: dict[str, str]


@dataclass
class RecordingSGLang:
    """SGLang 0.5.23's lifecycle endpoints, recording each call (in `log`, shared)."""

    name: str
    log: list[Call] = field(default_factory=list)
    api_key: str | None = None
    fail: dict[str, tuple[int, Any]] = field(default_factory=dict)  # path -> status, body
    hang: set[str] = field(default_factory=set)
    chunked: bool = False
    running_in_place: bool = False  # requests paused in place: flush_cache refuses
    actions: dict[str, Callable[[], None]] = field(default_factory=dict)  # path -> run first
    session_open: bool = False
    paused: bool = False
    weight_version: str = "default"
    url: str = ""
    _server: asyncio.Server | None = None

    @property
    def calls(self) -> list[Call]:
        return [c for c in self.log if c.server == self.name]

    async def start(self) -> RecordingSGLang:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await reader.readline()).decode()
            method, target, _ = line.split(" ", 2)
            headers = {}
            while (raw := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = raw.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            raw_body = await reader.readexactly(int(headers.get("content-length", "0")))
            parts = urlsplit(target)
            body = json.loads(raw_body) if raw_body else None
            call = Call(self.name, method, parts.path, parse_qs(parts.query), body, headers)
            self.log.append(call)
            if parts.path in self.hang:
                await asyncio.sleep(3600)
            status, answer = self._answer(call)
            await self._send(writer, status, answer)
        except (asyncio.CancelledError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, status: int, answer: Any) -> None:
        if isinstance(answer, bytes):  # raw bytes: sent as they are (a broken server)
            writer.write(answer)
            await writer.drain()
            return
        if isinstance(answer, str):
            data, ctype = answer.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(answer).encode(), "application/json"
        head = f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\n"
        if self.chunked:
            mid = len(data) // 2
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (data[:mid], data[mid:]) if c)
            writer.write(
                f"{head}transfer-encoding: chunked\r\n\r\n".encode() + chunks + b"0\r\n\r\n"
            )
        else:
            writer.write(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()

    def _answer(self, c: Call) -> tuple[int, Any]:
        routes: dict[str, tuple[set[str], Callable[[Call], tuple[int, Any]]]] = {
            "/pause_generation": ({"POST"}, self._pause),
            "/continue_generation": ({"POST"}, self._continue),
            "/flush_cache": ({"GET", "POST"}, self._flush),
            "/begin_weight_update": ({"POST"}, self._begin),
            "/end_weight_update": ({"POST"}, self._end),
            "/update_weight_version": ({"POST"}, self._version),
            "/model_info": ({"GET"}, lambda c: (200, {"weight_version": self.weight_version})),
            "/health": ({"GET"}, lambda c: (200, "")),
        }
        authorized = c.headers.get("authorization") == f"Bearer {self.api_key}"
        if self.api_key and c.path != "/health" and not authorized:
            return 401, {"error": "Unauthorized"}
        if c.path not in routes:
            return 404, {"detail": "Not Found"}
        methods, fn = routes[c.path]
        if c.method not in methods:
            return 405, {"detail": "Method Not Allowed"}
        if c.path in self.fail:
            return self.fail[c.path]
        if c.path in self.actions:  # what the server does in its workers (other tests)
            try:
                self.actions[c.path]()
            except Exception as exc:
                return 500, {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        return fn(c)

    @staticmethod
    def _invalid(loc: str, msg: str) -> tuple[int, Any]:
        return 422, {"detail": [{"type": "value_error", "loc": ["body", loc], "msg": msg}]}

    def _pause(self, c: Call) -> tuple[int, Any]:
        mode = (c.body or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return self._invalid("mode", "Input should be 'abort', 'retract' or 'in_place'")
        self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, c: Call) -> tuple[int, Any]:
        self.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _flush(self, c: Call) -> tuple[int, Any]:
        timeout = float(c.query.get("timeout", ["0"])[0])
        if timeout < 0:
            return 422, {"detail": [{"loc": ["query", "timeout"], "msg": "must be >= 0"}]}
        if self.running_in_place:
            return 400, "Flush cache failed: there are running requests.\n"
        return 200, FLUSHED

    def _begin(self, c: Call) -> tuple[int, Any]:
        if self.session_open:
            msg = "a weight-update session is already open; call end_weight_update() first"
            return 400, {"success": False, "message": msg}
        self.session_open = True
        return 200, {"success": True, "message": "Success"}

    def _end(self, c: Call) -> tuple[int, Any]:
        if not self.session_open:
            msg = "no weight-update session is open; call begin_weight_update() first"
            return 400, {"success": False, "message": msg}
        self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def _version(self, c: Call) -> tuple[int, Any]:
        v = (c.body or {}).get("new_version")
        if not isinstance(v, str):
            return self._invalid("new_version", "Field required")
        self.weight_version = v
        return 200, {"success": True, "message": f"Weight version updated to {v}", "new_version": v}


def run(fn: Callable[..., Awaitable[Any]], n: int = 1, **kw: Any) -> Any:
    """Run `fn(*servers)` against `n` fresh recording servers sharing one call log."""

    async def main() -> Any:
        log: list[Call] = []
        servers = [await RecordingSGLang(f"s{i}", log, **kw).start() for i in range(n)]
        try:
            return await fn(*servers)
        finally:
            for s in servers:
                await s.stop()

    return asyncio.run(main())


def steps(calls: list[Call]) -> list[str]:
    return [c.path.lstrip("/") for c in calls]


# --------------------------------------------------------------------------- single calls
def test_each_call_sends_sglang_paths_and_payloads() -> None:
    async def body(s: RecordingSGLang) -> None:
        c = SGLangClient(s.url)
        assert await c.pause_generation("retract") == {
            "message": "Generation paused successfully.",
            "status": "ok",
        }
        assert await c.flush_cache(wait_s=2.5) == FLUSHED.strip()
        assert (await c.begin_weight_update())["success"] is True
        assert (await c.end_weight_update())["message"] == "Success"
        assert (await c.update_weight_version(12))["new_version"] == "12"
        await c.continue_generation(torch_empty_cache=False)
        assert (await c.model_info())["weight_version"] == "12"
        await c.health()
        got = [(x.method, x.path, x.query, x.body) for x in s.calls]
        assert got == [
            ("POST", "/pause_generation", {}, {"mode": "retract"}),
            ("POST", "/flush_cache", {"timeout": ["2.5"]}, None),
            ("POST", "/begin_weight_update", {}, {"selector": "all"}),
            ("POST", "/end_weight_update", {}, {}),
            (
                "POST",
                "/update_weight_version",
                {},
                {"new_version": "12", "abort_all_requests": True},
            ),
            ("POST", "/continue_generation", {}, {"torch_empty_cache": False}),
            ("GET", "/model_info", {}, None),
            ("GET", "/health", {}, None),
        ]
        assert all(x.headers["content-type"] == "application/json" for x in s.calls[:6])
        assert "authorization" not in s.calls[0].headers

    run(body)


def test_chunked_answers_and_a_path_prefix() -> None:
    async def body(s: RecordingSGLang) -> None:
        c = SGLangClient(s.url)
        assert (await c.begin_weight_update("target"))["success"] is True
        assert s.calls[-1].body == {"selector": "target"}
        with pytest.raises(SGLangError, match="HTTP 404: Not Found"):
            await SGLangClient(s.url + "/behind/router").health()
        assert s.calls[-1].path == "/behind/router/health"

    run(body, chunked=True)


# --------------------------------------------------------------------------- errors
def test_errors_name_the_call_the_url_the_status_and_sglangs_message() -> None:
    async def body(s: RecordingSGLang) -> None:
        c = SGLangClient(s.url)
        with pytest.raises(SGLangError) as err:
            await c.end_weight_update()
        e = err.value
        assert isinstance(e, WeightwireError) and e.code == ErrorCode.INVALID
        assert (e.call, e.method, e.url, e.status) == (
            "end_weight_update",
            "POST",
            f"{s.url}/end_weight_update",
            400,
        )
        assert e.reason == "no weight-update session is open; call begin_weight_update() first"
        assert str(e) == (
            f"[invalid] SGLang end_weight_update failed: POST {s.url}/end_weight_update -> "
            "HTTP 400: no weight-update session is open; call begin_weight_update() first"
        )
        # FastAPI's validation answer: each problem with where it is
        with pytest.raises(SGLangError, match=r"HTTP 422: body\.mode: Input should be 'abort'"):
            await c.pause_generation("halt")  # type: ignore[arg-type]
        # a plain-text refusal
        s.running_in_place = True
        with pytest.raises(SGLangError, match="HTTP 400: Flush cache failed: there are running"):
            await c.flush_cache()
        # a server error with an OpenAI-style body
        s.fail["/continue_generation"] = (500, {"error": {"message": "scheduler died"}})
        with pytest.raises(SGLangError) as err:
            await c.continue_generation()
        assert err.value.status == 500 and err.value.reason == "scheduler died"
        assert err.value.code == ErrorCode.INTERNAL
        # 200 with success false is a failure as well
        s.fail["/update_weight_version"] = (200, {"success": False, "message": "busy"})
        with pytest.raises(SGLangError, match=r"update_weight_version failed.*HTTP 200: busy"):
            await c.update_weight_version("3")
        # a broken answer
        s.fail["/model_info"] = (200, b"SPDY/9 what\r\n\r\n")
        with pytest.raises(SGLangError, match=r"model_info failed.*broken HTTP answer"):
            await c.model_info()
        # an answer larger than the client holds is refused before it is read
        s.fail["/model_info"] = (200, b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999\r\n\r\n{")
        with pytest.raises(SGLangError, match=r"broken HTTP answer: content-length 99999999999"):
            await c.model_info()
        s.fail["/model_info"] = (200, "<html>not json</html>")
        with pytest.raises(SGLangError, match="not JSON: <html>not json</html>"):
            await c.model_info()

    run(body)


def test_admin_key_and_unauthorized() -> None:
    async def body(s: RecordingSGLang) -> None:
        await SGLangClient(s.url, api_key="sekrit").pause_generation()
        assert s.calls[-1].headers["authorization"] == "Bearer sekrit"
        with pytest.raises(SGLangError) as err:
            await SGLangClient(s.url, api_key="wrong").begin_weight_update()
        assert err.value.status == 401 and err.value.reason == "Unauthorized"
        assert err.value.code == ErrorCode.UNAUTHORIZED

    run(body, api_key="sekrit")


def test_timeouts_and_unreachable_servers() -> None:
    async def body(s: RecordingSGLang) -> None:
        s.hang.add("/end_weight_update")
        c = SGLangClient(s.url, timeout_s=0.3)
        await c.begin_weight_update()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(SGLangTimeout) as err:
            await c.end_weight_update()
        assert 0.25 < asyncio.get_running_loop().time() - t0 < 2
        assert err.value.code == ErrorCode.TIMEOUT and err.value.status is None
        assert str(err.value) == (
            f"[timeout] SGLang end_weight_update failed: POST {s.url}/end_weight_update -> "
            "no complete answer within 0.3 s"
        )
        with pytest.raises(SGLangTimeout, match=r"within 0\.1 s"):
            await c.end_weight_update(timeout_s=0.1)  # per call
        await s.stop()
        with pytest.raises(
            SGLangError, match=r"pause_generation failed: POST .* connection failed: Connect"
        ):
            await c.pause_generation()

    run(body)


# --------------------------------------------------------------------------- the sequence
def test_update_weights_runs_the_sequence_on_every_engine() -> None:
    async def body(a: RecordingSGLang, b: RecordingSGLang) -> None:
        landed: list[str] = []

        async def transfer() -> str:
            # the writes land while both engines are paused, inside their sessions
            assert a.paused and b.paused and a.session_open and b.session_open
            landed.append("v7")
            return "published"

        engines = [SGLangClient(a.url), SGLangClient(b.url)]
        report = await update_weights(engines, 7, transfer)
        assert report.result == "published" and report.version == "7" and landed
        want = [
            "pause_generation",
            "flush_cache",
            "begin_weight_update",
            "end_weight_update",
            "update_weight_version",
            "continue_generation",
        ]
        assert steps(a.calls) == steps(b.calls) == want
        assert set(report.seconds) == {*want, "transfer"}
        assert report.paused_s >= sum(report.seconds.values()) * 0.99
        # every engine finishes a step before any starts the next
        order = [want.index(p) for p in steps(a.log)]
        assert order == sorted(order)
        assert a.calls[0].body == {"mode": "abort"}
        assert a.calls[4].body == {"new_version": "7", "abort_all_requests": False}
        assert not a.paused and not a.session_open and a.weight_version == "7"

    run(body, n=2)


def test_in_place_pause_skips_the_flush() -> None:
    async def body(s: RecordingSGLang) -> None:
        s.running_in_place = True
        await update_weights([SGLangClient(s.url)], "step-3", _noop, pause_mode="in_place")
        assert "flush_cache" not in steps(s.calls)
        assert s.calls[0].body == {"mode": "in_place"}
        assert s.weight_version == "step-3"

    run(body)


def test_a_failed_begin_resumes_every_engine_and_reraises() -> None:
    async def body(a: RecordingSGLang, b: RecordingSGLang) -> None:
        b.session_open = True  # a session someone left open: SGLang refuses a second one
        ran: list[int] = []

        async def transfer() -> None:
            ran.append(1)

        with pytest.raises(SGLangError) as err:
            await update_weights([SGLangClient(a.url), SGLangClient(b.url)], 5, transfer)
        assert err.value.call == "begin_weight_update" and err.value.url.startswith(b.url)
        assert "already open" in err.value.reason
        assert not ran
        # a's session was opened, so it is closed again; both engines generate again
        assert steps(a.calls)[-2:] == ["end_weight_update", "continue_generation"]
        assert steps(b.calls)[-1] == "continue_generation"
        assert "end_weight_update" not in steps(b.calls)
        assert not a.paused and not b.paused and not a.session_open

    run(body, n=2)


def test_a_failed_transfer_closes_the_session_and_leaves_engines_paused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Part of version 9 may have landed while the engines still report the old version:
    by default they are not resumed, and the error and the log say so."""

    async def body(a: RecordingSGLang, b: RecordingSGLang) -> None:
        async def transfer() -> None:
            raise RuntimeError("trainer rank 1: peer lost")

        with pytest.raises(RuntimeError, match="peer lost") as err:
            await update_weights([SGLangClient(a.url), SGLangClient(b.url)], 9, transfer)
        for s in (a, b):
            assert steps(s.calls)[-1] == "end_weight_update"
            assert "update_weight_version" not in steps(s.calls)
            assert "continue_generation" not in steps(s.calls)
            assert not s.session_open and s.paused and s.weight_version == "default"
        notes = getattr(err.value, "__notes__", [])
        assert any("left paused on 2 engine(s)" in n and "partly version 9" in n for n in notes)
        assert any("left paused" in r.getMessage() for r in caplog.records)

    with caplog.at_level("WARNING", logger="weightwire.adapters.sglang"):
        run(body, n=2)


def test_resuming_on_partial_weights_is_an_opt_in_with_a_warning() -> None:
    async def body(a: RecordingSGLang, b: RecordingSGLang) -> None:
        async def transfer() -> None:
            raise RuntimeError("trainer rank 1: peer lost")

        engines = [SGLangClient(a.url), SGLangClient(b.url)]
        with (
            pytest.warns(RuntimeWarning, match="partly version 9"),
            pytest.raises(RuntimeError, match="peer lost") as err,
        ):
            await update_weights(engines, 9, transfer, resume_on_failure=True)
        for s in (a, b):
            assert steps(s.calls)[-2:] == ["end_weight_update", "continue_generation"]
            assert not s.session_open and not s.paused and s.weight_version == "default"
        assert any("resume_on_failure=True" in n for n in getattr(err.value, "__notes__", []))

    run(body, n=2)


def test_a_failed_continue_after_the_version_landed_is_tried_again() -> None:
    """Weights and reported version agree once update_weight_version succeeded: a failed
    continue_generation is tried once more, whatever resume_on_failure says."""

    async def body(s: RecordingSGLang) -> None:
        s.hang.add("/continue_generation")
        with pytest.raises(SGLangTimeout):
            await update_weights([SGLangClient(s.url, timeout_s=0.3)], 3, _noop)
        assert steps(s.calls)[-2:] == ["continue_generation", "continue_generation"]
        assert s.weight_version == "3"

    run(body)


def test_a_hung_end_times_out_and_recovery_is_reported() -> None:
    async def body(a: RecordingSGLang, b: RecordingSGLang) -> None:
        b.hang.add("/end_weight_update")
        engines = [SGLangClient(a.url, timeout_s=0.3), SGLangClient(b.url, timeout_s=0.3)]
        with pytest.raises(SGLangTimeout) as err:
            await update_weights(engines, 4, _noop)
        assert err.value.call == "end_weight_update" and b.url in err.value.url
        # the cleanup tried b's end again (hung again: noted); both stay paused (the
        # version landed, but neither engine reports it)
        notes = getattr(err.value, "__notes__", [])
        assert any(b.url in n and "end_weight_update" in n for n in notes), notes
        assert any("left paused" in n for n in notes), notes
        assert "continue_generation" not in steps(a.calls) + steps(b.calls)
        assert a.paused and b.paused

    run(body, n=2)


def test_resume_on_failure_false_leaves_engines_paused() -> None:
    async def body(s: RecordingSGLang) -> None:
        async def transfer() -> None:
            raise RuntimeError("not this time")

        with pytest.raises(RuntimeError):
            await update_weights([SGLangClient(s.url)], 1, transfer, resume_on_failure=False)
        assert steps(s.calls)[-1] == "end_weight_update"
        assert s.paused and not s.session_open
        # and the next update, once it succeeds, resumes them
        await update_weights([SGLangClient(s.url)], 2, _noop)
        assert not s.paused and s.weight_version == "2"

    run(body)


def test_client_refuses_non_http_urls() -> None:
    with pytest.raises(ValueError, match="not an http"):
        SGLangClient("ftp://h:1")
    assert SGLangClient("10.0.0.2:30000").url == "http://10.0.0.2:30000"


async def _noop() -> None:
    return None
