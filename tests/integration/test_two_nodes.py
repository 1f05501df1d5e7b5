"""Two nodes over real soft-RoCE: a prefill node (A, also the NFS-over-RDMA and NVMe-oF server) and a decode
node (B), two QEMU guests on one network, each with its own rxe device.

Both guests run this module (``tools/testbed/run`` boots them for the two-node scenario); every test has a half
for each role, and the nodes meet at named points (:class:`tests.integration.two_nodes.Peer`). In order:
verbs between the two rxe devices; KV blocks put on A got bit-exact on B from the shared tier (NFS over RDMA);
the shared tier's byte budget kept while both nodes write; a torch DCP checkpoint saved by two ranks (one per
node, gloo over the node network) loaded on one rank bit-exact; each node's own NVMe-oF namespace connected
with libnvme; and node A's NFS server stalled for node B (its RDMA traffic dropped at A's NIC): a KV get on B
is a miss within its deadline + 50 ms, and the tier recovers once the traffic flows again.

Outside the two-node scenario (the single-node run collects this file too) every test is skipped.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .endpoints import env
from .two_nodes import Peer, node_from_env

NODE = node_from_env()
pytestmark = pytest.mark.skipif(NODE is None, reason="runs in the testbed's two-node scenario only "
                                                     "(tools/testbed/run --scenario two-node)")

MODEL = "two-node-testbed"
BLOCK_TOKENS = 16
DEADLINE_MS = 1000  # kvcache_io_timeout_ms of node B's store in the stall test
SLACK_S = 0.050  # the bound: a miss within the deadline + 50 ms
QUARANTINE_MS = 250
ROCE_PORT = 4791  # RoCE v2's UDP port: every soft-RoCE packet, NFS over RDMA and NVMe-oF alike


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    assert NODE is not None
    p = Peer(*NODE)
    yield p
    # node A hosts the store (and the NFS server): it leaves only once node B is done with both (node B does
    # not wait for an answer: node A may be gone by then)
    p.test = "module-end"
    if p.role == "decode":
        p.tell("done")
    else:
        p.hear("done", timeout=600)


@pytest.fixture(scope="module")
def mount() -> Path:
    path = Path(env("SFSTORE_TEST_NFS_MOUNT"))
    line = next((ln for ln in Path("/proc/mounts").read_text().splitlines() if f" {path} " in ln), "")
    assert " nfs4 " in line and "proto=rdma" in line, line
    return path


def geometry() -> Any:
    from sfstore.kvcache import KVGeometry

    return KVGeometry(num_layers=4, block_tokens=BLOCK_TOKENS, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def store(shared: Path, namespace: str, io_timeout_ms: int = 0, **kwargs: Any) -> Any:
    """A store with only the shared tier. No deadline unless asked: NFS in these TCG guests is far slower than
    on the hardware ``kvcache_io_timeout_ms``'s default is meant for (a batch of 64 blocks can take longer)."""
    from sfstore.kvcache import KVCacheStore

    return KVCacheStore(geometry(), model_id=MODEL, pinned_bytes=0, shared_dir=str(shared),
                        cache_namespace=namespace, io_timeout_ms=io_timeout_ms, **kwargs)


def tokens(first_block: int, blocks: int) -> list[int]:
    """A prompt of ``blocks`` full blocks: its keys chain, so they differ from any other range's."""
    return list(range(first_block * BLOCK_TOKENS, (first_block + blocks) * BLOCK_TOKENS))


def block(i: int) -> np.ndarray:
    """Block ``i``'s bytes (any node can make them, and tell them from another block's)."""
    return np.random.default_rng(1000 + i).integers(0, 256, geometry().block_bytes, dtype=np.uint8)


def sfstore_cli(*args: str) -> str:
    """Run the installed ``sfstore`` command; its stdout (fails the test on a non-zero exit)."""
    exe = shutil.which("sfstore")
    cmd = [exe] if exe else [sys.executable, "-m", "sfstore.cli"]
    result = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, (args, result.returncode, result.stderr)
    return result.stdout


