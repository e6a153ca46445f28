"""The REST gateway: OpenAI-compatible completions and chat (streaming as server-sent events),
models (with what each target replica runs), specd's sessions, health. Served by uvicorn inside
the coordinator process, next to the gRPC API, over the same Frontend.

Every error is an OpenAI-style body with a 4xx for what the client can fix: bad JSON or
fields 400, no key 401, someone else's session 404, too large a body 413, a key over its
quota or a model service out of capacity 429 (with Retry-After for a quota). A named session's
turn may carry an `Idempotency-Key` header: its retry does not append the turn twice. A client that goes away (disconnect, its own timeout) cancels its
generation, and a one-off session's caches are freed at once (the loop's `finally`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Awaitable, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from specd.contracts import EngineInfo
from specd.loop import Chunk, Finished
from specd.session import Fenced, SessionNotFound
from specd.validation import InvalidParams
from services.common.metrics import exposition
from services.common.telemetry import instrument_app
from services.coordinator import openai_api, requests
from services.coordinator.auth import ApiKeys, Unauthenticated
from services.coordinator.frontend import DownstreamFailed, Failure, Frontend
from services.coordinator.openai_api import ChatCompletionRequest, CompletionRequest, Reply, error_body
from services.coordinator.quotas import QuotaExceeded

DEFAULT_HTTP_PORT = 8000
MAX_BODY_BYTES = 1024 * 1024
MAX_CONNECTIONS = 1024  # open REST connections: each may hold a generation
CLIENT_CLOSED = 499  # nginx's code for a client that closed the connection before the response
T = TypeVar("T")
log = logging.getLogger(__name__)

# A downstream failure as an HTTP status: capacity and deadlines are the client's to retry.
FAILURE_STATUS = {Failure.UNAVAILABLE: 503, Failure.EXHAUSTED: 429, Failure.DEADLINE: 504, Failure.INTERNAL: 500}


class ModelNotFound(Exception):
    pass


def create_app(frontend: Frontend, keys: ApiKeys, model_name: str, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    guarded = keys.required  # with keys, what the edge says of itself (spec, metrics) needs one too
    app = FastAPI(
        title="specd",
        version="1",
        summary="Lossless speculative decoding, OpenAI-compatible",
        description="Greedy output is token-identical to the target model alone; sampled output has its distribution.",
        openapi_url=None if guarded else "/openapi.json", docs_url=None if guarded else "/docs",
        redoc_url=None if guarded else "/redoc",
    )
    bearer = HTTPBearer(auto_error=False, description="An API key from the deployment's key file")

    def owner(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
        header = f"{credentials.scheme} {credentials.credentials}" if credentials else None
        return keys.owner(header)

    def served(model: str) -> None:
        if model != model_name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {model_name!r}")

    @app.get("/health", tags=["ops"])
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], include_in_schema=False)
    async def metrics(who: str = Depends(owner)) -> Response:
        """Keyless scraping: the coordinator's --metrics-port, a port of its own."""
        body, content_type = exposition(frontend.metrics.registry)
        return Response(body, media_type=content_type)

    if guarded:
        @app.get("/openapi.json", include_in_schema=False)
        async def spec(who: str = Depends(owner)) -> dict:
            return app.openapi()

    @app.get("/v1/models", tags=["openai"])
    async def models(who: str = Depends(owner)) -> dict:
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "specd"}
        card["specd"] = {"target": [_engine_json(e) for e in await frontend.engines()]}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", tags=["openai"])
    async def completions(body: CompletionRequest, request: Request, who: str = Depends(owner)):
        served(body.model)
        reply = Reply("completion", model_name)
        return await _respond(frontend, reply, body, openai_api.completion_request(body), who, request)

    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request, who: str = Depends(owner)):
        served(body.model)
        client_request = await asyncio.to_thread(openai_api.chat_request, body, frontend.model, frontend.limits)
        return await _respond(frontend, Reply("chat", model_name), body, client_request, who, request)

    @app.get("/v1/sessions/{session_id}", tags=["specd"])
    async def get_session(session_id: str, include_tokens: bool = False, who: str = Depends(owner)) -> dict:
        """`include_tokens`: the committed tokens too (a client resuming after a lost stream)."""
        state = await frontend.session(requests.session_id(session_id), who)
        policy = state.policy
        tokens = {"token_ids": list(state.tokens)} if include_tokens else {}
        return tokens | {
            "session_id": state.session_id,
            "length": len(state.tokens),
            "requests": state.requests,
            "mode": policy.mode,
            "k": policy.k,
            "alpha": policy.estimates.alpha,
            "stats": openai_api.stats_json(state.stats),
        }

    @app.delete("/v1/sessions/{session_id}", tags=["specd"])
    async def release_session(session_id: str, who: str = Depends(owner)) -> dict:
        await frontend.release(requests.session_id(session_id), who)
        return {"session_id": session_id, "released": True}

    _add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(KeyGate, keys=keys, frontend=frontend)  # outside BodyLimit: before any body is read
    app.openapi = lambda: _openapi(app, model_name)
    instrument_app(app)  # a server span per request when tracing is on: the root of the request's trace
    return app


