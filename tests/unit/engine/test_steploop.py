"""The step loop with a fake Runner and a fake Writer: plain Python, a real batcher, no torch, no
device. Per step: stage -> run -> publish, in the batcher's order; a step that fails while staging or
running fails only its own items and the loop goes on; after batcher.close() the loop drains the queue,
closes the writer and returns."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from service.engine.batcher import Batcher, BatchLimits
from service.errors import BackendError
from service.metrics import Metrics
from service.engine.steploop import StepLoop


class FakeRunner:
    """Logs the loop's calls. A step that holds a key in `fail` raises in that call ("stage" or "run")."""

    def __init__(self, log: list, fail: dict[str, str] | None = None, fence_waits: int = 0):
        self.log, self.fail = log, fail or {}
        self.pool = SimpleNamespace(stats=SimpleNamespace(waits_blocked=fence_waits))
        self.busy_calls = 0

    def steps_in_flight(self) -> int:
        self.busy_calls += 1
        return 0

    def _raise_if(self, call: str, keys: tuple[str, ...]) -> None:
        if any(self.fail.get(k) == call for k in keys):
            raise RuntimeError(f"injected {call} fault")

    @contextlib.contextmanager
    def stage(self, images):
        keys = tuple(img.key for img in images)  # the items' payload images, in the batch's order
        self.log.append(("stage", keys))
        self._raise_if("stage", keys)
        try:
            yield SimpleNamespace(keys=keys, tokens=sum(img.num_tokens for img in images))
        except BaseException as e:  # where the real runner releases a slot that `run` did not get to
            self.log.append(("stage left by", type(e).__name__, keys))
            raise

    def run(self, staged):
        self.log.append(("run", staged.keys))
        self._raise_if("run", staged.keys)
        # (a step whose output buffer was free at once; output_wait_s is the real runner's measured wait)
        return SimpleNamespace(keys=staged.keys, token_offsets=[0, staged.tokens], output_wait_s=0.0)


class FakeWriter:
    def __init__(self, log: list):
        self.log = log

    def publish(self, items, launched) -> None:
        assert tuple(it.key for it in items) == launched.keys, "the items go with the step made of their images"
        self.log.append(("publish", launched.keys))

    def close(self) -> None:
        self.log.append(("close",))


def _loop(images_per_step: int, fail=None, max_wait_s: float = 0.0, fence_waits: int = 0):
    log: list = []
    batcher = Batcher(BatchLimits(max_batch_tokens=1000, max_batch_images=images_per_step, max_wait_s=max_wait_s,
                                  max_queue_images=100))
    runner = FakeRunner(log, fail, fence_waits)
    return StepLoop(batcher, runner, FakeWriter(log), Metrics()), batcher, log


def _submit(batcher: Batcher, keys: list[str]) -> dict:
    """Key i has 10 + i tokens; its payload's image (what the runner stages) names its key."""
    return {k: batcher.submit(k, payload=SimpleNamespace(image=SimpleNamespace(key=k, num_tokens=10 + i), is_video=False, stamps=None), tokens=10 + i)
            for i, k in enumerate(keys)}


def _count(loop: StepLoop, name: str, labels: dict | None = None) -> float:
    return loop.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_each_step_is_staged_run_and_published_in_order_and_close_drains():
    loop, batcher, log = _loop(images_per_step=2, fence_waits=7)
    tickets = _submit(batcher, ["a", "b", "c", "d", "e"])
    batcher.close()  # queued work is still run: the loop drains, closes the writer and returns
    loop.run()
    steps = [("a", "b"), ("c", "d"), ("e",)]
    assert log == [entry for keys in steps for entry in (("stage", keys), ("run", keys), ("publish", keys))] + [("close",)]
    assert batcher.queue_depth() == 0 and batcher.in_flight() == 5  # published: the writer answers them
    assert not any(t.future.done() for t in tickets.values())
    assert loop.failed_steps == 0 and _count(loop, "qve_steps_total", {"result": "ok"}) == 3
    assert _count(loop, "qve_step_images_sum") == 5 and _count(loop, "qve_step_tokens_sum") == 10 + 11 + 12 + 13 + 14
    assert _count(loop, "qve_fence_waits") == 7


def test_each_step_reports_where_the_loop_spent_its_time():
    """qve_step_phase_seconds: one idle, stage and launch observation per step, and the runner's output wait."""
    loop, batcher, log = _loop(images_per_step=2)
    real_run = loop.runner.run

    def slow_run(staged):  # a launch that took 100 ms, 5 of them waiting for an output buffer
        time.sleep(0.1)
        return SimpleNamespace(**{**vars(real_run(staged)), "output_wait_s": 0.005})

    loop.runner.run = slow_run
    _submit(batcher, ["a", "b", "c"])
    batcher.close()
    loop.run()
    phase = lambda name, what: _count(loop, f"qve_step_phase_seconds_{what}", {"phase": name})  # noqa: E731
    assert phase("stage", "count") == phase("launch", "count") == phase("output_wait", "count") == 2
    assert phase("idle", "count") >= 2  # (and once more for the wait that found the batcher closed)
    assert 0.2 <= phase("launch", "sum") < 5.0 and phase("output_wait", "sum") == pytest.approx(0.01)
    assert phase("stage", "sum") < 0.1  # (the launch's time is not staging's, on a loaded machine too)


