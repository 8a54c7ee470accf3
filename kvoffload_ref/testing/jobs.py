"""Fuzz campaigns across processes (``kvoffload-ref fuzz --jobs N``), and naming a factory as ``module:callable``.

:func:`run_jobs` starts N processes (``spawn``: each imports the factory by its name), each running
:func:`~kvoffload_ref.testing.campaign.run_campaign` with a seed derived from the campaign's seed
(:func:`derive_seed`; job 0 keeps the campaign seed), and its share of the steps or the whole time. It prints
one aggregated progress line at most every second; at the first failure it prints that job's report (with the
job's seed and the command that repeats it alone), stops the other jobs and returns 1. When every job passed it
prints the jobs' counters summed (``fuzz: totals: ...``: steps, runs, faults fired, interrupts, concurrent
shutdowns, races, ...) before ``fuzz: OK``.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import os
import queue
import random
import sys
import time
from collections.abc import Sequence
from typing import Final, TextIO, cast

from kvoffload_ref.testing.adapter import Capabilities, WorkerFactory
from kvoffload_ref.testing.machine import Counters

__all__ = ["FactoryError", "derive_seed", "load_factory", "run_jobs"]

#: Seconds between aggregated progress lines.
PROGRESS_EVERY: Final = 1.0


class FactoryError(ValueError):
    """A ``module:callable`` reference that does not name an importable callable."""


def load_factory(reference: str) -> WorkerFactory:
    """Import the worker factory a ``module:callable`` reference names (``callable`` may be dotted).

    The module is looked up as ``python -m`` looks it up: the current directory first on ``sys.path`` (put there
    when it is not on it already), so ``--factory mymod:make_worker`` finds ``./mymod.py`` without ``PYTHONPATH=.``
    and the ``reproduce:`` commands run as printed from the directory they were printed in.

    Args:
        reference: e.g. ``"kvoffload_ref.testing.mutants:failures_reported_as_success"``.

    Returns:
        The callable.

    Raises:
        FactoryError: a malformed reference, a module that cannot be imported (or raises any exception while
            being imported), or a missing or non-callable name.
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise FactoryError(f"--factory {reference!r}: expected module:callable")
    _cwd_first_on_path()
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(f"--factory {reference!r}: cannot import {module_name!r} ({_one_line(exc)})") from None
    except Exception as exc:  # the module itself raised while being imported: still a bad factory, not a finding
        raise FactoryError(f"--factory {reference!r}: importing {module_name!r} raised "
                           f"{type(exc).__name__}: {_one_line(exc)}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise FactoryError(f"--factory {reference!r}: {module_name!r} has no {attribute!r}") from None
        except Exception as exc:  # e.g. a module-level __getattr__ or a property that raises
            raise FactoryError(f"--factory {reference!r}: looking up {attribute!r} raised "
                               f"{type(exc).__name__}: {_one_line(exc)}") from None
    if not callable(target):
        raise FactoryError(f"--factory {reference!r}: {attribute!r} is not callable")
    return cast(WorkerFactory, target)


def _cwd_first_on_path() -> None:
    """Put the current directory first on ``sys.path`` unless it is on it already (as ``""`` or by its path)."""
    cwd = os.getcwd()
    if not any(entry in ("", ".") or os.path.abspath(entry) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (the CLI prints a bad factory as one line)."""
    return " ".join(str(exc).split()) or "no message"


def derive_seed(seed: int, job: int) -> int:
    """The seed of job ``job`` of a campaign seeded ``seed``: the seed itself for job 0, else a 32-bit hash."""
    return seed if job == 0 else random.Random(f"{seed}/{job}").randrange(2**32)


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one process runs."""

    index: int
    factory: str
    steps: int | None
    seconds: float | None
    seed: int
    policy: str | None
    capabilities: Capabilities | None
    quiet: bool
    shrink_seconds: float | None


#: (kind, job index, payload, text): ("progress", i, Counters, "") or ("done", i, exit status, the job's output).
_Message = tuple[str, int, "Counters | int", str]


class _Tally:
    """Progress of every job (Invariant: one Counters per job, the latest it sent)."""

    def __init__(self, jobs: int, shrinks: bool = True) -> None:
        self.latest = [Counters() for _ in range(jobs)]
        self.done = [False] * jobs
        # Invariant: whether the jobs shrink a failure (their shrink budget is not 0).
        self.shrinks = shrinks

    def line(self, goal: str, started: float) -> str:
        total = self.total()
        seconds = max(time.perf_counter() - started, 1e-9)
        running = self.done.count(False)
        return (f"fuzz: {len(self.latest)} jobs ({running} running)  steps {total.steps}/{goal}  "
                f"{total.steps / seconds:,.0f} steps/s  {seconds:.1f} s  runs {total.runs}  "
                f"violations {total.violations}{total.shrinking(self.shrinks)}  "
                f"accepted release-policy hazards {total.hazards}\n")

    def total(self) -> Counters:
        """Every counter summed over the jobs (``first_failure_step``: the first job's that has one)."""
        summed = Counters()
        for field in dataclasses.fields(Counters):
            values = [getattr(c, field.name) for c in self.latest]
            if field.name == "first_failure_step":
                setattr(summed, field.name, next((v for v in values if v), 0))
            else:
                setattr(summed, field.name, sum(values))
        return summed


def _child(job: _Job, messages: multiprocessing.Queue[_Message]) -> None:
    """One job: a campaign whose progress and outcome go to the parent."""
    import io  # noqa: PLC0415

    from kvoffload_ref.testing.campaign import run_campaign  # noqa: PLC0415  (a fresh interpreter)

    out = io.StringIO()
    try:
        status = run_campaign(job.steps, job.seed, job.policy, out, factory=load_factory(job.factory),
                              capabilities=job.capabilities, seconds=job.seconds, quiet=job.quiet,
                              shrink_seconds=job.shrink_seconds,
                              on_progress=lambda c: messages.put(("progress", job.index, dataclasses.replace(c), "")))
    except Exception as exc:  # a factory that fails outside the machine: report it, do not hang the parent
        messages.put(("done", job.index, 1, f"fuzz: job {job.index} (seed {job.seed}) crashed: {exc!r}\n"))
        return
    messages.put(("done", job.index, status, out.getvalue()))


def run_jobs(factory: str, jobs: int, steps: int | None, seed: int | None, policy: str | None,
             out: TextIO | None = None, *, seconds: float | None = None, capabilities: Capabilities | None = None,
             quiet: bool = True, shrink_seconds: float | None = None) -> int:
    """Run ``jobs`` campaigns in parallel processes and aggregate them.

    Args:
        factory: the ``module:callable`` reference of the worker factory (each process imports it).
        jobs: how many processes (at least 1).
        steps: total rule steps, shared out between the jobs (None when ``seconds`` bounds them).
        seed: the campaign's seed (None: random, printed); job i runs with ``derive_seed(seed, i)``.
        policy: as :func:`~kvoffload_ref.testing.campaign.run_campaign`.
        out: where the aggregated progress and the first failure go (default: ``sys.stdout`` at call time).
        seconds: how long each job runs (instead of ``steps``).
        capabilities: the optional behaviours the implementation has.
        quiet: silence the library's loggers in the jobs.
        shrink_seconds: each job's shrink budget (None: the kit's default; 0: failures are reported as found).

    Returns:
        0 if no job found a violation, 1 at the first job that did (or crashed).

    Raises:
        FactoryError: ``factory`` does not name an importable callable (checked before any process starts).
        ValueError: ``jobs`` below 1, or a bad step/time bound.
    """
    from kvoffload_ref.testing.settings import DEFAULT_SHRINK_SECONDS  # noqa: PLC0415

    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs!r} (e.g. 1)")
    if (steps is None) == (seconds is None) or (steps is not None and steps < 1):
        raise ValueError(f"steps and seconds: expected exactly one, steps >= 1 (e.g. steps=2000) or seconds (e.g. "
                         f"seconds=60); got steps={steps!r}, seconds={seconds!r}")
    load_factory(factory)
    out = out if out is not None else sys.stdout
    seed = random.SystemRandom().randrange(2**32) if seed is None else seed
    share = None if steps is None else -(-steps // jobs)
    plans = [_Job(i, factory, share, seconds, derive_seed(seed, i), policy, capabilities, quiet,
                  shrink_seconds if shrink_seconds is not None else DEFAULT_SHRINK_SECONDS) for i in range(jobs)]
    out.write(f"fuzz: {jobs} jobs, campaign seed {seed} (job seeds {', '.join(str(p.seed) for p in plans)}), "
              f"{f'{share} steps' if share is not None else f'{seconds:g} s'} each, factory {factory}\n")
    context = multiprocessing.get_context("spawn")
    messages: multiprocessing.Queue[_Message] = context.Queue()
    processes = [context.Process(target=_child, args=(plan, messages), daemon=True) for plan in plans]
    for process in processes:
        process.start()
    try:
        return _collect(plans, processes, messages, out, goal=str(steps) if steps is not None else "-")
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()


def _collect(plans: Sequence[_Job], processes: Sequence[multiprocessing.process.BaseProcess],
             messages: multiprocessing.Queue[_Message], out: TextIO, goal: str) -> int:
    """Read the jobs' messages until all are done or one failed; returns the exit status."""
    tally, started, printed = _Tally(len(plans), plans[0].shrink_seconds != 0), time.perf_counter(), 0.0
    while not all(tally.done):
        try:
            message = messages.get(timeout=PROGRESS_EVERY)
        except queue.Empty:
            dead = [i for i, p in enumerate(processes) if not p.is_alive() and not tally.done[i]]
            if dead:
                out.write(f"fuzz: job {dead[0]} (seed {plans[dead[0]].seed}) died "
                          f"(exit code {processes[dead[0]].exitcode})\n")
                return 1
            continue
        kind, index, payload, text = message
        if isinstance(payload, Counters):
            tally.latest[index] = payload
        elif kind == "done":
            tally.done[index] = True
            if payload != 0:
                out.write(tally.line(goal, started))
                out.write(f"fuzz: job {index} failed, seed {plans[index].seed} (repeat it alone: kvoffload-ref fuzz "
                          f"--factory {plans[index].factory} --seed {plans[index].seed} "
                          f"{_bound(plans[index])})\n")
                out.write(text)
                out.flush()
                return 1
        if time.perf_counter() - printed >= PROGRESS_EVERY:
            printed = time.perf_counter()
            out.write(tally.line(goal, started))
            out.flush()
    out.write(tally.line(goal, started))
    out.write(f"fuzz: totals: {tally.total().line()}\n")
    out.write(f"fuzz: OK: {len(plans)} jobs, no violation\n")
    return 0


def _bound(job: _Job) -> str:
    return f"--steps {job.steps}" if job.steps is not None else f"--seconds {job.seconds:g}"
