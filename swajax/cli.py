"""`python -m swajax`: the command line, argument parsing and dispatch only.

    python -m swajax generate --model DIR_OR_PRESET --input prompts.jsonl --output out.jsonl \\
        [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--chat] \\
        [--kv-cap BYTES] [--scratch on|off|auto] [--page-size N] [--max-batch N] \\
        [--dtype auto|bfloat16|float32] [--resume] [--tokenizer DIR] [--small] \\
        [--max-num-tokens N] [--prefill-chunk N] [--implementation auto|reference|pallas] \\
        [--no-prefix-caching] [--num-draft-tokens K] [--drafter ngram|DIR]
    python -m swajax info --model DIR_OR_PRESET [--kv-cap BYTES] [--max-context N] ...
    python -m swajax serve --model DIR_OR_PRESET [--host 127.0.0.1] [--port 8000] \
        [--max-waiting N] [engine options of generate]

`generate` runs `swajax.jsonl.generate_jsonl` (the JSONL input and output formats and
`--resume` are described there); `info` prints `swajax.plan.memory_plan`; `serve` runs the
OpenAI-compatible server of `swajax.serve` until SIGINT / SIGTERM. Every argument and
file is checked before a model loads: integer options in their range, the input a readable
file, the output a writable file in an existing directory and not the input file. A bad one is
an `error:` line and exit status 2.

`DIR_OR_PRESET`: a Hugging Face checkpoint directory (its tokenizer too, unless `--tokenizer`
names another), or `preset:NAME` (a `gemma.configs` preset with random weights and the
vocabulary of the `--tokenizer` directory; `--small` shrinks it with
`gemma.configs.small_preset`). `info` reads only the config: full-size presets are sized with
`jax.eval_shape`, nothing is allocated.

This module is an application entry point: it imports gemma (the `swajax` package does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from swajax._config import KVCacheConfig
from swajax._engine_config import EngineConfig
from swajax._sampling import SamplingParams, check_seed
from swajax.jsonl import DEFAULT_MAX_NEW_TOKENS, GenerateSummary, check_files, generate_jsonl
from swajax.plan import DEFAULT_CHUNK, DEFAULT_INFO_LENGTH, format_plan, memory_plan

PRESET_PREFIX = "preset:"
_UNIT_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


# ----------------------------------------------------------------------------- arguments


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '512M', '2GB', '1.5GiB' -> bytes: KiB..TiB and K..T are powers of
    1024, KB..TB powers of 1000. ValueError for anything else."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)\s*(?:([kmgt])(i?)(b?))?", str(text).strip(), re.I)
    if m is None:
        raise ValueError(f"a byte count must look like 1073741824, 512MiB or 2GB, got {text!r}")
    number, unit, binary, b = m.groups()
    base = 1000 if unit and b and not binary else 1024
    value = int(float(number) * base ** _UNIT_POWER[(unit or "").lower()])
    if value < 1:
        raise ValueError(f"a byte count must be >= 1, got {text!r}")
    return value


def _bytes_argument(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(minimum: int):
    """An argparse type: an int >= `minimum` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)
_non_negative_int = _int_at_least(0)


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {text!r}")
    return value


def _seed_argument(text: str) -> int:
    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [0, 2**63 - 1], got {text!r}"
        ) from None


def _dtype_name(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    import jax

    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def model_config(spec: str, *, small: bool = False, vocab_size: int | None = None):
    """The `gemma.TransformerConfig` of `DIR_OR_PRESET` (only config.json of a directory)."""
    import gemma

    if spec.startswith(PRESET_PREFIX):
        name = spec[len(PRESET_PREFIX) :]
        overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
        if small:
            return gemma.configs.small_preset(name, **overrides)
        return gemma.configs.preset(name, **overrides)
    if small:
        raise ValueError("--small applies to preset:NAME models only")
    directory = Path(spec)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"--model {spec!r} is neither preset:NAME nor a checkpoint directory with a "
            f"config.json; presets: {', '.join(gemma.configs.PRESET_NAMES)}"
        )
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(config_file)!r} is not valid JSON: {e}") from e
    try:
        return gemma.config_from_hf(hf)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{str(config_file)!r}: {e}") from e


