"""slime's rollout side, as the weightwire recipe needs it: the engines' environment (the
SGLang plugin in every server slime launches) and calls on slime's engine handles.

slime (`slime/ray/rollout.py`) makes each SGLang server a ray actor (`SGLangEngine`,
`slime/backends/sglang_utils/sglang_engine.py`) with `runtime_env={"env_vars": ...}`; the
server process it launches inherits that environment, so the plugin's variables go there.
Its trainer calls the actors as `ray.get([e.method.remote() for e in engines])`; `call_all`
does that for ray handles and calls plain objects (anything with the same methods) directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def engine_env(
    engine: int,
    engines: int,
    *,
    job: str = "slime",
    socket: str | None = None,
    mode: str = "rules",
) -> dict[str, str]:
    """The environment of slime's rollout engine `engine` (of `engines`, slime's engine
    index: `SGLangEngine(rank=...)`) for the weightwire SGLang plugin: each engine is one
    engine replica of the job (README, "SGLang", "Elastic engines"). Merge it into the
    `env_vars` slime's rollout.py gives each `SGLangEngine` actor."""
    if not 0 <= engine < engines:
        raise ValueError(f"engine {engine} of {engines}: expected 0 <= engine < engines")
    if mode not in ("rules", "replica"):
        raise ValueError(f"mode={mode!r}: expected rules or replica")
    env = {
        "SGLANG_PLUGINS": "weightwire",
        "WEIGHTWIRE_SGLANG": mode,
        "WEIGHTWIRE_JOB": job,
        "WEIGHTWIRE_ENGINE_REPLICA": str(engine),
        "WEIGHTWIRE_ENGINE_REPLICAS": str(engines),
    }
    if socket:
        env["WEIGHTWIRE_SOCKET"] = socket
    return env


def call_all(engines: Sequence[Any], method: str, *args: Any, **kwargs: Any) -> list[Any]:
    """`method(*args, **kwargs)` on every engine: ray actor handles through `.remote()` and
    one `ray.get` (as slime's trainer calls them), anything else directly."""
    calls = [getattr(e, method) for e in engines]
    if calls and all(hasattr(c, "remote") for c in calls):
        import ray

        return list(ray.get([c.remote(*args, **kwargs) for c in calls]))
    return [c(*args, **kwargs) for c in calls]


def engine_urls(engines: Sequence[Any]) -> list[str]:
    """Each engine's HTTP address (`SGLangEngine.get_url`; an engine spanning several nodes
    answers on its first node only, the others give None)."""
    return [u for u in call_all(engines, "get_url") if u]
