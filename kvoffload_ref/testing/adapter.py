"""What an implementation must offer to be checked by the conformance machine, and the device the kit gives it.

The kit owns the device: a :class:`SimDevice` wraps a :class:`~kvoffload_ref.backends.sim.SimBackend` (virtual
clock, violation log, ledger) whose faults come from a :class:`RecordingPlan` (a ``FaultPlan`` that also records
the tag each fault fired on). An implementation plugs in through a :data:`WorkerFactory`: given the device's
backend, its GPU tensors and the :class:`Setup`, it builds a worker that does every device call through that
backend and offers the :class:`WorkerLike` methods (the protocols live in
:mod:`~kvoffload_ref.testing.worker_protocol`, re-exported here). That is the whole adapter (see docs/conformance.md).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Event, Ledger, Stream, Tag
from kvoffload_ref.backends.sim import SimBackend
from kvoffload_ref.fault_plan import STALL_KINDS
from kvoffload_ref.faults import Fault, FaultKind, FaultPlan, FaultPoint
from kvoffload_ref.reference import create_reference_worker
from kvoffload_ref.shared_region import SharedRegion
from kvoffload_ref.specs import KVCacheLayout
from kvoffload_ref.testing.worker_protocol import (
    RUNNING_CALLS,
    HandlerReportLike,
    HeldLike,
    JobOutcomeLike,
    ReleasedLike,
    ReportLike,
    ResultLike,
    RunningLike,
    WorkerLike,
    has_running_calls,
)
from kvoffload_ref.worker import ShutdownPolicy, create_worker

__all__ = [
    "Capabilities",
    "DeviceLike",
    "Firing",
    "RUNNING_CALLS",
    "HandlerReportLike",
    "HeldLike",
    "JobOutcomeLike",
    "RecordingPlan",
    "ReleasedLike",
    "ReportLike",
    "ResultLike",
    "RunningLike",
    "Setup",
    "SimDevice",
    "WorkerFactory",
    "WorkerLike",
    "has_running_calls",
    "initial_gpu_bytes",
    "reference_factory",
    "reference_worker_factory",
]

Bytes = npt.NDArray[np.uint8]


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything one machine run is built from. Its repr is valid Python (names from ``kvoffload_ref``).

    Attributes:
        layout: the KV-cache layout.
        blocks_per_chunk: GPU blocks per CPU chunk.
        num_gpu_blocks: rows of every GPU tensor.
        num_cpu_chunks: rows of every CPU tensor.
        gpu_row_pad: per tensor, bytes of padding after each GPU row (the worker gets a strided view).
        policy: the shutdown policy.
        faults: the faults armed before the worker is built.
        pin_chunk_bytes: the most bytes pinned per registration.
        seed: seed of the GPU tensors' initial random bytes.
        schedule: "racy": the machine queues work that conflicts with unobserved work as drawn (R20 races on
            purpose); "ordered": before such work it waits for the conflicting jobs (the caller's duty, R20), and
            skips the work if they cannot be observed complete.
        shared_region: the worker's region is a one-rank ``SharedRegion`` (a /dev/shm file) instead of private
            memory (a factory that cannot build one may ignore it).
        refuse_registration: the device is a platform that refuses host registration (status 801, as under
            confidential computing, vLLM #55428: ``SimBackend(host_register="refuse")``); the worker's region must
            then be a pinned allocation (``pinning="auto"`` falls back to one) or run pageable.
    """

    layout: KVCacheLayout
    blocks_per_chunk: int
    num_gpu_blocks: int
    num_cpu_chunks: int
    gpu_row_pad: tuple[int, ...]
    policy: ShutdownPolicy
    faults: tuple[Fault, ...] = ()
    pin_chunk_bytes: int = 1 << 30
    seed: int = 0
    schedule: str = "racy"
    shared_region: bool = False
    refuse_registration: bool = False