def facts(kv: Any) -> dict[str, Any]:
    """What a store's counters say (those not zero), for assertion messages."""
    st = kv.stats()
    out = {k: v for k, v in st.items() if isinstance(v, int) and v and k != "pinned_capacity_blocks"}
    out["shared_bytes_held"] = st["shared_bytes_held"]
    out["quarantine"] = {t: {k: v for k, v in q.items() if v} for t, q in st["quarantine"].items()}
    return out


def sizes(files: list[Path]) -> int:
    """Bytes of ``files`` (one evicted meanwhile counts nothing)."""
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            pass
    return total


def block_files(shared: Path, namespace: str) -> list[Path]:
    """The block files of ``namespace`` in the shared directory, from a plain directory listing."""
    from sfstore.kvcache.shared_budget import namespace_prefix

    root = shared / namespace_prefix(namespace)
    if not root.is_dir():
        return []
    return [f for sub in root.iterdir() if sub.is_dir() and len(sub.name) == 2
            for f in sub.iterdir() if f.name.endswith(".kvb") and not f.name.startswith(".")]


def ipv4_gid_index(dev: str, ip: str) -> int:
    """The index of the port's RoCE v2 GID made from ``ip`` (an IPv4-mapped IPv6 address)."""
    a, b, c, d = (int(x) for x in ip.split("."))
    want = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"
    port = Path(f"/sys/class/infiniband/{dev}/ports/1")
    for gid in sorted(port.glob("gids/*"), key=lambda g: int(g.name)):
        try:
            if gid.read_text().strip() == want:
                assert "v2" in (port / "gid_attrs" / "types" / gid.name).read_text()
                return int(gid.name)
        except OSError:  # an empty slot
            continue
    raise AssertionError(f"{dev} has no GID for {ip}")


def test_verbs_between_the_two_rxe_devices(peer: Peer) -> None:
    """An RC ping-pong between node A's and node B's soft-RoCE devices (the fabric under everything below)."""
    dev = env("SFSTORE_TEST_RDMA_DEVICE")
    with peer.step("verbs"):
        assert "ACTIVE" in Path(f"/sys/class/infiniband/{dev}/ports/1/state").read_text()
        gid = ipv4_gid_index(dev, env("SFSTORE_TEST_IP"))
        cmd = ["ibv_rc_pingpong", "-d", dev, "-g", str(gid), "-n", "200", "-s", "4096"]
        if peer.role == "prefill":
            server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                time.sleep(0.5)
                peer.tell("listening")
                out, _ = server.communicate(timeout=120)
            finally:
                server.kill()
            assert server.returncode == 0, out
        else:
            peer.hear("listening")
            out = ""
            for _ in range(10):  # the server may not listen yet the instant it says so
                result = subprocess.run([*cmd, env("SFSTORE_TEST_PEER_IP")], capture_output=True, text=True,
                                        timeout=120, check=False)
                out = result.stdout + result.stderr
                if result.returncode == 0:
                    break
                time.sleep(1)
            assert result.returncode == 0, out
            assert "bytes in" in out, out
            peer.note(next((ln.strip() for ln in out.splitlines() if "bytes in" in ln), ""))
        peer.meet("end")


