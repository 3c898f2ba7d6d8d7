"""What the kernels and the KV pool agree on, defined once (pure Python, no JAX).

- `BAD` (-1): the page id that means "no page" (unallocated, stale and released, or backed by
  scratch in a base table). Every conversion passes it through; kernels never read a BAD page.
- `MASK_VALUE`: the logit of a masked key (large, finite: a row with every key masked stays
  finite, where -inf would give NaN).
- `rotate(p, scale, layer_offset)`: the scratch rotation of relative block p of a scratch
  range (`docs/design.md`, "SWA scratch reuse").
"""

BAD = -1
MASK_VALUE = -1e30


def rotate(p, scale: int, layer_offset):
    """Scratch rotation of relative block p: (index into the scratch slots, page within slot).

    Works on Python ints, NumPy and jnp arrays. `scale` is even and `layer_offset` = 2*j + role,
    so the page within the slot keeps the role's parity: V = K + 1.
    """
    t = p * 2
    return t // scale, (t % scale + layer_offset) % scale
