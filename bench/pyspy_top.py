"""Summarize a py-spy raw profile (`py-spy record -f raw`): samples per thread and top frames."""

import collections
import sys

threads, frames = collections.Counter(), collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1)
    parts = stack.split(";")
    threads[parts[0]] += int(n)
    frames[parts[-1]] += int(n)
total = sum(threads.values())
print(f"{total} samples")
for k, v in threads.most_common(12):
    print(f"{v:6d} {100 * v / total:5.1f}%  thread root {k}")
for k, v in frames.most_common(40):
    print(f"{v:6d} {100 * v / total:5.1f}%  {k}")
