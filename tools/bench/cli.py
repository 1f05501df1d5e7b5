"""Command line of ``python -m tools.bench``: one sub-command per registered suite, plus ``all``.

Options every suite takes (``--json``, ``--report``, ``--repeat``, ``--quick``, ``--cases``, ``--dir``,
``--engine``, ``--seed``) come from :func:`common_parser`; each suite adds its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from tools.bench.common import BenchSetupError, machine_info, utc_now
from tools.bench.options import positive_int
from tools.bench.registry import Suite, all_suites, unavailable_suites
from tools.bench.report import write_report

__all__ = ["common_parser", "build_parser", "main", "write_json"]


def common_parser() -> argparse.ArgumentParser:
    """The options every suite (and ``all``) takes.

    Returns
    -------
    argparse.ArgumentParser
        A parent parser (``add_help=False``).
    """
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common options")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    g.add_argument("--report", metavar="DIR",
                   help="write a report into DIR: each suite's JSON, text table and chart (PNG, needs matplotlib), "
                        "and index.md with the tables, date, machine and command")
    g.add_argument("--repeat", type=positive_int, default=3, metavar="N",
                   help="interleaved sfstore/reference pairs per case (default 3; BENCHMARKING.md asks for >= 3)")
    g.add_argument("--quick", action="store_true", help="run each suite's short list of headline cases only")
    g.add_argument("--cases", action="append", metavar="GLOB",
                   help="run only cases whose name matches one of these shell globs (comma-separated, repeatable), "
                        "e.g. 'read-1m-*,randread-4k-qd32'")
    g.add_argument("--dir", metavar="DIR",
                   help="directory for benchmark files (default: <sfstore data_dir>/bench); never tmpfs or /dev/shm")
    g.add_argument("--engine", choices=("auto", "uring", "threads", "python"),
                   help="sfstore I/O engine (default: the 'engine' setting, SFSTORE_ENGINE)")
    g.add_argument("--seed", type=int, default=1234, help="seed of random offsets and data (default 1234)")
    return p


def _add_suite_parser(sub: Any, suite: Suite, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(suite.name, parents=[common], help=suite.help, description=suite.help)
    suite.add_arguments(p)


def _suite_parser(suite: Suite) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m tools.bench {suite.name}", parents=[common_parser()])
    suite.add_arguments(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The full parser: one sub-command per registered suite, plus ``all``.

    Returns
    -------
    argparse.ArgumentParser
        The parser of ``python -m tools.bench``.
    """
    registered = all_suites()
    missing = unavailable_suites()
    epilog = ""
    if missing:
        epilog = "suites that cannot load here: " + "; ".join(f"{k} ({v})" for k, v in sorted(missing.items()))
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description="Benchmark sfstore against reference tools on the same data, by the rules of "
                    "BENCHMARKING.md. Run from the project root.",
        epilog=epilog or None)
    common = common_parser()
    sub = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for suite in registered.values():
        _add_suite_parser(sub, suite, common)
    every = sub.add_parser("all", parents=[common], help="run every suite in turn",
                           description="Run every suite in turn with the options given here; each suite takes the "
                                       "ones it knows (e.g. the engine suite's --size). A suite that cannot run here "
                                       "is reported and skipped. The docs' performance table: python -m tools.bench "
                                       "all --quick --report docs/bench --readme docs/performance.md")
    every.add_argument("--readme", metavar="PATH",
                       help="with --report: rewrite the block between '<!-- bench-report:start -->' and "
                            "'<!-- bench-report:end -->' in PATH (e.g. docs/performance.md) with the table of this run")
    return parser


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` as indented JSON (parents created, replaced atomically).

    Parameters
    ----------
    path : str
        Destination file.
    doc : dict
        The document.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m tools.bench`` with ``argv`` (default ``sys.argv[1:]``).

    Parameters
    ----------
    argv : sequence of str or None
        Arguments after the program name.

    Returns
    -------
    int
        0 on success, 2 when the benchmark cannot run here (the reason is printed), 130 on Ctrl-C; ``all``: 1 when
        a suite crashed (its traceback printed, the report written without it), 2 when no suite could run.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(args_list)
    registered = all_suites()
    plan: list[tuple[Suite, argparse.Namespace]] = []
    if args.suite == "all":
        # `all` passes each suite the options it knows (e.g. --size to those that have it); an option no suite
        # knows is an error.
        rest = _without_readme(args_list[args_list.index("all") + 1:])
        if args.readme and not args.report:
            parser.error("--readme needs --report DIR (the table links the charts written there)")
        unknown: set[str] | None = None
        for suite in registered.values():
            ns, left = _suite_parser(suite).parse_known_args(rest)
            plan.append((suite, ns))
            unknown = set(left) if unknown is None else unknown & set(left)
        if unknown:
            parser.error("no suite takes " + " ".join(a for a in rest if a in unknown))
    elif extra:
        parser.error("unrecognized arguments: " + " ".join(extra))
    else:
        plan.append((registered[args.suite], args))
    crashed: list[str] = []
    try:
        if args.suite == "all":
            docs = []
            for suite, ns in plan:
                print(f"== suite {suite.name} ==", flush=True)
                try:
                    docs.append(suite.run(ns))
                except BenchSetupError as exc:  # the other suites still run; the report says why this one did not
                    print(f"error: suite {suite.name} cannot run here: {exc}", file=sys.stderr, flush=True)
                    docs.append({"bench": suite.name, "date": utc_now(), "error": str(exc), "cases": []})
                except Exception as exc:  # a bug: shown in full, the other suites still run, the exit status is 1
                    traceback.print_exc()
                    print(f"error: suite {suite.name} crashed: {type(exc).__name__}: {exc}", file=sys.stderr,
                          flush=True)
                    crashed.append(suite.name)
                    docs.append({"bench": suite.name, "date": utc_now(), "cases": [],
                                 "error": f"crashed: {type(exc).__name__}: {exc}"})
                print(flush=True)
            if not crashed and all(d.get("error") for d in docs):
                raise BenchSetupError("no suite could run here")
            doc: dict[str, Any] = {"bench": "all", "machine": machine_info(), "date": utc_now(), "suites": docs}
        else:
            docs = [plan[0][0].run(plan[0][1])]
            doc = docs[0]
    except BenchSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.report:
        command = "python -m tools.bench " + shlex.join(args_list)
        try:
            paths = write_report(args.report, docs, command=command,
                                 readme=getattr(args, "readme", None) if args.suite == "all" else None)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for path in paths:
            print(f"wrote {path}")
    if crashed:
        print(f"error: suite(s) crashed: {', '.join(crashed)}", file=sys.stderr)
        return 1
    return 0


def _without_readme(argv: Sequence[str]) -> list[str]:
    """``argv`` less ``--readme PATH`` / ``--readme=PATH`` (an option of ``all`` itself, not of any suite)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--readme":
            skip = True
        elif not arg.startswith("--readme="):
            out.append(arg)
    return out
