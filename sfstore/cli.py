"""The ``sfstore`` command.

Subcommands are added by ``_add_<name>(subparsers)`` functions listed in :data:`SUBCOMMANDS`; each sets
``func`` on its parser to a callable taking the parsed arguments and returning the exit status.

::

    sfstore --version
    sfstore probe [--json] [--data-dir PATH]
    sfstore demo [--data-dir PATH] [--size 64m]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import sfstore
from sfstore.errors import SfstoreError

__all__ = ["build_parser", "main"]

Subparsers = Any  # argparse's _SubParsersAction is private


def _cmd_probe(args: argparse.Namespace) -> int:
    from sfstore.probe import format_table, probe

    report = probe(data_dir=args.data_dir)
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=False, default=str)
        sys.stdout.write("\n")
    else:
        print(format_table(report))
    return 0


def _add_probe(sub: Subparsers) -> None:
    p = sub.add_parser("probe", help="report the I/O engine, memory, data directory, RDMA, NFS, NVMe-oF, GDS, GPUs",
                       description="Report what this host offers sfstore. Absent hardware is reported as absent.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--data-dir", metavar="PATH", default=None,
                   help="data directory to check (default: the data_dir setting, SFSTORE_DATA_DIR)")
    p.set_defaults(func=_cmd_probe)


def _cmd_demo(args: argparse.Namespace) -> int:
    from sfstore.defaults import SETTINGS
    from sfstore.demo import run_demo

    size = SETTINGS["buffer_size"].parse(args.size, "--size")
    return run_demo(data_dir=args.data_dir, size=size, show_probe=not args.no_probe)


def _add_demo(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="show what sfstore does, on the embedded default data directory",
                       description="Print the probe, then move data through the I/O engine and verify it.")
    p.add_argument("--data-dir", metavar="PATH", default=None,
                   help="data directory (default: the data_dir setting, SFSTORE_DATA_DIR)")
    p.add_argument("--size", default="64m", help="bytes for the engine round trip (default 64m)")
    p.add_argument("--no-probe", action="store_true", help="skip the probe table")
    p.set_defaults(func=_cmd_demo)


SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_add_probe, _add_demo]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="sfstore", description="Direct storage paths for AI jobs on RDMA clusters.")
    parser.add_argument("--version", action="version", version=f"sfstore {sfstore.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``sfstore`` command; return its exit status (0 ok, 1 error, 2 usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return func(args)
    except SfstoreError as exc:
        print(f"sfstore {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `sfstore probe | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
