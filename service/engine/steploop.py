"""The step loop: the one thread that owns the device.

    step():  schedule (batcher) -> stage (host, into pinned slot k) -> run (device) -> publish (writer)

The runner sees only the step's images (the items' payloads); the writer gets the items back with
the launched step, to store each image under its key and answer its waiters.

Continuous batching: the batcher closes a step at once when the device has nothing in flight, and
holds it for company (at most max_wait) only while earlier steps still run (`runner.device_busy`).
The loop never waits on the device for its own sake (runner.py lists its only host waits); the
writer thread waits on each step's copy-done event, then writes the store and resolves futures.

Like the batcher, this module imports no torch: it is tested with a fake Runner and a fake Writer.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from service.engine.batcher import Batch, Batcher
from service.errors import BackendError
from service.metrics import Metrics

if TYPE_CHECKING:
    from service.engine.job import EncodeJob
    from service.engine.runner import Launched, Runner
    from service.engine.writer import Writer

log = logging.getLogger(__name__)


class StepLoop:
    """Feeds the runner from the batcher and hands each launched step to the writer. `run()` is the thread."""

    def __init__(self, batcher: Batcher[EncodeJob], runner: Runner, writer: Writer, metrics: Metrics):
        self.batcher, self.runner, self.writer, self.metrics = batcher, runner, writer, metrics
        self.failed_steps = 0
        self._step_no = 0

    def run(self) -> None:
        while self.step():
            pass
        self.writer.close()  # drained: let the writer finish and exit

    def step(self) -> bool:
        """schedule -> stage -> run -> publish. Returns False once the batcher is closed and drained."""
        batch = self.batcher.next_batch(timeout=0.25, busy=self.runner.device_busy)
        if batch is None:
            return not self.batcher.closed
        self._step_no += 1
        t0 = time.perf_counter()
        try:
            with self.runner.stage([item.payload.image for item in batch.items]) as staged:
                launched = self.runner.run(staged)
        except Exception as e:  # a failed step fails only its own requests; the loop lives on
            self._fail(batch, e)
            return True
        self.writer.publish(batch.items, launched)
        self._observe(batch, launched, t0)
        return True

    def _fail(self, batch: Batch[EncodeJob], e: Exception) -> None:
        self.failed_steps += 1
        self.metrics.steps.labels(result="failed").inc()
        log.error("step %d failed (%d images, keys %s...): %r", self._step_no, len(batch.items),
                  [it.key for it in batch.items[:3]], e, exc_info=log.isEnabledFor(logging.DEBUG))
        err = BackendError(f"encoding step {self._step_no} failed: {type(e).__name__}: {e}")
        for item in batch.items:
            self.batcher.finish(item, error=err)

    def _observe(self, batch: Batch[EncodeJob], launched: Launched, t0: float) -> None:
        self.metrics.steps.labels(result="ok").inc()
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        self.metrics.step_tokens.observe(launched.token_offsets[-1])
        self.metrics.step_images.observe(len(batch.items))
        self.metrics.fence_waits.set(self.runner.pool.stats.waits_blocked)
