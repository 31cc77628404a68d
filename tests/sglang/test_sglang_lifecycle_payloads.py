"""The lifecycle client's requests against SGLang 0.5.23 itself: every request the client
makes (recorded by tests/test_sglang_lifecycle.py's stand-in server) must hit a route of
SGLang's HTTP server with an allowed method, and its JSON body must validate, field by
field, as the request struct that route declares, through SGLang's own pydantic schema
(what FastAPI applies). SGLang's server module cannot be imported here (it needs uvicorn
and FastAPI), so its route table is read from its source: decorator, path, methods, and
the handler's `Annotated[<Struct>, Body()]` or query parameters.

Runs only in `.venv-sglang` (`make test-sglang`); skipped anywhere sglang is missing.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not importable here: `make test-sglang` runs tests/sglang in .venv-sglang",
        allow_module_level=True,
    )

from . import sglang_cpu  # first: SGLANG_USE_CPU_ENGINE and the stand-in modules

# isort: split
import msgspec
import pydantic
from sglang.srt.managers import io_struct

from weightwire.adapters.sglang.lifecycle import SGLangClient, update_weights

from ..test_sglang_lifecycle import Call, RecordingSGLang

assert sglang_cpu
pytestmark = pytest.mark.filterwarnings("ignore")


@dataclass
class Route:
    methods: set[str]
    body: str | None  # the request struct's name
    params: set[str]  # every parameter of the handler (query ones among them)


def sglang_routes() -> dict[str, Route]:
    spec = importlib.util.find_spec("sglang.srt.entrypoints.http_server")
    assert spec is not None and spec.origin
    src = Path(spec.origin).read_text()
    deco = re.compile(
        r'@app\.(post|get|put|api_route)\(\s*"([^"]+)"(?:\s*,\s*methods=\[([^\]]*)\])?'
        r"[^\n]*\n(?:@[^\n]*\n)*async def \w+\(((?:[^()]|\([^()]*\))*)\)",
        re.S,
    )
    routes: dict[str, Route] = {}
    for kind, path, methods, params in deco.findall(src):
        ms = set(re.findall(r'"(\w+)"', methods)) if kind == "api_route" else {kind.upper()}
        body = re.search(r"Annotated\[(\w+),\s*Body\(\)\]", params)
        names = set(re.findall(r"(\w+)\s*:", params))
        routes[path] = Route(ms, body.group(1) if body else None, names)
    return routes


def exercise() -> list[Call]:
    """Every call the client makes, the sequence helper's included."""

    async def main() -> list[Call]:
        log: list[Call] = []
        s = await RecordingSGLang("s", log).start()
        try:
            c = SGLangClient(s.url)
            for mode in ("abort", "retract", "in_place"):
                await c.pause_generation(mode)  # type: ignore[arg-type]
            await c.flush_cache(wait_s=1.5)
            for selector in ("all", "target", "draft"):
                await c.begin_weight_update(selector)  # type: ignore[arg-type]
                await c.end_weight_update()
            await c.update_weight_version("v1", abort_all_requests=True)
            await c.continue_generation(torch_empty_cache=False)
            await c.model_info()
            await c.health()
            await update_weights([c], 2, _noop, pause_mode="retract")
        finally:
            await s.stop()
        return log

    return asyncio.run(main())


async def _noop() -> None:
    return None


def test_routes_were_read() -> None:
    routes = sglang_routes()
    assert routes["/pause_generation"] == Route(
        {"POST"}, "PauseGenerationReqInput", {"obj", "request"}
    )
    assert routes["/flush_cache"].methods == {"GET", "POST"}
    assert "timeout" in routes["/flush_cache"].params


def test_every_request_is_one_sglang_accepts() -> None:
    routes = sglang_routes()
    calls = exercise()
    paths = {c.path for c in calls}
    assert paths == {
        "/pause_generation",
        "/flush_cache",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/continue_generation",
        "/model_info",
        "/health",
    }
    for c in calls:
        route = routes.get(c.path)
        assert route is not None, f"SGLang has no route {c.path}"
        assert c.method in route.methods, (c.method, c.path, route.methods)
        assert set(c.query) <= route.params, (c.path, c.query)
        if route.body is None:
            assert c.body is None, c
            continue
        struct = getattr(io_struct, route.body)
        fields = {f.name for f in msgspec.structs.fields(struct)}
        assert c.body is not None and set(c.body) <= fields, (c.path, c.body, fields)
        parsed = pydantic.TypeAdapter(struct).validate_python(c.body)
        for k, v in c.body.items():
            assert getattr(parsed, k) == v, (c.path, k)