@dataclasses.dataclass(frozen=True)
class Firing:
    """One fault that fired: where, and on which transfer's tag (None for an untagged call)."""

    fault: Fault
    point: FaultPoint
    tag: Tag | None


class RecordingPlan(FaultPlan):
    """A FaultPlan that also records, per firing, the point and the tag it fired on (``firings``).

    The machine reads it to learn which transfer an error or a hang hit; the selection itself is FaultPlan's.
    """

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        super().__init__(faults)
        # Invariant: one entry per entry of ``fired``, in the same order.
        self.firings: list[Firing] = []

    def _record(self, before: int, point: FaultPoint, tag: Tag | None) -> None:
        for fault in self.fired[before:]:
            self.firings.append(Firing(fault, point, tag))

    def check(self, point: FaultPoint, tag: Tag | None = None) -> None:
        """As FaultPlan.check, recording what fired."""
        before = len(self.fired)
        try:
            super().check(point, tag)
        finally:
            self._record(before, point, tag)

    def check_release(self, point: FaultPoint) -> None:
        """As FaultPlan.check_release, recording what fired."""
        before = len(self.fired)
        try:
            super().check_release(point)
        finally:
            self._record(before, point, None)

    def check_hang(self, point: FaultPoint, tag: Tag | None = None) -> bool:
        """As FaultPlan.check_hang, recording what fired."""
        before = len(self.fired)
        try:
            return super().check_hang(point, tag)
        finally:
            self._record(before, point, tag)

    def select_hang(self, tag: Tag | None, kinds: tuple[FaultKind, ...] = STALL_KINDS) -> Fault | None:
        """As FaultPlan.select_hang, recording the hang (or slow fault) that selected the transfer."""
        before = len(self.fired)
        chosen = super().select_hang(tag, kinds)
        for fault in self.fired[before:]:
            self.firings.append(Firing(fault, fault.point, tag))
        return chosen


# -- what the machine talks to: the worker protocols (worker_protocol.py), the device ----------------------------
class DeviceLike(Protocol):
    """The device side the machine reads: clock, compute stream, memory, ledger, violations and faults."""

    backend: Backend
    gpu: list[object]
    plan: RecordingPlan
    interrupted: bool

    def clock(self) -> float:
        """The virtual clock."""
        ...

    def advance(self, seconds: float) -> None:
        """Let virtual time pass (queued work runs)."""
        ...

    def compute_write(self, tensor: int, rows: Sequence[int], value: int, delay: float,
                      stream: str | None = None) -> None:
        """Queue a kernel on the compute stream (or the named one) writing byte ``value`` into whole rows of GPU
        tensor ``tensor``."""
        ...

    def read_gpu(self) -> list[Bytes]:
        """Host copies of the GPU tensors, after the compute stream's queued work."""
        ...

    def violations(self) -> list[object]:
        """The misuse the device detected so far."""
        ...

    def interrupt_after(self, queries: int) -> None:
        """Raise KeyboardInterrupt from the ``queries``-th event query from now on."""
        ...

    def disarm(self) -> None:
        """Cancel interrupt_after."""
        ...

    @property
    def ledger(self) -> Ledger:
        """The resources the implementation acquired through the backend."""
        ...

    def lost(self) -> bool:
        """Whether a sticky fault lost the device."""
        ...


