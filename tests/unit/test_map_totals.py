"""Totals of counters kept in an LRU map (spanlet.probes.maps.Totals): an entry
the LRU forgot and made again must not read as a counter going back."""

from spanlet.probes.maps import Totals


def test_growth_is_added_and_a_remade_entry_counts_from_zero():
    t = Totals()
    assert t.update({7: 5, 8: 1}) == {7: 5, 8: 1}
    assert t.update({7: 9, 8: 1}) == {7: 9, 8: 1}
    assert t.update({8: 2}) == {7: 9, 8: 2}          # 7 evicted: its total stays
    assert t.update({7: 3, 8: 2}) == {7: 12, 8: 2}   # 7 remade: 3 more, not 3 - 9
    assert t.update({7: 1, 8: 2}) == {7: 13, 8: 2}   # remade again between reads


def test_keys_beyond_the_bound_fold_into_key_zero_oldest_growth_first():
    t = Totals(max_keys=2)
    t.update({1: 1})
    t.update({1: 1, 2: 2})
    got = t.update({1: 1, 2: 2, 3: 4})
    assert got == {0: 1, 2: 2, 3: 4}
    assert sum(t.update({1: 1, 2: 2, 3: 4, 4: 8}).values()) == 15
    assert len(t.update({})) <= 3   # two keys and the fold
