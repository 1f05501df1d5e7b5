"""Registered pool buffers as RDMA memory regions on the testbed's soft-RoCE device (real verbs, no mocks).

Contract (``sfstore.buffers``): ``RegisteredBuffer.register_rdma(pd, access=None) -> RdmaRegistration`` with
``.lkey``, ``.rkey``, ``.access`` and ``.deregister()``; the default access is the least a local data path
needs (``IBV_ACCESS_LOCAL_WRITE``); a failed registration raises ``sfstore.errors.RegistrationError``.
Data really moves: RDMA WRITE and READ between pool buffers over a loopback RC queue pair on rxe0.
"""

from __future__ import annotations

import errno
import glob
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sfstore.buffers import RegisteredBufferPool
from sfstore.errors import RegistrationError

BUFFER = 1 << 20


@pytest.fixture
def enums() -> Any:
    import pyverbs.enums as e

    return e


@pytest.fixture
def pool() -> Iterator[RegisteredBufferPool]:
    with RegisteredBufferPool(buffer_size=BUFFER, max_buffers=4) as p:
        yield p


def _fill(buf: Any, pattern: bytes) -> None:
    with memoryview(buf) as mv:
        mv[: len(pattern)] = pattern


def _read(buf: Any, length: int) -> bytes:
    with memoryview(buf) as mv:
        return bytes(mv[:length])


def test_default_registration_is_local_write_only(rdma_verbs: tuple[Any, Any], pool: RegisteredBufferPool,
                                                  enums: Any) -> None:
    _, pd = rdma_verbs
    with pool.acquire() as buf:
        reg = buf.register_rdma(pd)
        try:
            assert reg.access == enums.IBV_ACCESS_LOCAL_WRITE
            assert isinstance(reg.lkey, int) and isinstance(reg.rkey, int)
        finally:
            reg.deregister()


def test_every_pool_buffer_registers_and_deregisters(rdma_verbs: tuple[Any, Any], pool: RegisteredBufferPool) -> None:
    _, pd = rdma_verbs
    bufs = [pool.acquire() for _ in range(4)]
    regs = [b.register_rdma(pd) for b in bufs]
    assert len({r.lkey for r in regs}) == 4, "each buffer is its own memory region"
    for r in regs:
        r.deregister()
    for b in bufs:
        b.release()
    # deregistered buffers go back to the pool and register again
    with pool.acquire() as again:
        again.register_rdma(pd).deregister()


def test_explicit_remote_access(rdma_verbs: tuple[Any, Any], pool: RegisteredBufferPool, enums: Any) -> None:
    _, pd = rdma_verbs
    access = enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_WRITE | enums.IBV_ACCESS_REMOTE_READ
    with pool.acquire() as buf:
        reg = buf.register_rdma(pd, access=access)
        assert reg.access == access
        reg.deregister()


def test_registration_refused_by_the_kernel_is_a_registration_error(rdma_verbs: tuple[Any, Any],
                                                                    pool: RegisteredBufferPool,
                                                                    enums: Any) -> None:
    _, pd = rdma_verbs
    # remote write without local write is invalid in verbs: ibv_reg_mr fails with EINVAL
    with pool.acquire() as buf, pytest.raises(RegistrationError) as info:
        buf.register_rdma(pd, access=enums.IBV_ACCESS_REMOTE_WRITE)
    assert info.value.errno == errno.EINVAL
    assert isinstance(info.value, OSError)


def test_registration_with_something_that_is_not_a_pd(pool: RegisteredBufferPool) -> None:
    with pool.acquire() as buf, pytest.raises(RegistrationError):
        buf.register_rdma(object())


# ---- data moves through the registered memory


def _roce_v2_ipv4_gid_index(device: str, port: int = 1) -> int:
    """Index of the RoCE v2 GID holding the NIC's IPv4 address (what rdma_cm would pick), else 0."""
    base = f"/sys/class/infiniband/{device}/ports/{port}"
    for path in sorted(glob.glob(f"{base}/gids/*"), key=lambda p: int(os.path.basename(p))):
        index = os.path.basename(path)
        try:
            gid = open(path).read().strip()
            kind = open(f"{base}/gid_attrs/types/{index}").read().strip()
        except OSError:
            continue
        if gid.startswith("0000:0000:0000:0000:0000:ffff:") and kind == "RoCE v2":
            return int(index)
    return 0