def _engine_json(engine: EngineInfo | str) -> dict:
    """What a target replica runs, or why it did not answer."""
    if isinstance(engine, str):
        return {"error": engine}
    return {"numerics": engine.numerics, "quantize": engine.quantize, "invariant": engine.invariant,
            "reason": engine.reason}


def _openapi(app: FastAPI, model_name: str) -> dict:
    """The generated spec, with `model` narrowed to the one model served here."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, summary=app.summary,
                           description=app.description, routes=app.routes)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            spec["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [model_name]}
        app.openapi_schema = spec
    return app.openapi_schema


async def _respond(frontend: Frontend, reply: Reply, body, client_request, owner: str, request: Request):
    client_request = replace(client_request, request_id=request.headers.get("idempotency-key", ""))
    # tokenising is work a request's size decides: in a thread, so no body stalls the other streams
    generation = await asyncio.to_thread(requests.generation_request, client_request, frontend.model, frontend.limits)
    reply.prompt_tokens, reply.session_id = len(generation.prompt), client_request.session_id
    events = frontend.generate(generation, client_request.session_id, owner, client_request.request_id)
    limits = frontend.limits
    deadline = asyncio.get_running_loop().time() + limits.request_timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            if body.stream:
                return await _stream(events, reply, openai_api.include_usage(body), limits, deadline)
            done = await _until_disconnected(request, _last(events))
    except TimeoutError:
        await events.aclose()
        return JSONResponse(error_body(_timed_out(limits), "server_error", "timeout"), status_code=504)
    if done is None:  # nobody reads this: the client is gone
        return JSONResponse(error_body("client disconnected"), status_code=CLIENT_CLOSED)
    return reply.body(done)


def _timed_out(limits: requests.Limits) -> str:
    return f"the request ran past this server's limit of {limits.request_timeout_s:g} s: lower max_tokens"


async def _last(events: AsyncIterator[Chunk | Finished]) -> Finished:
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                return event
    raise AssertionError("the loop always ends with Finished")


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` unless the client leaves first; then cancel it (freeing a one-off session's
    caches) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stream(events: AsyncIterator[Chunk | Finished], reply: Reply, usage: bool,
                  limits: requests.Limits, deadline: float) -> StreamingResponse:
    """Server-sent events. The first event is awaited before the response starts, so a request
    that fails at once (a session that is not yours, no capacity) still gets its status code."""
    first = await anext(events)

    async def sse() -> AsyncIterator[str]:
        async with contextlib.aclosing(events):
            event, opening = first, True
            try:
                while True:
                    if isinstance(event, Chunk):
                        yield _sse(reply.chunk(event.text, first=opening))
                        opening = False
                    else:
                        yield _sse(reply.final_chunk(event))
                        if usage:
                            yield _sse(reply.usage_chunk(event))
                        break
                    event = await anext(events)
            except Exception as error:  # the status is sent already: the error goes in the stream
                yield _sse(_error(error)[1])
            yield "data: [DONE]\n\n"

    return BoundedStream(sse(), limits, deadline, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class BoundedStream(StreamingResponse):
    """A stream with an end: a client that stops reading blocks a write, and one write waiting past
    `stream_stall_s`, or the request past its `deadline` (loop time), ends it. The generation is
    closed either way, to its end, so its quota slot and the model services' work go back at once."""

    def __init__(self, content: AsyncIterator[str], limits: requests.Limits, deadline: float, **kwargs):
        super().__init__(content, **kwargs)
        self.limits, self.deadline, self._sent_all = limits, deadline, False

    async def __call__(self, scope, receive, send) -> None:
        """Starlette's own cancels the stream with an anyio scope, again at every await, as soon as
        receive says "disconnected" (uvicorn does once the last byte is out): the generation's clean-up
        would be cut short. One plain cancel, and only while the client can still be written to."""
        streaming = asyncio.ensure_future(self.stream_response(send))
        leaving = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({streaming, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not self._sent_all:
                streaming.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await streaming
        if self.background is not None:
            await self.background()

    async def stream_response(self, send) -> None:
        stall_s, loop = self.limits.stream_stall_s, asyncio.get_running_loop()

        async def bounded(message: dict) -> None:
            async with asyncio.timeout(stall_s):  # not wait_for: on 3.11 it can swallow the deadline's cancel
                await send(message)

        try:
            async with asyncio.timeout_at(self.deadline):
                await bounded({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    if loop.time() >= self.deadline:  # also when a layer below swallowed the deadline's cancel
                        raise TimeoutError
                    await bounded({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                self._sent_all = True
                await bounded({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            log.warning("a streamed reply ended: its client read nothing for %g s, or it ran past its deadline",
                        stall_s)
            await self.body_iterator.aclose()  # before the last word: a client told "done" finds its slot free
            self._sent_all = True
            with contextlib.suppress(TimeoutError, OSError):  # a last word, if the client still reads
                done = _sse(error_body(_timed_out(self.limits), "server_error", "timeout")) + "data: [DONE]\n\n"
                async with asyncio.timeout(stall_s):
                    await send({"type": "http.response.body", "body": done.encode(), "more_body": False})
        finally:
            await self.body_iterator.aclose()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _error(error: Exception) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for an exception; 500 only for what is our own fault."""
    if isinstance(error, (InvalidParams, RequestValidationError)):
        return 400, error_body(_message(error))
    if isinstance(error, Unauthenticated):
        return 401, error_body(str(error), "authentication_error", "invalid_api_key")
    if isinstance(error, QuotaExceeded):
        return 429, error_body(str(error), "rate_limit_error", "quota_exceeded")
    if isinstance(error, (SessionNotFound, ModelNotFound)):
        return 404, error_body(str(error.args[0]), "not_found_error")
    if isinstance(error, Fenced):
        return 409, error_body("the session was taken over by a newer request", "conflict_error")
    if isinstance(error, DownstreamFailed):
        return FAILURE_STATUS[error.failure], error_body(str(error), "server_error")
    error_id = uuid.uuid4().hex[:16]
    log.error("error %s: %r", error_id, error, exc_info=error)
    return 500, error_body(f"internal error (error id {error_id})", "server_error")


def _error_response(error: Exception) -> JSONResponse:
    status, payload = _error(error)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if isinstance(error, QuotaExceeded):
        headers = {"Retry-After": str(error.retry_after_s)}
    return JSONResponse(payload, status_code=status, headers=headers)


def _message(error: Exception) -> str:
    if not isinstance(error, RequestValidationError):
        return str(error)
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def _add_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, error: Exception) -> JSONResponse:
        return _error_response(error)

    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code, headers=error.headers)

    for kind in (InvalidParams, RequestValidationError, Unauthenticated, SessionNotFound, ModelNotFound, Fenced,
                 DownstreamFailed, QuotaExceeded):
        app.add_exception_handler(kind, handle)
    app.add_exception_handler(StarletteHTTPException, http_error)


class KeyGate:
    """A generation request's key and its key's request rate and requests in flight, from the headers,
    before the body is read: a key over its limits costs the edge no body (401 / 429 + Retry-After)."""

    GATED = frozenset({"/v1/completions", "/v1/chat/completions"})

    def __init__(self, app, keys: ApiKeys, frontend: Frontend):
        self.app, self.keys, self.frontend = app, keys, frontend

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.GATED:
            try:
                await self.frontend.knock(self.keys.owner(_header(scope, b"authorization")))
            except (Unauthenticated, QuotaExceeded, DownstreamFailed) as error:
                return await _error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


def _header(scope, name: bytes) -> str | None:
    value = dict(scope["headers"]).get(name)
    return value.decode("latin-1") if value is not None else None


class BodyLimit:
    """Refuse request bodies over `max_bytes` with a 413 before any parsing: the declared
    length is checked first, and a body without one (chunked) is read up to the limit."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
        return await self.app(scope, _replay([{"type": "http.request", "body": b"".join(parts)}], receive), send)

    async def _too_large(self, scope, receive, send):
        payload = error_body(f"the request body exceeds {self.max_bytes} bytes", code="request_too_large")
        await JSONResponse(payload, status_code=413)(scope, receive, send)


def _replay(messages: list[dict], receive):
    """A receive() that hands out the buffered messages, then the connection's own (disconnects)."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


class HttpServer(uvicorn.Server):
    """uvicorn inside the coordinator's event loop, next to the gRPC server: signals stay with
    the process's own handler (`run_until_signalled`), which stops both."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    @classmethod
    async def start(cls, app: FastAPI, host: str, port: int, ssl_certfile: str | None = None,
                    ssl_keyfile: str | None = None,
                    max_connections: int = MAX_CONNECTIONS) -> tuple["HttpServer", int]:
        """Start serving (https with a certificate chain and its key, PEM); returns the server and
        its bound port (0 picks a free one). `server.config.ssl` is the TLS context then. Past
        `max_connections` open connections a request gets 503 at once."""
        server = cls(uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="warning",
                                    ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                                    limit_concurrency=max_connections))
        server.task = asyncio.create_task(server.serve())
        while not server.started:
            if server.task.done():  # failed to bind: raise its error
                await server.task
                raise OSError(f"cannot serve HTTP on {host}:{port}")
            await asyncio.sleep(0.02)
        return server, server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.should_exit = True
        await self.task