#: Builds the implementation under test: (backend, GPU tensors, setup) -> worker. It must do every device call
#: through ``backend`` and own its CPU region; the machine never passes it anything else.
WorkerFactory = Callable[[Backend, Sequence[object], Setup], WorkerLike]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """Which optional behaviours the implementation has (rules that need a missing one are not drawn).

    Attributes:
        finalizer: dropping the worker without shutdown() shuts it down (R15).
        stats: ``stats()`` is a snapshot that a refused submission leaves equal (R7).
        interrupts: a KeyboardInterrupt during shutdown is handled as R14 says.
        threads: every method may be called from several threads at once (R19).
        attribution: results carry ``invalid_blocks`` and ``transfer_type``, the report lists ``unreported``
            jobs (R22): the machine predicts and checks both, and that every accepted job is accounted for once.
        ordering: ``order_after`` (R23): the rule that orders compute work after queued transfers is drawn.
        running: a running engine (R26-R28): ``held()`` is asked before each submission (a conflicting one must
            raise ``BlocksHeldError``), ``take_released()`` after each step, ``cancel`` and ``deadline=`` are drawn.
            A worker without ``cancel``/``held``/``take_released`` is run without them (the kit says so once).
    """

    finalizer: bool = True
    stats: bool = True
    interrupts: bool = True
    threads: bool = True
    attribution: bool = True
    ordering: bool = True
    running: bool = True


#: Suffix of the label of an observed *start* event of a transfer (``("load" + START, job)``): what precedes the
#: transfer on its stream is observed, not the transfer itself (R26: a deadline's check queries the start).
START: Final = ":start"


def _tag_of(event: object) -> tuple[str, int] | None:
    """The tag of a sim event's latest record (None for an untagged one)."""
    tag = getattr(event, "tag", None)
    return tag if isinstance(tag, tuple) else None


def initial_gpu_bytes(setup: Setup, tensor: int) -> Bytes:
    """The deterministic initial bytes of one GPU tensor, padding included: (num_gpu_blocks, page + pad)."""
    rng = np.random.default_rng((setup.seed, tensor))
    width = setup.layout.tensor_page_bytes[tensor] + setup.gpu_row_pad[tensor]
    return rng.integers(0, 256, (setup.num_gpu_blocks, width), dtype=np.uint8)


