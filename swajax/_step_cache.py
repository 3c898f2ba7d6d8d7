"""Lowered steps kept on disk between processes (`jax.export`), beside JAX's compilation cache.

With JAX's persistent compilation cache a new process still traces every step variant and
lowers it, Mosaic GPU kernels included, before it can look the executable up: for a Gemma 3 4B
prefill step that is 3.4 s on this project's CI machine, most of it lowering its Mosaic
GPU kernels (`experiments/NOTES.md` v12). This cache stores each variant the first time it is
lowered as a serialized `jax.export.Exported` of the step over its flattened arguments, with
the tree of its outputs. A later process with the same key deserializes it and calls it from a
thin jit (the same donation and compiler options), whose lowering only embeds the stored
module; the compiled executable then comes from the compilation cache as before. A step found
here is not traced (`swajax._runner.trace_count` does not move).

On by default; `SWAJAX_STEP_CACHE=0` turns it off. On the H200 an exported step updates its
pool roots in place as the plain jit does, and a warm process reached its first token in
2.6-3.0 s against 11.9-14.6 s with the compilation cache alone (`experiments/NOTES.md` v13).
Where:
`$SWAJAX_STEP_CACHE_DIR`, else `swajax-steps/` inside JAX's compilation cache directory (swajax
turns that cache on by default: `swajax._compilation_cache`); off without one. Not used with a
mesh.

Key: the step's static arguments (a digest of the model's GraphDef, the layout, decode,
implementation, sampling mode, logits), the arguments' tree, shapes and dtypes, the compiler
options, the backend and device kind, the jax, jaxlib and flax versions, a digest of the
source files of `swajax`, `gemma` and `pallas_kernels` (any code change is a new key), and the
jax settings that change lowering (matmul precision, x64, PRNG, Pallas debug checks); under a
forced Pallas mode (`pallas_kernels._checks.force_interpret` / `force_compiled`) the cache is
not used. Model code outside those packages (a user's own modules) is not in the key. A file
that cannot be read is exported again; a step that cannot be exported runs on the ordinary jit
path. Code patched at run time (monkeypatching a kernel or the model in a session) is
invisible to the key: keep the cache off (`SWAJAX_STEP_CACHE=0`, as the test suite does) while
doing that. The directory is trusted like JAX's own cache (the outputs' tree is a pickle);
nothing is evicted (a variant is 0.3-0.7 MiB).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import threading
import warnings
from pathlib import Path

import jax

_PACKAGES = ("swajax", "gemma", "pallas_kernels")
# jax settings that change how a step lowers (those this jax has)
_CONFIG = (
    "jax_default_matmul_precision",
    "jax_enable_x64",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_threefry_gpu_kernel_lowering",
    "jax_pallas_enable_debug_checks",
    "jax_pallas_poison_buffers",
    "jax_ragged_dot_use_gpu_pallas_triton_lowering",
    "jax_debug_key_reuse",
)


def _lowering_settings() -> tuple:
    """What besides the arguments changes a step's lowering in this process: the jax settings
    above and a forced Pallas mode (`pallas_kernels._checks.force_interpret/force_compiled`)."""
    from pallas_kernels import _checks

    config = tuple((k, str(getattr(jax.config, k, None))) for k in _CONFIG)
    return config, _checks._FORCED_MODE[0]


@functools.cache
def _versions() -> dict:
    out = {}
    for name in ("jax", "jaxlib", "flax"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = getattr(__import__(name), "__version__", "?")
    return out


@functools.cache
def source_digest() -> str:
    """sha256 over the source files of the packages a step is built from."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path | None:
    """The directory in use, or None (cache off: `SWAJAX_STEP_CACHE=0`)."""
    if os.environ.get("SWAJAX_STEP_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if os.environ.get("SWAJAX_STEP_CACHE_DIR"):
        return Path(os.environ["SWAJAX_STEP_CACHE_DIR"])
    jax_dir = jax.config.jax_compilation_cache_dir
    if not jax_dir or "://" in str(jax_dir):  # none, or a remote one (gs://...): off
        return None
    return Path(jax_dir) / "swajax-steps"


class CachedStep:
    """A jitted step with its exported lowering kept on disk, per argument shapes.

    Called like the jitted step it wraps (`step(*args)`, `step.trace(*args)`). `bound` is the
    step function the jit wraps (static arguments bound), `static_key` what identifies them.
    """

    def __init__(self, jitted, bound, static_key: str, *, donate_argnums, compiler_options):
        self._jitted = jitted
        self._bound = bound
        self._static_key = static_key
        self._donate = tuple(donate_argnums)
        self._options = dict(compiler_options)
        self._by_signature: dict = {}
        self._lock = threading.Lock()

    def __call__(self, *args):
        return self._function(args)(*args)

    def resolve(self, *args):
        """The callable for arguments shaped like `args` (loaded or exported once)."""
        return self._function(args)

    def trace(self, *args):
        return self._function(args).trace(*args)

    def _function(self, args):
        leaves, in_tree = jax.tree.flatten(args)
        avals = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
        settings = _lowering_settings()
        signature = (in_tree, avals, settings)
        fn = self._by_signature.get(signature)
        if fn is not None:
            return fn
        with self._lock:  # precompile lowers variants from several threads
            fn = self._by_signature.get(signature)
            if fn is None:
                fn = self._load_or_export(leaves, in_tree, avals, settings)
                self._by_signature[signature] = fn
        return fn

    def _key(self, in_tree, avals, settings) -> str:
        device = jax.devices()[0]
        parts = dict(
            step=self._static_key,
            tree=str(in_tree),
            avals=avals,
            options=sorted(self._options.items()),
            donate=self._donate,
            platform=device.platform,
            device_kind=device.device_kind,
            settings=settings,
            versions=_versions(),
            source=source_digest(),
        )
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()

    def _load_or_export(self, leaves, in_tree, avals, settings):
        directory = cache_dir()
        if directory is None or settings[1] is not None:  # off, or a forced Pallas mode
            return self._jitted
        path = directory / self._key(in_tree, avals, settings)
        try:
            exported = jax.export.deserialize(bytearray(path.with_suffix(".exported").read_bytes()))
            out_tree = pickle.loads(path.with_suffix(".tree").read_bytes())
        except Exception:  # noqa: BLE001 - missing or unreadable: export it (again)
            if not _can_serialize():
                return self._jitted
            try:
                exported, out_tree = self._export(leaves, in_tree)
                data = bytes(exported.serialize())
            except Exception as e:  # noqa: BLE001 - the ordinary jit still works
                message = f"swajax step cache: not exported ({e!r:.200}); jit as usual"
                warnings.warn(message, stacklevel=2)
                return self._jitted
            try:
                _write(path.with_suffix(".tree"), pickle.dumps(out_tree))
                _write(path.with_suffix(".exported"), data)
            except OSError as e:  # not stored (disk full, read-only): use it all the same
                warnings.warn(f"swajax step cache: not stored ({e!r:.200})", stacklevel=2)
        return self.call(exported, out_tree)

    @property
    def jitted(self):
        """The plain jitted step (no export): for lowering to another platform."""
        return self._jitted

    def export(self, *args, platforms=None):
        """(exported step, tree of its outputs) for arguments shaped like `args`, not stored."""
        leaves, in_tree = jax.tree.flatten(args)
        return self._export(leaves, in_tree, platforms)

    def call(self, exported, out_tree):
        """The jit that calls an exported step with this step's donation and options."""
        return call_exported(exported, out_tree, self._donate, self._options)

    def _export(self, leaves, in_tree, platforms=None):
        out_tree = []

        def flat(*flat_args):
            out = self._bound(*jax.tree.unflatten(in_tree, flat_args))
            out_leaves, tree = jax.tree.flatten(out)
            out_tree.append(tree)
            return out_leaves

        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        jitted = jax.jit(flat, compiler_options=self._options)
        exported = jax.export.export(jitted, platforms=platforms)(*specs)
        return exported, out_tree[0]


@functools.cache
def _can_serialize() -> bool:
    """`jax.export` serialization needs the flatbuffers package (a swajax dependency); without
    it the cache is off, with one warning per process."""
    try:
        import flatbuffers  # noqa: F401
    except ImportError:
        warnings.warn("swajax step cache off: the flatbuffers package is missing", stacklevel=3)
        return False
    return True


def resolve(step, args):
    """The callable of `step` for arguments shaped like `args`: a `CachedStep` resolves to its
    loaded or exported step (flattening the arguments once, not at every call); a plain jit
    is returned as it is."""
    return step.resolve(*args) if isinstance(step, CachedStep) else step


def load_kernel_runtimes(exported) -> None:
    """Mosaic GPU's custom calls find their runtime library through an environment variable
    that `jax.experimental.mosaic.gpu` sets when it is imported, as lowering a Pallas kernel
    does. A step loaded from this cache lowers no kernel, so without this import its first
    run fails ("Symbols not found: mosaic_gpu_launch_kernel")."""
    if "cuda" in exported.platforms:
        import jax.experimental.mosaic.gpu  # noqa: F401


def call_exported(exported, out_tree, donate_argnums, compiler_options):
    """A jit that calls the exported step on the flattened arguments (same donation)."""
    load_kernel_runtimes(exported)

    def run(*args):
        return jax.tree.unflatten(out_tree, exported.call(*jax.tree.leaves(args)))

    return jax.jit(run, donate_argnums=donate_argnums, compiler_options=compiler_options)


def _write(path: Path, data: bytes) -> None:
    """Written whole or not at all (a concurrent reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
