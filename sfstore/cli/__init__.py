"""The ``sfstore`` command.

Each group of subcommands is a module of this package (``host``, ``files``, ``nvme``, ``kv``) whose
``add_<name>(subparsers)`` functions are listed in :data:`SUBCOMMANDS`; each sets ``func`` on its parser to a
callable taking the parsed arguments and returning the exit status.

::

    sfstore --version
    sfstore probe [--json] [--config FILE] [--data-dir PATH]   (exit 1 when the configuration is bad)
    sfstore config check [FILE]                                (every problem of a config and SFSTORE_*)
    sfstore demo [--data-dir PATH] [--size 64m]
    sfstore ls [PATH] [-l] [-R] [--root DIR] [--config FILE]
    sfstore cp SRC DST [-r] [--root DIR] [--config FILE]     (local paths <-> sf:// URLs; - is stdin/stdout)
    sfstore cat URL... [--root DIR] [--config FILE]          (the files' bytes to stdout, streamed)
    sfstore rm [-r] [-f] URL... [--root DIR] [--config FILE] (remove files; -r: directories too)
    sfstore nvme list [--json]
    sfstore nvme discover -t rdma -a ADDR [-s PORT] [-n NQN] [--hostnqn NQN] [--json]
    sfstore nvme connect -t rdma -a ADDR [-s PORT] -n NQN [--hostnqn NQN] [--json]
    sfstore nvme disconnect (NAME | -n NQN [-t T -a ADDR -s PORT])
    sfstore kv du [DIR] [--namespace N] [--budget BYTES] [--json]   (the shared KV tier: bytes per namespace)
    sfstore kv gc [DIR] [--namespace N] [--budget BYTES] [--grace S] [--json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import sfstore
from sfstore.cli.common import Subparsers, message
from sfstore.cli.files import add_cat, add_cp, add_ls, add_rm
from sfstore.cli.host import add_config, add_demo, add_probe
from sfstore.cli.kv import add_kv
from sfstore.cli.nvme import add_nvme
from sfstore.errors import SfstoreError

__all__ = ["build_parser", "main", "SUBCOMMANDS"]

SUBCOMMANDS: list[Callable[[Subparsers], None]] = [add_probe, add_config, add_demo, add_ls, add_cp, add_cat, add_rm,
                                                   add_nvme, add_kv]


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
    import warnings

    from sfstore.errors import SfstoreWarning

    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
             line: str | None = None) -> None:
        # sfstore's own warnings (an unknown SFSTORE_* variable, ...) speak to the user, not about a source line.
        if issubclass(category, SfstoreWarning):
            print(f"sfstore {args.command}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        return func(args)
    except SfstoreError as exc:
        print(f"sfstore {args.command}: error: {message(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `sfstore probe | head`
        return 0
    finally:
        warnings.showwarning = shown
