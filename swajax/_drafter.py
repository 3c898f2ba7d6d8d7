"""Drafters for speculative decoding: what a request's next tokens probably are.

A drafter proposes up to k tokens to follow a sequence; the engine feeds them after the
request's last token in one step, the target model scores every position, and the request keeps
the longest run it agrees with (`swajax._sampling.verify_drafts`), so the output is the
target's whatever the drafter proposes. A drafter sees the request's tokens (prompt and output
so far) and nothing else. Besides `NgramDrafter` here, any `swajax.Engine` is a drafter
(`Engine.propose` / `propose_batch`: its model's greedy continuation, in its own KV pool).

A Gemma 4 assistant (`gemma.Gemma4Assistant`, Gemma 4's multi-token-prediction drafter) is
not called here: it drafts inside every step, on the target's final hidden state and the K/V
in the target's pages (`swajax._runner`), and the scheduler takes a request's drafts from the
step that drew its last token (`is_in_step`).

`NgramDrafter` is prompt-lookup decoding: the last n tokens are looked up earlier in the
sequence (n from `max_n` down to `min_n`, the most recent match first), and the tokens that
followed the match are proposed. It needs no model and gains where outputs repeat their
context (code, extraction, edits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    """Proposes tokens to follow a sequence."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens expected after `tokens` (fewer, or none, when it has no guess)."""
        ...


def is_in_step(drafter) -> bool:
    """Whether `drafter` drafts inside the step (a `gemma.Gemma4Assistant`)."""
    from gemma._assistant import Gemma4Assistant

    return isinstance(drafter, Gemma4Assistant)


class NgramDrafter:
    """Prompt lookup: the continuation of the most recent earlier match of the last n tokens.

    Args:
      max_n, min_n: the longest and shortest suffix looked up (1 <= min_n <= max_n).
      window: only the last `window` tokens are searched (bounds the host's work per step).
    """

    def __init__(self, max_n: int = 3, min_n: int = 1, window: int = 4096):
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an int >= 2, got {window!r}")
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        seq = list(tokens[-self.window :])
        last, end = seq[-1], len(seq) - 1
        best_n, best_at = 0, -1
        for i in range(end - 1, -1, -1):  # most recent first; the longest match wins
            if seq[i] != last:
                continue
            n = 1
            while n < self.max_n and i - n >= 0 and seq[i - n] == seq[end - n]:
                n += 1
            if n > best_n:
                best_n, best_at = n, i
                if n == self.max_n:
                    break
        if best_n < self.min_n:
            return []
        return seq[best_at + 1 : best_at + 1 + k]
