"""The prefix cache: blocks of earlier sequences that new requests start from.

The cache names whole blocks of token sequences. A *node* is one block of some sequence: its
tokens and its parent (the node of the block before it, None for a first block), so a node at
depth j stands for the first j blocks of every sequence that passes through it. Nodes form a
tree indexed by (parent, block tokens), exact (no hash can collide). A node's id, in
[0, layout.cache_nodes), indexes the device's `KVPoolState.cached[g]`: the slot holding that
block's KV in pool group g, by reference. A node may name a block in some groups and not in
others: a row holds every block of its full layers but, of its sliding layers, only those not
yet released out of window.

A request whose tokens pass through nodes n_1 .. n_j starts from k = j * page_size tokens when
every block a row of history k reads is cached (`SlotLedger.can_adopt`: every block of a full
group, of a sliding group the window ending at k and the rewind pages before it): the longest
such j (`longest_hit`). Its row then references those slots (`adopt`) and prefills from k on.

Blocks are cached (`park`) at three points of a sequence's life, each the first k tokens of
the sequence, k a multiple of the page size:
  - a *boundary*: the prefix a running prefill shares with queued requests, parked when the
    step ends exactly there (with scratch reuse on, the window ending at the boundary is then
    in normal pages, never scratch);
  - the *prompt*, when its prefill ends: the next turn of a conversation starts with this
    prompt even where its re-encoded answer differs from the generated tokens;
  - a finished request's whole *history* (prompt and generated tokens), so that the next turn,
    which extends it, starts from it.
Parking takes no slot (the cache references blocks a row holds), and a block already named is
not parked twice, so turns of one conversation share their earlier blocks.

The cache is bounded by free KV memory only: cached blocks that no row reads stay until
admission needs their slots; then the least recently used node whose release frees a slot is
evicted (a park or a hit uses every node of its path, and among equals the deepest goes first,
so a chain is cut from its tail). A node evicted leaves its descendants unreachable: they are
evicted first.

Pure Python: the blocks nodes name are counted by the scheduler's `SlotLedger`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Collection, Sequence


@dataclasses.dataclass(eq=False)
class Node:
    """One cached block: `tokens` after the blocks of `parent` (None: the first block)."""

    id: int
    parent: Node | None
    tokens: tuple[int, ...]
    depth: int  # blocks from the first to this one
    children: dict[tuple[int, ...], Node] = dataclasses.field(default_factory=dict)
    last_used: int = 0
    reachable: bool = True  # False once an ancestor was evicted
    order: int = 0  # creation order (ties of the eviction key go to the older node)

    def eviction_key(self) -> tuple[bool, int, int, int]:
        """Smallest first: unreachable, then least recently used, then deepest, then oldest."""
        return (self.reachable, self.last_used, -self.depth, self.order)


class PrefixCache:
    """The node tree of the cached blocks, with LRU eviction order and node ids.

    The eviction order is a heap of (key, node) entries, one pushed whenever a node's key
    changes (made, touched, cut off); entries whose node is gone or has a newer key are
    dropped as they surface, and the heap is rebuilt when they outnumber the live ones. A
    victim costs O(log n) plus the nodes it passes over, not a scan of every node.

    Args:
      page_size: tokens per block.
      num_nodes: node ids available (`KVLayout.cache_nodes`).
    """

    def __init__(self, page_size: int, num_nodes: int):
        self.page_size = page_size
        self.num_nodes = num_nodes
        self.nodes: dict[int, Node] = {}  # id -> node
        self._roots: dict[tuple[int, ...], Node] = {}
        self._free_ids: list[int] = []  # ids given back; ids >= _next_id were never given
        self._next_id = 0
        self._clock = itertools.count(1)
        self._order = itertools.count()
        self._heap: list[tuple[tuple[bool, int, int, int], Node]] = []

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def free_ids(self) -> int:
        return len(self._free_ids) + self.num_nodes - self._next_id

    def _new_id(self) -> int:
        if self._free_ids:
            return self._free_ids.pop()
        self._next_id += 1
        return self._next_id - 1

    def _block(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.page_size : (i + 1) * self.page_size])

    def match(self, tokens: Sequence[int], num_blocks: int) -> list[Node]:
        """The nodes of the longest path of cached blocks that `tokens` starts with, at most
        `num_blocks` long (path[i] is block i)."""
        path, children = [], self._roots
        for i in range(min(num_blocks, len(tokens) // self.page_size)):
            node = children.get(self._block(tokens, i))
            if node is None:
                break
            path.append(node)
            children = node.children
        return path

    def extend(self, tokens: Sequence[int], num_blocks: int) -> list[Node]:
        """The path of the first `num_blocks` blocks of `tokens`, with nodes made for those not
        in the tree yet; shorter when node ids run out."""
        path = self.match(tokens, num_blocks)
        parent = path[-1] if path else None
        for i in range(len(path), num_blocks):
            if not self.free_ids:
                break
            block = self._block(tokens, i)
            node = Node(self._new_id(), parent, block, i + 1, order=next(self._order))
            (parent.children if parent else self._roots)[block] = node
            self.nodes[node.id] = node
            self._push(node)
            path.append(node)
            parent = node
        return path

    def longest_hit(
        self, tokens: Sequence[int], limit: int, usable: Callable[[int, list[int]], bool]
    ) -> tuple[list[Node], int]:
        """(path, k): the longest k <= limit, a multiple of the page size, such that `tokens`
        passes through the nodes `path` of its first k tokens and `usable(k, node ids)` (every
        block a row of history k reads is cached); ([], 0) if none."""
        path = self.match(tokens, limit // self.page_size)
        ids = [n.id for n in path]
        for j in range(len(path), 0, -1):
            if usable(j * self.page_size, ids[:j]):
                return path[:j], j * self.page_size
        return [], 0

    def touch(self, path: Sequence[Node]) -> None:
        """A park or a hit uses every node of its path."""
        stamp = next(self._clock)
        for node in path:
            node.last_used = stamp
            self._push(node)

    def _push(self, node: Node) -> None:
        """Enters node's current key (keys are unique: `order` differs between nodes)."""
        if len(self._heap) > 2 * len(self.nodes) + 64:  # mostly stale entries: rebuild, which
            self._heap = [(n.eviction_key(), n) for n in self.nodes.values()]  # holds node
            heapq.heapify(self._heap)
            return
        heapq.heappush(self._heap, (node.eviction_key(), node))

    def _live(self, entry) -> bool:
        key, node = entry
        return self.nodes.get(node.id) is node and key == node.eviction_key()

    def victim(
        self, frees: Callable[[int], int] | None = None, protect: Collection[Node] = ()
    ) -> Node | None:
        """The node to evict next: unreachable nodes first, then the least recently used, the
        deepest among equals; only nodes outside `protect` and, with `frees`, whose release
        frees a slot (frees(node id) > 0); None if there is none."""
        passed, best = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if not self._live(entry):
                continue
            passed.append(entry)
            node = entry[1]
            if node not in protect and (frees is None or frees(node.id) > 0):
                best = node
                break
        for entry in passed:  # the victim too: it stays cached until `remove`
            heapq.heappush(self._heap, entry)
        return best

    def victim_by_scan(
        self, frees: Callable[[int], int] | None = None, protect: Collection[Node] = ()
    ) -> Node | None:
        """`victim` by a scan of every node: the reference the heap is tested against."""
        best, best_key = None, None
        for node in self.nodes.values():
            if node in protect or (frees is not None and frees(node.id) == 0):
                continue
            key = node.eviction_key()
            if best_key is None or key < best_key:
                best, best_key = node, key
        return best

    def remove(self, node: Node) -> None:
        """Drops a node whose blocks were released: its id is free again, its descendants are
        unreachable (evicted first)."""
        del self.nodes[node.id]
        self._free_ids.append(node.id)
        siblings = node.parent.children if node.parent else self._roots
        if node.reachable and siblings.get(node.tokens) is node:
            del siblings[node.tokens]
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            if child.reachable:
                child.reachable = False
                self._push(child)
            stack.extend(child.children.values())

    def clear(self) -> list[int]:
        """Drops every node; returns their ids."""
        ids = list(self.nodes)
        self.nodes.clear()
        self._roots.clear()
        self._heap.clear()
        self._free_ids, self._next_id = [], 0
        return ids
