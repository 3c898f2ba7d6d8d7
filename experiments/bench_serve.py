"""Load against the OpenAI-compatible server: latency percentiles under a request rate, and
prefix-cache reuse in a multi-turn chat.

    # GPU: a preset with random weights, three rates up to saturation, then the chat mode
    SWAJAX_GIT_COMMIT=... PYTHONPATH=. python3 experiments/bench_serve.py \
        --model preset:gemma3_1b --rates 2,8,inf --requests 128 --chat --out $OUT/serve.json
    # CPU: the committed tiny model (what tests/test_experiments.py runs)
    PYTHONPATH=. .venv/bin/python experiments/bench_serve.py --quick --out /tmp/serve.json

The script starts `python -m swajax serve --model ...` (the server a user runs; `--server-arg`
passes more options) on a free port, or uses `--url`. Clients are the `openai` package,
streaming, one thread per request.

- Rate mode, per rate: `--requests` completions arrive as a Poisson process (`inf`: all at
  once), prompt and output lengths drawn from a seeded log-normal mix shaped like ShareGPT's
  (median prompt ~`--input-len`, median output ~`--output-len`, clipped to the context);
  prompts are token-id lists, so their lengths are exact; greedy. Per request: TTFT (send ->
  first token chunk), inter-token gaps, end-to-end latency, output tokens (`usage`).
- Chat mode (`--chat`): `--sessions` conversations of `--turns` turns, round robin (every
  session's turn t, concurrently, then turn t + 1), each turn the whole history plus a new user
  message; reusable tokens of a turn = the prompt tokens of the history it extends (the earlier
  turn's prompt and answer); served from the cache = `usage.prompt_tokens_details.
  cached_tokens`. The ratio is the figure the issue asks >= 80 % of.

Writes JSON (device, versions, commit, every parameter; per rate p50 / p90 / p99 of TTFT, ITL
and end-to-end latency, request and output-token throughput; the chat mode's reuse) and prints
a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments._meta import run_metadata  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_model")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m swajax serve` in a child process, stopped with SIGINT (a clean shutdown)."""

    def __init__(self, model: str, args: list[str], timeout: float, log: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "swajax", "serve", "--model", model, "--port", str(self.port)]
        self.log = open(log, "w")  # noqa: SIM115
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            cmd + args, stdout=self.log, stderr=subprocess.STDOUT, cwd=root, env=env
        )
        start = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - start > timeout:
                self.close()
                raise TimeoutError(f"the server did not answer /health in {timeout} s; see {log}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - start

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def lengths(rng, n: int, median: int, sigma: float, low: int, high: int) -> list[int]:
    """Seeded log-normal lengths (ShareGPT's prompt and answer lengths are roughly log-normal
    with sigma ~1), clipped to [low, high]."""
    x = rng.lognormal(math.log(median), sigma, n)
    return [int(v) for v in np.clip(np.round(x), low, high)]


def one_request(client, kind: str, payload: dict, t_send: float) -> dict:
    """Streams one request; times from `t_send` (its scheduled arrival)."""
    rec = dict(ok=False)
    chunks = []
    usage = None
    try:
        create = client.chat.completions.create if kind == "chat" else client.completions.create
        stream = create(stream=True, stream_options={"include_usage": True}, **payload)
        text = []
        for ev in stream:
            now = time.perf_counter()
            if ev.usage is not None:
                usage = ev.usage
            for c in ev.choices:
                piece = c.delta.content if kind == "chat" else c.text
                if piece:
                    chunks.append(now)
                    text.append(piece)
        rec.update(ok=True, text="".join(text))
    except Exception as e:  # noqa: BLE001
        rec["error"] = repr(e)[:300]
    end = time.perf_counter()
    rec["e2e_s"] = end - t_send
    if chunks:
        rec["ttft_s"] = chunks[0] - t_send
        rec["itl_s"] = list(np.diff(chunks))
    if usage is not None:
        rec["prompt_tokens"] = usage.prompt_tokens
        rec["output_tokens"] = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        rec["cached_tokens"] = getattr(details, "cached_tokens", 0) or 0
    return rec


def percentiles(values) -> dict:
    if not len(values):
        return {}
    v = np.asarray(values, float)
    return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)} | {"mean": float(v.mean())}