class LoopbackQP:
    """An RC queue pair connected to itself on the testbed device: RDMA operations between local buffers."""

    def __init__(self, ctx: Any, pd: Any, device: str) -> None:
        import pyverbs.enums as e
        from pyverbs.addr import AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.e = e
        self.cq = CQ(ctx, 8)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                          cap=QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1))
        attr = QPAttr(port_num=1)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        self.qp = QP(pd, init, attr)
        gid_index = _roce_v2_ipv4_gid_index(device)
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        attr.ah_attr = AHAttr(port_num=1, is_global=1,
                              gr=GlobalRoute(dgid=ctx.query_gid(1, gid_index), sgid_index=gid_index))
        attr.dest_qp_num = self.qp.qp_num
        attr.rq_psn = attr.sq_psn = 0
        self.qp.to_rts(attr)

    def run(self, opcode: int, local: tuple[int, int, int], remote_addr: int, rkey: int) -> int:
        """Post one signalled RDMA op (local = address, length, lkey) and return its completion status."""
        from pyverbs.wr import SGE, SendWR

        addr, length, lkey = local
        wr = SendWR(opcode=opcode, num_sge=1, sg=[SGE(addr, length, lkey)])
        wr.set_wr_rdma(rkey, remote_addr)
        self.qp.post_send(wr)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            n, wcs = self.cq.poll(1)
            if n:
                return int(wcs[0].status)
            time.sleep(0.001)
        raise AssertionError("no RDMA completion within 30 s")

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


@pytest.fixture
def loopback(rdma_verbs: tuple[Any, Any], rdma_device: str) -> Iterator[LoopbackQP]:
    ctx, pd = rdma_verbs
    qp = LoopbackQP(ctx, pd, rdma_device)
    try:
        yield qp
    finally:
        qp.close()


def test_rdma_write_and_read_between_pool_buffers(rdma_verbs: tuple[Any, Any], pool: RegisteredBufferPool,
                                                  loopback: LoopbackQP, enums: Any) -> None:
    _, pd = rdma_verbs
    e = enums
    n = 256 * 1024
    pattern = os.urandom(n)
    with pool.acquire() as src, pool.acquire() as dst, pool.acquire() as back:
        _fill(src, pattern)
        _fill(dst, bytes(n))
        _fill(back, bytes(n))
        src_reg = src.register_rdma(pd, access=e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ)
        dst_reg = dst.register_rdma(pd, access=e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
        back_reg = back.register_rdma(pd)  # default access: the NIC writes read responses into it
        try:
            status = loopback.run(e.IBV_WR_RDMA_WRITE, (src.address, n, src_reg.lkey), dst.address, dst_reg.rkey)
            assert status == e.IBV_WC_SUCCESS
            assert _read(dst, n) == pattern
            status = loopback.run(e.IBV_WR_RDMA_READ, (back.address, n, back_reg.lkey), src.address, src_reg.rkey)
            assert status == e.IBV_WC_SUCCESS
            assert _read(back, n) == pattern
        finally:
            for reg in (src_reg, dst_reg, back_reg):
                reg.deregister()


def test_default_registration_refuses_remote_writes(rdma_verbs: tuple[Any, Any], pool: RegisteredBufferPool,
                                                    loopback: LoopbackQP, enums: Any) -> None:
    _, pd = rdma_verbs
    e = enums
    with pool.acquire() as src, pool.acquire() as dst:
        _fill(src, b"\xab" * 4096)
        _fill(dst, bytes(4096))
        src_reg, dst_reg = src.register_rdma(pd), dst.register_rdma(pd)  # dst: default, no remote write
        try:
            status = loopback.run(e.IBV_WR_RDMA_WRITE, (src.address, 4096, src_reg.lkey), dst.address, dst_reg.rkey)
            assert status == e.IBV_WC_REM_ACCESS_ERR
            assert _read(dst, 4096) == bytes(4096)
        finally:
            src_reg.deregister()
            dst_reg.deregister()
