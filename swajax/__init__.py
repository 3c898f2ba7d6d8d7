"""swajax: Gemma 3 / Gemma 4 served from a paged KV cache whose sliding-window layers share
scratch KV storage during long prefills.

The names here are what a user of the engine calls; the pool's algebra is `swajax.pool`, the
JSONL batch runner `swajax.jsonl`, the memory plan `swajax.plan`, the command line
`swajax.cli`. `docs/design.md` follows a request through the code. Names are imported on first
use: importing the scheduler (pure Python) does not import JAX.
"""

import importlib

# Public names and the module each lives in.
_EXPORTS = {
    "Engine": "swajax._engine",
    "EngineConfig": "swajax._engine_config",
    "KVCacheConfig": "swajax._config",
    "RequestOutput": "swajax._requests",
    "RunStats": "swajax._stats",
    "SamplingParams": "swajax._sampling",
    "TextChunk": "swajax._text",
    "TextOutput": "swajax._text",
    "generate": "swajax._generate",
    "generate_text": "swajax._text",
}
_SUBMODULES = ("cli", "jsonl", "plan", "pool")
__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"swajax.{name}")
    else:
        raise AttributeError(f"module 'swajax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
