"""``sfstore probe``, ``sfstore config check`` and ``sfstore demo``: this host, its configuration, a first run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

import sfstore
from sfstore.cli.common import Subparsers
from sfstore.errors import SfstoreError

if TYPE_CHECKING:
    pass

__all__ = ["add_probe", "add_config", "add_demo"]


def _cmd_probe(args: argparse.Namespace) -> int:
    import warnings

    from sfstore.config_check import check
    from sfstore.environment import ConfigProblem
    from sfstore.errors import ConfigWarning
    from sfstore.probe import format_table, probe

    # The configuration first, whole: each bad value, key or variable named at the top and again at the end of
    # the table, and the exit status 1, so a bad configuration cannot pass as a report with "ok" beside it.
    # A misspelt SFSTORE_* name is an error here: the setting it was meant to be is not in force.
    config_file, problems = check(args.config, unknown_variables="error")
    checked_clean = not any(p.severity == "error" for p in problems)
    # Where each data class goes (the router sits above the probe, so the command joins the two). The router is
    # opened first: a config file's data_dir is a setting it sets, which the probe's data_dir check then reads.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # printed below, with the other problems
        try:
            router = sfstore.open(args.config)
            routing: dict[str, Any] = router.describe()
            routing_text = router.format()
        except SfstoreError as exc:
            routing = {"status": "error", "reason": str(exc)}
            routing_text = f"error: {exc}"
            if checked_clean:
                problems.append(ConfigProblem("error", "sfstore.open()", "", str(exc)))
        report = probe(data_dir=args.data_dir)
    for name, c in routing.get("classes", {}).items():
        # A missing root is among the problems already; a read-only one is news (a warning: reads work).
        if c.get("error") and (c.get("severity") == "warning" or checked_clean):
            problems.append(ConfigProblem(c["severity"], "routing", f"classes.{name}", c["error"]))
        elif c.get("read_only"):
            problems.append(ConfigProblem("warning", "routing", f"classes.{name}",
                                          f"the root of data class {name!r} ({c['root']}): {c['read_only']}"))
    section = report["data_dir"]
    known = any(p.key == "data_dir" and str(section.get("path")) in p.message for p in problems)
    if section.get("status") == "error" and not known:  # the data directory is a setting (SFSTORE_DATA_DIR)
        problems.append(ConfigProblem("error", f"data_dir {section.get('path')}", "data_dir",
                                      str(section.get("reason"))))
    n_err = sum(p.severity == "error" for p in problems)
    routing["configuration"] = {
        "file": config_file,
        "status": "error" if n_err else "warning" if problems else "ok",
        "problems": [{"severity": p.severity, "source": p.source, "key": p.key, "line": p.line,
                      "message": p.message} for p in problems],
    }
    report["routing"] = routing
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=False, default=str)
        sys.stdout.write("\n")
    else:
        block: list[str] = []
        if problems:
            n_warn = len(problems) - n_err
            count = ", ".join(f"{n} {what}(s)" for n, what in ((n_err, "error"), (n_warn, "warning")) if n)
            block = [f"configuration  {'error' if n_err else 'warning'}  ({count})"]
            block += ["    " + str(p) for p in problems]
        print("\n".join(block + [format_table({k: v for k, v in report.items() if k != "routing"}), "routing"]
                        + ["    " + line for line in routing_text.splitlines()] + block))
    if n_err:
        print(f"sfstore probe: the configuration has {n_err} error(s), listed above", file=sys.stderr)
        return 1
    return 0


def add_probe(sub: Subparsers) -> None:
    p = sub.add_parser("probe", help="report the I/O engine, memory, data directory, RDMA, NFS, NVMe-oF, GDS, GPUs",
                       description="Report what this host offers sfstore. Absent hardware is reported as absent.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="sfstore config file (default: SFSTORE_CONFIG, ./sfstore.toml, ~/.config/sfstore/)")
    p.add_argument("--data-dir", metavar="PATH", default=None,
                   help="data directory to check (default: the data_dir setting, SFSTORE_DATA_DIR)")
    p.set_defaults(func=_cmd_probe)


def _cmd_config_check(args: argparse.Namespace) -> int:
    import warnings

    from sfstore.config_check import check, report
    from sfstore.errors import ConfigWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        config_file, problems = check(args.file, unknown_variables="error")  # a misspelt name sets nothing
    print(report(config_file, problems))
    return 1 if any(p.severity == "error" for p in problems) else 0


def add_config(sub: Subparsers) -> None:
    p = sub.add_parser("config", help="check a configuration: the config file and every SFSTORE_* variable",
                       description="Commands on sfstore's configuration.")
    csub = p.add_subparsers(dest="config_command", metavar="COMMAND")
    q = csub.add_parser(
        "check", help="validate a config file and the SFSTORE_* variables; exit 1 on any error",
        description="Validate FILE (default: the config that applies: SFSTORE_CONFIG, ./sfstore.toml, "
                    "~/.config/sfstore/sfstore.toml) and every SFSTORE_* environment variable: TOML syntax, "
                    "unknown or misspelt keys and variables, bad values, [classes.*] tables, roots that do not "
                    "exist. Every problem is printed; the exit status is 1 when any is an error (an SFSTORE_* "
                    "name sfstore does not read is one), else 0.")
    q.add_argument("file", metavar="FILE", nargs="?", default=None, help="the config file to check")
    q.set_defaults(func=_cmd_config_check)

    def usage(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=usage)


def _cmd_demo(args: argparse.Namespace) -> int:
    from sfstore.defaults import SETTINGS
    from sfstore.demo import run_demo

    size = SETTINGS["buffer_size"].parse(args.size, "--size")
    return run_demo(data_dir=args.data_dir, size=size, show_probe=not args.no_probe, config=args.config,
                    json_out=args.json, shards=args.shards)


def add_demo(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="show what sfstore does, on the embedded default data directory",
                       description="A training job (dataset over sf://, DataLoader, save_async, a crash and a "
                                   "resume) and an inference job (KV-cache reuse across tiers), hot blocks, then a "
                                   "per-path summary. Everything read back is verified.")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="sfstore config file: run on a real cluster's paths (default: the embedded default)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the summary as JSON")
    p.add_argument("--shards", type=int, default=32, help="dataset shards of 512 samples (default 32)")
    p.add_argument("--data-dir", metavar="PATH", default=None,
                   help="data directory (default: the data_dir setting, SFSTORE_DATA_DIR)")
    p.add_argument("--size", default="64m", help="bytes for the file path's round trip (default 64m)")
    p.add_argument("--no-probe", action="store_true", help="skip the probe table")
    p.set_defaults(func=_cmd_demo)


# -- ls and cp ---------------------------------------------------------------------------------------------
