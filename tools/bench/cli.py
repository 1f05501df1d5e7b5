"""Command line of ``python -m tools.bench``: one sub-command per registered suite, plus ``all``.

Options every suite takes (``--json``, ``--report``, ``--repeat``, ``--quick``, ``--cases``, ``--dir``,
``--engine``, ``--seed``) come from :func:`common_parser`; each suite adds its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from tools.bench.common import BenchSetupError, machine_info, utc_now
from tools.bench.registry import Suite, all_suites, unavailable_suites
from tools.bench.report import write_report

__all__ = ["common_parser", "build_parser", "main", "write_json"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
                   help="write a report into DIR (for now: each suite's JSON and text table)")
    g.add_argument("--repeat", type=_positive_int, default=3, metavar="N",
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
    sub.add_parser("all", parents=[common], help="run every suite in turn",
                   description="Run every suite in turn with the options given here; each suite takes the ones it "
                               "knows (e.g. the engine suite's --size).")
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
        0 on success, 2 when the benchmark cannot run here (the reason is printed), 130 on Ctrl-C.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(args_list)
    registered = all_suites()
    plan: list[tuple[Suite, argparse.Namespace]] = []
    if args.suite == "all":
        # `all` passes each suite the options it knows (e.g. --size to those that have it); an option no suite
        # knows is an error.
        rest = args_list[args_list.index("all") + 1:]
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
    try:
        if args.suite == "all":
            docs = []
            for suite, ns in plan:
                print(f"== suite {suite.name} ==", flush=True)
                docs.append(suite.run(ns))
                print(flush=True)
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
        for path in write_report(args.report, docs):
            print(f"wrote {path}")
    return 0
