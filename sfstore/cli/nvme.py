"""``sfstore nvme``: NVMe-over-Fabrics targets (list, discover, connect, disconnect) through libnvme."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sfstore import errors
from sfstore.cli.common import Subparsers, human

if TYPE_CHECKING:
    from sfstore.nvme import Controller, NvmeofTarget

__all__ = ["add_nvme"]


def _nvme_target(args: argparse.Namespace) -> NvmeofTarget:
    from sfstore.nvme import NvmeofTarget

    return NvmeofTarget(args.transport, args.traddr or "", args.trsvcid or "", args.nqn or "", hostnqn=args.hostnqn)


def _print_controllers(ctrls: Sequence[Controller]) -> None:
    from sfstore.text_tables import grid

    rows = []
    for c in ctrls:
        address = f"{c.traddr}:{c.trsvcid}" if c.trsvcid else (c.traddr or "-")
        namespaces = [f"{n.device} ({human(n.capacity)}, {n.lba_size} B blocks)" for n in c.namespaces]
        rows.append([c.name, c.transport, address, c.subsysnqn, c.state, namespaces])
    for line in grid(["CONTROLLER", "TRANSPORT", "ADDRESS", "SUBSYSNQN", "STATE", "NAMESPACES"], rows, indent=""):
        print(line)


def _cmd_nvme_list(args: argparse.Namespace) -> int:
    from sfstore import nvme

    ctrls = nvme.list_controllers()
    if args.json:
        json.dump([c.to_dict() for c in ctrls], sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not ctrls:
        print("no NVMe controllers")
    else:
        _print_controllers(ctrls)
    return 0


def _cmd_nvme_discover(args: argparse.Namespace) -> int:
    from sfstore import nvme
    from sfstore.text_tables import grid

    target = _nvme_target(args)
    entries = nvme.discover(target, timeout=args.timeout)
    if args.nqn:
        entries = [e for e in entries if e["subsysnqn"] == args.nqn]
    if args.json:
        json.dump(entries, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not entries:
        print(f"no subsystems offered at {target.transport} {target.traddr}:{target.trsvcid}"
              + (f" with NQN {args.nqn}" if args.nqn else ""))
    else:
        for line in grid(["SUBTYPE", "TRANSPORT", "TRADDR", "TRSVCID", "SUBSYSNQN"],
                          [[e["subtype"], e["transport"], e["traddr"], e["trsvcid"], e["subsysnqn"]]
                           for e in entries], indent=""):
            print(line)
    return 0


def _cmd_nvme_connect(args: argparse.Namespace) -> int:
    from sfstore import nvme

    ctrl = nvme.connect(_nvme_target(args), timeout=args.timeout)
    if args.json:
        json.dump(ctrl.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_controllers([ctrl])
    return 0


def _cmd_nvme_disconnect(args: argparse.Namespace) -> int:
    from sfstore import nvme

    if args.name and (args.nqn or args.traddr):
        raise errors.InvalidRequestError("give a controller NAME or -n NQN (with -t/-a/-s), not both")
    if args.name:
        what, names = args.name, [args.name]
    elif not args.nqn:
        raise errors.InvalidRequestError("name the controller (nvme0) or its subsystem (-n NQN)")
    elif args.traddr:
        target = _nvme_target(args)
        what, names = str(target), [target]
    else:  # every controller of the subsystem, wherever it is connected
        what = args.nqn
        names = [c.name for c in nvme.list_controllers() if c.subsysnqn == args.nqn]
    done = [n for n in names if nvme.disconnect(n)]
    if done:
        print(f"disconnected {what}")
    else:
        print(f"nothing to disconnect: no controller of {what} is connected")
    return 0


def _add_nvme_target_options(p: argparse.ArgumentParser, nqn_required: bool) -> None:
    p.add_argument("-t", "--transport", default="rdma", choices=["rdma", "tcp", "loop"],
                   help="fabrics transport (default rdma)")
    p.add_argument("-a", "--traddr", metavar="ADDR", default=None, help="target address (rdma, tcp)")
    p.add_argument("-s", "--trsvcid", metavar="PORT", default=None, help="target port (default 4420)")
    p.add_argument("-n", "--nqn", "--subsysnqn", dest="nqn", metavar="NQN", required=nqn_required, default=None,
                   help="subsystem NQN" + ("" if nqn_required else " (discover: show only this subsystem)"))
    p.add_argument("--hostnqn", metavar="NQN", default=None, help="this host's NQN (default /etc/nvme/hostnqn)")


def _add_target_action(nsub: Subparsers, name: str, func: Callable[[argparse.Namespace], int], *,
                       nqn_required: bool, json_help: str, help: str, description: str) -> None:
    """An action that talks to a target over the fabric: its address, how long to wait for it, JSON output."""
    q = nsub.add_parser(name, help=help, description=description)
    _add_nvme_target_options(q, nqn_required=nqn_required)
    q.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="default 30")
    q.add_argument("--json", action="store_true", help=json_help)
    q.set_defaults(func=func)


def add_nvme(sub: Subparsers) -> None:
    p = sub.add_parser("nvme", help="NVMe over Fabrics: list, discover, connect, disconnect controllers",
                       description="NVMe-oF controllers through libnvme (the block path's transport). "
                                   "discover, connect and disconnect need root and the nvme-fabrics module.")
    nsub = p.add_subparsers(dest="nvme_command", metavar="ACTION", required=True)

    q = nsub.add_parser("list", help="NVMe controllers of this host with their namespaces (from sysfs)",
                        description="List this host's NVMe controllers (local PCIe and NVMe-oF) with their "
                                    "transport, address, subsystem NQN, state and namespaces, read from sysfs. "
                                    "Needs no root.")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=_cmd_nvme_list)

    _add_target_action(nsub, "discover", _cmd_nvme_discover, nqn_required=False, json_help="print JSON",
                       help="the subsystems a target offers (its discovery log page)",
                       description="Ask an NVMe-oF target's discovery controller (-t, -a, -s) which subsystems "
                                   "it offers, and print its discovery log page; -n shows one subsystem. Needs "
                                   "root and the nvme-fabrics module.")
    _add_target_action(nsub, "connect", _cmd_nvme_connect, nqn_required=True,
                       json_help="print the controller as JSON",
                       help="connect a subsystem (idempotent) and wait for its namespaces",
                       description="Connect the subsystem -n NQN at -t/-a/-s and wait (--timeout) until its "
                                   "namespaces appear as /dev/nvmeXnY; an existing connection is reused. The "
                                   "block path (BlockPath) then opens the namespace. Needs root and the "
                                   "nvme-fabrics module.")

    q = nsub.add_parser("disconnect", help="disconnect a controller (by name) or a subsystem's controllers",
                        description="Disconnect one controller by NAME (nvme0), or with -n NQN every controller "
                                    "of that subsystem (narrowed to one target with -t/-a/-s). Needs root.")
    q.add_argument("name", nargs="?", metavar="NAME", default=None, help="controller name (nvme0)")
    _add_nvme_target_options(q, nqn_required=False)
    q.set_defaults(func=_cmd_nvme_disconnect)
