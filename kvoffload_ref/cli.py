"""The ``kvoffload-ref`` command line: ``demo``, ``bench``, ``fuzz``, ``explore``, ``diagram``, ``spec``,
``failure-modes``, ``trace-plot``, ``cost-table``.

Exit status: 0 success; 1 a check failed (a demo check, a missed bench goal under ``--check``, a conformance
violation, out-of-date docs); 2 bad usage (bad arguments, an unimportable ``--factory``, Hypothesis missing for
``fuzz``, ``spec``/``failure-modes --check`` run outside a source checkout).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload_ref import __version__, cost_table
from kvoffload_ref.backends.sim_profiles import PROFILES
from kvoffload_ref.bench import missed_goals, run_bench
from kvoffload_ref.demo import demo
from kvoffload_ref.docgen import diagram as diagram_mod
from kvoffload_ref.docgen import failure_modes
from kvoffload_ref.docgen import spec as spec_mod

if TYPE_CHECKING:
    from kvoffload_ref.testing.adapter import WorkerFactory

__all__ = ["main"]

#: The factory ``fuzz`` checks when none is named: kvoffload_ref's own worker.
REFERENCE_FACTORY = "kvoffload_ref.testing.adapter:reference_factory"
#: Capabilities a factory may lack (``fuzz --without``).
CAPABILITIES = ("finalizer", "stats", "interrupts", "threads", "attribution", "ordering", "running")


def _checkout(root: str, needs: Sequence[str], command: str) -> pathlib.Path | None:
    """``root`` as a path when it holds every path in ``needs``; else print one line saying so and return None."""
    path = pathlib.Path(root)
    missing = [n for n in needs if not (path / n).exists()]
    if missing:
        print(f"kvoffload-ref {command}: needs a source checkout of kvoffload_ref ({missing[0]} not found under "
              f"{path.resolve()}); run it from the repository root or pass --root", file=sys.stderr)
        return None
    return path


def _spec(check_only: bool, root: str) -> int:
    path = _checkout(root, ("docs/spec.md", "docs/lifecycle.md", "tests"), "spec")
    if path is None:
        return 2
    if not check_only:
        spec_mod.write(path)
    problems = spec_mod.check(path)
    for problem in problems:
        print(f"spec: {problem}")
    if not problems:
        print("spec: every rule is cited by a test and the generated docs are current")
    return 1 if problems else 0


def _failure_modes(check_only: bool, write: bool, root: str) -> int:
    if not (check_only or write):
        sys.stdout.write(failure_modes.render())
        return 0
    path = _checkout(root, ("docs/failure-modes.md",), "failure-modes")
    if path is None:
        return 2
    if check_only:
        ok = failure_modes.check(path)
        print("failure-modes: docs/failure-modes.md is current" if ok else
              "failure-modes: docs/failure-modes.md is out of date (run: kvoffload-ref failure-modes --write)")
        return 0 if ok else 1
    (path / "docs" / "failure-modes.md").write_text(failure_modes.render())
    failure_modes.write_readme_table(path)
    return 0


def _bench(json_path: str | None, quick: bool, check: bool) -> int:
    doc = run_bench(json_path, quick=quick, progress=sys.stderr)
    missed = missed_goals(doc)
    if missed:
        print(f"bench: goals missed: {', '.join(missed)}", file=sys.stderr)
    return 1 if check and missed else 0


def _kit_factory(command: str, reference: str) -> WorkerFactory | None:
    """The worker factory ``reference`` names, loaded through the kit; None, after one line on stderr, when
    Hypothesis (the kit's one dependency) is missing or the reference is bad (exit 2)."""
    try:
        from kvoffload_ref.testing.jobs import FactoryError, load_factory  # noqa: PLC0415  (needs Hypothesis)
    except ModuleNotFoundError as exc:
        if exc.name != "hypothesis":
            raise
        print(f"kvoffload-ref {command}: {exc}", file=sys.stderr)
        return None
    try:
        return load_factory(reference)
    except FactoryError as exc:
        print(f"kvoffload-ref {command}: {exc}", file=sys.stderr)
        return None


def _fuzz(args: argparse.Namespace) -> int:
    """``kvoffload-ref fuzz``: 2 for bad usage (before anything runs), else the campaign's status."""
    factory = _kit_factory("fuzz", args.factory)
    if factory is None:
        return 2
    from kvoffload_ref.testing import Capabilities  # noqa: PLC0415  (the kit is importable now)
    from kvoffload_ref.testing.campaign import run_campaign  # noqa: PLC0415
    from kvoffload_ref.testing.jobs import run_jobs  # noqa: PLC0415
    from kvoffload_ref.testing.settings import DEFAULT_SHRINK_SECONDS  # noqa: PLC0415
    off = set(args.without or ())
    capabilities = Capabilities(**{name: name not in off for name in CAPABILITIES}) if off else None
    if args.verbose:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[log %(levelname)s %(name)s] %(message)s")
    steps = args.steps if args.seconds is None else None
    shrink = args.shrink_seconds if args.shrink_seconds is not None else DEFAULT_SHRINK_SECONDS
    if args.jobs > 1:
        return run_jobs(args.factory, args.jobs, steps, args.seed, args.policy, seconds=args.seconds,
                        capabilities=capabilities, quiet=not args.verbose, shrink_seconds=shrink)
    return run_campaign(steps, args.seed, args.policy, factory=factory, capabilities=capabilities,
                        seconds=args.seconds, quiet=not args.verbose, shrink_seconds=shrink)


def _explore(args: argparse.Namespace) -> int:
    """``kvoffload-ref explore``: 2 for bad usage, 1 when a case breaks a rule, else 0."""
    factory = _kit_factory("explore", args.factory)
    if factory is None:
        return 2
    if args.pairs:
        return _explore_pairs(args, factory)
    if args.second:
        print("kvoffload-ref explore: --second needs --pairs", file=sys.stderr)
        return 2
    from kvoffload_ref.testing.explorer import explore  # noqa: PLC0415  (the kit is importable now)
    if not args.verbose:
        logging.disable(logging.CRITICAL)  # thousands of interrupted shutdowns log as designed
    try:
        result = explore(factory, name=args.factory, configs=args.config or EXPLORE_CONFIGS,
                         methods=args.method or EXPLORE_METHODS, injections=args.injection or EXPLORE_INJECTIONS,
                         points=args.point, progress=print)
    finally:
        logging.disable(logging.NOTSET)
    return _print_found(result, result.per_method, args.show)


def _explore_pairs(args: argparse.Namespace, factory: WorkerFactory) -> int:
    """``kvoffload-ref explore --pairs``: the pair explorer (R19); 2 for what it cannot pair or interrupt."""
    unpaired = sorted(set(args.method or ()) - set(PAIR_METHODS))
    if args.injection or unpaired:
        print("kvoffload-ref explore --pairs: a second thread runs at each call point (no --injection); "
              f"methods: {', '.join(PAIR_METHODS)}" + (f" (not {', '.join(unpaired)})" if unpaired else ""),
              file=sys.stderr)
        return 2
    from kvoffload_ref.testing.pairs import explore_pairs  # noqa: PLC0415  (the kit is importable now)
    if not args.verbose:
        logging.disable(logging.CRITICAL)
    try:
        result = explore_pairs(factory, name=args.factory, configs=args.config or EXPLORE_CONFIGS,
                               firsts=args.method or PAIR_METHODS, seconds=args.second or PAIR_METHODS,
                               points=args.point, progress=print)
    except TypeError as exc:  # a worker not built on reference.Core: its lock cannot be watched
        print(f"kvoffload-ref explore --pairs: {exc}", file=sys.stderr)
        return 2
    finally:
        logging.disable(logging.NOTSET)
    return _print_found(result, result.cases_per_method(), args.show)


def _print_found(result: Any, cases: dict[str, int], show: int) -> int:
    """Print an explorer's table, its summary per method and its first ``show`` groups of failures (each once,
    with its count and one shortest rerun command); 1 if it found any, else 0."""
    from kvoffload_ref.testing.findings import render  # noqa: PLC0415  (the kit is importable now)
    print(result.table())
    print(render(cases, result.failures, EXPLORE_METHODS, show))
    return 1 if result.failures else 0


def _positive_int(text: str) -> int:
    """An option's int >= 1 (argparse names the option in its message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 (e.g. 2000), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value} (e.g. 2000)")
    return value


def _seconds_or_zero(text: str) -> float:
    """An option's number of seconds, 0 allowed (argparse names the option in its message)."""
    return _seconds(text, allow_zero=True)


def _positive_float(text: str) -> float:
    """An option's positive number of seconds (argparse names the option in its message)."""
    return _seconds(text, allow_zero=False)


def _seconds(text: str, *, allow_zero: bool) -> float:
    """An option's number of seconds: > 0, or >= 0 with ``allow_zero`` (any spelling of zero: 0, 0.00, 0e0, -0)."""
    wanted = "a number >= 0" if allow_zero else "a positive number"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {wanted} (e.g. 60), got {text!r}") from None
    if not (value >= 0 if allow_zero else value > 0):
        raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else 'positive'}, got {value} (e.g. 60)")
    return value + 0.0  # -0.0 reads as 0.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvoffload-ref", description="kvoffload_ref: a reference KV-cache offloading worker (GPU <-> pinned CPU)")
    parser.add_argument("--version", action="version", version=f"kvoffload-ref {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_cmd = _command(
             sub, "demo", "round trips, a hung shutdown, the release-policy hazard, a caught DMA race and a TP=4 -> "
             "TP=2 canonical round trip, on the simulated device",
             "Five acts on the simulated device, each explained before it runs, every check printed: round trips "
             "with every byte verified, a never-completing load shut down within its timeout (quarantine), the "
             "same under the vLLM #51622 'release' policy (the use-after-free it allows), and a racy offload "
             "schedule (a load into GPU blocks a pending store reads) flagged by the race detector, clean with a "
             "wait() in between, and the canonical layout (R24): a TP=4 model stores, a TP=2 model loads back "
             "byte-exact. Exit 1 if a check fails.")
    demo_cmd.add_argument("--trace", metavar="FILE", default=None,
                          help="also write every act's timeline as Chrome trace-event JSON (Perfetto)")
    plot = _command(sub, "trace-plot", "draw a timeline (Chrome trace JSON) as a PNG (needs matplotlib)",
                    "Draw a trace written by the simulated device or the CuPy backend (SimBackend(trace=True), "
                    "demo --trace, the layer-wise example's --trace): one row per stream, a bar per copy, compute "
                    "work, wait; markers for faults and violations. Needs matplotlib: "
                    'pip install "kvoffload_ref[plot]". Exit 2 without it or for an unreadable trace.')
    plot.add_argument("trace", help="the trace JSON")
    plot.add_argument("out", help="the PNG to write")
    plot.add_argument("--title", default=None, help="the picture's title (default: the trace's source)")
    _command(sub, "diagram", "print the lifecycle state machines as Mermaid text",
             "Print the worker's, the handler's and the region's state machines (generated from "
             "kvoffload_ref/lifecycle.py) as Mermaid stateDiagram-v2 text.")
    spec = _command(sub, "spec", "check (or --write) docs/spec.md's rule->test lists and docs/lifecycle.md",
                    "In a source checkout: check that every rule in docs/spec.md is cited by a test and that the "
                    "generated lists and docs/lifecycle.md are current (exit 1 if not), or regenerate them with "
                    "--write. Outside a checkout: exit 2.")
    mode = spec.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only check (the default)")
    mode.add_argument("--write", action="store_true", help="regenerate, then check")
    spec.add_argument("--root", default=".", help="repository root (default: the current directory)")
    modes = _command(sub, "failure-modes", "print, --write or --check the failure-mode table",
                     "Run every failure scenario on the simulated device and print the table of "
                     "docs/failure-modes.md (vLLM before/after #51622 against kvoffload_ref), --write it, or "
                     "--check the committed one (exit 1 if out of date; 2 outside a source checkout).")
    fm_mode = modes.add_mutually_exclusive_group()
    fm_mode.add_argument("--check", action="store_true", help="compare with the committed table")
    fm_mode.add_argument("--write", action="store_true",
                         help="rewrite docs/failure-modes.md and README's guarantee table")
    modes.add_argument("--root", default=".", help="repository root (default: the current directory)")
    bench = _command(sub, "bench", "measure the planner, the sim data path, shutdown and fuzzing (ratios)",
                     "Measure each figure against a baseline from the same run and print the table (progress "
                     "goes to stderr). Exit 1 under --check when a goal is missed.")
    bench.add_argument("--json", default=None, help="also write the results as JSON to this path")
    bench.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    bench.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    _fuzz_parser(sub)
    _explore_parser(sub)
    _cost_table_parser(sub)
    return parser


