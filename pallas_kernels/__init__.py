"""Pallas (Mosaic GPU) kernels for paged attention, each beside its pure-jnp reference."""
