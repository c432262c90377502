"""The step loop: the one thread that owns the device.

    step():  schedule (batcher) -> stage (host, into pinned slot k) -> run (device) -> publish (writer)

The runner sees only the step's images and videos (the items' payloads, images first); the writer gets
the items back with the launched step, to store each under its key and answer its waiters. A video over
the step token budget runs alone (the batcher's rule for any oversize item) and is split here into steps
of whole temporal groups, each as many as the budget holds; the writer joins their outputs, in order, into
the one entry (groups never attend to each other: tower.video_groups).

Continuous batching: the batcher closes a step at once when the device has nothing in flight, and
holds it for company (at most max_wait) only while earlier steps still run (`runner.steps_in_flight`),
longer while one of them still waits behind the running one (batcher.BACKLOG).
The loop never waits on the device for its own sake (runner.py lists its only host waits); the
writer thread waits on each step's copy-done event, then writes the store and resolves futures.

Like the batcher, this module imports no torch: it is tested with a fake Runner and a fake Writer.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from service import tracing
from service.engine.batcher import Batch, Batcher, Part
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
        t_idle = time.perf_counter()
        batch = self.batcher.next_batch(timeout=0.25, busy=self.runner.steps_in_flight)
        t0 = time.perf_counter()
        self._phase("idle", t0 - t_idle)  # (a timed-out wait too: idle is idle)
        if batch is None:
            return not self.batcher.closed
        self._step_no += 1
        _stamp_staged(batch.items)
        # Images first, then videos: the runner's layout (a video's rows are the last of a step).
        items = [it for it in batch.items if not it.payload.is_video] + [it for it in batch.items if it.payload.is_video]
        if len(items) == 1 and items[0].payload.is_video and items[0].tokens > self.batcher.limits.max_batch_tokens:
            return self._split(batch, items[0], t0)
        try:
            with self.runner.stage([item.payload.image for item in items]) as staged:
                t_staged = time.perf_counter()
                launched = self.runner.run(staged)
        except Exception as e:  # a failed step fails only its own requests; the loop lives on
            self._fail(batch, e)
            return True
        self.writer.publish(items, launched)
        self._phase("stage", t_staged - t0)
        self._phase("launch", time.perf_counter() - t_staged)
        self._phase("output_wait", launched.output_wait_s)
        self._observe(batch, launched, t0)
        return True

    def _split(self, batch: Batch[EncodeJob], item, t0: float) -> bool:
        """One video over the token budget, as steps of whole temporal groups (each step as many groups as
        the budget holds, at least one), published as parts of one entry."""
        video = item.payload.image
        t = video.grid_thw[0]
        per_step = max(1, self.batcher.limits.max_batch_tokens // (video.num_tokens // t))
        starts = range(0, t, per_step)
        for k, start in enumerate(starts):
            if k:
                self._step_no += 1
            try:
                with self.runner.stage([video.groups(start, min(t, start + per_step))]) as staged:
                    launched = self.runner.run(staged)
            except Exception as e:
                if k == 0:
                    self._fail(batch, e)
                else:  # earlier parts are the writer's: it answers the item (and drops what it holds)
                    self.failed_steps += 1
                    self.metrics.steps.labels(result="failed").inc()
                    log.error("step %d failed (part %d of %d of video %s): %r", self._step_no, k + 1, len(starts),
                              item.key, e)
                    self.writer.publish([item], None, part=Part(k, len(starts), error=self._error(e)))
                return True
            self.writer.publish([item], launched, part=Part(k, len(starts)))
            self._observe(batch, launched, t0)
            t0 = time.perf_counter()
        return True

    def _fail(self, batch: Batch[EncodeJob], e: Exception) -> None:
        self.failed_steps += 1
        self.metrics.steps.labels(result="failed").inc()
        log.error("step %d failed (%d images, keys %s...): %r", self._step_no, len(batch.items),
                  [it.key for it in batch.items[:3]], e, exc_info=log.isEnabledFor(logging.DEBUG))
        err = self._error(e)
        for item in batch.items:
            self.batcher.finish(item, error=err)

    def _error(self, e: Exception) -> BackendError:
        # NOTE: the exception's text goes to the log, not to the client: a device or allocator message
        # (sizes, addresses, library internals) is no answer to a request.
        return BackendError(f"encoding step {self._step_no} failed on the device ({type(e).__name__}); the "
                            f"server's log has step {self._step_no}'s error")

    def _phase(self, name: str, seconds: float) -> None:
        self.metrics.step_phase_seconds.labels(phase=name).observe(seconds)

    def _observe(self, batch: Batch[EncodeJob], launched: Launched, t0: float) -> None:
        self.metrics.steps.labels(result="ok").inc()
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        self.metrics.step_tokens.observe(launched.token_offsets[-1])
        self.metrics.step_images.observe(len(batch.items))
        self.metrics.encoded_images.inc(len(batch.items))
        self.metrics.encoded_tokens.inc(launched.token_offsets[-1])
        self.metrics.fence_waits.set(self.runner.pool.stats.waits_blocked)


def _stamp_staged(items) -> None:
    """A traced item's step begins (tracing.Stamps; only its first step, for a video split across steps)."""
    for item in items:
        if (s := item.payload.stamps) is not None and not s.staged:
            s.staged = tracing.now_ns()
