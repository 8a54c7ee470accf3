"""The sim's ``"fifo"`` link model (``backends/_simengine.py``): one copy engine per direction, arrival order,
priority-blind, one stream's queued copies as a block (a compute op ends it), directions independent, the duplex cap;
against the ``"fair"`` model on the same two-stream schedule. Every expected time is computed here from the
profile's terms."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvoffload_ref as kv
from kvoffload_ref.backends._simcost import LINK_MODELS, CostProfile, PathCost
from kvoffload_ref.backends.base import Event, Stream
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.backends.sim_profiles import H200, PROFILES, SIMPLE
from kvoffload_ref.errors import InvalidTransferError

PAGE = 64 * 1024
GB = 1e9
CALL = 2e-6   # the profile's call_cost: each copy's fixed phase
RATE = 10 * GB

#: Round numbers: a 2 us fixed phase, every path at the link's 10 GB/s, duplex cap 20 GB/s (both directions free).
ENGINE = CostProfile("engine", CALL, PathCost(0.0, 0.0, ((1, RATE),)), None, None,
                     link_bandwidth=RATE, bidirectional_bandwidth=2 * RATE, pageable_bandwidth=1 * GB,
                     link_model="fifo")
L16 = 16 * PAGE / RATE   # 16 pages on the link alone: 104.8576 us
L8 = 8 * PAGE / RATE     # 8 pages: 52.4288 us


class Rig:
    """A device array and a pinned host array of 128 pages; copies of page ranges between them."""

    def __init__(self, link_model: str = "fifo", profile: CostProfile = ENGINE, trace: bool = False) -> None:
        be = self.be = SimBackend(profile=profile, link_model=link_model, trace=trace)  # type: ignore[arg-type]
        self.dev = be.array_info(be.empty_device((128, PAGE)))
        self.host = np.zeros(128 * PAGE, np.uint8)
        self.hptr = int(self.host.ctypes.data)
        be.track_host(self.hptr, self.host.nbytes)
        be.host_register(self.hptr, self.host.nbytes)
        self.jobs = 0

    def copy(self, stream: Stream, direction: str, rows: range) -> tuple[Event, Event]:
        """One copy of ``rows`` on ``stream`` between two events (as a transfer is submitted); returns them."""
        be = self.be
        self.jobs += 1
        ids = np.array(rows, np.int64)
        dev, host = self.dev.ptr + ids * PAGE, self.hptr + ids * PAGE
        src, dst = (dev, host) if direction == "store" else (host, dev)
        buf = be.alloc_descriptors(len(ids))
        buf.fill(src, dst, np.full(len(ids), PAGE, np.int64))
        start, end = be.create_event(), be.create_event()
        be.record(start, stream)
        be.copy_batch(stream, buf, len(ids), tag=(direction, self.jobs))
        be.record(end, stream)
        return start, end

    def end(self, events: tuple[Event, Event]) -> float:
        """The virtual time the copy between ``events`` finished (its end event's record)."""
        self.be.synchronize(events[1])
        return done_at(events[1])


def done_at(event: Event) -> float:
    """When the event's latest record completed."""
    latest = event.latest  # type: ignore[attr-defined]  # a SimEvent's
    assert latest is not None and latest.done_at is not None
    return float(latest.done_at)


def two_stream_schedule(link_model: str, between: str = "records", rig: Rig | None = None) -> dict[str, float]:
    """Stream A queues a1 a2 a3 (16 pages each, store) at t=0; stream B queues b1 (8 pages, store) at 50 us.
    ``between``: what A has between a1 and a2 besides the events (``"records"``: nothing; ``"compute"``: a 1 us
    compute op; ``"done wait"``: a wait on an event already complete; ``"pending wait"``: a wait on an event
    recorded after 200 us of compute on another stream). ``rig``: the rig to use (else a new one). Returns each
    copy's finish time."""
    rig = rig or Rig(link_model)
    be = rig.be
    a, b = be.create_stream(), be.create_stream()
    done, later = be.create_event(), be.create_event()
    be.record(done, be.current_stream())
    be.enqueue_compute_write(be.empty_device((1, 64)), [0], 1, 200e-6, stream="other")
    be.record(later, be.compute_stream("other"))
    a1 = rig.copy(a, "store", range(0, 16))
    if between == "compute":
        be.enqueue_compute_write(be.empty_device((1, 64)), [0], 1, 1e-6, stream=a)
    elif between == "done wait":
        be.wait_event(a, done)
    elif between == "pending wait":
        be.wait_event(a, later)
    a2 = rig.copy(a, "store", range(16, 32))
    a3 = rig.copy(a, "store", range(32, 48))
    be.clock_advance(50e-6)
    b1 = rig.copy(b, "store", range(48, 56))
    return {name: rig.end(ev) for name, ev in (("a1", a1), ("a2", a2), ("a3", a3), ("b1", b1))}


def test_sim_engine_fifo_serves_one_streams_queued_copies_as_a_block() -> None:
    """a1 a2 a3 queued on A at t=0, b1 on B ready at 52 us while a1 is on the link: under "fifo" the engine serves
    A's block (a2 and a3 go before b1, though b1 arrived first: current-stream-first, torchrec #4315), then b1."""
    t = two_stream_schedule("fifo")
    assert t["a1"] == pytest.approx(CALL + L16)
    assert t["a2"] == pytest.approx(2 * CALL + 2 * L16), "the engine held for a2 through its fixed phase"
    assert t["a3"] == pytest.approx(3 * CALL + 3 * L16)
    assert t["b1"] == pytest.approx(3 * CALL + 3 * L16 + L8), "b1 waits for A's whole block"
    assert two_stream_schedule("fifo", "done wait") == pytest.approx(t), "a completed wait does not end a block"


def test_sim_engine_trace_shows_how_long_a_copy_waited_for_its_engine() -> None:
    """The timeline's copy spans carry ``engine_wait_s`` when a copy queued for its engine: b1 arrived at 52 us and
    was served when A's block ended; A's copies never queued (their fixed phases are their own)."""
    rig = Rig(trace=True)
    t = two_stream_schedule("fifo", rig=rig)
    waits = [(e["args"]["bytes"], e["args"].get("engine_wait_s"))
             for e in rig.be.trace_document()["traceEvents"] if e.get("cat") == "copy"]
    assert waits == [(16 * PAGE, None)] * 3 + [(8 * PAGE, pytest.approx(t["a3"] - (50e-6 + CALL)))]   # 268.5728 us
    fair = Rig("fair", trace=True)
    two_stream_schedule("fair", rig=fair)
    assert not any("engine_wait_s" in e.get("args", {}) for e in fair.be.trace_document()["traceEvents"])


def test_sim_engine_fair_shares_the_same_schedule() -> None:
    """The same schedule under "fair": b1 shares the link with a1 from 52 us (half each), finishes first, and a1
    takes the whole link back; a2 and a3 follow on A."""
    t = two_stream_schedule("fair")
    b_ready = 50e-6 + CALL
    a1_left = 16 * PAGE - (b_ready - CALL) * RATE   # a1's bytes left when b1 joins
    b1_end = b_ready + 8 * PAGE / (RATE / 2)
    a1_end = b1_end + (a1_left - 8 * PAGE) / RATE
    assert t["b1"] == pytest.approx(b1_end)                       # 156.8576 us
    assert t["a1"] == pytest.approx(a1_end)                       # 159.2864 us
    assert t["a2"] == pytest.approx(a1_end + CALL + L16)
    assert t["a3"] == pytest.approx(a1_end + 2 * (CALL + L16))    # 373.7152 us
    assert t["b1"] < two_stream_schedule("fifo")["b1"] - 200e-6, "fifo makes b1 wait for A's block"


def test_sim_engine_a_compute_op_between_two_copies_lets_the_other_stream_go_first() -> None:
    """A compute op on A between a1 and a2 ends the block: b1 (waiting since 52 us) goes when a1 finishes, and a2,
    ready at a1 + 1 us + its fixed phase, waits for b1."""
    t = two_stream_schedule("fifo", "compute")
    a1 = CALL + L16
    assert t["a1"] == pytest.approx(a1)
    assert t["b1"] == pytest.approx(a1 + L8), "the engine yields to B"
    assert t["a2"] == pytest.approx(a1 + L8 + L16)
    assert t["a3"] == pytest.approx(a1 + L8 + 2 * L16 + CALL), "a2 and a3 are a block again"


def test_sim_engine_a_wait_not_yet_satisfied_ends_a_block() -> None:
    """A wait on A between a1 and a2 for an event complete only at 200 us: when a1 finishes the engine is not held
    (A cannot go on), so b1 goes at once; a2 starts at 200 us and finds the engine free again."""
    t = two_stream_schedule("fifo", "pending wait")
    a1 = CALL + L16
    assert t["b1"] == pytest.approx(a1 + L8)
    assert t["a2"] == pytest.approx(200e-6 + CALL + L16)
    assert t["a3"] == pytest.approx(200e-6 + 2 * (CALL + L16))


def test_sim_engine_serves_in_arrival_order_not_by_stream() -> None:
    """Three streams created P, Q, R; while X's copy holds the engine their copies arrive R (10 us), P (20 us),
    Q (30 us): served R, P, Q. The sim's streams carry no priority; nothing about a stream (its age, its name)
    ranks it -- only when its copy became ready (priority-blind, torchrec #4303/#4339)."""
    rig = Rig()
    be = rig.be
    x = be.create_stream()
    p, q, r = be.create_stream(), be.create_stream(), be.create_stream()
    first = rig.copy(x, "load", range(0, 16))
    arrivals = {}
    for name, stream, at, rows in (("r", r, 10e-6, range(16, 24)), ("p", p, 20e-6, range(24, 32)),
                                   ("q", q, 30e-6, range(32, 40))):
        be.clock_advance(at - be.monotonic())
        arrivals[name] = rig.copy(stream, "load", rows)
    be.clock_advance(CALL)   # q's fixed phase ends: three wait, X's copy moves
    assert be._cost is not None and (be._cost.waiting(), be._cost.in_flight()) == (3, 1)
    ends = {name: rig.end(ev) for name, ev in arrivals.items()}
    assert rig.end(first) == pytest.approx(CALL + L16)
    assert ends["r"] == pytest.approx(CALL + L16 + L8)
    assert ends["p"] == pytest.approx(CALL + L16 + 2 * L8)
    assert ends["q"] == pytest.approx(CALL + L16 + 3 * L8)


def test_sim_engine_copies_ready_at_the_same_time_go_in_submission_order() -> None:
    """Three loads submitted at t=0 on three streams all arrive at 2 us (the scheduler settles them latest-submitted
    first): served in submission order."""
    rig = Rig()
    be = rig.be
    loads = [rig.copy(be.create_stream(), "load", range(16 * i, 16 * i + 16)) for i in range(3)]
    assert [rig.end(ev) for ev in loads] == pytest.approx([CALL + L16, CALL + 2 * L16, CALL + 3 * L16])


def test_sim_engine_store_is_not_delayed_by_queued_loads() -> None:
    """Two loads queue on the h2d engine; a store submitted with them runs on its own engine at once and finishes
    as if alone (torchrec #4303: D2H unaffected by H2D congestion)."""
    rig = Rig()
    be = rig.be
    l1, l2 = rig.copy(be.create_stream(), "load", range(0, 16)), rig.copy(be.create_stream(), "load", range(16, 32))
    store = rig.copy(be.create_stream(), "store", range(32, 48))
    assert rig.end(store) == pytest.approx(CALL + L16), "as alone"
    assert rig.end(l1) == pytest.approx(CALL + L16)
    assert rig.end(l2) == pytest.approx(CALL + 2 * L16), "the second load waited for the first"


def test_sim_engine_duplex_cap_applies_to_the_two_engines() -> None:
    """With the cap at 15 GB/s, the store and the first load (each engine's copy) run at 7.5 GB/s each; the second
    load then runs alone at 10 GB/s."""
    capped = dataclasses.replace(ENGINE, bidirectional_bandwidth=15 * GB)
    rig = Rig(profile=capped)
    be = rig.be
    l1, l2 = rig.copy(be.create_stream(), "load", range(0, 16)), rig.copy(be.create_stream(), "load", range(16, 32))
    store = rig.copy(be.create_stream(), "store", range(32, 48))
    both = CALL + 16 * PAGE / (7.5 * GB)
    assert rig.end(store) == pytest.approx(both) and rig.end(l1) == pytest.approx(both)
    assert rig.end(l2) == pytest.approx(both + L16)


def test_sim_engine_each_engine_moves_at_its_own_directions_rate() -> None:
    """Loads at 20 GB/s (the path's ``load_bandwidth`` under a 20 GB/s ``load_link_bandwidth``), stores at 10: two
    queued loads run one after the other at 20 GB/s while a store runs on its own engine at 10."""
    fast_loads = dataclasses.replace(ENGINE, memcpy=PathCost(0.0, 0.0, ((1, RATE),), load_bandwidth=((1, 2 * RATE),)),
                                     load_link_bandwidth=2 * RATE, bidirectional_bandwidth=3 * RATE)
    rig = Rig(profile=fast_loads)
    be = rig.be
    l1, l2 = rig.copy(be.create_stream(), "load", range(0, 16)), rig.copy(be.create_stream(), "load", range(16, 32))
    store = rig.copy(be.create_stream(), "store", range(32, 48))
    assert rig.end(store) == pytest.approx(CALL + L16)
    assert rig.end(l1) == pytest.approx(CALL + L16 / 2) and rig.end(l2) == pytest.approx(CALL + L16)


def test_sim_engine_a_hold_for_a_copy_going_the_other_way_is_released_at_once() -> None:
    """A's store a1 then load a2; B's store b1 ready during a1. The store engine, held for A's next copy, learns
    when a2 is priced that it is a load: b1 goes at a1's finish, with no time lost; a2 runs on the load engine."""
    rig = Rig()
    be = rig.be
    a, b = be.create_stream(), be.create_stream()
    a1, a2 = rig.copy(a, "store", range(0, 16)), rig.copy(a, "load", range(16, 32))
    be.clock_advance(50e-6)
    b1 = rig.copy(b, "store", range(48, 56))
    assert rig.end(a1) == pytest.approx(CALL + L16)
    assert rig.end(b1) == pytest.approx(CALL + L16 + L8)
    assert rig.end(a2) == pytest.approx(2 * CALL + 2 * L16)


def test_sim_engine_fifo_and_fair_agree_on_one_copy_at_a_time() -> None:
    """One stream, one copy at a time: nothing to order, both models give the same times (the h200 profile,
    several sizes and both directions)."""
    times = {}
    for model in LINK_MODELS:
        rig = Rig(model, H200)
        s = rig.be.create_stream()
        evs = [rig.copy(s, d, range(0, n)) for n in (1, 16, 64) for d in ("store", "load")]
        times[model] = [rig.end(ev) for ev in evs]
    assert times["fifo"] == times["fair"]


@pytest.mark.rule("R7")
def test_sim_engine_link_model_is_chosen_and_validated() -> None:
    assert all(p.link_model == "fair" for p in PROFILES.values()), "every named profile keeps the fair model"
    assert SimBackend(profile="h200", link_model="fifo").profile.link_model == "fifo"
    assert SimBackend(profile=ENGINE).profile.link_model == "fifo", "the profile's, unless overridden"
    assert SimBackend(profile=ENGINE, link_model="fair").profile.link_model == "fair"
    assert kv.get_backend("sim", profile="h100", link_model="fifo").profile.link_model == "fifo"
    assert dataclasses.replace(H200, link_model="fifo").link_model == "fifo"
    for bad in ("lifo", "FIFO", 1):
        with pytest.raises(InvalidTransferError, match=r"link_model must be one of 'fair', 'fifo'; got "):
            SimBackend(profile="h200", link_model=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidTransferError, match=f"link_model.*got {bad!r}"):
            dataclasses.replace(H200, link_model=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransferError, match="'fifo' needs a shared link"):
        SimBackend(link_model="fifo")   # "simple": no link phase to order
    with pytest.raises(InvalidTransferError, match="'fifo' needs a shared link"):
        dataclasses.replace(SIMPLE, link_model="fifo")