def test_kv_blocks_put_on_prefill_are_got_bit_exact_on_decode(peer: Peer, mount: Path) -> None:
    from sfstore.paths.file import FilePath

    n = 64
    with peer.step("kv-share"):
        assert FilePath(mount).transport == "rdma"
        shared = mount / "kv"
        if peer.role == "prefill":
            kv = store(shared, "pd")
            try:
                keys = kv.keys_for(tokens(0, n))
                t0 = time.monotonic()
                kv.put(keys, [block(i) for i in range(n)])
                kv.wait_for_puts()
                seconds = time.monotonic() - t0
            finally:
                kv.close()
            peer.note(f"A put {n} blocks ({n * geometry().block_bytes >> 10} KiB) in {seconds:.2f}s")
            peer.tell("put", [k.hex() for k in keys])
            peer.hear("got")
        else:
            sent = peer.hear("put")
            kv = store(shared, "pd")
            try:
                keys = kv.keys_for(tokens(0, n))
                assert [k.hex() for k in keys] == sent  # both nodes derive the same keys from the tokens
                dests = [np.zeros(geometry().block_bytes, dtype=np.uint8) for _ in range(n)]
                t0 = time.monotonic()
                tiers = kv.get_into(keys, dests)
                seconds = time.monotonic() - t0
                if tiers != ["shared"] * n:  # say what this node sees of them
                    seen = len(block_files(shared, "pd"))
                    time.sleep(3)
                    again = kv.get_into(keys, dests)
                    pytest.fail(f"B got {tiers.count('shared')} of {n} blocks from the shared tier; it lists {seen} "
                                f"block files there; 3 s later it gets {again.count('shared')}; {facts(kv)}")
                for i, d in enumerate(dests):
                    assert np.array_equal(d, block(i)), f"block {i} differs"
                assert kv.stats()["hits_shared"] == n
            finally:
                kv.close()
            peer.note(f"B got {n} blocks bit-exact from the shared tier in {seconds:.2f}s")
            peer.tell("got")


def test_shared_budget_holds_while_both_nodes_write(peer: Peer, mount: Path) -> None:
    per_node, budget_blocks = 48, 12
    file_bytes = 4096 + geometry().block_bytes  # a block's file: header and block
    budget = budget_blocks * file_bytes
    shared = mount / "kv"
    with peer.step("kv-budget"):
        first = peer.rank * per_node
        kv = store(shared, "budget", shared_bytes=budget)
        peak = 0
        try:
            keys = kv.keys_for(tokens(10_000 + first, per_node))
            peer.meet("writing")  # both nodes write at once
            for i, k in enumerate(keys):
                kv.put([k], [block(first + i)])
                if peer.role == "prefill" and i % 8 == 7:
                    peak = max(peak, sizes(block_files(shared, "budget")))
            mine = facts(kv)
        finally:
            kv.close()  # settles this writer's share of the budget
        evictions = mine.get("evictions_shared", 0)
        peer.note(f"{peer.role} evicted {evictions} while writing")
        other = peer.meet("closed", value={"keys": [k.hex() for k in keys], "facts": mine})
        # between them the two nodes evicted (before closing, which settles each writer's share): both keep the
        # budget, each counting what the other evicted
        assert evictions + other["facts"].get("evictions_shared", 0) > 0, (mine, other["facts"])
        if peer.role == "prefill":
            files = block_files(shared, "budget")
            held = sizes(files)
            peer.note(f"budget {budget >> 10} KiB, held {held >> 10} KiB after both closed "
                      f"(peak seen while writing {peak >> 10} KiB)")
            # settled: within one block per writer of the budget
            assert held <= budget + 2 * file_bytes, (held, budget, mine, other["facts"])
            assert len(files) > 0
            peer.tell("held", held)
            peer.hear("verified")
        else:
            held = peer.hear("held")
            # whatever is left is whole: every block there reads back bit-exact on this node, the rest miss
            kv = store(shared, "budget")
            try:
                all_keys = [bytes.fromhex(h) for h in other["keys"]] + keys
                index = {k: i for i, k in enumerate(all_keys)}  # node A's blocks first, then this node's
                dest = np.zeros(geometry().block_bytes, dtype=np.uint8)
                hits = 0
                for k in all_keys:
                    dest[:] = 7
                    got = kv.get_into([k], [dest])
                    if got == ["shared"]:
                        hits += 1
                        assert np.array_equal(dest, block(index[k])), "a wrong block"
                    else:
                        assert got == [None] and (dest == 7).all()
            finally:
                kv.close()
            assert hits * file_bytes == held, (hits, held)
            # `sfstore kv du` on this node counts what node A's listing of its export did, and nothing left over
            (du,) = json.loads(sfstore_cli("kv", "du", str(shared), "--namespace", "budget", "--json"))
            assert du["bytes"] == held and du["files"] == hits, du
            assert du["evicting"] == 0 and du["temporaries"] == 0, du
            peer.note(f"B read back the {hits} blocks left, each bit-exact; sfstore kv du on B: "
                      f"{du['bytes'] >> 10} KiB")
            peer.tell("verified")