def _cost_table_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    table = _command(sub, "cost-table", "what one copy costs under a sim profile, measured on the sim (JSON, CSV)",
                     "Measure on the simulated device, under --profile, the time of one copy_batch alone on an "
                     "idle device per direction (d2h store, h2d load), per copy path the profile has, per "
                     "descriptor size (1 KiB .. 4 MiB) and count (1 .. 4096; copies over --max-bytes left out), "
                     "with each series' fixed and per-descriptor cost, a store and a load together against each "
                     "alone, and the profile's provenance (docs/cost-table.md). Exit 2 for an unknown profile or "
                     "format.")
    table.add_argument("--profile", required=True, choices=tuple(PROFILES), help="the sim profile")
    table.add_argument("--format", choices=("json", "csv"), default="json",
                       help="json (everything) or csv (one row per direction, path, size, count); default json")
    table.add_argument("--output", metavar="FILE", default=None, help="write here (default: standard output)")
    table.add_argument("--max-bytes", type=_positive_int, default=cost_table.DEFAULT_MAX_BYTES,
                       help=f"the largest copy measured, in bytes (default {cost_table.DEFAULT_MAX_BYTES})")


def _command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, short: str,
             long: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=short, description=long)


def _fuzz_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fuzz = _command(sub, "fuzz", "fuzz a worker against the conformance machine (needs Hypothesis)",
                    "Run the conformance state machine against a worker -- kvoffload_ref's own, or the one "
                    "--factory builds -- for --steps or --seconds, in --jobs processes. Exit 0: no violation; "
                    "1: a violation (shrunk, printed with its seed and a runnable reproduction); 2: bad usage. "
                    'Needs Hypothesis: pip install "hypothesis>=6.100".')
    fuzz.add_argument("--factory", default=REFERENCE_FACTORY, metavar="MODULE:CALLABLE",
                      help="the worker factory, (backend, gpu_tensors, setup) -> worker, as in docs/conformance.md "
                           "(default: kvoffload_ref's own worker)")
    bound = fuzz.add_mutually_exclusive_group()
    bound.add_argument("--steps", type=_positive_int, default=10_000, help="rule steps to run (default 10000)")
    bound.add_argument("--seconds", type=_positive_float, default=None, help="run for this long instead")
    fuzz.add_argument("--jobs", type=_positive_int, default=1,
                      help="processes, each seeded from the campaign seed (default 1)")
    fuzz.add_argument("--seed", type=int, default=None, help="campaign seed (default: random, printed)")
    fuzz.add_argument("--policy", choices=("quarantine", "release"), default=None,
                      help="shutdown policy to fuzz (default: drawn per example)")
    fuzz.add_argument("--without", action="append", choices=CAPABILITIES, default=None,
                      help="a capability the worker lacks (repeatable): its rules are not drawn")
    fuzz.add_argument("--shrink-seconds", type=_seconds_or_zero, default=None,
                      help="how long to shrink a failure (default 30; 0: report it as found, unshrunk)")
    fuzz.add_argument("--verbose", action="store_true", help="show the library's logs (quiet by default)")


