"""service/metrics.py: the engine process's garbage-collection pauses (Metrics.watch_gc)."""

import gc

from service.metrics import Metrics
from tests.support.live import metric


def test_watch_gc_times_the_collections_of_generations_1_and_2_until_stopped():
    m = Metrics()
    was_enabled = gc.isenabled()
    gc.disable()  # no collection but the ones below (an allocation-triggered one would add to the counts)
    try:
        stop = m.watch_gc()
        # Both series are there at 0 before any collection: a scrape (and the service tests) see them at once.
        first = {line.split()[0]: float(line.split()[1]) for line in m.exposition().decode().splitlines()
                 if line.startswith("qve_gc_pause_seconds_count")}
        assert first == {'qve_gc_pause_seconds_count{generation="1"}': 0.0,
                         'qve_gc_pause_seconds_count{generation="2"}': 0.0}
        try:
            gc.collect(0)  # too short and too frequent to time: not observed
            gc.collect(1)
            gc.collect(2)
        finally:
            stop()
        gc.collect(2)  # after stop: not observed
    finally:
        if was_enabled:
            gc.enable()
    text = m.exposition().decode()
    assert metric(text, "qve_gc_pause_seconds_count", 'generation="0"') == 0
    assert metric(text, "qve_gc_pause_seconds_count", 'generation="1"') == 1
    assert metric(text, "qve_gc_pause_seconds_count", 'generation="2"') == 1
    assert 0 < metric(text, "qve_gc_pause_seconds_sum", 'generation="2"') < 10
