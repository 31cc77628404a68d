"""How a failed SGLang call is reported: `SGLangError` (a `WeightwireError`) and the words
taken from SGLang's answer."""

from __future__ import annotations

import json

from weightwire.protocol.errors import ErrorCode, WeightwireError


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


def excerpt(body: bytes, n: int = 300) -> str:
    text = body.decode(errors="replace").strip()
    return text if len(text) <= n else text[:n] + "..."


def sglang_message(body: bytes) -> str:
    """SGLang's own words from an error answer: JSON "message" / "error" / FastAPI's
    "detail" (validation errors listed), else the text itself."""
    text = body.decode(errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return excerpt(body, 2000) or "(empty answer)"
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
    return excerpt(body, 2000)
