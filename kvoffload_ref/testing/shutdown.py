"""What the model knows about how a shutdown must end, and the report checks (R9-R13, R16).

Pure functions over the model, the device and the report; the machine turns each problem into a failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Final

from kvoffload_ref.faults import FaultPoint
from kvoffload_ref.testing.adapter import ReportLike, SimDevice
from kvoffload_ref.testing.model import Model
from kvoffload_ref.testing.reproduction import set_literal
from kvoffload_ref.worker import ShutdownPolicy

__all__ = ["MARGIN", "REGION_MEMORY", "SLACK", "Expectations", "Problem", "expectations", "interrupted_problems",
           "may_release_unproven", "region_kept", "report_problems"]

#: Virtual seconds a bounded call (shutdown, wait with a timeout) may run past its timeout (R11).
SLACK: Final = 0.01
#: Virtual seconds after the compute stream drains by which every transfer nothing blocks has run on the sim.
MARGIN: Final = 0.01
#: Points where a fault can still change how shutdown ends (its drain queries, the proof's events and sync).
SHUTDOWN_POINTS: Final[frozenset[FaultPoint]] = frozenset({"event_query", "event_sync", "device_sync",
                                                           "event_create"})

#: (rule ids, message, the check as the reproduction asserts it: a Python expression over its names, true when the
#: rule holds -- ``report``, the shutdown's report; ``dev``, the device; ``start``, the clock before the shutdown
#: call; ``elapsed``, the time to an interrupt)
Problem = tuple[str, str, str]
#: The release policy's fate (R12), as a problem says it.
RELEASE_LEFT: Final = "policy 'release' left the region"


#: The ledger kinds of a region's memory: a mapping, or a pinned allocation where registration is refused.
REGION_MEMORY: Final = frozenset({"mapping", "pinned_alloc"})


def region_kept(quarantined: Iterable[str]) -> bool:
    """Whether a quarantine table (the report's, the ledger's: its kinds) keeps a region's memory (R12)."""
    return not REGION_MEMORY.isdisjoint(quarantined)


@dataclasses.dataclass(frozen=True)
class Expectations:
    """What the model knows, before a shutdown, about how it must end.

    Attributes:
        must_release: nothing can keep the device from being proven idle within the timeout (R12).
        must_quarantine: a hang selected a transfer, so its stream never idles (R12, quarantine policy).
        clean: every transfer will be proven by its own event: no device-level proof (R13).
        unclean: some transfer hung: the proof is needed (R13). (A failed one is a late copy whose end the drain
            may still observe, R27/R28: then nothing needs the proof.)
    """

    must_release: bool
    must_quarantine: bool
    clean: bool
    unclean: bool


def _may_fire(model: Model, device: SimDevice) -> bool:
    """Whether an armed fault could still fire on the shutdown path (so the model cannot predict its end): the
    drain queries the queued jobs and the late copies still held (R27)."""
    plan, pending = device.plan, [*model.pending(), *model.holding()]
    for fault in plan.faults:
        if fault.point not in SHUTDOWN_POINTS:
            continue
        if fault.nth is not None and plan.fired.count(fault) >= plan.faults.count(fault):
            continue  # every copy of it fired: a fault with nth fires once
        if fault.job_id is not None and all(t.job_id != fault.job_id for t in pending):
            continue  # its job is not queued any more: no call of the shutdown carries its tag
        if fault.direction is not None and all(t.direction != fault.direction for t in pending):
            continue
        return True
    return False


def expectations(model: Model, device: SimDevice, policy: ShutdownPolicy) -> Expectations:
    """What the model knows now about how a shutdown starting now must end."""
    certain = not (device.lost() or model.tainted or device.violations())
    enough = policy.timeout >= max(model.compute_busy_until - device.clock(), 0.0) + MARGIN
    must_release = certain and not model.any_hung and not _may_fire(model, device) and enough
    failed = model.any_failed or any(t.must_fail for t in model.pending())
    return Expectations(must_release, model.any_hung and not model.tainted, must_release and not failed,
                        model.any_hung)


def may_release_unproven(report: ReportLike, model: Model) -> bool:
    """R29: whether the region may be released although the device was not proven idle: no copy the worker never
    proved -- reported failed and never released (R27: a release says its copy was observed done), or neither drained
    nor proven-unreaped in the report, or a ghost -- moves a byte.
    (A job id reused after a failure hides the older transfer from the model; the sim's violation check still
    catches a region given back under a copy.)"""
    proven = {o.result.job_id for part in (report.store, report.load) for o in getattr(part, "jobs", ())
              if o.ended == "drained" or (o.ended == "unreaped" and o.result.success)}
    return not model.ghost_touches and not any(
        t.status != "succeeded" and not t.released and t.job_id not in proven and any(m.size for m in t.moves)
        for t in model.transfers.values())


