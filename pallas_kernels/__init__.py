"""Pallas (Mosaic GPU) kernels for paged attention, each beside its pure-jnp reference.

Conventions shared by every kernel (the contract with `swajax`):

- Pool root: [num_pages, page_size, num_kv_heads, head_dim], page-major; bf16, float32 or
  float8_e4m3fn. K and V pages of a (layer, slot) are adjacent: page = slot*scale + 2*j + role
  (role 0 = K, 1 = V), so V page = K page + 1.
- A layer's page table: i32[batch, 2, max_blocks] (role 0 = K pages, role 1 = V pages);
  BAD = -1 means no page. Block o of a sequence holds tokens [o*page_size, (o+1)*page_size).
- The step's new tokens are packed along one token axis of static (bucketed) length T:
  q_starts i32[batch + 1] are non-decreasing cumulative starts (rows >= q_starts[batch] are
  padding; a sequence with no new tokens has q_starts[b] == q_starts[b+1]); kv_lens i32[batch]
  is each sequence's context after the step. New token r of sequence b sits at position
  kv_lens[b] - q_len_b + r.
- A query at position i sees keys at positions j <= i with i - j < window (window None: all).
  Logits s = scale * q.k, then softcap * tanh(s / softcap) if a soft-cap is given. GQA: query
  head h reads KV head h // (Hq // Hkv).
- fp8 KV: stored = round(x / scale), read = stored * scale, with float32 k_scale / v_scale.
- Kernels never read a BAD page nor a page wholly outside every query's window.
- `implementation`: "reference" (pure jnp), "pallas" (the Mosaic GPU kernel; interpret mode
  off a GPU) or "auto" (the kernel on a Hopper GPU where it supports the case).
"""

import importlib

# Public names and the module each lives in, imported on first use: importing one kernel (or
# `pallas_kernels._contract`, which the pool shares) does not import the others.
_EXPORTS = {
    "kv_write": "pallas_kernels.kv_write",
    "kv_write_reference": "pallas_kernels.kv_write",
    "paged_decode_attention": "pallas_kernels.paged_attention",
    "paged_decode_attention_reference": "pallas_kernels.paged_attention",
    "ragged_paged_attention": "pallas_kernels.paged_attention",
    "ragged_paged_attention_reference": "pallas_kernels.paged_attention",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        # Every export of that module at once: importing `pallas_kernels.kv_write` makes the
        # package attribute `kv_write` that submodule, which the function must replace.
        for other, where in _EXPORTS.items():
            if where == _EXPORTS[name]:
                globals()[other] = getattr(module, other)
        return globals()[name]
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
