"""What every child process does first (service/procs/child.py): its threads named for the OS; and what a
serving one does last before it serves: its start-up objects frozen (settle_heap)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_childs_threads_carry_their_python_names_for_the_kernel():
    # In a process of its own: name_os_threads wraps threading's bootstrap for the whole process.
    code = """
import threading
from pathlib import Path
from service.procs.child import name_os_threads

comm = lambda tid: Path(f"/proc/self/task/{tid}/comm").read_text().strip()
before = threading.Thread(target=lambda: None, name="before")
name_os_threads("engine")
seen = {}
def work():
    seen["tid"] = threading.get_native_id()
    seen["comm"] = comm(seen["tid"])
t = threading.Thread(target=work, name="store-writer-with-a-long-name")
t.start(); t.join()
print(comm(threading.get_native_id()), seen["comm"], sep="|")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "qve-engine|store-writer-wi"  # the kernel keeps 15 bytes


def test_settle_heap_collects_start_up_garbage_then_freezes_the_rest_out_of_later_full_collections():
    # In a process of its own: a freeze is the whole process's (this test process's objects stay collectable).
    code = """
import gc, time, weakref
import torch  # a heap of a serving process's size: torch's modules and objects
from service.procs.child import settle_heap

class Node:
    pass

def full_ms():
    t0 = time.perf_counter()
    gc.collect()
    return 1e3 * (time.perf_counter() - t0)

before = min(full_ms() for _ in range(3))
n = Node(); n.me = n  # a cycle: garbage only a collection frees
dead = weakref.ref(n)
del n
frozen, seconds = settle_heap()
after = min(full_ms() for _ in range(3))
print(frozen, gc.get_freeze_count(), dead() is None, before, after, sep="|")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    frozen, count, collected, before, after = out.stdout.strip().split("|")
    assert int(frozen) == int(count) > 50_000  # torch's objects, frozen
    assert collected == "True"  # start-up's cyclic garbage was collected first, not frozen
    assert float(after) < float(before) / 5, (before, after)  # later full collections skip the frozen objects