def load_model(
    spec: str,
    *,
    tokenizer_dir: str | None = None,
    dtype: str = "auto",
    small: bool = False,
    seed: int = 0,
):
    """(model, tokenizer) of `DIR_OR_PRESET` (module docstring); dtype of the parameters."""
    import jax.numpy as jnp
    from flax import nnx

    import gemma

    dtype = jnp.dtype(_dtype_name(dtype))
    if spec.startswith(PRESET_PREFIX):
        if tokenizer_dir is None:
            raise ValueError(
                f"--model {spec!r} has random weights and no tokenizer: give a tokenizer "
                "directory with --tokenizer DIR"
            )
        tokenizer = gemma.load_tokenizer(tokenizer_dir)
        config = model_config(spec, small=small, vocab_size=tokenizer.vocab_size)
        model = gemma.Transformer(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)
        return model, tokenizer
    model_config(spec, small=small)  # names a bad directory before loading anything
    tokenizer = gemma.load_tokenizer(tokenizer_dir or spec)
    return gemma.from_pretrained(spec, dtype=dtype), tokenizer


# ----------------------------------------------------------------------------- main


def _kv_cache_config(args) -> KVCacheConfig:
    scratch = {"on": True, "off": False, "auto": None}[args.scratch]
    return KVCacheConfig(
        page_size=args.page_size,
        max_gpu_total_bytes=args.kv_cap,
        enable_swa_scratch_reuse=scratch,
        dtype=args.kv_dtype,
    )


def _common_options(q, dtype_default, max_batch_default):
    """The model and KV options of every command."""
    q.add_argument(
        "--model",
        required=True,
        metavar="DIR_OR_PRESET",
        help="a Hugging Face checkpoint directory, or preset:NAME (random weights)",
    )
    q.add_argument("--small", action="store_true", help="with preset:NAME: a shrunk preset")
    q.add_argument(
        "--kv-cap",
        type=_bytes_argument,
        default=None,
        metavar="BYTES",
        help="KV cache quota, e.g. 2GiB (default: 90%% of the device's free memory)",
    )
    q.add_argument("--scratch", choices=("on", "off", "auto"), default="auto")
    q.add_argument("--page-size", type=_positive_int, default=32)
    q.add_argument("--max-batch", type=_positive_int, default=max_batch_default)
    q.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default=dtype_default,
        help="parameter and KV dtype (auto: bfloat16 on a GPU, float32 on a CPU)",
    )


def _engine_options(q):
    """The engine options of `generate` and `serve` (`_engine_config`)."""
    q.add_argument(
        "--max-num-tokens", type=_positive_int, default=None, help="token budget of a step"
    )
    q.add_argument("--prefill-chunk", type=_positive_int, default=None)
    q.add_argument("--implementation", choices=("auto", "reference", "pallas"), default="auto")
    q.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn automatic prefix caching off (on by default)",
    )
    q.add_argument(
        "--num-draft-tokens",
        type=_nonnegative_int,
        default=0,
        help="speculative decoding: most drafted tokens per step (default 0: off)",
    )
    q.add_argument(
        "--drafter",
        type=_drafter_arg,
        default="ngram",
        help="what drafts with --num-draft-tokens: 'ngram' (prompt lookup, the default) or the "
        "directory of a Gemma 4 assistant checkpoint (model_type gemma4_assistant)",
    )


