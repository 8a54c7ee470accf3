"""The conformance machine's device-side ordering rule (R23, R20): ``order_after`` on queued transfers, then
compute work on the GPU blocks they touch.

``order_then_compute`` draws some of the queued transfers that can finish (mostly loads; the compute stream then
waits for them on the device, so a stuck one is never drawn: it would block that stream for good), perhaps a
reported or an unknown id (they order nothing), the stream to order (mostly the worker's compute stream, else a
named one), whether to call ``order_after`` at all, and rarely an id that is not an int (``InvalidTransferError``,
and nothing is ordered). Then it queues compute work into rows the listed transfers touch, mostly on the stream it
ordered. The models learn the edge (:meth:`~kvoffload_ref.testing.races.RaceModel.order_after`,
:meth:`~kvoffload_ref.testing.model.Model.order_after`), so the race check (R20) says whether the device must flag
the compute work: not when it was ordered after the transfers it overlaps, yes otherwise (no ``order_after``,
another stream, a transfer left out, a job no longer queued). The host must not block (the clock stays).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.testing.machine_base import MachineBase
from kvoffload_ref.testing.model import ModelTransfer

__all__ = ["KIT_STREAM", "ORDER_STREAMS", "OrderingRules"]

#: The named compute stream the rule orders (and queues compute work on) besides the worker's own.
KIT_STREAM: Final = "kit-side"
#: The stream ``order_after`` is asked to order (None: the worker's compute stream).
ORDER_STREAMS: Final = (None, None, KIT_STREAM)
#: Mostly no bad id; sometimes a job id that is not an int (R7/R23: InvalidTransferError, nothing ordered).
BAD_IDS: Final[tuple[object, ...]] = (None, None, None, None, None, None, "1", 1.5)


def _can_order(self: MachineBase) -> bool:
    """Precondition: an open worker on a live device, with some transfer queued (else there is nothing to order)."""
    if self.phase != "open" or not self.capabilities.ordering or self.current_device.lost():
        return False
    chain = self.current_model.chain
    return bool(chain["load"] or chain["store"])


class OrderingRules(MachineBase):
    """Rule: order_then_compute (see the module docstring).

    A mixin over :class:`~kvoffload_ref.testing.machine_base.MachineBase`, composed with the others in
    :class:`~kvoffload_ref.testing.machine.OffloadingMachine`; it queues compute work through
    :class:`~kvoffload_ref.testing.rules.TransferRules` (declared below for the type checker only).
    """

    if TYPE_CHECKING:  # from TransferRules
        def _write_rows(self, data: st.DataObject, tensor: int, aimed: list[int],
                        stream: str | None = None) -> None: ...

    @precondition(_can_order)
    @rule(data=st.data())
    def order_then_compute(self, data: st.DataObject) -> None:
        """R23/R20: ``order_after`` (or not) on some queued transfers, then compute work on the rows they touch."""
        with self._step():
            model, setup = self.current_model, self.current_setup
            queued = [t for d in ("load", "store") for t in model.chain[d]  # R26: an expired job orders nothing
                      if model.can_finish(t) and not model.may_be_late(t)]
            pool = self._id_pool(t.job_id for t in queued)
            ids = data.draw(st.lists(st.sampled_from(pool), max_size=3, unique=True), label="ids")
            if data.draw(st.booleans(), label="order_after"):
                stream = data.draw(st.sampled_from(ORDER_STREAMS), label="stream")
                self._order_after(ids, stream, data.draw(st.sampled_from(BAD_IDS), label="bad id"))
            else:
                stream = None
            other = KIT_STREAM if stream is None else None
            on = data.draw(st.sampled_from((stream, stream, stream, other)), label="compute stream")
            known = [model.transfers[j] for j in ids if j in model.transfers]
            aimed = [t for t in known if t.status == "pending"] or model.pending()
            tensors = sorted({m.tensor for t in aimed for m in t.moves})
            tensor = data.draw(st.sampled_from(tensors or list(range(setup.layout.num_tensors))), label="tensor")
            rows = sorted({m.gpu_row for t in aimed for m in t.moves if m.tensor == tensor})
            self._write_rows(data, tensor, rows, on)  # rows the queued transfers touch, if any

    def _order_after(self, ids: list[int], stream: str | None, bad: object) -> None:
        """Call ``order_after`` and tell the models which transfers the stream now waits for: the listed jobs the
        worker still has queued (R23: reported and unknown ids order nothing)."""
        call: list[object] = [*ids, bad] if bad is not None else list(ids)
        named = "" if stream is None else f", stream={stream!r}"
        self._say(f"w.order_after({call!r}{named})")
        self._outcome("InvalidTransferError")
        dev, model = self.current_device, self.current_model
        clock = dev.clock()
        try:
            self.current_worker.order_after(call, stream)  # type: ignore[arg-type]
        except InvalidTransferError as exc:
            self._check(bad is not None, "R23", f"order_after({call!r}) raised {exc!r}", "raised is None")
        else:
            self._check(bad is None, "R7/R23", f"order_after accepted the job id {bad!r}, which is not an int",
                        "raised is not None")
        self._check(dev.clock() == clock, "R23", "order_after() blocked the host (the virtual clock moved)",
                    f"dev.clock() == {clock!r}")
        if bad is not None:
            return  # refused: nothing is ordered (the race check sees it if something was)
        waited: list[ModelTransfer] = [model.transfers[j] for j in ids if j in model.transfers
                                       and model.transfers[j] in model.chain[model.transfers[j].direction]]
        if stream is None:
            model.order_after(waited, clock)
        self.current_race.order_after([(t.direction, t.job_id) for t in waited], stream)
        counters = type(self).counters
        counters.orderings += 1
        counters.ordered_edges += len(waited)
