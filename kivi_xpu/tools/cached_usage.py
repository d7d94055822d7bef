"""``usage.prompt_tokens_details.cached_tokens`` in the OpenAI responses of ``kivi-xpu serve --continuous-batching``.

transformers' handlers build ``usage`` without it; the KIVI pages know how many prompt tokens of each request they
found cached (:attr:`kivi_xpu.paged.cache.KiviPagedCache.cached_prompt_tokens`, by request id, which is the
response's ``id``). :func:`report_cached_tokens` adds an HTTP middleware that writes the count into every ``usage``
object of a chat or text completion, whole or streamed (0 when nothing was reused, as OpenAI reports it).
"""

from __future__ import annotations

import json

from ..paged.cache import LIVE_CACHES

_PATHS = ("/v1/chat/completions", "/v1/completions")


def cached_tokens(request_id: str) -> int:
    """Prompt tokens the KIVI pages found cached for ``request_id`` (0: none, or not a continuous-batching request)."""
    return max((cache.cached_prompt_tokens.get(request_id, 0) for cache in list(LIVE_CACHES)), default=0)


def with_cached_tokens(payload: dict) -> dict:
    """``payload`` (a completion or a chunk) with ``usage.prompt_tokens_details.cached_tokens`` filled, if it has a
    ``usage``."""
    usage = payload.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details") or {}
        usage["prompt_tokens_details"] = dict(details, cached_tokens=cached_tokens(str(payload.get("id", ""))))
    return payload


def _patch_events(text: str) -> str:
    """Server-sent events with each ``data:`` JSON payload's usage filled."""
    lines = []
    for line in text.split("\n"):
        if line.startswith("data: {") and '"usage"' in line:
            line = "data: " + json.dumps(with_cached_tokens(json.loads(line[len("data: ") :])))
        lines.append(line)
    return "\n".join(lines)


def report_cached_tokens(app) -> None:
    """Adds the middleware (see the module docstring) to the FastAPI ``app``."""
    from starlette.responses import Response

    @app.middleware("http")
    async def fill_cached_tokens(request, call_next):
        response = await call_next(request)
        if request.url.path not in _PATHS or response.status_code != 200:
            return response
        media = response.headers.get("content-type", "")
        if media.startswith("text/event-stream"):
            events = response.body_iterator

            async def patched():
                async for chunk in events:
                    text = chunk.decode() if isinstance(chunk, bytes) else chunk
                    yield _patch_events(text).encode() if '"usage"' in text else text.encode()

            response.body_iterator = patched()
            return response
        if not media.startswith("application/json"):
            return response
        body = b"".join([chunk async for chunk in response.body_iterator])
        content = json.dumps(with_cached_tokens(json.loads(body))).encode()
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(content, status_code=response.status_code, headers=headers, media_type="application/json")