def test_a_failed_stage_or_run_fails_only_that_steps_items_and_the_loop_goes_on():
    fail = {"bad_stage": "stage", "bad_run": "run"}
    loop, batcher, log = _loop(images_per_step=2, fail=fail)
    tickets = _submit(batcher, ["ok1", "ok2", "x", "bad_stage", "y", "bad_run", "ok3", "ok4"])
    batcher.close()
    loop.run()
    assert [e for e in log if e[0] in ("publish", "close")] == [("publish", ("ok1", "ok2")), ("publish", ("ok3", "ok4")),
                                                                 ("close",)]
    # A run that raised leaves the stage block by its exception: the real runner releases its slot there.
    assert ("stage left by", "RuntimeError", ("y", "bad_run")) in log
    for step_no, keys, call in ((2, ("x", "bad_stage"), "stage"), (3, ("y", "bad_run"), "run")):
        for k in keys:  # every item of the failed step, and only those
            err = tickets[k].future.exception(timeout=0)
            assert isinstance(err, BackendError)
            assert str(err) == (f"encoding step {step_no} failed on the device (RuntimeError); the server's log has "
                                f"step {step_no}'s error")  # (not the exception's text: issue 23)
    assert not any(tickets[k].future.done() for k in ("ok1", "ok2", "ok3", "ok4"))
    assert batcher.in_flight() == 4  # the published items, for the writer to answer
    assert loop.failed_steps == 2
    assert _count(loop, "qve_steps_total", {"result": "failed"}) == 2 and _count(loop, "qve_steps_total", {"result": "ok"}) == 2


def test_the_batch_closes_at_once_when_the_runner_says_the_device_is_idle():
    loop, batcher, log = _loop(images_per_step=8, max_wait_s=3600)  # only an idle device closes this batch
    _submit(batcher, ["a", "b"])
    assert loop.step() is True
    assert loop.runner.busy_calls >= 1 and log[-1] == ("publish", ("a", "b"))


def test_an_open_batcher_with_nothing_queued_keeps_the_loop_going_and_a_closed_one_ends_it():
    loop, batcher, log = _loop(images_per_step=2)
    assert loop.step() is True  # nothing queued: next_batch times out, the loop goes round again
    batcher.close()
    assert loop.step() is False and log == []


def test_steploop_imports_no_torch_or_numpy():
    code = "import sys, service.engine.steploop; bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


class FakeVideo:
    """A payload video of `t` groups of 10 tokens; groups(a, b) names its share as the key 'v[a:b]'."""

    def __init__(self, key: str, t: int, prefix: str = ""):
        self.key, self.grid_thw, self.num_tokens, self.prefix = key, (t, 2, 20), 10 * t, prefix

    def groups(self, start: int, stop: int):
        return SimpleNamespace(key=f"{self.prefix}{self.key}[{start}:{stop}]", num_tokens=10 * (stop - start))


class PartsWriter(FakeWriter):
    def publish(self, items, launched, part=None) -> None:
        self.log.append(("publish", tuple(it.key for it in items), launched and launched.keys, part))


def test_a_video_over_the_token_budget_runs_alone_in_steps_of_whole_groups_published_as_parts():
    log: list = []
    batcher = Batcher(BatchLimits(max_batch_tokens=25, max_batch_images=8, max_wait_s=0.0, max_queue_images=100))
    loop = StepLoop(batcher, FakeRunner(log, {"v[4:5]": "run"}), PartsWriter(log), Metrics())
    image = SimpleNamespace(image=SimpleNamespace(key="i", num_tokens=5), is_video=False, stamps=None)
    small = SimpleNamespace(image=FakeVideo("w", 1), is_video=True, stamps=None)
    batcher.submit("w", small, tokens=10)  # a video within the budget shares a step, after the images
    batcher.submit("i", image, tokens=5)
    batcher.submit("v", SimpleNamespace(image=FakeVideo("v", 5), is_video=True, stamps=None), tokens=50)
    batcher.close()
    loop.run()
    published = [e for e in log if e[0] == "publish"]
    assert ("stage", ("i", "w")) in log  # images first: the runner's layout
    assert published[0] == ("publish", ("i", "w"), ("i", "w"), None)
    # 50 tokens, a budget of 25, 10 a group: steps of 2 groups; the third part failed to launch.
    assert published[1:] == [("publish", ("v",), ("v[0:2]",), (0, 3, None)), ("publish", ("v",), ("v[2:4]",), (1, 3, None))] \
        + [("publish", ("v",), None, published[3][3])]
    part = published[3][3]
    assert (part.index, part.count) == (2, 3) and isinstance(part.error, BackendError)
    assert "step 4 failed on the device (RuntimeError)" in str(part.error) and loop.failed_steps == 1
