"""The conformance model's account of R20: which pairs of device operations are unordered, by the rules alone.

Theory of operation
-------------------
Every transfer the worker queued (also one with no bytes, and a failed submission whose copy was queued) and
every compute write the machine queued is a *node*. A node's ``preds`` is the set of nodes ordered before it
(transitively closed), by the rules and nothing else:

* a transfer is ordered after the previous transfer queued on its stream, failed or not (R4: FIFO per
  direction; R28: after a failure the direction goes on on a fresh stream, which waits for nothing of the
  retired one -- the kit's device says which stream each transfer went to);
* a transfer is ordered after everything the worker's compute stream is ordered after when it is submitted (R4:
  the compute-stream wait): the compute writes queued there so far, and what its ``order_after`` waits covered;
* a compute write is ordered after the earlier work of its stream: the compute writes queued on it, and the
  transfers an ``order_after`` on it waited for (R23: a wait on a transfer's end event covers that transfer and
  everything ordered before it), whether or not they later fail (a failed copy still ends on the device);
* every node is ordered after what the host had *observed complete* when it was queued.

Streams are the worker's compute stream (``None``, the sim's default one) and named compute streams (the kit's
device queues compute work on one by name); transfers wait for the worker's compute stream only.

Observation is the simulated device's, as docs/simulator.md defines it: an event query that returned True or a
``synchronize`` that returned, on the event a transfer's tag names, observes that transfer and what precedes it;
a query that raised is *not* an observation (a failed job's completion is unknown: nothing orders it until a
later transfer of its direction is observed complete); ``to_host`` observes the compute writes queued so far. A
transfer's *start* event (a deadline's check queries it, R26) observes what precedes the transfer, not itself.
The kit's device records these (:meth:`~kvoffload_ref.testing.adapter.SimDevice.take_observations`) and the
machine feeds them here before each new node; the kit assumes the worker proves a transfer by its tagged end
event (R5), as the reference does.

Two nodes *race* when neither is ordered before the other and their byte ranges overlap with at least one of
them writing: a store reads GPU rows ``[0, page_size)`` and writes CPU chunk rows at ``[sub_block * page, ...)``,
a load the reverse, a compute write writes whole GPU rows. :attr:`RaceModel.races` is the set of (earlier,
later) label pairs, a label being ``(direction, job_id)`` for a transfer and ``("compute", k)`` for the machine's
k-th compute write (from 0, over every stream): the machine compares it with the pairs the device flagged
``dma_race``. ``to_host`` observes the worker's compute stream only (what it waited for included).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence

from kvoffload_ref.testing.adapter import START
from kvoffload_ref.testing.model import Move

__all__ = ["Label", "RaceModel", "RaceNode", "transfer_ranges"]

#: ("store" | "load", job id) for a transfer; ("compute", k) for the k-th compute write.
Label = tuple[str, int]
#: (side, tensor, row) -> [(lo, hi, writes)]
Ranges = dict[tuple[str, int, int], list[tuple[int, int, bool]]]


def transfer_ranges(direction: str, moves: Iterable[Move]) -> Ranges:
    """The bytes a transfer reads and writes, by (side, tensor, row)."""
    ranges: Ranges = defaultdict(list)
    source = "gpu" if direction == "store" else "cpu"
    for move in moves:
        for side in ("gpu", "cpu"):
            row, lo, hi = move.at(side)
            if hi > lo:
                ranges[(side, move.tensor, row)].append((lo, hi, side != source))
    return dict(ranges)


@dataclasses.dataclass(eq=False)
class RaceNode:
    """One device operation as the race model sees it.

    Attributes:
        label: its label (see the module docstring).
        index: its position among the nodes.
        ranges: the bytes it touches (empty for a transfer with no bytes).
        preds: the indices of the nodes ordered before it.
    """

    label: Label
    index: int
    ranges: Ranges
    preds: frozenset[int]

    def cover(self) -> frozenset[int]:
        """Itself and everything ordered before it: what observing its completion observes."""
        return self.preds | {self.index}


def _conflict(a: Ranges, b: Ranges) -> bool:
    small, large = (a, b) if len(a) <= len(b) else (b, a)
    for key, spans in small.items():
        others = large.get(key)
        if not others:
            continue
        for lo, hi, writes in spans:
            for olo, ohi, owrites in others:
                if (writes or owrites) and lo < ohi and olo < hi:
                    return True
    return False


class RaceModel:
    """Happens-before by the rules (see the module docstring); a naive pairwise model."""

    def __init__(self) -> None:
        # Invariant: every node, by index.
        self.nodes: list[RaceNode] = []
        # Invariant: label -> node, for every node.
        self.by_label: dict[Label, RaceNode] = {}
        # Invariant: per stream (a transfer's lane), the last transfer node queued there (the next one follows it).
        self.last: dict[str, RaceNode] = {}
        # Invariant: per compute stream (None: the worker's), the nodes its next op is ordered after (its compute
        # writes and what its order_after waits covered, closed under preds); a stream not present: none.
        self.frontier: dict[str | None, frozenset[int]] = {}
        # Invariant: the nodes the host observed complete (closed under preds).
        self.observed: set[int] = set()
        # Invariant: every predicted race, (earlier label, later label).
        self.races: set[tuple[Label, Label]] = set()
        # Invariant: every order_after the model took an edge from: (stream, the labels waited for), in order.
        self.waits: list[tuple[str | None, tuple[Label, ...]]] = []
        self.computes = 0

    # -- queries ----------------------------------------------------------------------------------------------
    def partners_of_transfer(self, direction: str, moves: Sequence[Move], lane: str | None) -> list[Label]:
        """The nodes a transfer submitted now on stream ``lane`` (None: a fresh one) would race with."""
        return self._partners(self._transfer_preds(lane), transfer_ranges(direction, moves))

    def partners_of_compute(self, tensor: int, rows: Sequence[int], page: int,
                            stream: str | None = None) -> list[Label]:
        """The nodes a compute write queued now on ``stream`` would race with."""
        return self._partners(self._compute_preds(stream), self._compute_ranges(tensor, rows, page))

    def is_observed(self, label: Label) -> bool:
        """Whether the host observed the node's completion."""
        node = self.by_label.get(label)
        return node is not None and node.index in self.observed

    # -- events -----------------------------------------------------------------------------------------------
    def transfer(self, direction: str, job_id: int, moves: Sequence[Move], lane: str | None = None) -> RaceNode:
        """The worker queued a transfer (its copy, if it has bytes) on stream ``lane`` (None: unknown, its
        direction's one)."""
        lane = direction if lane is None else lane
        node = self._add((direction, job_id), self._transfer_preds(lane), transfer_ranges(direction, moves))
        self.last[lane] = node
        return node

    def compute(self, tensor: int, rows: Sequence[int], page: int, stream: str | None = None) -> RaceNode:
        """The machine queued on ``stream`` (None: the worker's compute stream) a compute write of whole rows
        (``page`` bytes each) of GPU tensor ``tensor``."""
        node = self._add(("compute", self.computes), self._compute_preds(stream),
                         self._compute_ranges(tensor, rows, page))
        self.computes += 1
        self.frontier[stream] = node.cover()
        return node

    def order_after(self, labels: Iterable[Label], stream: str | None = None) -> None:
        """R23: ``stream`` waited on the device for the end of each listed transfer (those the worker still had
        queued): its later ops are ordered after them and everything ordered before them."""
        covered = set(self.frontier.get(stream, frozenset()))
        waited = tuple(label for label in labels if label in self.by_label)
        for label in waited:
            covered |= self.by_label[label].cover()
        self.frontier[stream] = frozenset(covered)
        if waited:
            self.waits.append((stream, waited))

    def observe(self, label: Label | None) -> None:
        """The host observed the completion of a transfer (its label) or, with ``("compute", -1)``, of the work
        queued on the worker's compute stream so far (its compute writes, and what it waited for). Unknown labels
        (an untagged event) observe nothing the model can name."""
        if label == ("compute", -1):
            self.observed |= self.frontier.get(None, frozenset())
            return
        if label is not None and label[0].endswith(START):  # a transfer's start: what precedes it on its stream
            start = self.by_label.get((label[0][:-len(START)], label[1]))
            if start is not None:
                self.observed |= start.preds
            return
        node = self.by_label.get(label) if label else None
        if node is not None:
            self.observed |= node.cover()

    # -- internals --------------------------------------------------------------------------------------------
    @staticmethod
    def _compute_ranges(tensor: int, rows: Sequence[int], page: int) -> Ranges:
        return {("gpu", tensor, int(r)): [(0, page, True)] for r in rows}

    def _transfer_preds(self, lane: str | None) -> frozenset[int]:
        preds = set(self.observed) | self.frontier.get(None, frozenset())
        last = None if lane is None else self.last.get(lane)
        if last is not None:
            preds |= last.cover()
        return frozenset(preds)

    def _compute_preds(self, stream: str | None) -> frozenset[int]:
        return frozenset(self.observed | self.frontier.get(stream, frozenset()))

    def _partners(self, preds: frozenset[int], ranges: Ranges) -> list[Label]:
        if not ranges:
            return []
        return [n.label for n in self.nodes if n.index not in preds and n.ranges and _conflict(n.ranges, ranges)]

    def _add(self, label: Label, preds: frozenset[int], ranges: Ranges) -> RaceNode:
        for partner in self._partners(preds, ranges):
            self.races.add((partner, label))
        node = RaceNode(label, len(self.nodes), ranges, preds)
        self.nodes.append(node)
        self.by_label[label] = node
        return node