#: What ``explore`` may be asked for (the explorer's own lists; kept here so that --help needs no Hypothesis).
EXPLORE_CONFIGS = ("clean", "failed", "hung", "hung-release", "failed-release", "shared", "expired", "allocated",
                   "allocated-hung")
EXPLORE_METHODS = ("construct", "submit_store", "submit_load", "get_finished", "wait", "order_after", "cancel",
                   "shutdown", "finalizer")
EXPLORE_INJECTIONS = ("KeyboardInterrupt", "SystemExit", "double", "SIGINT", "handler_shutdown",
                      "handler_shutdown_exit", "handler_cancel")
#: The methods ``explore --pairs`` pairs (the pair explorer's own list).
PAIR_METHODS = ("submit_store", "submit_load", "get_finished", "wait", "order_after", "cancel", "shutdown")


def _explore_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    explore = _command(sub, "explore", "interrupt every backend call of every public method (needs Hypothesis)",
                       "The call-point explorer: for each configuration, public method and backend call the method "
                       "makes, build a fresh worker, interrupt it there (a KeyboardInterrupt, a SystemExit, two "
                       "interrupts, a real SIGINT, a signal handler calling shutdown()) and check R5, R8, R12, R14, "
                       "R16, R19 and R22. Prints the call points per method and configuration, a summary per "
                       "method, and the failures grouped by (method, interruption, problem), each group once with "
                       "its count and the command that reruns its shortest case. Exit 0: no rule broken; 1: a "
                       "failure; 2: bad usage.")
    explore.add_argument("--factory", default=REFERENCE_FACTORY, metavar="MODULE:CALLABLE",
                         help="the worker factory, as for fuzz (default: kvoffload_ref's own worker)")
    explore.add_argument("--config", action="append", choices=EXPLORE_CONFIGS, help="only this configuration "
                         "(repeatable; default: all)")
    explore.add_argument("--method", action="append", choices=EXPLORE_METHODS, help="only this method (repeatable)")
    explore.add_argument("--injection", action="append", choices=EXPLORE_INJECTIONS,
                         help="only this injection (repeatable)")
    explore.add_argument("--point", action="append", type=int, help="only this call point (repeatable)")
    explore.add_argument("--pairs", action="store_true",
                         help="the pair explorer: pause each method (--method) at each backend call while a second "
                         "thread runs another (--second); checks R19's promises between threads as well")
    explore.add_argument("--second", action="append", choices=PAIR_METHODS,
                         help="with --pairs: only this method in the second thread (repeatable)")
    explore.add_argument("--show", type=int, default=20, help="groups of failures to print in full (default 20)")
    explore.add_argument("--verbose", action="store_true", help="show the library's logs (quiet by default)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvoffload-ref``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status (see the module docstring).
    """
    args = _parser().parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "bench": lambda a: _bench(a.json, a.quick, a.check),
        "fuzz": _fuzz,
        "explore": _explore,
        "failure-modes": lambda a: _failure_modes(a.check, a.write, a.root),
        "demo": lambda a: demo(a.trace),
        "trace-plot": lambda a: _trace_plot(a.trace, a.out, a.title),
        "spec": lambda a: _spec(not a.write, a.root),
        "diagram": _diagram,
        "cost-table": _cost_table,
    }
    return commands[args.command](args)


def _trace_plot(trace: str, out: str, title: str | None) -> int:
    """``kvoffload-ref trace-plot``: 0 written, 2 matplotlib missing or the trace unreadable."""
    from kvoffload_ref import trace_plot  # noqa: PLC0415  (matplotlib is optional: imported only here)
    return trace_plot.main(trace, out, title)


def _cost_table(args: argparse.Namespace) -> int:
    """``kvoffload-ref cost-table``: 0 written."""
    table = cost_table.build(args.profile, max_bytes=args.max_bytes)
    text = cost_table.to_json(table) if args.format == "json" else cost_table.to_csv(table)
    if args.output is None:
        sys.stdout.write(text)
    else:
        pathlib.Path(args.output).write_text(text, encoding="utf-8")
    return 0


def _diagram(args: argparse.Namespace) -> int:
    sys.stdout.write(diagram_mod.render())
    return 0
