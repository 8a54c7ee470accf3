"""The conformance kit's Hypothesis settings: what the pytest route, CI and long fuzzing runs use.

A state machine's default ``TestCase`` settings run Hypothesis's *explain* phase after a failure, which on this
machine can take minutes (it replays the shrunk example many times to explain it); the kit's settings never run
it. Shrinking stays on (a shrunk reproduction is what a failure is worth) and is bounded: the machines'
``TestCase`` and the campaign run under :func:`bounded_shrinking`, so Hypothesis reports the smallest failure it
found within :data:`DEFAULT_SHRINK_SECONDS` (its own bound, 300 s, is too long for CI); ``shrink=False`` skips
shrinking. The health checks that a stateful machine trips by design (slow examples, large draws, filtered
draws, a large minimal example) are suppressed; the others stay on.

The kit's own profiles (:func:`register_profiles`): ``kvoffload_ref-dev`` (quick), ``kvoffload_ref-ci``
(derandomized: every CI run draws the same examples), ``kvoffload_ref-fuzz`` (long) and ``kvoffload_ref-hypofuzz``
(long campaigns under HypoFuzz, ``hypothesis fuzz``: the fuzz profile's settings with an example database, which
HypoFuzz needs to share and replay examples between its processes and runs; :func:`settings_for_hypofuzz`). Only
that profile keeps a database: the others leave no files behind.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Final

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

__all__ = [
    "DEFAULT_EXAMPLES",
    "DEFAULT_EXAMPLE_DATABASE",
    "DEFAULT_SHRINK_SECONDS",
    "EXAMPLE_DATABASE_ENV",
    "FUZZ_EXAMPLES",
    "PROFILES",
    "STEPS_PER_EXAMPLE",
    "SUPPRESSED_HEALTH_CHECKS",
    "bounded_shrinking",
    "kit_settings",
    "register_profiles",
    "settings_for_ci",
    "settings_for_dev",
    "settings_for_fuzz",
    "settings_for_hypofuzz",
]

#: Seconds a machine lets Hypothesis shrink a failure before it reports the smallest found so far.
DEFAULT_SHRINK_SECONDS: Final = 30.0
#: Rule steps per example (one worker's life).
STEPS_PER_EXAMPLE: Final = 50
#: Examples per run of :func:`kit_settings` (the pytest route's default). Hypothesis's generation makes about
#: seven related examples from each new one (the swarm choice of enabled rules included), so 200 examples are
#: about 30 independent tries of the failure path (an error at a transfer's completion, then ``get_finished``).
#: Measured with a worker reporting failures as successes: 80 of 80 runs caught it within 62 examples; with 100
#: examples 180 of 180 did too, but the slowest only just (a margin of 2x for a budget of ~15 s).
DEFAULT_EXAMPLES: Final = 200
#: Health checks a stateful conformance machine trips by design.
SUPPRESSED_HEALTH_CHECKS: Final = (HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                   HealthCheck.large_base_example)
#: Hypothesis's engine constant bounding a shrink in seconds.
_ENGINE_SHRINK_LIMIT: Final = "MAX_SHRINKING_SECONDS"
#: Examples per run of the long-campaign profiles (HypoFuzz ignores it: it runs until stopped).
FUZZ_EXAMPLES: Final = 5000
#: Where :func:`settings_for_hypofuzz` keeps its examples by default (Hypothesis's own default place, under the
#: working directory at the time the settings are made), unless :data:`EXAMPLE_DATABASE_ENV` names a directory.
DEFAULT_EXAMPLE_DATABASE: Final = os.path.join(".hypothesis", "examples")
#: The environment variable naming the directory of :func:`settings_for_hypofuzz`'s default database.
EXAMPLE_DATABASE_ENV: Final = "KVOFFLOAD_REF_EXAMPLE_DATABASE"
#: The kit's profile names (registered by :func:`register_profiles`).
PROFILES: Final = ("kvoffload_ref-dev", "kvoffload_ref-ci", "kvoffload_ref-fuzz", "kvoffload_ref-hypofuzz")


def kit_settings(max_examples: int = DEFAULT_EXAMPLES, *, derandomize: bool = False, shrink: bool = True,
                 stateful_step_count: int = STEPS_PER_EXAMPLE, database: ExampleDatabase | None = None) -> settings:
    """Settings for a conformance machine: no explain phase, no deadline, no example database (unless given).

    Args:
        max_examples: examples (worker lives) per run (default :data:`DEFAULT_EXAMPLES`).
        derandomize: draw the same examples on every run (CI).
        shrink: shrink a failure (bounded in time by :func:`bounded_shrinking`); False reports it as found.
        stateful_step_count: most rule steps per example.
        database: an example database (default None: none; :func:`settings_for_hypofuzz` passes one); with one,
            the run replays its saved examples first (Hypothesis's *reuse* phase).

    Returns:
        The settings (pass them to ``run_state_machine_as_test``, or assign them to ``Machine.TestCase.settings``).

    Raises:
        hypothesis.errors.InvalidArgument: a non-positive ``max_examples`` or ``stateful_step_count``, or a
            database with ``derandomize`` (Hypothesis refuses the pair).
    """
    # With a database, its examples (e.g. the failures HypoFuzz saved, under Hypothesis's own keys) replay first.
    phases = [Phase.explicit, *([Phase.reuse] if database is not None else []), Phase.generate,
              *([Phase.shrink] if shrink else [])]
    return settings(max_examples=max_examples, stateful_step_count=stateful_step_count, deadline=None,
                    database=database, derandomize=derandomize, report_multiple_bugs=False, phases=phases,
                    suppress_health_check=SUPPRESSED_HEALTH_CHECKS)


def settings_for_dev() -> settings:
    """Quick local runs: 50 examples."""
    return kit_settings(50)


def settings_for_ci() -> settings:
    """CI: 100 examples, derandomized (every run draws the same examples, so CI is deterministic)."""
    return kit_settings(100, derandomize=True)


def settings_for_fuzz() -> settings:
    """Long runs: 5,000 examples, random."""
    return kit_settings(FUZZ_EXAMPLES)


def settings_for_hypofuzz(database: ExampleDatabase | str | os.PathLike[str] | None = None) -> settings:
    """Long campaigns under HypoFuzz (``hypothesis fuzz``): :func:`settings_for_fuzz` with an example database.

    HypoFuzz keeps its corpus, its reports and the failures it found in the loaded profile's database (and
    refuses to run without one), so that its processes share examples and a later run replays them. Load this
    profile before the test modules are imported (in a ``conftest.py``), and give the machines' ``TestCase``
    the loaded profile's settings (``settings=hypothesis.settings()``), as ``tests/test_testing_machine.py`` does.

    Args:
        database: the example database: an ``ExampleDatabase`` (e.g. one shared between machines), or the path of
            a directory for Hypothesis's ``DirectoryBasedExampleDatabase`` (default: the directory named by
            ``$KVOFFLOAD_REF_EXAMPLE_DATABASE``, else :data:`DEFAULT_EXAMPLE_DATABASE`; made absolute now, the
            directory itself is made when the first example is saved).

    Returns:
        The settings (random, 5,000 examples per pytest run, no explain phase, bounded shrinking, a database whose
        examples a pytest run replays first: the failures HypoFuzz saved are under Hypothesis's own keys).
    """
    if isinstance(database, ExampleDatabase):
        return kit_settings(FUZZ_EXAMPLES, database=database)
    path = os.fspath(database) if database is not None else (os.environ.get(EXAMPLE_DATABASE_ENV)
                                                             or DEFAULT_EXAMPLE_DATABASE)
    return kit_settings(FUZZ_EXAMPLES, database=DirectoryBasedExampleDatabase(os.path.abspath(path)))


def register_profiles() -> None:
    """Register the kit's profiles (``kvoffload_ref-dev``, ``-ci``, ``-fuzz``, ``-hypofuzz``) with Hypothesis; load
    one with ``settings.load_profile(name)`` or ``HYPOTHESIS_PROFILE``-style in a conftest."""
    makers = (settings_for_dev, settings_for_ci, settings_for_fuzz, settings_for_hypofuzz)
    for name, make in zip(PROFILES, makers, strict=True):
        settings.register_profile(name, make())


@contextlib.contextmanager
def bounded_shrinking(seconds: float | None = DEFAULT_SHRINK_SECONDS) -> Iterator[None]:
    """Let Hypothesis shrink a failure for at most ``seconds`` inside the block (None: Hypothesis's own bound).

    Hypothesis has no setting for this; its engine stops shrinking (and reports the smallest failure so far)
    after a module-level number of seconds, which this sets for the duration of the block and then restores.
    On a Hypothesis without that bound the block changes nothing.

    Args:
        seconds: the shrink budget (positive), or None to leave Hypothesis's bound as it is.

    Yields:
        Nothing; the bound holds inside the block.

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if seconds is not None and seconds <= 0:
        raise ValueError(f"seconds (the shrink budget) must be positive or None, got {seconds!r} (e.g. 30.0)")
    engine = importlib.import_module("hypothesis.internal.conjecture.engine")
    before = getattr(engine, _ENGINE_SHRINK_LIMIT, None)
    if seconds is None or before is None:
        yield
        return
    setattr(engine, _ENGINE_SHRINK_LIMIT, seconds)
    try:
        yield
    finally:
        setattr(engine, _ENGINE_SHRINK_LIMIT, before)