def _drafter_arg(value: str) -> str:
    """'ngram', or a directory whose config.json is a Gemma 4 assistant's."""
    if value == "ngram":
        return value
    config = Path(value) / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither 'ngram' nor a checkpoint directory with a readable "
            f"config.json ({e})"
        ) from e
    if model_type != "gemma4_assistant":
        raise argparse.ArgumentTypeError(
            f"{str(config)!r} has model_type {model_type!r}; a drafter checkpoint is a Gemma 4 "
            "assistant's (gemma4_assistant)"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swajax",
        description="Text generation on swajax's paged KV cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a result line for each line of a JSONL file")
    _common_options(g, "auto", None)
    g.add_argument("--input", required=True, help="prompts.jsonl")
    g.add_argument("--output", required=True, help="out.jsonl")
    g.add_argument("--tokenizer", default=None, metavar="DIR")
    g.add_argument("--max-new-tokens", type=_positive_int, default=DEFAULT_MAX_NEW_TOKENS)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=_non_negative_int, default=None)
    g.add_argument("--seed", type=_seed_argument, default=0)
    g.add_argument("--chat", action="store_true", help='"prompt" lines are user messages')
    g.add_argument("--resume", action="store_true", help="keep the results already written")
    _engine_options(g)
    g.add_argument("--no-progress", action="store_true")

    i = sub.add_parser("info", help="the KV layout and memory plan of a model (no weights)")
    _common_options(i, "bfloat16", 16)
    i.add_argument("--max-context", type=_positive_int, default=None, help="default: the model's")
    i.add_argument("--chunk", type=_positive_int, default=DEFAULT_CHUNK, help="prefill chunk")
    i.add_argument(
        "--input-len",
        type=_positive_int,
        default=DEFAULT_INFO_LENGTH,
        help="sequence length of the plan",
    )
    i.add_argument("--json", action="store_true", help="print the plan as JSON")

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (swajax.serve)")
    _common_options(v, "auto", 16)
    v.add_argument("--tokenizer", default=None, metavar="DIR")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=_port, default=8000)
    v.add_argument("--served-model-name", default=None, help="default: the --model value")
    v.add_argument("--max-context", type=_positive_int, default=None, help="default: the model's")
    _engine_options(v)
    v.add_argument(
        "--max-waiting",
        type=_positive_int,
        default=256,
        help="requests not yet running beyond which a request gets HTTP 503",
    )
    return p


def run(argv=None) -> GenerateSummary | dict:
    """`main` without the error handling: ValueError for bad input, argparse's SystemExit for
    an option out of its range. The options and files are checked before a model config is
    read or a model loads; the input's lines are checked by `generate_jsonl` before it
    generates anything."""
    args = _parser().parse_args(argv)
    args.kv_dtype = _dtype_name(args.dtype)
    cfg = _kv_cache_config(args)
    if args.command == "info":
        config = model_config(args.model, small=args.small)
        plan = memory_plan(
            config,
            cfg,
            max_context=args.max_context,
            max_batch=args.max_batch,
            chunk=args.chunk,
            input_len=args.input_len,
            param_dtype=args.kv_dtype,
        )
        print(json.dumps(plan, indent=1) if args.json else format_plan(plan, args.model))
        return plan
    if args.command == "serve":
        return _serve(args, cfg)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    check_files(args.input, args.output)
    config = _engine_config(args, cfg)  # ValueError before the model loads
    model, tokenizer = load_model(
        args.model,
        tokenizer_dir=args.tokenizer,
        dtype=args.dtype,
        small=args.small,
        seed=args.seed,
    )
    config = _with_drafter(args, config, model)
    summary = generate_jsonl(
        model,
        tokenizer,
        args.input,
        args.output,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        chat=args.chat,
        resume=args.resume,
        progress=not args.no_progress,
        config=config,
    )
    print(summary.line())
    return summary


def _engine_config(args, cfg: KVCacheConfig) -> EngineConfig:
    """The EngineConfig of `generate`'s and `serve`'s engine options."""
    return EngineConfig(
        kv_cache=cfg,
        max_context=getattr(args, "max_context", None),
        max_batch=args.max_batch,
        max_num_tokens=args.max_num_tokens,
        prefill_chunk_size=args.prefill_chunk,
        implementation=args.implementation,
        enable_prefix_caching=not args.no_prefix_caching,
        num_draft_tokens=args.num_draft_tokens,
    )


def _with_drafter(args, config: EngineConfig, model) -> EngineConfig:
    """config with --drafter's assistant loaded (in the model's dtype) when it names one."""
    if args.drafter == "ngram":
        return config
    from gemma._assistant import load_assistant

    return dataclasses.replace(config, drafter=load_assistant(args.drafter, dtype=model.dtype))


def _serve(args, cfg: KVCacheConfig) -> None:
    from swajax._engine import Engine
    from swajax.serve import serve

    config = _engine_config(args, cfg)  # ValueError before the model loads
    model, tokenizer = load_model(
        args.model, tokenizer_dir=args.tokenizer, dtype=args.dtype, small=args.small
    )
    engine = Engine(model, _with_drafter(args, config, model))
    serve(
        engine,
        tokenizer,
        model_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        max_waiting=args.max_waiting,
    )


def main(argv=None) -> int:
    """The command line; returns the exit status (2: bad input, 130: interrupted)."""
    try:
        run(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: every line in the output is complete; run the same command with "
            "--resume to continue",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
