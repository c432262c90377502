"""The pixel arena: cells allocated and freed by the owner, read in place by another mapping."""

import os

import numpy as np
import pytest

from service.errors import Overloaded
from service.procs.arena import ALIGN, Arena, ArenaReader, leaked_segments, segment_name
from tests.support.errors import raises_code

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


@pytest.fixture
def arena():
    a = Arena(segment_name(os.getpid(), 0, 99), 64 * ALIGN)
    yield a
    a.close()


def test_cells_are_aligned_reused_and_merged(arena):
    a = arena.alloc(1)
    b = arena.alloc(ALIGN + 1)  # two units
    c = arena.alloc(3 * ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and arena.used == 6 * ALIGN
    arena.free(b, ALIGN + 1)
    assert arena.alloc(2 * ALIGN) == ALIGN  # first fit reuses the hole
    arena.free(a, 1)
    arena.free(ALIGN, 2 * ALIGN)
    arena.free(c, 3 * ALIGN)
    assert arena.used == 0
    assert arena.alloc(64 * ALIGN) == 0  # the free neighbours merged back into one whole arena
    with raises_code(Overloaded, "overloaded", match="no free"):
        arena.alloc(1)
    arena.free(0, 64 * ALIGN)
    with pytest.raises(AssertionError, match="double free"):
        arena.free(0, ALIGN)


def test_another_mapping_reads_cells_in_place_and_checks_bounds(arena):
    off = arena.alloc(300)
    arena.view(off, 300)[:] = np.arange(300) % 251
    reader = ArenaReader()
    got = reader.view(arena.name, off, 300)
    assert np.array_equal(got, np.arange(300) % 251)
    arena.view(off, 1)[:] = 7  # the same pages, not a copy
    assert got[0] == 7
    with pytest.raises(ValueError, match="outside arena"):
        reader.view(arena.name, 64 * ALIGN - 10, 20)
    with pytest.raises(ValueError, match="not a pixel arena"):
        reader.view("../etc/passwd", 0, 1)


def test_close_removes_the_segment():
    a = Arena(segment_name(os.getpid(), 1, 99), 4 * ALIGN)
    assert a.name in leaked_segments(os.getpid())
    a.close()
    assert a.name not in leaked_segments(os.getpid())