def report_problems(report: ReportLike, *, model: Model, device: SimDevice, policy: ShutdownPolicy,
                    elapsed: float, expect: Expectations) -> Iterator[Problem]:
    """Every way the report (and the ledger after it) contradicts the rules and the model."""
    limit = policy.timeout + SLACK
    if not (elapsed <= limit and report.elapsed <= limit):
        yield ("R11", f"shutdown took {elapsed} s (report: {report.elapsed}) with timeout {policy.timeout}",
                      f"dev.clock() - start <= {limit!r} and report.elapsed <= {limit!r}")
    yield from _fate(report, policy, expect, may_release_unproven(report, model))
    if not (device.lost() or device.violations()):  # else queries failed without a recorded firing
        yield from _drains(report, model)
    yield from _ledger(report, device)


def interrupted_problems(report: ReportLike, *, device: SimDevice, policy: ShutdownPolicy,
                         elapsed: float, model: Model | None = None) -> Iterator[Problem]:
    """R14: an interrupted shutdown waited for nothing more, skipped the proof, quarantined what was not proven
    idle (the region: the interrupt hit a wait on unproven work -- unless, per R29, no unproven copy touches it:
    then it is released), released the rest, and says so."""
    if not report.interrupted:
        yield "R14", "the report of an interrupted shutdown is not marked interrupted", "report.interrupted"
    fates = ("quarantined", "released") if model is not None and may_release_unproven(report, model) else (
        "quarantined",)
    if report.device_sync != "skipped" or report.region not in fates:
        # Released unproven under the quarantine policy: R12's breach too.
        unproven = report.region == "released" and policy.on_unproven == "quarantine"
        yield "R12/R14" if unproven else "R14", (
            f"interrupted shutdown: device_sync={report.device_sync!r}, region={report.region!r}; "
            "expected 'skipped' and 'quarantined'"), f"report.device_sync == 'skipped' and report.region in {fates!r}"
    if elapsed > policy.timeout + SLACK:
        yield ("R11/R14", f"interrupted shutdown took {elapsed} s with timeout {policy.timeout}",
                          f"elapsed <= {policy.timeout + SLACK!r}")
    yield from _ledger(report, device)


def _fate(report: ReportLike, policy: ShutdownPolicy, expect: Expectations,
          may_release: bool) -> Iterator[Problem]:
    """R12/R13: release iff provable (or policy release; R29: or no unproven copy touches the region); the proof
    only off the clean path."""
    sync, region = report.device_sync, report.region
    if policy.on_unproven == "release":
        if region != "released":
            yield "R12", f"{RELEASE_LEFT} {region}", "report.region == 'released'"
    else:
        unproven = ("quarantined", "released") if may_release else ("quarantined",)
        fates = ("released",) if sync in ("not_needed", "ok") else unproven
        if region not in fates:
            yield ("R12/R29", f"region {region} with device_sync={sync!r} under policy 'quarantine'",
                              f"report.region in (('released',) if report.device_sync in ('not_needed', 'ok') else "
                              f"{unproven!r})")
        if expect.must_quarantine and region != "quarantined" and not may_release:
            yield ("R12", "released the region although a hung transfer may still touch it",
                          "report.region == 'quarantined'")
        if expect.must_release and region != "released":
            yield ("R12", f"quarantined (device_sync={sync!r}) although everything could be proven idle in time",
                          "report.region == 'released'")
    if expect.clean and sync != "not_needed":
        yield "R13", f"device_sync={sync!r} on the clean path", "report.device_sync == 'not_needed'"
    if expect.unclean and sync == "not_needed":
        yield ("R13", "no device-level proof although a transfer was not proven by its own event",
                      "report.device_sync != 'not_needed'")


def _drains(report: ReportLike, model: Model) -> Iterator[Problem]:
    """R9/R10: both handlers drained; what can never be proven is abandoned, never drained."""
    for direction, part in (("store", report.store), ("load", report.load)):
        queued = model.chain[direction]
        stuck = sum(t.stuck and not model.may_be_late(t) for t in queued)  # R26: an expired one is reported
        if part.abandoned < stuck:
            yield ("R9/R10", f"{direction} handler abandoned {part.abandoned} transfers; {stuck} can never be proven",
                             f"report.{direction}.abandoned >= {stuck}")
        if part.drained > len(queued) - stuck:
            yield ("R10", f"{direction} handler drained {part.drained} transfers; at most {len(queued) - stuck} "
                          "could be proven", f"report.{direction}.drained <= {len(queued) - stuck}")


def _ledger(report: ReportLike, device: SimDevice) -> Iterator[Problem]:
    """R16: nothing live after shutdown except what the report lists as quarantined or leaked."""
    ledger = device.ledger
    if ledger.live():
        yield "R16", f"live after shutdown: {ledger.live()}", "dev.ledger.live() == {}"
    if ledger.quarantined() != dict(report.quarantined):
        yield ("R16", f"ledger quarantined {ledger.quarantined()}, report says {dict(report.quarantined)}",
                      "dev.ledger.quarantined() == dict(report.quarantined)")
    if ledger.leaked() != dict(report.leaked):
        yield ("R16", f"ledger leaked {ledger.leaked()}, report says {dict(report.leaked)}",
                      "dev.ledger.leaked() == dict(report.leaked)")
    if (report.region == "quarantined") != region_kept(report.quarantined):
        yield ("R12", f"region {report.region} but quarantined {dict(report.quarantined)}",
                      f"(report.region == 'quarantined') == "
                      f"bool({set_literal(REGION_MEMORY)} & set(report.quarantined))")