class SimDevice:
    """The kit's device: a SimBackend with a RecordingPlan and GPU tensors (strided views when padded).

    The device also records, for the race check (R20), the memory ops queued on it in the order the sim numbers
    them (``op_labels``: a transfer's tag, or ``("compute", k)`` for the k-th compute write, on any compute
    stream) and the completions the host observed (:meth:`take_observations`): an event query that returned True
    or a ``synchronize`` that returned (labelled with the event's tag), and ``to_host`` (``("compute", -1)``: the
    work queued on the default compute stream so far, what an ``order_after`` made it wait for included).

    Args:
        setup: the run's setup (its ``faults`` are armed from the start).
        race_check: the sim's R20 detector (off only to check that the machine catches a missing one).

    Attributes:
        backend: the simulated device.
        plan: its fault plan (``plan.add`` arms a fault mid-run).
        gpu: one device array per layout tensor, as the worker gets them.
    """

    def __init__(self, setup: Setup, *, race_check: bool = True) -> None:
        self.plan = RecordingPlan(setup.faults)
        self.sim = SimBackend(self.plan, race_check=race_check,
                              host_register="refuse" if setup.refuse_registration else "allow")
        self.backend: Backend = self.sim
        self.gpu: list[object] = []
        # Invariant: True once the interrupt armed by interrupt_after() was raised.
        self.interrupted = False
        # Invariant: event queries left before interrupt_after's KeyboardInterrupt (0: disarmed).
        self._interrupt_in = 0
        # Invariant: one label per memory op the sim numbered, in its order (Violation.pair indexes it).
        self.op_labels: list[Tag | tuple[str, int] | None] = []
        # Invariant: per transfer tag, the label of the (non-compute) stream its latest record went to: the stream
        # it was queued on (R28: a fresh one after a retirement).
        self.streams: dict[Tag, str] = {}
        # Invariant: per transfer tag, how many records it made on non-compute streams (even: its start is next).
        self._records: collections.Counter[Tag] = collections.Counter()
        # Invariant: id() of each event whose latest record is a transfer's start (a pair's first record).
        self._starts: set[int] = set()
        # Invariant: observations not yet taken, in order, each with the number of ops labelled when it was made.
        self._observed: list[tuple[int, tuple[str, int] | None]] = []
        # Invariant: every completion the host observed, taken or not (what a reproduction asserts over).
        self._ever_observed: set[tuple[str, int]] = set()
        self._computes = 0
        for t, page in enumerate(setup.layout.tensor_page_bytes):
            full = self.sim.from_host(initial_gpu_bytes(setup, t))
            self.gpu.append(full[:, :page] if setup.gpu_row_pad[t] else full)  # type: ignore[index]
        self._wrap()

    def __repr__(self) -> str:
        return f"<SimDevice {self.sim!r}>"

    def _wrap(self) -> None:
        """Instance wrappers (the worker calls the backend's methods through the instance) that record ops and
        observations and raise the armed interrupt."""
        sim, cls = self.sim, type(self.sim)

        def query(event: Event) -> bool:
            if self._interrupt_in:
                self._interrupt_in -= 1
                if self._interrupt_in == 0:
                    self.interrupted = True
                    raise KeyboardInterrupt
            done = cls.query(sim, event)
            if done:
                self._observe(self._label(event))
            return done

        def synchronize(event: Event) -> None:
            cls.synchronize(sim, event)
            self._observe(self._label(event))

        def copy_batch(stream: Stream, buf: DescriptorBuffer, count: int, *, tag: Tag | None = None) -> None:
            cls.copy_batch(sim, stream, buf, count, tag=tag)
            self.op_labels.append(tag)

        def record(event: Event, stream: Stream, *, tag: Tag | None = None) -> None:
            cls.record(sim, event, stream, tag=tag)
            self._starts.discard(id(event))
            if isinstance(tag, tuple) and not getattr(stream, "compute", True):
                self.streams[tag] = str(getattr(stream, "label", stream))
                if self._records[tag] % 2 == 0:
                    self._starts.add(id(event))
                self._records[tag] += 1

        sim.query = query  # type: ignore[method-assign]
        sim.record = record  # type: ignore[method-assign]
        sim.synchronize = synchronize  # type: ignore[method-assign]
        sim.copy_batch = copy_batch  # type: ignore[method-assign]

    def _label(self, event: Event) -> tuple[str, int] | None:
        """The observation label of an event: its transfer's tag, or (direction + :data:`START`, job) for a
        transfer's start event."""
        tag = _tag_of(event)
        if tag is not None and id(event) in self._starts:
            return (f"{tag[0]}{START}", tag[1])
        return tag

    @property
    def ledger(self) -> Ledger:
        """The backend's ledger."""
        return self.sim.ledger

    def clock(self) -> float:
        """The virtual clock."""
        return self.sim.monotonic()

    def advance(self, seconds: float) -> None:
        """Advance the virtual clock."""
        self.sim.clock_advance(seconds)

    def compute_write(self, tensor: int, rows: Sequence[int], value: int, delay: float,
                      stream: str | None = None) -> None:
        """Queue a compute-stream write of ``value`` into ``rows`` of GPU tensor ``tensor`` (on the default compute
        stream, the worker's, or on the named compute stream ``stream``)."""
        self.sim.enqueue_compute_write(self.gpu[tensor], list(rows), value, delay, stream=stream)
        self.op_labels.append(("compute", self._computes))
        self._computes += 1

    def read_gpu(self) -> list[Bytes]:
        """Host copies of the GPU tensors (the clock advances past the compute stream's queued work, which the
        host thereby observes)."""
        copies = [self.sim.to_host(t) for t in self.gpu]
        self._observe(("compute", -1))
        return copies

    def _observe(self, label: tuple[str, int] | None) -> None:
        self._observed.append((len(self.op_labels), label))
        if label is not None:
            self._ever_observed.add(label)

    def observed(self) -> frozenset[tuple[str, int]]:
        """Every completion the host observed *directly* so far (an event query of that transfer's event that
        returned True, or a sync), as its transfer's tag (``("store", job)``): what a reproduction asserts R5/R20
        over. Stricter than the kit's own check, which also counts an observation implied by a later one on the same
        stream (``RaceModel.is_observed``): a reproduction of that check may still fail after a fix the kit accepts."""
        return frozenset(self._ever_observed)

    def take_observations(self, before: int | None = None) -> list[tuple[str, int] | None]:
        """The completions the host observed since the last call, in order (see the class docstring).

        Args:
            before: only those made before the op ``op_labels[before]`` was labelled (the rest stay); None: all.
                (A submission racing an observation in another thread is ordered by when each was recorded.)
        """
        cut = len(self._observed) if before is None else \
            next((i for i, (at, _) in enumerate(self._observed) if at > before), len(self._observed))
        taken, self._observed = self._observed[:cut], self._observed[cut:]
        return [label for _, label in taken]

    def copied(self, tag: Tag) -> bool:
        """Whether a copy carrying ``tag`` was queued."""
        return tag in self.op_labels

    def violations(self) -> list[object]:
        """The sim's violation log without ``dma_race`` (the misuse that makes copies fail or memory unsafe);
        races are compared with the model separately (:meth:`races`)."""
        return [v for v in self.sim.violations if v.kind != "dma_race"]

    def races(self) -> set[tuple[object, object]]:
        """The ``dma_race`` pairs the sim flagged, as (earlier op's label, later op's label)."""
        labels = self.op_labels
        return {(labels[v.pair[0]], labels[v.pair[1]]) for v in self.sim.violations
                if v.kind == "dma_race" and v.pair is not None}

    def race_details(self) -> list[str]:
        """The details of the ``dma_race`` violations (for messages)."""
        return [v.detail for v in self.sim.violations if v.kind == "dma_race"]

    def interrupt_after(self, queries: int) -> None:
        """Raise KeyboardInterrupt from the ``queries``-th event query from now on (a Ctrl-C during a wait)."""
        self.interrupted = False
        self._interrupt_in = queries

    def disarm(self) -> None:
        """Cancel :meth:`interrupt_after`."""
        self._interrupt_in = 0

    def lost(self) -> bool:
        """Whether a sticky fault lost the device."""
        return self.plan.lost() is not None


