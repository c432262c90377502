"""Joining a Mooncake pool (service/store/pool.py): which address ranges a client's set-up added (what is
faulted in at start). The faulting itself, against a real master: tests/unit/store/test_mooncake.py."""

from service.store.pool import added_ranges


def test_added_ranges_are_the_new_mappings_and_only_the_added_part_of_a_merged_one():
    """A mapping the kernel merged with an older neighbour counts only for what it added: taken whole (as
    `after - before` did), a full-suite run counted 1.77 GB for a 192 MiB segment and buffer, and the
    segment was not faulted in."""
    mib = 1 << 20
    before = {(100 * mib, 1700 * mib), (2000 * mib, 2001 * mib), (3000 * mib, 3010 * mib)}
    after = {
        (100 * mib, 1828 * mib),  # the old 1.6 GB mapping with a 128 MiB segment merged after it
        (1900 * mib, 2001 * mib),  # an old one with 100 MiB merged before it
        (2500 * mib, 2564 * mib),  # a new mapping alone
        (3000 * mib, 3010 * mib),  # unchanged
    }
    assert added_ranges(before, after) == {(1700 * mib, 1828 * mib), (1900 * mib, 2000 * mib),
                                           (2500 * mib, 2564 * mib)}
    # two old neighbours joined by a new middle: only the middle
    assert added_ranges({(0, 10), (20, 30)}, {(0, 30)}) == {(10, 20)}
    assert added_ranges(before, before) == set()
