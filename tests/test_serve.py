"""The OpenAI-compatible server (`swajax.serve`) as clients use it: a real uvicorn server on
127.0.0.1 at a free port with the committed tiny model, called through the official `openai`
client (and raw HTTP for malformed bodies).

Oracles: `swajax.generate_text` on the same prompts (greedy), the engine's slot ledger after
disconnects, the OpenAI error body's `param`.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from test_text import TINY

import gemma
import swajax
from swajax.serve import Server, StopStrings, create_app

SETTINGS = dict(
    kv_cache=swajax.KVCacheConfig(page_size=16),
    max_context=512,
    max_batch=8,
    max_num_tokens=256,
    implementation="reference",
)
NAME = "tiny"
JACK = [{"role": "user", "content": "Say the rhyme Jack and Jill."}]


def http(method: str, url: str, body=None, raw: bytes | None = None):
    """(status, headers, text) of a plain HTTP request (errors included)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A uvicorn server in a thread, stopped by `close()` (its lifespan stops the engine loop)."""

    def __init__(self, engine, tok, **kw):
        import uvicorn

        self.server = Server(engine, tok, model_name=NAME, **kw)
        self.port = _free_port()
        config = uvicorn.Config(
            create_app(self.server), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def close(self):
        self.uvicorn.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def tiny():
    return gemma.from_pretrained(TINY), gemma.load_tokenizer(TINY)


@pytest.fixture(scope="module")
def served(tiny):
    model, tok = tiny
    engine = swajax.Engine(model, swajax.EngineConfig(**SETTINGS))
    running = Running(engine, tok)
    yield running
    running.close()


def lone_text(tiny, prompt, max_tokens, **kw):
    model, tok = tiny
    [out] = swajax.generate_text(model, tok, [prompt], max_tokens, **SETTINGS, **kw)
    return out


def test_completions_chat_and_streaming_equal_the_library(served, tiny):
    c = served.client
    want = lone_text(tiny, "Humpty Dumpty\n", 24)
    got = c.completions.create(model=NAME, prompt="Humpty Dumpty\n", max_tokens=24)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    chat = lone_text(tiny, JACK, 32)
    got = c.chat.completions.create(model=NAME, messages=JACK, max_tokens=32)
    assert got.choices[0].message.content == chat.text
    pieces = c.chat.completions.create(model=NAME, messages=JACK, max_tokens=32, stream=True)
    chunks = list(pieces)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat.text
    assert chunks[-1].choices[0].finish_reason == chat.finish_reason
    streamed = c.completions.create(
        model=NAME, prompt="Humpty Dumpty\n", max_tokens=24, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed) == want.text
    assert [m.id for m in c.models.list().data] == [NAME]
    assert json.loads(http("GET", served.url + "/health")[2]) == {"status": "ok"}
    metrics = http("GET", served.url + "/metrics")[2]
    for name in (
        "swajax_requests_running",
        "swajax_kv_slots_used",
        "swajax_prefix_cache_hit",
        "swajax_time_to_first_token_seconds",
        "swajax_inter_token_latency_seconds",
        "swajax_draft_tokens",
    ):
        assert name in metrics, name


def test_usage_counts_cached_prompt_tokens_and_streams_at_the_end(served, tiny):
    """A chat's second turn extends the first: `usage.prompt_tokens_details.cached_tokens`
    counts the prompt tokens the prefix cache served (whole pages of the first turn's
    history: at least its prompt's whole pages), the first turn's is 0; with
    `stream_options.include_usage` the last chunk before [DONE] has no choices and the same
    usage as the plain response."""
    c = served.client
    page = SETTINGS["kv_cache"].page_size
    first = [{"role": "user", "content": "Tell me a long rhyme about a garden " * 3}]
    one = c.chat.completions.create(model=NAME, messages=first, max_tokens=20)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    history = one.usage.prompt_tokens + one.usage.completion_tokens
    second = first + [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "And another."},
    ]
    two = c.chat.completions.create(model=NAME, messages=second, max_tokens=8)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= history and cached % page == 0, (cached, history)
    # at least the first turn's prompt (its answer's tokens count where they re-encode alike)
    assert cached >= one.usage.prompt_tokens // page * page
    chunks = list(
        c.chat.completions.create(
            model=NAME,
            messages=second,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == two.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == two.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(
            model=NAME, prompt="a", max_tokens=2, stream_options={"include_usage": True}
        )
    assert e.value.body["param"] == "stream_options"
    card = http("GET", served.url + "/v1/models")[2]
    assert json.loads(card)["data"][0]["max_model_len"] == SETTINGS["max_context"]


def test_stop_strings_cut_the_text(served, tiny):
    want = lone_text(tiny, JACK, 32).text
    stop = want[5:9]
    assert stop and stop in want
    got = served.client.chat.completions.create(
        model=NAME, messages=JACK, max_tokens=32, stop=[stop]
    )
    assert got.choices[0].message.content == want[: want.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = served.client.chat.completions.create(
        model=NAME, messages=JACK, max_tokens=32, stop=stop, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed)
    assert text == want[: want.index(stop)]


def test_stop_string_holdback_by_hand():
    cut = StopStrings(["END"])
    assert cut.feed("abc E") == "abc "  # "E" may start "END"
    assert cut.feed("N") == ""
    assert cut.feed("Dxyz") == "" and cut.hit and cut.text == "abc "
    free = StopStrings(["END"])
    assert free.feed("abc E") == "abc " and free.feed("x", final=True) == "Ex"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "other", "prompt": "a"}, "model"),
        ({"model": NAME, "prompt": "a " * 2000}, "prompt"),
        ({"model": NAME, "prompt": "a", "temperature": -1}, "temperature"),
        ({"model": NAME, "prompt": "a", "top_p": 0}, "top_p"),
        ({"model": NAME, "prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"model": NAME, "prompt": "a", "n": 99}, "n"),
        ({"model": NAME, "prompt": "a", "stop": [1, 2]}, "stop"),
        ({"model": NAME, "prompt": 5}, "prompt"),
    ],
)
def test_bad_requests_are_400_naming_the_field(served, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(**body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_bad_chat_and_malformed_json(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model=NAME, messages=[])
    assert e.value.body["param"] == "messages"
    # a lone surrogate, as JSON can spell it (the openai client cannot send one)
    status, _, text = http(
        "POST", served.url + "/v1/completions", raw=b'{"model": "tiny", "prompt": "a\\ud800"}'
    )
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt", text
    status, _, text = http("POST", served.url + "/v1/completions", raw=b"{not json")
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in text


def test_too_many_waiting_is_503_with_retry_after(tiny):
    model, tok = tiny
    engine = swajax.Engine(model, swajax.EngineConfig(**SETTINGS))
    running = Running(engine, tok, max_waiting=0)
    try:
        status, headers, _ = http(
            "POST", running.url + "/v1/completions", {"model": NAME, "prompt": "a"}
        )
        assert status == 503 and headers["retry-after"] == "1"
    finally:
        running.close()


def test_32_concurrent_streams_8_disconnect(served, tiny):
    """32 streaming clients at once: the 24 that read to the end get a lone request's text
    (greedy); 8 close their stream after two chunks. Afterwards no slot is held (parked
    prefixes cleared) and the server still answers."""
    prompts = [f"Humpty Dumpty {i}\n" for i in range(32)]
    want = {p: lone_text(tiny, p, 24).text for p in prompts[:24]}
    got, errors = {}, []

    def client(i):
        try:
            stream = served.client.completions.create(
                model=NAME, prompt=prompts[i], max_tokens=24, stream=True
            )
            if i >= 24:
                for k, _ in enumerate(stream):
                    if k == 1:
                        break
                stream.close()
                return
            got[prompts[i]] = "".join(ch.choices[0].text for ch in stream)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a client hung"
    assert not errors, errors[:3]
    assert got == want
    engine = served.server.engine
    deadline = time.monotonic() + 30
    while served.server.loop.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.server.loop.in_flight == 0
    engine.clear_prefix_cache()
    assert tuple(engine.ledger.used()) == (0,) * len(engine.num_slots)
    assert served.client.completions.create(model=NAME, prompt="a", max_tokens=2).choices


def test_bench_serve_drives_the_server_and_reports_reuse(served, tmp_path):
    """`experiments/bench_serve.py --quick` against this server (`--url`; the script can also
    start `python -m swajax serve` itself, as on the GPU): every request completes, the
    multi-turn chat serves >= 80 % of its reusable prompt tokens from the prefix cache, the
    JSON holds the percentiles and the server's metrics."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("_experiments_bench_serve", path)
    bench_serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_serve)
    out = tmp_path / "serve.json"
    assert bench_serve.main(["--quick", "--url", served.url, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    [rate] = res["rates"]
    assert rate["completed"] == rate["requests"] == 8 and not rate["errors"]
    assert rate["output_tokens"] > 0 and rate["ttft_s"]["p50"] > 0 and rate["itl_s"]["p50"] > 0
    chat = res["chat"]
    assert all(t["completed"] == chat["sessions"] for t in chat["turns"])
    assert chat["turns"][0]["cached_tokens"] == 0 and chat["reuse"] >= 0.8, chat
    assert any(line.startswith("swajax_prefix_cache_hit_tokens") for line in res["metrics"])
