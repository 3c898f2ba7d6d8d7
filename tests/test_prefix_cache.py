"""The prefix cache's index (`swajax._prefix_cache`): entries found by their whole tokens
(`lookup`) and by any whole-block prefix they share with a request (`longest_shared`), the
shareability callback honoured, removal leaving no trace. Pure Python, hand-built cases."""

from __future__ import annotations

from swajax._prefix_cache import PrefixCache

PAGE = 4


def test_longest_shared_finds_a_partial_block_prefix_of_an_entry():
    cache = PrefixCache(PAGE, rows=[8, 9])
    history = list(range(100, 114))  # 14 tokens: 3 whole blocks parked
    entry = cache.add(8, history[:12], "finished")
    # a later turn re-encodes the history differently from token 9 on
    request = history[:9] + [1, 2, 3, 4, 5, 6, 7]
    assert cache.lookup(request, len(request) - 1) is None  # not the whole entry
    assert cache.longest_shared(request, len(request) - 1, lambda e, k: True) == (entry, 8)
    # the limit (a request keeps at least one token to prefill) and the callback both bound k
    assert cache.longest_shared(request, 7, lambda e, k: True) == (entry, 4)
    assert cache.longest_shared(request, 15, lambda e, k: k <= 4) == (entry, 4)
    assert cache.longest_shared(request, 15, lambda e, k: False) == (None, 0)
    assert cache.longest_shared([0] + request, 15, lambda e, k: True) == (None, 0)


def test_the_longest_and_then_the_most_recent_entry_wins_and_removal_unindexes():
    cache = PrefixCache(PAGE, rows=[8, 9, 10])
    a = cache.add(8, [1, 2, 3, 4, 5, 6, 7, 8], "finished")
    b = cache.add(9, [1, 2, 3, 4, 9, 9, 9, 9], "finished")
    c = cache.add(10, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13], "boundary")
    yes = lambda e, k: True  # noqa: E731
    assert cache.longest_shared([1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 0], 12, yes) == (c, 12)
    assert cache.longest_shared([1, 2, 3, 4, 5, 6, 7, 8, 0], 8, yes)[1] == 8
    cache.touch(b)
    assert cache.longest_shared([1, 2, 3, 4, 0], 4, yes) == (b, 4)  # most recently used
    cache.touch(a)
    assert cache.longest_shared([1, 2, 3, 4, 0], 4, yes) == (a, 4)
    for e in (a, b, c):
        cache.remove(e)
    assert cache.longest_shared([1, 2, 3, 4, 5, 6, 7, 8, 0], 8, yes) == (None, 0)
    assert not cache._by_block and not cache.entries
