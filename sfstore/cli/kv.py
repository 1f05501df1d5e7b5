"""``sfstore kv du`` and ``kv gc``: the shared KV tier's usage per namespace, and its garbage collection."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sfstore
from sfstore import errors
from sfstore.cli.common import Subparsers, human
from sfstore.errors import SfstoreError

if TYPE_CHECKING:
    from sfstore.kvcache.shared_budget import SharedBudget

__all__ = ["add_kv"]


def _kv_budgets(args: argparse.Namespace) -> list[tuple[str, SharedBudget]]:
    """One :class:`~sfstore.kvcache.shared_budget.SharedBudget` per namespace the command names (all that are
    there without ``--namespace``) of the shared directory ``DIR`` (default: the router's, as
    ``KVCacheStore.from_router`` uses it), with that directory relative to the budget's file path."""
    from sfstore import defaults
    from sfstore.kvcache.shared_budget import SharedBudget, check_namespace, list_namespaces, namespace_prefix

    budget = (defaults.SETTINGS["kvcache_shared_bytes"].parse(args.budget, "--budget") if args.budget is not None
              else int(defaults.get("kvcache_shared_bytes")))
    if args.dir is not None:
        if not os.path.isdir(args.dir):
            raise errors.os_error(errno.ENOENT, "no shared KV directory", os.path.abspath(args.dir))
        fp: Any = sfstore.open(args.config).location(args.dir)
        top = ""
    else:
        kv_path = sfstore.open(args.config).path("kvcache")
        fp, top = getattr(kv_path, "fp", None) or kv_path, "shared/"
    names = [check_namespace(args.namespace)] if args.namespace is not None else list_namespaces(fp, top)
    return [(top, SharedBudget(fp, top + namespace_prefix(n), budget, namespace=n)) for n in names]


def _kv_each(args: argparse.Namespace, call: Callable[[str, SharedBudget], dict[str, Any]]) -> list[dict[str, Any]]:
    """``call(top, budget)`` for each namespace, with a failed system call as a typed error (naming the path)."""
    try:
        return [call(top, b) for top, b in _kv_budgets(args)]
    except SfstoreError:
        raise
    except OSError as exc:
        raise errors.os_error(exc.errno or errno.EIO, exc.strerror or "shared KV directory",
                              str(exc.filename or args.dir or "")) from None


def _cmd_kv_du(args: argparse.Namespace) -> int:
    from sfstore.quarantine_records import quarantine_rows
    from sfstore.text_tables import grid

    rows = _kv_each(args, lambda top, b: {**b.du(), "directory": os.path.join(b.fp.root, top)})
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"shared KV directory {rows[0]['directory']}")
    for line in grid(["NAMESPACE", "BYTES", "FILES", "ESTIMATE", "BUDGET", "WRITERS", "LEFTOVERS"], [
            [r["namespace"] or "(default)", human(r["bytes"]), r["files"], human(r["estimate"]),
             human(r["budget"]) if r["budget"] else "unbounded", r["writers"], r["evicting"] + r["temporaries"]]
            for r in rows], indent=""):
        print(line)
    over = [r for r in rows if r["budget"] and r["bytes"] > r["budget"]]
    if over:
        print(f"over budget: {', '.join(r['namespace'] or '(default)' for r in over)} (sfstore kv gc enforces it)")
    quarantined = [[r["namespace"] or "(default)", *row] for r in rows for row in quarantine_rows(r["quarantined"])]
    if quarantined:
        print("quarantined by processes whose I/O to it missed its deadline:")
        for line in grid(["NAMESPACE", "HOST", "PID", "TIER", "TARGET", "SINCE", "LEFT", "STUCK", "REASON"],
                          quarantined, indent="  "):
            print(line)
    return 0


def _cmd_kv_gc(args: argparse.Namespace) -> int:
    from sfstore.text_tables import grid

    rows = _kv_each(args, lambda _top, b: b.gc(grace_s=args.grace))
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for line in grid(["NAMESPACE", "BEFORE", "AFTER", "EVICTED", "BUDGET", "LEFTOVERS REMOVED", "RECORDS REMOVED"], [
            [r["namespace"] or "(default)", human(r["bytes_before"]), human(r["bytes_after"]), r["evicted"],
             human(r["budget"]) if r["budget"] else "unbounded", r["evicting_removed"] + r["temporaries_removed"],
             r["records_removed"]] for r in rows], indent=""):
        print(line)
    return 0


def add_kv(sub: Subparsers) -> None:
    p = sub.add_parser("kv", help="the KV cache's shared directory: bytes held per namespace, and its budget",
                       description="The shared tier of KVCacheStore: du shows the bytes each cache namespace holds "
                                   "and its budget; gc repairs (leftovers of killed writers and evictors, stale "
                                   "records) and evicts least recently read blocks down to the budget now.")
    ksub = p.add_subparsers(dest="kv_command", metavar="ACTION", required=True)
    for name, func, text in (("du", _cmd_kv_du, "bytes and files held per namespace, the estimate writers keep, "
                                                 "the budget"),
                             ("gc", _cmd_kv_gc, "remove leftovers and evict down to the budget now")):
        q = ksub.add_parser(name, help=text)
        q.add_argument("dir", nargs="?", metavar="DIR", default=None,
                       help="the shared directory (default: the kvcache class's, as KVCacheStore.from_router uses)")
        q.add_argument("--namespace", "-n", metavar="N", default=None, help="only this cache namespace")
        q.add_argument("--budget", metavar="BYTES", default=None,
                       help="bytes per namespace, e.g. 64g (default: kvcache_shared_bytes; 0: unbounded)")
        q.add_argument("--config", metavar="FILE", default=None, help="sfstore config file (without DIR)")
        q.add_argument("--json", action="store_true", help="print JSON")
        if name == "gc":
            q.add_argument("--grace", type=float, default=600.0, metavar="SECONDS",
                           help="remove temporary files older than this whatever their writer (default 600)")
        q.set_defaults(func=func)
