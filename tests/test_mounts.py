"""sfstore.mounts: parsing /proc/self/mountinfo and finding the mount that serves a path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sfstore.errors import NotSupportedOnHostError
from sfstore.mounts import (
    MountInfo,
    mount_for,
    nfs_mounts,
    parse_mountinfo,
    parse_mountinfo_line,
    parse_options,
    read_mountinfo,
    unescape,
)

ROOT = "23 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,errors=remount-ro"
PROC = "24 23 0:22 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw"
NFS_RDMA = (
    "412 23 0:52 / /mnt/nfs rw,relatime shared:211 - nfs4 10.0.2.15:/export "
    "rw,vers=4.2,rsize=262144,wsize=262144,namlen=255,hard,proto=rdma,port=20049,timeo=600,retrans=2,sec=sys,"
    "clientaddr=10.0.2.15,local_lock=none,addr=10.0.2.15"
)
NFS_TCP = (
    "500 23 0:60 / /data/train rw,noatime shared:300 master:7 - nfs 192.168.1.10:/vol/train "
    "rw,vers=3,rsize=1048576,wsize=1048576,namlen=255,hard,nconnect=8,proto=tcp,timeo=600,retrans=2,sec=sys,"
    "mountaddr=192.168.1.10,mountvers=3,mountport=20048,mountproto=udp,local_lock=none,addr=192.168.1.10"
)
SPACE = r"600 23 8:1 /sub\040dir /mnt/my\040disk ro,nosuid - xfs /dev/sdb1 ro,attr2,inode64"
NO_OPTIONAL = "601 23 0:70 / /mnt/ram rw - tmpfs tmpfs rw,size=1024k"
OVER = "700 23 0:80 / /mnt/nfs rw - tmpfs overlay-tmp rw"  # mounted on top of the NFS mount
SAMPLE = "\n".join([ROOT, PROC, NFS_RDMA, NFS_TCP, SPACE, NO_OPTIONAL])


def test_parse_root_line() -> None:
    m = parse_mountinfo_line(ROOT)
    assert (m.mount_id, m.parent_id, m.device, m.root, m.mountpoint) == (23, 1, "254:0", "/", "/")
    assert m.fstype == "ext4" and m.source == "/dev/vda"
    assert m.options == {"rw": None, "relatime": None}
    assert m.optional_fields == ("shared:1",)
    assert m.super_options == {"rw": None, "errors": "remount-ro"}
    assert not m.is_nfs and m.nfs_proto is None and m.transport == "local" and not m.read_only


def test_parse_nfs4_over_rdma() -> None:
    m = parse_mountinfo_line(NFS_RDMA)
    assert m.is_nfs and m.fstype == "nfs4" and m.source == "10.0.2.15:/export" and m.mountpoint == "/mnt/nfs"
    assert m.nfs_proto == "rdma" and m.transport == "rdma"
    assert m.option("vers") == "4.2" and m.option("port") == "20049" and m.option("hard") == ""
    assert m.option("nconnect") is None and m.option("nconnect", "1") == "1"
    facts = m.nfs_facts()
    assert facts == {
        "mountpoint": "/mnt/nfs", "source": "10.0.2.15:/export", "server": "10.0.2.15", "export": "/export",
        "fstype": "nfs4", "vers": "4.2", "proto": "rdma", "rsize": 262144, "wsize": 262144, "nconnect": 1,
        "port": 20049, "addr": "10.0.2.15", "read_only": False,
    }


def test_parse_nfs3_over_tcp_with_nconnect() -> None:
    m = parse_mountinfo_line(NFS_TCP)
    assert m.optional_fields == ("shared:300", "master:7")
    assert m.fstype == "nfs" and m.nfs_proto == "tcp" and m.transport == "tcp"
    facts = m.nfs_facts()
    assert facts["vers"] == "3" and facts["nconnect"] == 8 and facts["rsize"] == 1 << 20
    assert facts["server"] == "192.168.1.10" and facts["export"] == "/vol/train"
    assert facts["port"] is None  # the NFS port was not given, only mountport


def test_escaped_paths_and_read_only() -> None:
    m = parse_mountinfo_line(SPACE)
    assert m.root == "/sub dir" and m.mountpoint == "/mnt/my disk"
    assert m.read_only and m.optional_fields == ()
    assert m.super_options["inode64"] is None


def test_no_optional_fields() -> None:
    m = parse_mountinfo_line(NO_OPTIONAL)
    assert m.optional_fields == () and m.fstype == "tmpfs" and m.super_options == {"rw": None, "size": "1024k"}


def test_as_dict_is_plain_data() -> None:
    d = parse_mountinfo_line(NFS_TCP).as_dict()
    assert d["optional_fields"] == ["shared:300", "master:7"] and d["super_options"]["nconnect"] == "8"


def test_unescape_and_options() -> None:
    assert unescape(r"a\040b\011c\134d\012") == "a b\tc\\d\n"
    assert parse_options("rw,,vers=4.2,sec=sys") == {"rw": None, "vers": "4.2", "sec": "sys"}
    assert parse_options("") == {}


@pytest.mark.parametrize("bad", ["", "garbage", "1 2 3 4 5 6 7", "x 1 0:1 / / rw - ext4 /dev/a rw"])
def test_malformed_line_raises(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_mountinfo_line(bad)


def test_parse_table_skips_malformed_lines() -> None:
    table = parse_mountinfo(SAMPLE + "\nnot a mount line\n\n")
    assert [m.mountpoint for m in table] == ["/", "/proc", "/mnt/nfs", "/data/train", "/mnt/my disk", "/mnt/ram"]
    assert [m.mountpoint for m in nfs_mounts(table)] == ["/mnt/nfs", "/data/train"]
    assert parse_mountinfo(SAMPLE.splitlines()) == table


def test_mount_for_in_a_sample_table() -> None:
    table = parse_mountinfo(SAMPLE)
    assert mount_for("/mnt/nfs", table).fstype == "nfs4"
    assert mount_for("/mnt/nfs/ckpt/shard-0.safetensors", table).nfs_proto == "rdma"
    assert mount_for("/mnt/nfsother/x", table).mountpoint == "/"  # a name prefix is not a path prefix
    assert mount_for("/data/train/../train/a", table).mountpoint == "/data/train"
    assert mount_for("/mnt/my disk/f", table).fstype == "xfs"
    assert mount_for("/etc/passwd", table).mountpoint == "/"
    # a later mount on the same mount point hides the earlier one
    assert mount_for("/mnt/nfs/x", parse_mountinfo(SAMPLE + "\n" + OVER)).fstype == "tmpfs"


def test_mount_for_without_a_containing_mount() -> None:
    with pytest.raises(NotSupportedOnHostError):
        mount_for("/x", [parse_mountinfo_line(NFS_TCP)])


# ---- the real mount table of this process


def test_real_mountinfo_has_root_and_proc() -> None:
    table = read_mountinfo()
    assert table and all(isinstance(m, MountInfo) for m in table)
    assert any(m.mountpoint == "/" for m in table)
    assert mount_for("/proc/self").fstype == "proc"
    assert mount_for("/").mountpoint == "/"


def test_real_mount_for_matches_st_dev(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"x")
    m = mount_for(f)
    real = os.path.realpath(f)
    assert real == m.mountpoint or m.mountpoint == "/" or real.startswith(m.mountpoint + "/")
    st = os.stat(f)
    if m.fstype not in ("btrfs", "overlay", "zfs"):  # these report per-subvolume / per-layer devices
        assert m.device == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def test_real_mount_for_missing_path_uses_nearest_parent(tmp_path: Path) -> None:
    assert mount_for(tmp_path / "not" / "yet" / "there") == mount_for(tmp_path)


def test_real_mount_for_follows_symlinks(tmp_path: Path) -> None:
    link = tmp_path / "proc-link"
    link.symlink_to("/proc")
    assert mount_for(link).fstype == "proc"


def test_unreadable_table_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(NotSupportedOnHostError, match="cannot read the mount table"):
        read_mountinfo(str(tmp_path / "nope"))
