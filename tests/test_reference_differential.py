"""The differential test: the engine (``create_worker``) and the reference (``create_reference_worker``) driven over
the same random schedule, each on its own simulated device with the same GPU contents and the same faults; every
result, every shutdown report's outcome and every CPU and GPU byte must agree. Where they disagree, the reference
is right (kvoffload_ref/reference.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload_ref.faults import Fault
from kvoffload_ref.testing import setups
from kvoffload_ref.testing.adapter import SimDevice, WorkerLike, reference_factory, reference_worker_factory
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.testing.strategies import completion_faults, transfer_specs

JOBS = range(1, 9)
#: Faults selected by the transfer they hit (never by a count of creations, which pooling changes), besides the
#: kit's ``completion_faults`` (an error at a transfer's end event).
AIMED = st.builds(Fault, st.sampled_from(["event_query", "copy"]), st.sampled_from(["error", "hang"]),
                  job_id=st.sampled_from(list(JOBS))).filter(lambda f: not (f.point == "event_query"
                                                                            and f.kind == "hang"))


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


def _outcome(call: Any) -> tuple[str, object]:
    """What a call did, comparably: its results (job id, success, bytes) or the type of what it raised."""
    try:
        out = call()
    except BaseException as exc:  # SimHang too: both must raise the same
        return "raised", type(exc).__name__
    if isinstance(out, list):
        return "results", [(r.job_id, r.success, r.transfer_size, r.invalid_blocks, r.transfer_type,
                            getattr(getattr(r, "error", None), "reason", None)) for r in out]
    return "returned", out


def _holds(worker: Any) -> tuple[object, ...]:
    """R27: what is held, and the holds that ended (each handed out once), comparably."""
    return worker.held(), [(r.job_id, r.direction, r.gpu_blocks, r.cpu_chunks) for r in worker.take_released()]


def _report(report: Any) -> tuple[object, ...]:
    return (report.region, report.device_sync, report.store.drained, report.store.abandoned, report.load.drained,
            report.load.abandoned, [(j.result.job_id, j.result.success, j.ended, j.result.invalid_blocks)
                                                             for j in report.unreported],
            dict(report.quarantined), dict(report.leaked), report.interrupted)


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
@pytest.mark.rule("R6")
@pytest.mark.rule("R8")
@pytest.mark.rule("R10")
@pytest.mark.rule("R12")
@pytest.mark.rule("R13")
@pytest.mark.rule("R22")
@pytest.mark.rule("R26")
@pytest.mark.rule("R27")
@pytest.mark.rule("R28")
@settings(derandomize=True, max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups(plans=st.lists(st.one_of(AIMED, completion_faults(list(JOBS))), max_size=2).map(tuple),
              schedules=("ordered",)), st.data())
def test_reference_and_engine_agree_on_every_result_report_and_byte(setup: Any, data: st.DataObject) -> None:
    devices = [SimDevice(setup), SimDevice(setup)]
    workers: list[WorkerLike] = [reference_factory(devices[0].backend, devices[0].gpu, setup),
                                 reference_worker_factory(devices[1].backend, devices[1].gpu, setup)]
    specs = transfer_specs(setup.layout, setup.blocks_per_chunk, setup.num_gpu_blocks, setup.num_cpu_chunks)
    for job in JOBS:
        op = data.draw(st.sampled_from(["store", "load", "wait", "get_finished", "cancel", "advance"]))
        if op in ("store", "load"):
            gpu_spec, cpu_spec = data.draw(specs)
            args = (gpu_spec, cpu_spec) if op == "store" else (cpu_spec, gpu_spec)
            deadline = data.draw(st.sampled_from([None, None, 1e-5, 1e-3]))  # R26
            calls = [getattr(w, f"submit_{op}") for w in workers]
            outs = [_outcome(lambda c=c, j=job, a=args, d=deadline: c(j, *a, deadline=d)) for c in calls]
            if data.draw(st.booleans()):  # R26/R27: cancelled at once; its blocks stay held while its copy may run
                outs += [_outcome(lambda w=w, j=job: w.cancel([j])) for w in workers]
            # The caller's duty (R20): order the next transfer after this one, so that no race decides a byte (a
            # cancelled one's blocks are held instead: a later transfer touching them is refused, R27).
            outs += [_outcome(lambda w=w, j=job: w.wait([j], timeout=setup.policy.timeout)) for w in workers]
        elif op == "cancel":
            ids = data.draw(st.lists(st.sampled_from(list(JOBS)), max_size=3))
            outs = [_outcome(lambda w=w, i=ids: w.cancel(i)) for w in workers]
        elif op == "advance":
            for device in devices:
                device.advance(1e-3)
            outs = [_outcome(w.get_finished) for w in workers]
        elif op == "wait":
            ids = data.draw(st.lists(st.sampled_from(list(JOBS)), max_size=3))
            outs = [_outcome(lambda w=w, i=ids: w.wait(i, timeout=0.5)) for w in workers]
        else:
            outs = [_outcome(w.get_finished) for w in workers]
        assert outs[0::2] == outs[1::2] if len(outs) > 2 else outs[0] == outs[1], (op, job, outs)
        assert _holds(workers[0]) == _holds(workers[1]), (op, job)
    assert _outcome(workers[0].get_finished) == _outcome(workers[1].get_finished)
    cpu = [w.cpu_snapshot() for w in workers]
    assert all(np.array_equal(a, b) for a, b in zip(*cpu, strict=True))
    reports = [w.shutdown() for w in workers]
    assert _report(reports[0]) == _report(reports[1])
    gpu = [d.read_gpu() for d in devices]
    assert all(np.array_equal(a, b) for a, b in zip(*gpu, strict=True))
    assert devices[0].ledger.live() == devices[1].ledger.live() == {}
