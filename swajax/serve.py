"""An OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

    python -m swajax serve --model DIR_OR_PRESET [--host 127.0.0.1] [--port 8000] [engine options]

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the checkpoint's chat template;
`stream: true` as server-sent events in OpenAI's chunk format), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text). Request fields: `model`, `prompt` (a string or token ids) or
`messages`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` (strings),
`stop_token_ids`, `n`, `stream`.

One engine loop (`EngineLoop`, its own thread) drives `Engine.step`; HTTP handlers only submit
requests and read their outputs from an asyncio queue the loop fills, so the device never waits
for request handling. A client that disconnects aborts its requests (their slots are freed); a
bad request is HTTP 400 with an OpenAI-style error body naming the field; more than
`max_waiting` requests not yet running is HTTP 503 with `Retry-After`; shutdown (SIGINT /
SIGTERM through uvicorn) aborts the requests in flight and stops the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from swajax._engine import Engine
from swajax._requests import RequestOutput
from swajax._sampling import SamplingParams

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "server_overloaded"}


class RequestError(Exception):
    """A request the server refuses: HTTP `status` with `message` naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": None,
            }
        }


class EngineLoop:
    """The thread that drives the engine: it steps while requests are in the engine and routes
    each output to the sink its request was submitted with (called on the loop's thread)."""

    def __init__(self, engine: Engine, *, on_step=None):
        self.engine = engine
        self._sinks: dict[int, object] = {}
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stop = False
        self._on_step = on_step
        self._thread = threading.Thread(target=self._run, name="swajax-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling, stop_ids, sink) -> int:
        """Queues a request (ValueError as `Engine.add_request`); its outputs go to `sink`."""
        with self._lock:
            rid = self.engine.add_request(prompt, max_new_tokens, sampling, stop_ids)
            self._sinks[rid] = sink
        self._work.set()
        return rid

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self._work.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished_requests:
                self._work.wait(0.05)
                self._work.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - ends the requests, keeps serving
                outputs = self._fail(e)
            with self._lock:
                routed = [(self._sinks.get(o.request_id), o) for o in outputs]
                for o in outputs:
                    if o.finished:
                        self._sinks.pop(o.request_id, None)
            for sink, out in routed:
                if sink is not None:
                    sink(out)
            if self._on_step is not None:
                self._on_step(self.engine)

    def _fail(self, error: Exception) -> list[RequestOutput]:
        """A failed step: every request in flight ends with an "error" output (the engine has
        already made itself consistent, `Engine._recover`) and is aborted in the engine."""
        with self._lock:
            ids = list(self._sinks)
        for rid in ids:
            self.engine.abort(rid)
        message = f"the engine step failed: {type(error).__name__}: {error}"
        return [RequestOutput(rid, (), (), True, "error", message) for rid in ids]

    def stop(self) -> None:
        """Aborts every request in flight, lets the loop deliver their final outputs, stops."""
        with self._lock:
            ids = list(self._sinks)
        for rid in ids:
            self.engine.abort(rid)
        deadline = time.monotonic() + 5
        while self.in_flight and time.monotonic() < deadline:
            self._work.set()
            time.sleep(0.01)
        self._stop = True
        self._work.set()
        self._thread.join(timeout=10)


class StopStrings:
    """Text of one request as it streams, cut at the first stop string: `feed(piece)` returns
    the text that can be sent (held back while it may be the start of a stop string)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text, self.sent, self.hit = "", 0, False

    def feed(self, piece: str, final: bool = False) -> str:
        self.text += piece
        cut = len(self.text)
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0 and i < cut:
                cut, self.hit = i, True
        if self.hit:
            self.text = self.text[:cut]
            final = True
        safe = len(self.text)
        if not final:  # hold back a suffix that may begin a stop string
            for s in self.stops:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        safe = min(safe, len(self.text) - k)
                        break
        out, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        return out


@dataclasses.dataclass
class Params:
    """A validated completion request."""

    prompts: list[list[int]]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    stop_ids: list[int]
    n: int
    stream: bool
    chat: bool
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def _number(body: dict, name: str, kind, low, high, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RequestError(f"'{name}' must be a {kind_name(kind)}, got {value!r}", name)
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be in [{low}, {high}], got {value!r}", name)
    return value


def kind_name(kind) -> str:
    return "number" if kind == (int, float) else "integer"


def parse_request(body, *, chat: bool, tokenizer, engine: Engine, model_name: str) -> Params:
    """The request body checked field by field (RequestError naming the field)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    model = body.get("model", model_name)
    if model != model_name:
        raise RequestError(f"unknown model {model!r}; this server serves {model_name!r}", "model")
    n = _number(body, "n", int, 1, 16, 1)
    max_tokens = _number(body, "max_tokens", int, 1, engine.layout.max_context, 16)
    if chat:
        max_tokens = _number(body, "max_completion_tokens", int, 1, 1 << 30, max_tokens)
    temperature = _number(body, "temperature", (int, float), 0.0, 2.0, 1.0 if n > 1 else 0.0)
    top_p = _number(body, "top_p", (int, float), 1e-6, 1.0, 1.0)
    top_k = _number(body, "top_k", int, -1, engine.vocab_size, 0)
    seed = _number(body, "seed", int, 0, (1 << 63) - 1, None)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 8:
        raise RequestError("'stop' must be a string or a list of at most 8 strings", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and 0 <= t < engine.vocab_size for t in stop_ids
    ):
        raise RequestError(
            f"'stop_token_ids' must be token ids in [0, {engine.vocab_size})", "stop_token_ids"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool) or (options and not stream):
        raise RequestError(
            "'stream_options' must be an object {'include_usage': bool}, with 'stream': true",
            "stream_options",
        )
    field = "messages" if chat else "prompt"
    prompt = _encode(body.get(field), chat, tokenizer, field)
    try:
        engine.check_fits(len(prompt), max_tokens)
    except ValueError as e:
        raise RequestError(str(e), field) from None
    sampling = SamplingParams(
        temperature=float(temperature), top_k=max(int(top_k), 0), top_p=float(top_p), seed=seed
    )
    eos = list(getattr(tokenizer, "eos_token_ids", ()))
    return Params([prompt] * n, max_tokens, sampling, stop, eos + stop_ids, n, stream, chat, usage)


def _encode(value, chat: bool, tokenizer, field: str) -> list[int]:
    from swajax import _validate

    try:
        if chat:
            if not isinstance(value, list) or not value:
                raise ValueError("must be a non-empty list of {'role', 'content'} messages")
            messages = []
            for m in value:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise ValueError(f"holds a message without a string 'role': {m!r}")
                content = m.get("content")
                if isinstance(content, list):  # OpenAI content parts: the text ones
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                if not isinstance(content, str):
                    raise ValueError(f"holds a message without text content: {m!r}")
                _validate.unicode_text("a message", content)
                messages.append({"role": m["role"], "content": content})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        elif isinstance(value, str):
            _validate.unicode_text("the prompt", value)
            ids = tokenizer.encode(value)
        elif isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            ids = value
        elif isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            ids = tokenizer.encode(value[0])
        else:
            raise ValueError("must be a string or a list of token ids")
    except ValueError as e:
        raise RequestError(f"'{field}' {e}", field) from None
    ids = list(ids)
    if not ids:
        raise RequestError(f"'{field}' is empty", field)
    return ids


class Server:
    """The app's state: the engine loop, the tokenizer, the metrics and the request limit."""

    def __init__(self, engine: Engine, tokenizer, *, model_name: str, max_waiting: int = 256):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_waiting = max_waiting
        r = self.registry = CollectorRegistry()
        self.m_running = Gauge("swajax_requests_running", "requests holding a row", registry=r)
        self.m_waiting = Gauge("swajax_requests_waiting", "requests queued", registry=r)
        self.m_slots = Gauge(
            "swajax_kv_slots_used", "KV slots held per pool group", ["group"], registry=r
        )
        self.m_prefix = Counter(
            "swajax_prefix_cache_hit_tokens",
            "prompt tokens served from the prefix cache",
            registry=r,
        )
        self.m_prompt = Counter("swajax_prompt_tokens", "prompt tokens admitted", registry=r)
        self.m_preempt = Counter("swajax_preemptions", "requests preempted", registry=r)
        self.m_drafted = Counter(
            "swajax_draft_tokens", "drafted tokens verified (speculative decoding)", registry=r
        )
        self.m_accepted = Counter("swajax_accepted_draft_tokens", "drafted tokens kept", registry=r)
        self.m_ttft = Histogram("swajax_time_to_first_token_seconds", "TTFT", registry=r)
        self.m_itl = Histogram("swajax_inter_token_latency_seconds", "ITL", registry=r)
        self.m_requests = Counter(
            "swajax_requests_finished", "requests by finish reason", ["reason"], registry=r
        )
        self._counted = engine.replicas.counters()
        self.loop = EngineLoop(engine, on_step=self._observe)

    def _observe(self, engine: Engine) -> None:
        """Gauges and counters after each step (on the loop's thread)."""
        schedulers = engine.replicas.schedulers
        self.m_running.set(sum(len(s.running) for s in schedulers))
        self.m_waiting.set(sum(len(s.waiting) for s in schedulers))
        for g, used in enumerate(engine.ledger.used()):
            self.m_slots.labels(group=str(g)).set(used)
        c = engine.replicas.counters()
        self.m_prefix.inc(c.prefix_tokens - self._counted.prefix_tokens)
        self.m_preempt.inc(c.preemptions - self._counted.preemptions)
        self.m_drafted.inc(c.draft_tokens - self._counted.draft_tokens)
        self.m_accepted.inc(c.accepted_tokens - self._counted.accepted_tokens)
        self._counted = c

    def waiting(self) -> int:
        return sum(len(s.waiting) for s in self.engine.replicas.schedulers)


def _add_error_handlers(app) -> None:
    """A bad request is HTTP 400 (503 with Retry-After when the queue is full) with an
    OpenAI-style error body naming the field."""

    @app.exception_handler(RequestError)
    async def request_error(request, e: RequestError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        err = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        return JSONResponse(RequestError(err.get("msg", "invalid request"), param).body(), 400)


def _add_info_routes(app, server: Server) -> None:
    """GET /health, /v1/models and /metrics (Prometheus text)."""

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "owned_by": "swajax",
                    "max_model_len": server.engine.layout.max_context,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import generate_latest

        return PlainTextResponse(generate_latest(server.registry).decode())


def create_app(server: Server):
    """The FastAPI app over `server` (its engine loop starts and stops with the app)."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()

    app = FastAPI(title="swajax", lifespan=lifespan)
    _add_error_handlers(app)
    _add_info_routes(app, server)

    async def completion(request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"malformed JSON: {e}", None) from None
        params = parse_request(
            body,
            chat=chat,
            tokenizer=server.tokenizer,
            engine=server.engine,
            model_name=server.model_name,
        )
        if server.waiting() + params.n > server.max_waiting:
            raise RequestError(
                f"{server.waiting()} requests are waiting (the limit is {server.max_waiting})",
                None,
                503,
            )
        run = _Run(server, params, chat)
        await run.submit()
        if params.stream:
            return StreamingResponse(run.events(request), media_type="text/event-stream")
        try:
            return JSONResponse(await run.result(request))
        finally:
            run.abort_unfinished()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    return app


class _Run:
    """One HTTP request's engine requests (n choices): submitted, decoded, cut at stop strings,
    and aborted when the client leaves."""

    def __init__(self, server: Server, params: Params, chat: bool):
        self.server, self.params, self.chat = server, params, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[int] = []
        self.done: set[int] = set()
        self.arrival = time.perf_counter()
        self.counts: dict[int, int] = {}  # choice -> tokens generated
        self.cached = 0  # prompt tokens of the first choice served from the prefix cache

    async def submit(self) -> None:
        loop = asyncio.get_running_loop()
        p = self.params
        for i, prompt in enumerate(p.prompts):
            sampling = p.sampling
            if sampling.seed is not None and p.n > 1:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + i)

            def sink(out, i=i):
                loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))

            try:
                self.rids.append(
                    self.server.loop.submit(prompt, p.max_tokens, sampling, p.stop_ids, sink)
                )
                self.server.m_prompt.inc(len(prompt))
            except ValueError as e:
                self.abort_unfinished()
                raise RequestError(str(e), "messages" if self.chat else "prompt") from None

    def abort_unfinished(self) -> None:
        for rid in self.rids:
            if rid not in self.done:
                self.server.loop.abort(rid)
                self.done.add(rid)

    async def outputs(self, request):
        """(choice index, RequestOutput) as they come; aborts when the client disconnects."""
        finished = 0
        while finished < len(self.rids):
            try:
                i, out = await asyncio.wait_for(self.queue.get(), 0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if out.finished:
                finished += 1
                self.done.add(out.request_id)
            yield i, out

    def _decoders(self):
        tok, stops = self.server.tokenizer, self.params.stops
        return (
            [tok.incremental_decoder(skip_special_tokens=True) for _ in self.rids],
            [StopStrings(stops) for _ in self.rids],
        )

    def _pieces(self, decoder, cut: StopStrings, out: RequestOutput) -> tuple[str, str | None]:
        """(text to send, finish reason or None) for one output."""
        known = self.server.tokenizer.vocab_size
        ids = [t for t in out.new_token_ids if t < known and t not in self.params.stop_ids]
        piece = decoder.feed(ids)
        if out.finished:
            piece += decoder.flush()
        text = cut.feed(piece, final=out.finished)
        if cut.hit:
            return text, "stop"
        if out.finished:
            reason = {"abort": "abort", "error": "error"}.get(out.finish_reason, out.finish_reason)
            return text, reason
        return text, None

    def _observe(self, out: RequestOutput, last: dict, i: int) -> None:
        now = time.perf_counter()
        s = self.server
        self.counts[i] = len(out.token_ids)
        if i == 0:
            self.cached = out.cached_tokens
        if out.new_token_ids:
            if i not in last:
                s.m_ttft.observe(now - self.arrival)
            else:
                s.m_itl.observe(now - last[i])
            last[i] = now
        if out.finished:
            s.m_requests.labels(reason=str(out.finish_reason)).inc()

    async def result(self, request) -> dict:
        decoders, cuts = self._decoders()
        k = len(self.rids)
        texts, reasons, counts, last = [""] * k, [None] * k, [0] * k, {}
        async for i, out in self.outputs(request):
            self._observe(out, last, i)
            if reasons[i] is not None:
                continue
            counts[i] = len(out.token_ids)
            text, reason = self._pieces(decoders[i], cuts[i], out)
            texts[i] += text
            if reason is not None:
                reasons[i] = reason
                if cuts[i].hit and not out.finished:
                    self.server.loop.abort(out.request_id)
        choices = []
        for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
            if self.chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": reason,
                    }
                )
            else:
                choices.append({"index": i, "text": text, "finish_reason": reason})
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
            "usage": self._usage(sum(counts)),
        }

    def _usage(self, completion: int) -> dict:
        """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache served."""
        prompt = len(self.params.prompts[0])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }

    def _chunk(self, i: int, text: str, reason, first: bool) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": i, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": i, "text": text, "finish_reason": reason}
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "choices": [choice],
        }
        return f"data: {json.dumps(body)}\n\n"

    async def events(self, request):
        """Server-sent events; leaving (a disconnect, a cancelled response) aborts the rest."""
        decoders, cuts = self._decoders()
        reasons, started, last = [None] * len(self.rids), set(), {}
        try:
            async for i, out in self.outputs(request):
                self._observe(out, last, i)
                if reasons[i] is not None:
                    continue
                text, reason = self._pieces(decoders[i], cuts[i], out)
                if text or reason is not None or i not in started:
                    yield self._chunk(i, text, reason, i not in started)
                    started.add(i)
                if reason is not None:
                    reasons[i] = reason
                    if cuts[i].hit and not out.finished:
                        self.server.loop.abort(out.request_id)
            if self.params.include_usage:
                body = {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created,
                    "model": self.server.model_name,
                    "choices": [],
                    "usage": self._usage(sum(self.counts.values())),
                }
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.abort_unfinished()


def serve(
    engine: Engine,
    tokenizer,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting: int = 256,
) -> None:
    """Runs the server until SIGINT / SIGTERM (uvicorn), then aborts what is in flight."""
    import uvicorn

    app = create_app(Server(engine, tokenizer, model_name=model_name, max_waiting=max_waiting))
    uvicorn.run(app, host=host, port=port, log_level="info")