ROWS, COLS = 96, 64


def _full(name: str, dtype: Any = None) -> Any:
    import torch

    g = torch.Generator().manual_seed(sum(map(ord, name)))
    t = torch.randn(ROWS, COLS, generator=g)
    return t.to(dtype) if dtype is not None else t


def _bits(t: Any) -> bytes:
    import torch

    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def test_dcp_saved_by_one_rank_per_node_loads_on_one_rank_bit_exact(peer: Peer, mount: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sfstore.checkpoint.dcp import StorageReader, StorageWriter

    with peer.step("dcp"):
        name = f"dcp-{uuid.uuid4().hex[:8]}" if peer.role == "prefill" else ""
        if peer.role == "prefill":
            peer.tell("name", name)
        else:
            name = peer.hear("name")
        ckpt = mount / name
        t0 = time.monotonic()
        dist.init_process_group("gloo", store=dist.PrefixStore("dcp", peer.store), rank=peer.rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,))
            sd = {
                "rows": distribute_tensor(_full("rows", torch.bfloat16), mesh, [Shard(0)]),
                "cols": distribute_tensor(_full("cols"), mesh, [Shard(1)]),
                "replicated": _full("replicated"),
                f"only_{peer.role}": torch.full((5, 3), float(peer.rank + 1)),
                "step": 42,
            }
            dcp.save(sd, storage_writer=StorageWriter(str(ckpt)))
        finally:
            dist.destroy_process_group()
        saved = time.monotonic() - t0
        peer.meet("saved")
        data = sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".sfdcp"))
        assert len(data) == 2, data  # one data file per rank, each written by its own node
        # one rank (no process group) loads the whole checkpoint: each node does, from the same files
        dest = {"rows": torch.zeros(ROWS, COLS, dtype=torch.bfloat16), "cols": torch.zeros(ROWS, COLS),
                "replicated": torch.zeros(ROWS, COLS), "only_prefill": torch.zeros(5, 3),
                "only_decode": torch.zeros(5, 3), "step": 0}
        t0 = time.monotonic()
        dcp.load(dest, storage_reader=StorageReader(str(ckpt)))
        loaded = time.monotonic() - t0
        for key, want in (("rows", _full("rows", torch.bfloat16)), ("cols", _full("cols")),
                          ("replicated", _full("replicated")), ("only_prefill", torch.full((5, 3), 1.0)),
                          ("only_decode", torch.full((5, 3), 2.0))):
            assert dest[key].dtype == want.dtype and _bits(dest[key]) == _bits(want), key
        assert dest["step"] == 42
        peer.note(f"2-rank save {saved:.1f}s, 1-rank load on {peer.role} {loaded:.1f}s")
        peer.meet("loaded")


