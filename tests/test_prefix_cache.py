"""`PrefixCache`: the node tree of cached blocks, its lookups, ids and eviction order."""

from swajax._prefix_cache import PrefixCache

PAGE = 4


def seq(*blocks):
    """Tokens of whole blocks, block b = (b, b, b, b)."""
    return [b for b in blocks for _ in range(PAGE)]


def test_extend_match_and_longest_hit_follow_exact_blocks():
    cache = PrefixCache(PAGE, num_nodes=8)
    path = cache.extend(seq(1, 2, 3), 3)
    assert [n.depth for n in path] == [1, 2, 3] and len(cache) == 3 and cache.free_ids == 5
    assert cache.extend(seq(1, 2, 3), 3) == path  # nothing new
    # a sequence that parts inside block 2 shares block 1 only
    assert cache.match(seq(1, 2) + [3, 3, 3, 9], 3) == path[:2]
    assert cache.match(seq(1, 9, 3), 3) == path[:1]
    assert cache.match(seq(1, 2, 3, 4), 2) == path[:2]  # at most num_blocks
    other = cache.extend(seq(1, 5), 2)
    assert other[0] is path[0] and other[1] is not path[1] and len(cache) == 4
    ids = {n.id for n in [*path, *other]}
    assert ids == {0, 1, 2, 3}
    # the longest usable depth below the limit
    usable = {4, 8}  # e.g. a sliding window cached only at these depths
    hit, k = cache.longest_hit(seq(1, 2, 3, 4), 15, lambda k, ids: k in usable)
    assert (k, hit) == (8, path[:2])
    assert cache.longest_hit(seq(1, 2, 3), 3, lambda k, ids: True) == ([], 0)


def test_ids_run_out_and_come_back():
    cache = PrefixCache(PAGE, num_nodes=2)
    assert len(cache.extend(seq(1, 2, 3), 3)) == 2  # shorter: no id left
    a, b = cache.match(seq(1, 2), 2)
    cache.remove(b)
    assert cache.free_ids == 1 and cache.match(seq(1, 2), 2) == [a]
    assert sorted(cache.clear()) == [a.id] and cache.free_ids == 2 and not cache.match(seq(1), 1)


def test_victim_is_unreachable_then_least_recently_used_then_deepest():
    cache = PrefixCache(PAGE, num_nodes=8)
    x = cache.extend(seq(1, 2, 3), 3)
    y = cache.extend(seq(7, 8), 2)
    cache.touch(x)
    cache.touch(y)  # y used last
    assert cache.victim() is x[2]  # least recently used, deepest among equals
    cache.touch(x[:1])  # a hit at depth 1 leaves the deeper nodes as old as they were
    assert cache.victim() is x[2]
    cache.touch(x)
    assert cache.victim() is y[1]
    # frees: only nodes whose release frees a slot; protect: never these
    assert cache.victim(frees=lambda i: i == x[1].id) is x[1]
    assert cache.victim(protect={y[1], x[2], x[1]}) is y[0]
    # evicting x[1] leaves x[2] unreachable: it goes first, and no lookup finds it
    cache.remove(x[1])
    assert not x[2].reachable and cache.victim() is x[2]
    assert cache.match(seq(1, 2, 3), 3) == x[:1]
    again = cache.extend(seq(1, 2, 3), 3)
    assert again[0] is x[0] and again[2] is not x[2]
    cache.remove(x[2])  # an unreachable node leaves its re-made twin alone
    assert cache.match(seq(1, 2, 3), 3) == again


def test_victim_heap_equals_a_scan_of_every_node_under_random_use():
    """The indexed eviction order against the plain scan (`victim_by_scan`), through random
    extends, touches, removals (cutting off subtrees), filters and clears; long enough for
    the heap to be rebuilt from its live entries several times."""
    import random

    rng = random.Random(0)
    cache = PrefixCache(PAGE, num_nodes=48)
    checks = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            blocks = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            path = cache.extend(seq(*blocks), len(blocks))
            if path and rng.random() < 0.7:
                cache.touch(path[: rng.randrange(1, len(path) + 1)])
        elif op < 0.5 and cache.nodes:
            cache.touch([rng.choice(list(cache.nodes.values()))])
        elif op < 0.75 and cache.nodes:
            nodes = list(cache.nodes.values())
            protect = set(rng.sample(nodes, rng.randrange(0, min(4, len(nodes)) + 1)))
            frees_set = {n.id for n in nodes if rng.random() < 0.6}
            frees = (lambda i, f=frees_set: int(i in f)) if rng.random() < 0.5 else None
            got = cache.victim(frees, protect)
            assert got is cache.victim_by_scan(frees, protect), step
            checks += 1
            if got is not None and rng.random() < 0.8:
                cache.remove(got)
        elif op < 0.995 and cache.nodes:
            victim = cache.victim_by_scan()
            assert cache.victim() is victim, step
            cache.remove(victim)
            checks += 1
        else:
            cache.clear()
        assert len(cache._heap) <= 2 * len(cache.nodes) + 65
    assert checks > 1000
