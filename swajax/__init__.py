"""swajax: a paged KV pool with sliding-window scratch reuse, and generation on it."""

from swajax._spec import LayerSpec

__all__ = ["LayerSpec"]
