r"""
`medusa-heads serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the tree-decoding runtime.

Routes parse and check a request (all checks before any compute), tokenize its prompt and queue it; one worker
thread decodes (`serve_scheduler`, `serve_engine`) and hands back events, which the routes turn into a response
or server-sent events. `/metrics` exposes the server's Prometheus metrics (`serve_metrics`).
"""

import asyncio
import json
import socket
import sys
from contextlib import asynccontextmanager
from typing import AsyncIterator

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException
from transformers import PreTrainedTokenizerBase

from medusa_heads.errors import MedusaError
from medusa_heads.model import MedusaModel

from .serve_api import APIError, ChatRequest, CompletionRequest, Format, SamplingRequest, error_body, usage
from .serve_engine import Engine, Failed, Finished, Job, Piece
from .serve_scheduler import QueueFull, Scheduler

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming request checks that its client is still there


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads so that a taken port fails at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as err:
        raise MedusaError(f"Cannot listen on {host}:{port}: {err.strerror or err}.") from None


def create_app(engine: Engine, scheduler: Scheduler, model_id: str) -> FastAPI:
    metrics = engine.metrics

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="medusa-heads", lifespan=lifespan)

    def rejected(status: int, body: dict) -> JSONResponse:
        metrics.requests.labels("rejected" if status == 503 else "invalid").inc()
        return JSONResponse(body, status_code=status)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return rejected(err.status, err.body())

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "decode error")
            return rejected(400, error_body(f"The body is not valid JSON: {reason}.", code="invalid_json"))
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return rejected(400, error_body(f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param,
                                        code="invalid_value"))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail), code=str(err.status_code)), status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = scheduler.alive
        return JSONResponse({"status": "ok" if ok else "worker stopped"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "medusa-heads"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        ids = encode_chat(engine.tokenizer, [m.as_dict() for m in body.messages])
        return await complete(Format.new(True, model_id), body, ids, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if not body.text:
            raise APIError(400, "The prompt is empty.", "prompt")
        ids = engine.tokenizer(body.text)["input_ids"]
        return await complete(Format.new(False, model_id), body, ids, request)

    async def complete(fmt: Format, body: SamplingRequest, prompt_ids: list[int], request: Request) -> Response:
        job = make_job(body, prompt_ids)
        try:
            scheduler.submit(job)
        except QueueFull as full:
            raise APIError(503, f"The server is busy: {full} requests are waiting; retry later.", code="queue_full",
                           type="server_error") from None
        if body.stream:
            return StreamingResponse(stream(fmt, job, body.include_usage), media_type="text/event-stream")
        return await respond(fmt, job, request)

    def make_job(body: SamplingRequest, prompt_ids: list[int]) -> Job:
        if body.model is not None and body.model != model_id:
            raise APIError(400, f"Unknown model `{body.model}`; this server serves `{model_id}`.", "model",
                           "model_not_found")
        needed = len(prompt_ids) + body.new_tokens + engine.tree_size
        if engine.context is not None and needed > engine.context:
            raise APIError(400, f"The prompt ({len(prompt_ids)} tokens) plus max_tokens ({body.new_tokens}) and the "
                           f"tree ({engine.tree_size} nodes) exceed the model's context of {engine.context} tokens.",
                           "max_tokens", "context_length_exceeded")
        try:
            acceptance = engine.acceptance(body.temperature, body.top_p, body.top_k, body.seed)
        except MedusaError as err:
            raise APIError(400, str(err)) from None
        seeded = body.temperature > 0 and body.seed is not None
        sampling = {"temperature": body.temperature, "acceptance": engine.rule(body.temperature)}
        return Job(prompt_ids, body.new_tokens, body.stops, acceptance, asyncio.get_running_loop(), seeded, sampling)

    return app


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """The chat template around the whole conversation, with the assistant's turn opened."""
    if tokenizer.chat_template is None:
        raise APIError(400, "This model has no chat template; use /v1/completions.", "messages")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    except TemplateError as err:  # the template refuses the conversation (e.g. roles out of order)
        raise APIError(400, f"The chat template refuses these messages: {err}", "messages") from None


async def respond(fmt: Format, job: Job, request: Request) -> Response:
    """The whole answer as one response; a client that goes away meanwhile cancels its request."""
    answer = asyncio.ensure_future(collect(job))
    while not (await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            job.cancelled.set()
            answer.cancel()
            return Response(status_code=499)  # nobody reads it
    text, event = answer.result()
    if isinstance(event, Failed):
        return JSONResponse(error_body(event.message, "server_error"), status_code=500)
    return JSONResponse(fmt.response(text, event.finish_reason, usage(event.prompt_tokens, event.completion_tokens),
                                     event.speculative))


async def collect(job: Job) -> tuple[str, Finished | Failed]:
    """The answer's text and the event that ended it."""
    pieces = []
    while isinstance(event := await job.events.get(), Piece):
        pieces.append(event.text)
    return "".join(pieces), event


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream(fmt: Format, job: Job, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per accepted block of text, the finish reason (and `speculative`), `[DONE]`.
    When the client disconnects, the response stops iterating and `finally` cancels the request."""
    try:
        if fmt.chat:
            yield sse(fmt.chunk("", role=True))
        while True:
            event = await job.events.get()
            if isinstance(event, Piece):
                yield sse(fmt.chunk(event.text))
                continue
            if isinstance(event, Failed):
                yield sse(error_body(event.message, "server_error"))
            else:
                yield sse(fmt.chunk(None, event.finish_reason) | {"speculative": event.speculative})
                if include_usage:
                    yield sse(fmt.usage_chunk(usage(event.prompt_tokens, event.completion_tokens)))
            yield sse("[DONE]")
            return
    finally:
        job.cancelled.set()


def run_server(sock: socket.socket, model: MedusaModel, tokenizer: PreTrainedTokenizerBase, model_id: str,
               drafter: str, drafter_options: dict, sampling_rule: str, max_queue: int, max_batch: int,
               verbose: bool = False) -> None:
    """Serve on `sock` until interrupted."""
    prometheus_client.disable_created_metrics()  # process-wide: no `*_created` series beside every counter
    engine = Engine(model, tokenizer, drafter, drafter_options, sampling_rule)
    scheduler = Scheduler(engine, max_queue, max_batch)
    app = create_app(engine, scheduler, model_id)
    host, port = sock.getsockname()[:2]
    print(f"medusa-heads serve: {model_id}, batches of up to {scheduler.batch} requests ({drafter} drafter with "
          f"{engine.tree_size} tree nodes alone, configs/batching.json in batches), greedy at temperature 0 and "
          f"{sampling_rule} above, on http://{host}:{port}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose)
    uvicorn.Server(config).run(sockets=[sock])
