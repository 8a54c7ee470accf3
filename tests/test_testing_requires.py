"""Without Hypothesis, ``import kvoffload_ref.testing`` fails with one line naming the install command, and the
bench reports its fuzz figure as not available (simulated: ``sys.modules['hypothesis'] = None``)."""

from __future__ import annotations

import subprocess
import sys

HINT = 'pip install "hypothesis>=6.100"'


def _run(code: str) -> subprocess.CompletedProcess[str]:
    prelude = "import sys; sys.modules['hypothesis'] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60,
                          check=False)


def test_testing_requires_hypothesis_with_a_one_line_hint() -> None:
    done = _run("""
try:
    import kvoffload_ref.testing
except ModuleNotFoundError as exc:
    print(type(exc).__name__, exc.name, str(exc), sep="|")
""")
    kind, name, message = done.stdout.strip().split("|")
    assert (kind, name) == ("HypothesisMissing", "hypothesis")
    assert HINT in message and "\n" not in message


def test_testing_requires_the_core_and_the_bench_do_not() -> None:
    done = _run("""
import kvoffload_ref as kv
from kvoffload_ref.bench.fuzz import _campaign
run, why = _campaign()
print(run is None, why)
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True not available: ") and HINT in done.stdout