def _write_marker(device: str, offset: int, data: bytes) -> None:
    buf = mmap.mmap(-1, len(data))  # page-aligned, as O_DIRECT wants
    buf[:] = data
    fd = os.open(device, os.O_RDWR | os.O_DIRECT)
    try:
        assert os.pwritev(fd, [buf], offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def test_each_node_connects_its_own_nvmeof_namespace_with_libnvme(peer: Peer) -> None:
    from sfstore import nvme
    from sfstore.blocks import BlockStore
    from sfstore.paths.block import BlockPath
    from sfstore.testing.block_store import CLASSES, STORE_BYTES

    nqn = env("SFSTORE_TEST_NVMEOF_SUBSYSNQN")
    target = nvme.NvmeofTarget("rdma", env("SFSTORE_TEST_NVMEOF_TRADDR"), env("SFSTORE_TEST_NVMEOF_TRSVCID"), nqn)
    marker = (f"sfstore two-node: written by the {peer.role} node to {nqn}\n".encode() * 200)[:4096]
    with peer.step("nvmeof"):
        t0 = time.monotonic()
        try:
            ctrl = nvme.connect(target, timeout=120)
            connected = time.monotonic() - t0
            assert ctrl.namespaces and ctrl.transport == "rdma", ctrl
            mine = {c.subsysnqn for c in nvme.list_controllers() if not c.state.startswith("deleting")}
            assert mine == {nqn}, mine  # this node's own subsystem only
            ns = ctrl.namespaces[0]
            path = BlockPath({"kind": "nvmeof", "transport": "rdma", "traddr": target.traddr,
                              "trsvcid": target.trsvcid, "subsysnqn": nqn})
            try:
                assert path.device == ns.device and path.transport == "rdma"
                with BlockStore(path, size_classes=CLASSES, capacity=STORE_BYTES, format=True) as bs:
                    values = {f"{peer.role}-{i}": bytes([i + 16 * peer.rank]) * 70_000 for i in range(8)}
                    bs.put_many(values, durable=True)
                    assert all(bs.get(k) == v for k, v in values.items())
            finally:
                path.close()
            # past the block store's bytes: a marker the target's side can find in this node's backing file
            _write_marker(ns.device, ns.capacity - 4096, marker)
        finally:
            nvme.disconnect(target)
        peer.note(f"{peer.role}: connect {connected:.1f}s ({ns.device}, {ns.capacity >> 20} MiB)")
        theirs = peer.meet("written", value={"nqn": nqn, "marker": marker.hex(), "capacity": ns.capacity})
        if peer.role == "prefill":  # the target's host: each subsystem's backing file holds its node's marker
            backing = {}
            for line in Path(env("SFSTORE_TEST_NVMEOF_TARGET_BACKING")).read_text().splitlines():
                sub, _loop, image = line.split()
                backing[sub] = image
            for sub, want, size in ((nqn, marker, ns.capacity),
                                    (theirs["nqn"], bytes.fromhex(theirs["marker"]), theirs["capacity"])):
                with open(backing[sub], "rb") as f:
                    f.seek(size - 4096)
                    assert f.read(4096) == want, f"{sub}'s backing file lacks its node's marker"
            assert marker != bytes.fromhex(theirs["marker"])
        peer.meet("checked")


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True, timeout=30)


def _stall_traffic_from(nic: str, src: str) -> None:
    """Drop every RoCE v2 packet from ``src`` arriving at ``nic`` (this node's RDMA service to it stalls)."""
    for module in ("sch_ingress", "cls_u32", "act_gact"):
        subprocess.run(["modprobe", module], check=False, timeout=30)
    _tc("qdisc", "add", "dev", nic, "ingress")
    _tc("filter", "add", "dev", nic, "parent", "ffff:", "protocol", "ip", "prio", "1", "u32",
        "match", "ip", "src", f"{src}/32", "match", "ip", "protocol", "17", "0xff",
        "match", "ip", "dport", str(ROCE_PORT), "0xffff", "action", "drop")


def _dropped_packets(nic: str) -> int:
    """Packets the ingress filter of ``nic`` dropped so far."""
    out = subprocess.run(["tc", "-s", "filter", "show", "dev", nic, "ingress"], capture_output=True, text=True,
                         timeout=30, check=False).stdout
    m = re.search(r"gact action drop.*?Sent \d+ bytes (\d+) pkt", out, re.S)
    assert m, out
    return int(m.group(1))


