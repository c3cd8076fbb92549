"""The FastAPI app: OpenAI routes, a token-level route, and OpenAI-style error bodies.

Every client mistake — a bad field caught by pydantic or a value the engine refuses — becomes an
HTTP 400 whose body names the field:
`{"error": {"message": ..., "type": "invalid_request_error", "param": <field>, "code": null}}`.
A failed request never takes the server down; the next request is served normally.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from polyrl.rollout.base import RolloutInputError
from polyrl.rollout.server.openai_images import LocalMedia
from polyrl.rollout.server.openai_service import MAX_SEQUENCES_PER_REQUEST, OpenAIService
from polyrl.rollout.server.protocol import ChatCompletionRequest, CompletionRequest
from polyrl.rollout.server.trajectories import TrajectoryRecorder

logger = logging.getLogger(__name__)


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends.

    When a client disconnects, Starlette cancels the sending task, which may leave the generator
    suspended (not closed) until garbage collection; closing it here runs its cleanup at once,
    which cancels the request in the engine.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class TokenRequest(BaseModel):
    """Body of POST /generate: the engine's own token-in / token-out call over HTTP."""

    prompt_ids: list[int]
    sampling: dict[str, Any] | None = None
    request_id: str | None = None


def error_body(message: str, param: str | None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(error: dict) -> tuple[str, str | None]:
    """(message, param) of the first pydantic / JSON error of a request body."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == "json_invalid":  # FastAPI puts the byte offset where a field goes
        detail = (error.get("ctx") or {}).get("error", "JSON decode error")
        where = f" at position {loc[0]}" if loc else ""
        return f"the request body is not valid JSON: {detail}{where}", None
    if error.get("type") == "extra_forbidden":
        return (f"unknown field '{'.'.join(loc)}': not part of the OpenAI API this server "
                "implements (check its spelling)"), loc[0] if loc else None
    param = loc[0] if loc else "body"
    return f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid value')}", param


def build_app(engine: Any, model_name: str, *, aliases: tuple[str, ...] = (),
              recorder: TrajectoryRecorder | None = None,
              max_sequences_per_request: int = MAX_SEQUENCES_PER_REQUEST,
              allowed_local_media_path: str | None = None) -> FastAPI:
    """An app serving `engine` as `model_name` (requests may also name any of `aliases`). With a
    `recorder`, black-box agent trajectories are served under /trajectories/<id>/v1/...
    A request asking for more than `max_sequences_per_request` (prompts x n) is a 400. Image
    parts may name local files only under `allowed_local_media_path` (default: none at all)."""
    service = OpenAIService(engine, model_name, aliases=aliases, recorder=recorder,
                            max_sequences_per_request=max_sequences_per_request,
                            local_media=LocalMedia(allowed_local_media_path))
    app = FastAPI(title="polyrl rollout server", docs_url=None, redoc_url=None)
    app.state.service = service

    @app.exception_handler(RolloutInputError)
    async def _input_error(_: Request, exc: RolloutInputError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.field, code=getattr(exc, "code", None)), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid request"}
        message, param = validation_message(first)
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", None, "server_error"), status_code=500)

    def respond(result: dict | Any) -> JSONResponse | StreamingResponse:
        if isinstance(result, dict):
            return JSONResponse(result)
        return ClosingStreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return respond(await service.complete(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        return respond(await service.chat(req))

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/health")
    async def health():
        status = service.health()
        return JSONResponse(status, status_code=200 if status.get("ok", True) else 503)

    @app.post("/generate")
    async def generate(req: TokenRequest):
        return await service.generate_tokens(req.prompt_ids, req.sampling, req.request_id)

    if recorder is not None:  # a black-box agent's base URL: /trajectories/<id>/v1
        @app.post("/trajectories/{trajectory_id}/v1/completions")
        async def trajectory_completions(trajectory_id: str, req: CompletionRequest):
            return respond(await service.complete(req, trajectory=trajectory_id))

        @app.post("/trajectories/{trajectory_id}/v1/chat/completions")
        async def trajectory_chat(trajectory_id: str, req: ChatCompletionRequest):
            return respond(await service.chat(req, trajectory=trajectory_id))

        @app.get("/trajectories/{trajectory_id}/v1/models")
        async def trajectory_models(trajectory_id: str):
            recorder.get(trajectory_id)
            return service.models()

    return app
