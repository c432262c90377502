"""Summarize a py-spy raw profile (`py-spy record -f raw`): samples per thread root, the top leaf
frames (where the time is spent) and the top inclusive frames of the project's own code (which of its
functions the time is spent under)."""

import collections
import sys

threads, leaves, inclusive = collections.Counter(), collections.Counter(), collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1)
    parts = stack.split(";")
    threads[parts[0]] += int(n)
    leaves[parts[-1]] += int(n)
    for frame in set(parts):
        if "service/" in frame or "kernels/" in frame:
            inclusive[frame] += int(n)
total = sum(threads.values())
print(f"{total} samples")
for k, v in threads.most_common(12):
    print(f"{v:6d} {100 * v / total:5.1f}%  thread root {k}")
print("-- leaf frames")
for k, v in leaves.most_common(40):
    print(f"{v:6d} {100 * v / total:5.1f}%  {k}")
print("-- inclusive, the project's frames")
for k, v in inclusive.most_common(30):
    print(f"{v:6d} {100 * v / total:5.1f}%  {k}")