def test_stalled_nfs_server_is_a_miss_within_the_deadline_and_the_tier_recovers(peer: Peer, mount: Path) -> None:
    n = 12
    shared = mount / "kv"
    nic = env("SFSTORE_TEST_RDMA_NETDEV")
    with peer.step("nfs-stall", start_timeout=300):
        if peer.role == "prefill":
            # a file per block: each get of a block this node never read has to ask the server (a chunk file read
            # once would hold the others)
            kv = store(shared, "stall", chunk_tokens=0)
            try:
                keys = kv.keys_for(tokens(50_000, n))
                kv.put(keys, [block(500 + i) for i in range(n)])
            finally:
                kv.close()
            peer.tell("put")
            peer.hear("ready")
            _stall_traffic_from(nic, env("SFSTORE_TEST_PEER_IP"))
            stalled_at = time.monotonic()
            peer.tell("stalled")
            try:
                # node A's own use of its server goes on: only node B's traffic is dropped
                kv = store(shared, "stall", io_timeout_ms=DEADLINE_MS, chunk_tokens=0)
                try:
                    dest = np.zeros(geometry().block_bytes, dtype=np.uint8)
                    assert kv.get_into([keys[-1]], [dest]) == ["shared"]
                    assert np.array_equal(dest, block(500 + n - 1))
                finally:
                    kv.close()
                peer.hear("measured", timeout=300)
            finally:
                dropped = _dropped_packets(nic)
                _tc("qdisc", "del", "dev", nic, "ingress")
            peer.note(f"B's RoCE traffic dropped at A for {time.monotonic() - stalled_at:.1f}s ({dropped} packets)")
            assert dropped > 0
            peer.tell("restored")
            peer.hear("recovered", timeout=400)
        else:
            peer.hear("put")
            kv = store(shared, "stall", io_timeout_ms=DEADLINE_MS, quarantine_ms=QUARANTINE_MS, chunk_tokens=0)
            try:
                keys = kv.keys_for(tokens(50_000, n))
                dest = np.zeros(geometry().block_bytes, dtype=np.uint8)
                assert kv.get_into([keys[0]], [dest]) == ["shared"]  # the tier works (and its workers run)
                assert np.array_equal(dest, block(500))
                peer.tell("ready")
                peer.hear("stalled")
                # blocks this node never read: nothing of theirs is cached here, each get has to ask the server
                trials: list[float] = []
                skips: list[float] = []
                for i in range(1, 4):
                    dest[:] = 7
                    t0 = time.monotonic()
                    got = kv.get_into([keys[i]], [dest])
                    trials.append(time.monotonic() - t0)
                    assert got == [None] and (dest == 7).all(), got
                    # the guard's own state (stats() would list the directory, an operation under the deadline too)
                    q = kv.shared.guard.describe()
                    assert q["quarantined"], q
                    # quarantined: answered at once, without I/O
                    t0 = time.monotonic()
                    assert kv.get_into([keys[i]], [dest]) == [None]
                    skips.append(time.monotonic() - t0)
                    time.sleep(q["quarantine_left_ms"] / 1000 + 0.05)  # then the next get probes the tier
                q = kv.shared.guard.describe()
                assert q["deadline_misses"] >= 3 and q["quarantine_skips"] >= 3, q
                # the mount itself is stalled: a plain stat of a name this node never looked up hangs
                probe = subprocess.Popen(["stat", str(mount / f"never-there-{uuid.uuid4().hex}")],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(3)
                hung = probe.poll() is None
                peer.note("deadline misses " + ", ".join(f"{t * 1000:.0f}" for t in trials)
                          + f" ms (deadline {DEADLINE_MS} ms); quarantined gets "
                          + ", ".join(f"{t * 1000:.1f}" for t in skips) + " ms")
                peer.tell("measured", {"trials": trials})
                assert max(trials) <= DEADLINE_MS / 1000 + SLACK_S, trials
                assert max(skips) < SLACK_S, skips
                assert hung, "the stat of a file on the mount returned during the stall: it was not stalled"
                peer.hear("restored")
                t_restore = time.monotonic()
                deadline = t_restore + 300
                while True:
                    dest[:] = 7
                    if kv.get_into([keys[4]], [dest]) == ["shared"]:
                        break
                    assert time.monotonic() < deadline, kv.shared.guard.describe()
                    time.sleep(0.2)
                recovered = time.monotonic() - t_restore
                assert np.array_equal(dest, block(504))
                q = kv.shared.guard.describe()
                assert not q["quarantined"] and q["recoveries"] >= 1, q
                # every block is there again, bit-exact (one get each: each under its own deadline)
                for i, k in enumerate(keys):
                    dest[:] = 7
                    assert kv.get_into([k], [dest]) == ["shared"], (i, kv.shared.guard.describe())
                    assert np.array_equal(dest, block(500 + i)), i
                peer.note(f"recovered {recovered:.1f}s after the traffic flowed again")
            finally:
                kv.close()
            assert probe.wait(timeout=120) == 1  # it returned once the server was back: no such file
            peer.tell("recovered")
