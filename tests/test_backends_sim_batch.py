"""The sim's batched calls (backends/_simbatch.py): the fast paths of ``query_prefix`` give the general path's
answers (the count, and what the race detector observes)."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload_ref.backends.base import Event, Stream
from kvoffload_ref.backends.sim import SimBackend

PAGE = 4096
TAG = ("store", 1)
RUN = 40  # longer than the sim's first run (PREFIX_FIRST_RUN): the count crosses a run boundary


class _Rig:
    """A sim with device rows 0..7 and a registered host buffer of 8 pages."""

    def __init__(self) -> None:
        self.be = be = SimBackend()
        dev = be.empty_device((8, PAGE))
        assert isinstance(dev, np.ndarray)
        self.dev = dev
        self.host = np.zeros(8 * PAGE, dtype=np.uint8)
        ptr = int(self.host.ctypes.data)
        be.track_host(ptr, self.host.nbytes)
        be.host_register(ptr, self.host.nbytes)

    def store(self, stream: Stream, row: int) -> Event:
        """A copy of device row ``row`` to host page ``row`` on ``stream``, then its end event."""
        be = self.be
        buf = be.alloc_descriptors(1, tag=TAG)
        dev_addr = int(self.dev.ctypes.data) + row * PAGE
        buf.fill(np.array([dev_addr], dtype=np.int64), np.array([int(self.host.ctypes.data) + row * PAGE],
                 dtype=np.int64), np.array([PAGE], dtype=np.int64))
        be.copy_batch(stream, buf, 1, tag=TAG)
        return self.end(stream)

    def end(self, stream: Stream) -> Event:
        event = self.be.create_event(tag=TAG)
        self.be.record(event, stream, tag=TAG)
        return event


@pytest.mark.rule("R10")
@pytest.mark.parametrize("intruder", ["pending", "destroyed", "foreign", "not_an_event", "never_recorded"])
@pytest.mark.parametrize("at", [0, 1, 17, RUN - 2])
def test_sim_query_prefix_of_a_done_run_stops_where_the_general_path_stops(intruder: str, at: int) -> None:
    """A long run whose last event is done (the drain's common case, answered without the general path's lists)
    still stops before a pending, destroyed or foreign event (or a handle that is no event) wherever it sits, and
    counts a never-recorded one."""
    rig = _Rig()
    be = rig.be
    fast = be.create_stream()
    done = [rig.end(fast) for _ in range(RUN)]
    be.sleep(1.0)
    if intruder == "pending":
        slow = be.create_stream()
        rig.store(slow, 0)  # its copy has not run: the clock stands still
        odd = rig.end(slow)
    elif intruder == "destroyed":
        odd = rig.end(fast)
        be.sleep(1.0)
        be.destroy_event(odd)
    elif intruder == "foreign":
        odd = SimBackend().create_event()
    elif intruder == "not_an_event":
        odd = object()  # no SimEvent at all (no ``key``): never live here
    else:
        odd = be.create_event()
    events = [*done[:at], odd, *done[at:]]
    expected = len(events) if intruder == "never_recorded" else at
    assert be.query_prefix(events) == expected
    assert be.query_prefix(done) == RUN
    assert not be.violations


@pytest.mark.rule("R20")
@pytest.mark.parametrize("order", ["a_then_b", "b_then_a", "interleaved"])
def test_sim_query_prefix_of_a_run_over_two_streams_observes_each_streams_latest(order: str) -> None:
    """A run over two streams (a retired stream's and a fresh one's, R28) observes the latest counted record of
    each stream: a compute write to rows both streams' copies read is ordered after both (no ``dma_race``)."""
    rig = _Rig()
    be = rig.be
    a, b = be.create_stream(), be.create_stream()
    on_a = [rig.store(a, 1), rig.store(a, 2)]
    on_b = [rig.store(b, 3), rig.store(b, 4)]
    events = {"a_then_b": [*on_a, *on_b], "b_then_a": [*on_b, *on_a],
              "interleaved": [on_a[0], on_b[0], on_a[1], on_b[1]]}[order]
    be.sleep(1.0)
    assert be.query_prefix(events) == 4
    be.enqueue_compute_write(rig.dev, [1, 2, 3, 4], 7, 0.0)  # every row a copy read
    be.sleep(1.0)
    assert not be.violations