def rate_run(client, rate: float, args, rng, context: int) -> dict:
    n = args.requests
    ins = lengths(rng, n, args.input_len, 1.0, 4, context // 2)
    outs = lengths(rng, n, args.output_len, 0.8, 1, max(1, context // 2))
    arrivals = np.zeros(n) if math.isinf(rate) else np.cumsum(rng.exponential(1.0 / rate, n))
    vocab = args.vocab
    prompts = [rng.integers(3, vocab, k).tolist() for k in ins]
    recs: list[dict | None] = [None] * n
    start = time.perf_counter()

    def go(i):
        t_send = start + arrivals[i]
        time.sleep(max(0.0, t_send - time.perf_counter()))
        payload = dict(
            model=args.model_name, prompt=prompts[i], max_tokens=outs[i], temperature=0.0
        )
        recs[i] = one_request(client, "completion", payload, t_send)

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in recs if r and r["ok"]]
    out_tokens = sum(r.get("output_tokens", 0) for r in ok)
    return dict(
        rate=None if math.isinf(rate) else rate,
        requests=n,
        completed=len(ok),
        errors=[r["error"] for r in recs if r and not r["ok"]][:5],
        wall_s=wall,
        request_throughput=len(ok) / wall,
        output_token_throughput=out_tokens / wall,
        prompt_tokens=sum(ins),
        output_tokens=out_tokens,
        ttft_s=percentiles([r["ttft_s"] for r in ok if "ttft_s" in r]),
        itl_s=percentiles([g for r in ok for g in r.get("itl_s", [])]),
        e2e_s=percentiles([r["e2e_s"] for r in ok]),
    )


WORDS = (
    "the a of to in garden river window morning quiet yellow cloud stone bread letter music "
    "friend road winter light small open city train paper green story field"
).split()


def chat_run(client, args, rng) -> dict:
    """Round-robin multi-turn chat; reuse = cached tokens / the earlier turn's tokens."""
    sessions = [[] for _ in range(args.sessions)]
    last_total = [0] * args.sessions  # prompt + answer tokens of each session's last turn
    turns = []
    for turn in range(args.turns):
        recs: list[dict | None] = [None] * args.sessions

        def go(s, turn=turn, recs=recs):
            words = " ".join(rng.choice(WORDS, args.chat_words))
            messages = sessions[s] + [{"role": "user", "content": f"Turn {turn}: {words}"}]
            payload = dict(
                model=args.model_name,
                messages=messages,
                max_tokens=args.chat_output,
                temperature=0.0,
            )
            recs[s] = one_request(client, "chat", payload, time.perf_counter())
            recs[s]["messages"] = messages

        threads = [threading.Thread(target=go, args=(s,), daemon=True) for s in range(len(recs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        reusable = cached = 0
        for s, r in enumerate(recs):
            if not r["ok"]:
                continue
            sessions[s] = r["messages"] + [{"role": "assistant", "content": r["text"]}]
            if turn:
                reusable += last_total[s]
                cached += r.get("cached_tokens", 0)
            last_total[s] = r.get("prompt_tokens", 0) + r.get("output_tokens", 0)
        turns.append(
            dict(
                turn=turn,
                completed=sum(bool(r["ok"]) for r in recs),
                errors=[r["error"] for r in recs if not r["ok"]][:3],
                reusable_tokens=reusable,
                cached_tokens=cached,
                prompt_tokens=sum(r.get("prompt_tokens", 0) for r in recs),
                ttft_s=percentiles([r["ttft_s"] for r in recs if "ttft_s" in r]),
            )
        )
    reusable = sum(t["reusable_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    return dict(
        sessions=args.sessions,
        turns=turns,
        reusable_tokens=reusable,
        cached_tokens=cached,
        reuse=cached / reusable if reusable else None,
    )


def _print(res: dict) -> None:
    print(f"server start {res.get('server_startup_s', float('nan')):.1f} s")
    print(
        f"{'rate':>6} {'done':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99':>7} "
        f"{'ITL p50':>8} {'p99':>7} {'E2E p50':>8} {'p99':>7}  (seconds, ms for ITL)"
    )
    for r in res["rates"]:
        t, i, e = r["ttft_s"], r["itl_s"], r["e2e_s"]
        rate = "inf" if r["rate"] is None else f"{r['rate']:g}"
        print(
            f"{rate:>6} {r['completed']:>5} {r['request_throughput']:7.2f} "
            f"{r['output_token_throughput']:8.1f} {t.get('p50', 0):9.3f} {t.get('p99', 0):7.3f} "
            f"{i.get('p50', 0) * 1e3:8.1f} {i.get('p99', 0) * 1e3:7.1f} {e.get('p50', 0):8.2f} "
            f"{e.get('p99', 0):7.2f}"
        )
    if res.get("chat"):
        c = res["chat"]
        reuse = "n/a" if c["reuse"] is None else f"{100 * c['reuse']:.1f} %"
        print(
            f"chat {c['sessions']} sessions x {len(c['turns'])} turns: {c['cached_tokens']} of "
            f"{c['reusable_tokens']} reusable prompt tokens from the prefix cache ({reuse})"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=TINY, help="DIR or preset:NAME (the server's --model)")
    p.add_argument("--url", default=None, help="an already running server (skip the start)")
    p.add_argument("--server-arg", action="append", default=[], help="more `serve` options")
    p.add_argument("--rates", default="2,8,inf", help="requests per second; inf: all at once")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="median prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="median output tokens")
    p.add_argument("--chat", action="store_true", help="also the multi-turn chat mode")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--chat-words", type=int, default=24, help="words per user message")
    p.add_argument("--chat-output", type=int, default=48, help="max tokens of each answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--quick", action="store_true", help="CPU smoke: the tiny model, small load")
    p.add_argument("--out", default="experiments/results/serve.json")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.rates, args.requests = TINY, "inf", 8
        args.input_len, args.output_len, args.sessions, args.turns = 24, 8, 3, 3
        args.chat, args.chat_words, args.chat_output = True, 6, 8
        args.server_arg = args.server_arg or [
            "--max-batch=4",
            "--max-context=512",
            "--page-size=16",
            "--implementation=reference",
        ]
    if args.model.startswith("preset:") and not any(
        a.startswith("--tokenizer") for a in args.server_arg
    ):
        # random weights need a tokenizer: the tiny model's (the preset takes its vocabulary)
        args.server_arg = [*args.server_arg, f"--tokenizer={TINY}"]
    import openai

    server = None
    if args.url is None:
        log = os.path.splitext(args.out)[0] + "_server.log"
        server = ServerProcess(args.model, args.server_arg, args.startup_timeout, log)
        url = server.url
    else:
        url = args.url.rstrip("/")
    res = run_metadata(
        **{k: v for k, v in vars(args).items() if k not in ("out", "url")}, url=url, client="openai"
    )
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            card = json.load(r)["data"][0]
        args.model_name = card["id"]
        res["served_model"] = args.model_name
        if server is not None:
            res["server_startup_s"] = server.startup_s
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        args.vocab = _vocab_size(args.model, args.server_arg)
        context = int(card["max_model_len"])
        rng = np.random.default_rng(args.seed)
        # warm the server's compiled steps so the first rate does not time compilation
        one_request(
            client,
            "completion",
            dict(model=args.model_name, prompt=[5, 6, 7], max_tokens=2, temperature=0.0),
            time.perf_counter(),
        )
        res["rates"] = []
        for rate in [float(r) for r in args.rates.split(",")]:
            res["rates"].append(rate_run(client, rate, args, rng, context))
            _save(res, args.out)
        if args.chat:
            res["chat"] = chat_run(client, args, rng)
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            res["metrics"] = [
                line for line in r.read().decode().splitlines() if line.startswith("swajax_")
            ]
    finally:
        if server is not None:
            res["server_exit_code"] = server.close()
        _save(res, args.out)
    _print(res)
    return 0


def _vocab_size(model: str, server_args: list[str]) -> int:
    """The served model's vocabulary: a preset's is its tokenizer's (`swajax.cli.load_model`)."""
    if model.startswith("preset:"):
        import gemma

        tokenizer = [a.split("=", 1)[1] for a in server_args if a.startswith("--tokenizer=")]
        if tokenizer:
            return gemma.load_tokenizer(tokenizer[-1]).vocab_size
        return gemma.configs.preset(model.split(":", 1)[1]).vocab_size
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return int(cfg.get("text_config", cfg).get("vocab_size"))


def _save(res: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
