"""The engine of one device: three small objects and the two threads that drive them.

    Runner    (runner.py)    the tower, the pinned staging pool, device buffers, CUDA graphs; stage/run, no threads
    StepLoop  (steploop.py)  thread "step-loop": schedule -> stage -> run -> publish
    Writer    (writer.py)    thread "store-writer": copy-done -> store -> answers
"""

from __future__ import annotations

import threading

import torch

from service.config import RunnerOptions
from service.engine.batcher import Batcher
from service.engine.job import EncodeJob
from service.engine.loader import LoadedModel
from service.engine.runner import Runner
from service.engine.steploop import StepLoop
from service.engine.writer import Writer
from service.media.images import PreparedImage
from service.metrics import Metrics
from service.store import Store


class Engine:
    """Builds the Runner now (model on the device, compile, graphs); `start()` spawns the loop and the writer."""

    def __init__(self, model: LoadedModel, store: Store, batcher: Batcher[EncodeJob], options: RunnerOptions,
                 metrics: Metrics, *, store_writers: int = 1):
        """`options`: Settings.runner_options() (an entry point calls runner.use_compile_cache first);
        `store_writers`: StoreOptions.writers, with which the writer reserves a step's entries ahead
        (unused by an engine without a store, which serves encode_sync only)."""
        self.store, self.batcher, self.metrics = store, batcher, metrics  # may be set until start()
        self.runner = Runner(model, options)
        self._store_writers = store_writers
        self.writer: Writer | None = None  # from start()
        self.loop: StepLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._writer_thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.writer = Writer(self.store, self.batcher, self.metrics, threads=self._store_writers)
        self.loop = StepLoop(self.batcher, self.runner, self.writer, self.metrics)
        self._writer_thread = threading.Thread(target=self.writer.run, name="store-writer", daemon=True)
        self._loop_thread = threading.Thread(target=self.loop.run, name="step-loop", daemon=True)
        self._writer_thread.start()
        self._loop_thread.start()

    def alive(self) -> bool:
        return bool(self._loop_thread and self._loop_thread.is_alive() and self._writer_thread.is_alive())

    def join(self, timeout: float | None = None) -> None:
        """Wait for the loop to drain (after batcher.close()) and the writer to finish."""
        if self._loop_thread:
            self._loop_thread.join(timeout)
        if self._writer_thread:
            self._writer_thread.join(timeout)

    # ---- synchronous path (warm-up, tests, benchmarks) ----------------------------------------------
    def encode_sync(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Encode one packed batch through the same stage/run path as the loop, wait, and return one
        CPU tensor per image ([num_tokens, out_width]). Must not run concurrently with the loop."""
        with self.runner.stage(images) as staged:
            launched = self.runner.run(staged)
        try:
            if launched.done is not None:
                launched.done.synchronize()
            offs = launched.token_offsets
            return [launched.host_out[offs[i] : offs[i + 1]].clone() for i in range(len(images))]
        finally:
            if launched.output is not None:
                launched.output.release()
