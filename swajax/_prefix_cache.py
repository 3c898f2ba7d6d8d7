"""The prefix cache: parked prefixes of earlier sequences that new requests start from.

An entry is a batch row of the pool (a *cache row*, past the serving rows) that holds, by
reference, the blocks of the first `k` tokens of some sequence (k a multiple of the page size):
every block of full layers and, of sliding layers, the window ending at k (`share_prefix`). A
request whose tokens start with the first j whole blocks of an entry is admitted into a row that
shares those blocks and prefills from j * page_size on (`longest_shared`: the longest such j of
any entry whose blocks for it are still held, so a chat turn whose re-encoded history parts from
the parked one inside the answer still starts from the blocks they share). Entries are found by
hashes chained over whole blocks (block i's hash covers its tokens and every block before it),
indexed at every block of every entry, and confirmed token by token.

Three kinds of entries:
  - "boundary": parked when a request's prefill reaches a block boundary that other queued
    requests share (the step ends exactly there, so with scratch reuse on the window ending at
    the boundary is in normal pages, never scratch);
  - "prompt": parked when a request's prefill ends, its sequence floored to a block, where the
    row still holds the window ending there: the next turn of a conversation starts with this
    prompt even where its re-encoded answer differs from the generated tokens;
  - "finished": a finished request's whole history (prompt and generated tokens, floored to a
    block), so the next turn of a conversation, which extends it, starts from it.

Entries are evicted least recently used (a hit or a park counts as use) when admission needs
their slots or a new entry needs a row; a "prompt" or "finished" entry (speculative) may only
displace another speculative one, so they never push out prefixes that queued requests want,
and a new speculative entry drops an older one that it extends (the same conversation's earlier
turn).

Pure Python: the slots an entry holds are counted by the scheduler's `SlotLedger`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

# Entries parked for requests that may never come: they displace only each other.
SPECULATIVE = ("prompt", "finished")


@dataclasses.dataclass(eq=False)
class PrefixEntry:
    row: int
    tokens: tuple[int, ...]  # the parked prefix, len(tokens) = k
    kind: str  # "boundary" or "finished"
    last_used: int = 0
    hits: int = 0


def block_hashes(tokens: Sequence[int], page_size: int, num_blocks: int | None = None) -> list:
    """Chained hashes of the first whole blocks of `tokens`: [h_1, ..., h_n], h_i covers
    blocks 0..i-1 (the first i * page_size tokens)."""
    n = len(tokens) // page_size if num_blocks is None else num_blocks
    out, h = [], 0
    for i in range(n):
        h = hash((h, tuple(tokens[i * page_size : (i + 1) * page_size])))
        out.append(h)
    return out


class PrefixCache:
    """Entries by (k, chained hash); LRU by a use counter."""

    KINDS = ("boundary", "prompt", "finished")

    def __init__(self, page_size: int, rows: Sequence[int]):
        self.page_size = page_size
        self.rows = tuple(rows)
        self.entries: dict[tuple[int, int], PrefixEntry] = {}
        self._by_block: dict[tuple[int, int], list[PrefixEntry]] = {}  # every block prefix
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self.entries)

    def _key(self, tokens: Sequence[int]) -> tuple[int, int]:
        k = len(tokens)
        return k, block_hashes(tokens, self.page_size)[-1] if k else 0

    def lookup(self, tokens: Sequence[int], limit: int) -> PrefixEntry | None:
        """The entry of the longest parked prefix of `tokens` with k <= limit, or None."""
        if not self.entries:
            return None
        hashes = block_hashes(tokens, self.page_size, min(len(tokens), limit) // self.page_size)
        for i in range(len(hashes), 0, -1):
            entry = self.entries.get((i * self.page_size, hashes[i - 1]))
            if entry is not None and entry.tokens == tuple(tokens[: i * self.page_size]):
                return entry
        return None

    def longest_shared(
        self, tokens: Sequence[int], limit: int, shareable
    ) -> tuple[PrefixEntry | None, int]:
        """(entry, k): the entry sharing the longest block-aligned prefix k <= limit with
        `tokens` for which `shareable(entry, k)` holds (its blocks for k still held), most
        recently used first among equals; (None, 0) if none."""
        if not self.entries:
            return None, 0
        n = min(len(tokens), limit) // self.page_size
        hashes = block_hashes(tokens, self.page_size, n)
        for i in range(n, 0, -1):
            k = i * self.page_size
            found = self._by_block.get((k, hashes[i - 1]), ())
            for entry in sorted(found, key=lambda e: -e.last_used):
                if entry.tokens[:k] == tuple(tokens[:k]) and shareable(entry, k):
                    return entry, k
        return None, 0

    def contains(self, tokens: Sequence[int]) -> bool:
        entry = self.entries.get(self._key(tokens))
        return entry is not None and entry.tokens == tuple(tokens)

    def touch(self, entry: PrefixEntry, hit: bool = False) -> None:
        entry.last_used = next(self._clock)
        entry.hits += hit

    def free_row(self) -> int | None:
        used = {e.row for e in self.entries.values()}
        return next((r for r in self.rows if r not in used), None)

    def lru(self, kinds=KINDS, protect=()) -> PrefixEntry | None:
        """The least recently used entry of `kinds` not in `protect`, or None."""
        candidates = [e for e in self.entries.values() if e.kind in kinds and e not in protect]
        return min(candidates, key=lambda e: e.last_used, default=None)

    def add(self, row: int, tokens: Sequence[int], kind: str) -> PrefixEntry:
        assert kind in self.KINDS and row in self.rows and len(tokens) % self.page_size == 0
        entry = PrefixEntry(row, tuple(tokens), kind)
        self.touch(entry)
        self.entries[self._key(tokens)] = entry
        for i, h in enumerate(block_hashes(tokens, self.page_size)):
            self._by_block.setdefault(((i + 1) * self.page_size, h), []).append(entry)
        return entry

    def remove(self, entry: PrefixEntry) -> None:
        del self.entries[self._key(entry.tokens)]
        for i, h in enumerate(block_hashes(entry.tokens, self.page_size)):
            key = ((i + 1) * self.page_size, h)
            left = [e for e in self._by_block[key] if e is not entry]
            if left:
                self._by_block[key] = left
            else:
                del self._by_block[key]
