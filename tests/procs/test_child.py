"""What every child process does first (service/procs/child.py): here, its threads named for the OS."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
