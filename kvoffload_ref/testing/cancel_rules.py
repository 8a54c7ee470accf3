"""The conformance machine's cancel rule (R26): ``cancel`` on queued, reported and unknown ids, and a cancel racing
the completion it comes too late for.

``cancel`` draws ids among the pending jobs, the reported ones and an unknown one (rarely one that is not an int:
``InvalidTransferError``, nothing changed). The host must not block (the virtual clock stays); the model marks the
listed pending jobs ``cancelled``: each is then reported once, a success if the cancel's first look proved it,
else failed with ``TransferExpired`` (reason "cancel"; those behind it on its stream "behind"), and its blocks are
held until its copy is observed done (checked by :mod:`~kvoffload_ref.testing.holds` after every step).

Half the time (when a job is pending) it cancels after completion instead: it lets the device run everything
queued (the clock passes the compute stream's work and a margin), then cancels a job nothing keeps from
completing: its copy is done, so the cancel's first look must find it proven and report it as it is
(``proven_first``: a success, never ``TransferExpired``).

It runs only for a worker with a running engine's calls (``Capabilities.running``).
"""

from __future__ import annotations

from typing import Final

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.testing.adapter import RunningLike
from kvoffload_ref.testing.machine_base import MachineBase
from kvoffload_ref.testing.shutdown import MARGIN

__all__ = ["CancelRules"]

#: Mostly no bad id; sometimes a job id that is not an int (R7/R26: InvalidTransferError, nothing cancelled).
BAD_IDS: Final[tuple[object, ...]] = (None, None, None, None, None, None, "1", 2.5)


def _can_cancel(self: MachineBase) -> bool:
    """Precondition: an open worker with a running engine's calls."""
    return self.phase == "open" and self.running


class CancelRules(MachineBase):
    """Rule: cancel (see the module docstring).

    A mixin over :class:`~kvoffload_ref.testing.machine_base.MachineBase`, composed with the others in
    :class:`~kvoffload_ref.testing.machine.OffloadingMachine`.
    """

    @precondition(_can_cancel)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """R26: cancel queued, reported and unknown ids (never blocks; a bad id cancels nothing), or a job whose
        copy has completed (one rule: the other rules keep their share of the steps)."""
        with self._step():
            model = self.current_model
            pending = [t.job_id for t in model.pending()]
            if pending and not self.current_device.lost() and data.draw(st.booleans(), label="after completion"):
                self._cancel_after_completion(data)
                return
            ids = data.draw(st.lists(st.sampled_from(self._id_pool(pending)), max_size=3, unique=True), label="ids")
            bad = data.draw(st.sampled_from(BAD_IDS), label="bad id")
            self._cancel(ids, bad)

    def _cancel_after_completion(self, data: st.DataObject) -> None:
        """R26: a cancel that comes after the copy completed on the device reports the job as it is (a success)."""
        model, dev = self.current_model, self.current_device
        job = data.draw(st.sampled_from([t.job_id for t in model.pending()]), label="job")
        seconds = max(model.compute_busy_until - dev.clock(), 0.0) + MARGIN
        self._say(f"dev.advance({seconds!r})  # everything nothing blocks has run")
        dev.advance(seconds)
        transfer = model.transfers[job]
        done = (model.can_finish(transfer) and not transfer.must_fail and not model.may_be_late(transfer)
                and not self._unreliable())
        self._cancel([job], None)
        if done and not transfer.must_fail and transfer.status == "pending":  # no error fired at its look
            transfer.proven_first = True
            type(self).counters.cancels_after_completion += 1

    def _cancel(self, ids: list[int], bad: object) -> None:
        """Call ``cancel`` and tell the model which pending jobs it listed."""
        call: list[object] = [*ids, bad] if bad is not None else list(ids)
        self._say(f"w.cancel({call!r})")
        self._outcome("InvalidTransferError")
        dev, model = self.current_device, self.current_model
        worker: RunningLike = self.current_worker  # type: ignore[assignment]
        clock, stats, fired = dev.clock(), self._stats(), len(dev.plan.fired)
        try:
            worker.cancel(call)  # type: ignore[arg-type]
        except InvalidTransferError:
            self._check(bad is not None, "R26", f"cancel({call!r}) raised InvalidTransferError", "raised is None")
            self._check(self._stats() == stats and len(dev.plan.fired) == fired, "R7/R26",
                        f"cancel({call!r}) was refused but changed the worker or the device", self._before)
        else:
            self._check(bad is None, "R7/R26", f"cancel accepted the job id {bad!r}, which is not an int",
                        "raised is not None")
        self._check(dev.clock() == clock, "R26", "cancel() blocked the host (the virtual clock moved)",
                    f"dev.clock() == {clock!r}")
        self._absorb(self._new_firings())
        if bad is not None:
            return
        for job in ids:
            transfer = model.transfers.get(job)
            if transfer is not None and transfer.status == "pending":
                transfer.cancelled = True
        type(self).counters.cancels += 1