def _open_shared_region(backend: Backend, setup: Setup) -> SharedRegion | None:
    """The one-rank SharedRegion a setup asks for (None: the factory builds a private region)."""
    if not setup.shared_region:
        return None
    return SharedRegion.open(f"kvoffload-kit-{os.getpid()}-{next(_ENGINES)}", backend=backend, layout=setup.layout,
                             blocks_per_chunk=setup.blocks_per_chunk, num_cpu_chunks=setup.num_cpu_chunks, rank=0,
                             world_size=1)


def _build(create: Callable[..., WorkerLike], backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """``create(...)`` with the setup's options, over a shared region when asked (released again if the worker
    cannot be built, R2)."""
    region = _open_shared_region(backend, setup)
    try:
        return create(backend, gpu, setup.layout, blocks_per_chunk=setup.blocks_per_chunk,
                      num_cpu_chunks=setup.num_cpu_chunks, policy=setup.policy,
                      pin_chunk_bytes=setup.pin_chunk_bytes, region=region)
    except BaseException:
        if region is not None:
            region.release()
        raise


def reference_factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """Build kvoffload_ref's own worker (``create_worker``) for a setup (over a one-rank SharedRegion when the
    setup asks for one; the region is released again if the worker cannot be built, R2)."""
    return _build(create_worker, backend, gpu, setup)


def reference_worker_factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """Build the normative reference worker (``kvoffload_ref.reference.create_reference_worker``) for a setup,
    as :func:`reference_factory` builds the engine: the worked example of a factory (docs/conformance.md)."""
    return _build(create_reference_worker, backend, gpu, setup)


#: Numbers the engine ids of the shared regions the reference factory opens (unique within the process).
_ENGINES = itertools.count()
