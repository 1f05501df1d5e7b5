"""Corrupt and hostile checkpoints: every case is a typed error, never a crash or an out-of-bounds read."""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from sfstore import checkpoint, errors
from sfstore.checkpoint import MANIFEST_NAME
from sfstore.checkpoint import safetensors_format as stf
from sfstore.checkpoint.manifest import SUM_KEY, seal

SHARD = "shard-00000.safetensors"


def make(tmp_path: Path, **kw: Any) -> Path:
    state = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.int16), "n": 3}
    checkpoint.save(state, tmp_path / "ck", **kw)
    return tmp_path / "ck"


def manifest(ck: Path) -> dict[str, Any]:
    return json.loads((ck / MANIFEST_NAME).read_text())


def write_manifest(ck: Path, m: dict[str, Any], *, reseal: bool = True) -> None:
    """Write ``m``; one that has a manifest sum gets a fresh one (``reseal``), so the manifest is hostile but
    self-consistent and the checks behind its sum are what is tested."""
    if SUM_KEY in m and reseal:
        body = {k: v for k, v in m.items() if k != SUM_KEY}
        (ck / MANIFEST_NAME).write_bytes(seal(json.dumps(body, indent=1).encode("ascii")))
    else:
        (ck / MANIFEST_NAME).write_text(json.dumps(m))


def replace_shard(ck: Path, data: bytes, name: str = SHARD) -> None:
    """Put ``data`` as the shard and make the manifest's size and checksum agree, so only the content's
    structure can give it away."""
    (ck / name).write_bytes(data)
    m = manifest(ck)
    (n,) = struct.unpack("<Q", data[:8]) if len(data) >= 8 else (0,)
    for s in m["shards"]:
        if s["file"] == name:
            s["size"], s["xxh3_64"] = len(data), xxhash.xxh3_64(data).hexdigest()
            if "header_xxh3_64" in s:
                s["header_xxh3_64"] = xxhash.xxh3_64(data[: 8 + n]).hexdigest()
    write_manifest(ck, m)


def as_version_1(ck: Path) -> None:
    """Rewrite the manifest as format version 1 wrote it: no header sums, no manifest sum."""
    m = manifest(ck)
    m["version"] = 1
    m.pop(SUM_KEY, None)
    for s in m["shards"]:
        del s["header_xxh3_64"]
    write_manifest(ck, m)


def header_json(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def with_header(obj: dict[str, Any], rest: bytes) -> bytes:
    text = json.dumps(obj).encode()
    return struct.pack("<Q", len(text)) + text + rest


def corrupt(match: str, ck: Path, **kw: Any) -> errors.CorruptCheckpointError:
    with pytest.raises(errors.CorruptCheckpointError, match=match) as info:
        checkpoint.load(ck, **kw)
    return info.value


def test_flipped_data_byte_names_shard_and_tensor(tmp_path: Path) -> None:
    ck = make(tmp_path)
    data = bytearray((ck / SHARD).read_bytes())
    header = stf.parse_header(bytes(data), len(data), shard=SHARD)
    w = header.entries["w"]
    data[header.data_start + w.begin + 17] ^= 0x01
    (ck / SHARD).write_bytes(bytes(data))
    err = corrupt("checksum mismatch in tensor 'w'", ck)
    assert err.shard == SHARD and err.tensor == "w" and SHARD in str(err)
    into = {"w": torch.zeros(64), "b": torch.zeros(8, dtype=torch.int16)}
    err = corrupt("checksum mismatch in tensor 'w'", ck, into=into)
    assert err.tensor == "w"
    assert not torch.equal(checkpoint.load(ck, verify=False)["w"], torch.arange(64, dtype=torch.float32))


@pytest.mark.parametrize("version", [2, 1])
def test_flipped_header_padding_byte_fails_the_shard_checksum(tmp_path: Path, version: int) -> None:
    ck = make(tmp_path)
    if version == 1:
        as_version_1(ck)  # no header sum: the whole shard's sum catches it
    data = bytearray((ck / SHARD).read_bytes())
    header = stf.parse_header(bytes(data), len(data), shard=SHARD)
    data[header.data_start - 2] = ord("\t")  # still valid JSON, same tensors
    (ck / SHARD).write_bytes(bytes(data))
    err = corrupt("checksum mismatch in shard", ck)
    assert err.shard == SHARD and err.tensor is None
    into = {"w": torch.zeros(64), "b": torch.zeros(8, dtype=torch.int16)}
    assert corrupt("checksum mismatch in shard", ck, into=into).tensor is None


def test_saves_write_version_3_with_header_and_manifest_sums_and_versions_1_and_2_still_load(tmp_path: Path) -> None:
    ck = make(tmp_path)
    raw = (ck / MANIFEST_NAME).read_bytes()
    m = manifest(ck)
    data = (ck / SHARD).read_bytes()
    header = stf.parse_header(data, len(data), shard=SHARD)
    assert m["version"] == 3 and list(m)[-1] == SUM_KEY
    assert m[SUM_KEY] == xxhash.xxh3_64(raw[:-43] + b"\n}").hexdigest()  # as the manifest module documents
    assert m["shards"][0]["header_xxh3_64"] == xxhash.xxh3_64(data[: header.data_start]).hexdigest()
    assert m["shards"][0]["xxh3_64"] == xxhash.xxh3_64(data).hexdigest()  # the whole file's, for other tools
    v2 = {k: v for k, v in m.items() if k != SUM_KEY}
    v2["version"] = 2
    write_manifest(ck, v2)
    got = checkpoint.load(ck)
    assert torch.equal(got["w"], torch.arange(64, dtype=torch.float32)) and got["n"] == 3
    assert [i.name for i in checkpoint.list(tmp_path)] == ["ck"]
    as_version_1(ck)
    got = checkpoint.load(ck)
    assert torch.equal(got["w"], torch.arange(64, dtype=torch.float32)) and got["n"] == 3
    data2 = bytearray(data)
    data2[header.data_start + header.entries["b"].begin] ^= 0x40
    (ck / SHARD).write_bytes(bytes(data2))
    assert corrupt("checksum mismatch in tensor 'b'", ck).tensor == "b"


def test_version_3_shards_may_lack_their_header_sum(tmp_path: Path) -> None:
    """Manifests made for other writers' shards have no header sum: the whole shard's sum is checked."""
    ck = make(tmp_path)
    m = manifest(ck)
    del m["shards"][0]["header_xxh3_64"]
    write_manifest(ck, m)
    assert checkpoint.load(ck)["n"] == 3
    data = bytearray((ck / SHARD).read_bytes())
    header = stf.parse_header(bytes(data), len(data), shard=SHARD)
    data[header.data_start - 2] = ord("\t")  # header padding: only the whole-file sum covers it
    (ck / SHARD).write_bytes(bytes(data))
    corrupt("checksum mismatch in shard", ck)


@pytest.mark.parametrize(
    ("version", "drop_header_sum", "sealed", "match"),
    [(2, True, False, "must have exactly file, header_xxh3_64, size, xxh3_64"),
     (1, False, False, "must have exactly file, size, xxh3_64"),
     (2, False, True, "a version 2 manifest has no manifest_xxh3_64"),
     (3, False, False, "a version 3 manifest must end with its manifest_xxh3_64"),
     (4, False, True, "format version 4 is not supported"),
     (True, False, True, "format version True is not supported")],
)
def test_manifest_versions_and_their_fields(tmp_path: Path, version: Any, drop_header_sum: bool, sealed: bool,
                                            match: str) -> None:
    ck = make(tmp_path)
    m = manifest(ck)
    m["version"] = version
    if drop_header_sum:
        del m["shards"][0]["header_xxh3_64"]
    if not sealed:
        del m[SUM_KEY]
    write_manifest(ck, m)
    corrupt(match, ck)


def test_a_manifest_sum_that_is_not_the_last_member_or_differs_is_refused(tmp_path: Path) -> None:
    ck = make(tmp_path)
    raw = (ck / MANIFEST_NAME).read_bytes()
    m = manifest(ck)
    moved = {SUM_KEY: m[SUM_KEY], **{k: v for k, v in m.items() if k != SUM_KEY}}
    write_manifest(ck, moved, reseal=False)
    corrupt("must end with its manifest_xxh3_64", ck)
    changed = raw.replace(b'"n",\n    3\n', b'"n",\n    4\n')
    assert changed != raw
    (ck / MANIFEST_NAME).write_bytes(changed)
    corrupt("checksum mismatch: the manifest's bytes", ck)
    assert checkpoint.list(tmp_path) == [] and checkpoint.latest(tmp_path) is None
    (ck / MANIFEST_NAME).write_bytes(raw + b"\n")  # anything after the sum member
    corrupt("must end with its manifest_xxh3_64", ck)
    (ck / MANIFEST_NAME).write_bytes(raw)
    assert checkpoint.load(ck)["n"] == 3


def test_truncated_missing_and_extended_shards(tmp_path: Path) -> None:
    ck = make(tmp_path)
    data = (ck / SHARD).read_bytes()
    (ck / SHARD).write_bytes(data[:-10])
    assert corrupt("truncated", ck).shard == SHARD
    (ck / SHARD).write_bytes(data + b"x")
    corrupt("longer than recorded", ck)
    (ck / SHARD).unlink()
    corrupt("missing", ck)
    replace_shard(ck, data[:-10])  # the manifest agrees, the header does not
    err = corrupt("past the .* data bytes", ck)
    assert err.tensor is not None
    replace_shard(ck, data[:5])
    corrupt("too short", ck)


def test_manifest_that_does_not_match_its_shards(tmp_path: Path) -> None:
    ck = make(tmp_path)
    good = manifest(ck)

    def drop_b(m: dict[str, Any]) -> None:  # the shard still holds b, the manifest no longer does
        m["tensors"].pop("b")
        m["structure"] = {"dict": [p if p[0] != "b" else ["b", 0] for p in m["structure"]["dict"]]}

    cases: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
        ("manifest says float32\\[65\\]", lambda m: m["tensors"]["w"].update(shape=[65], nbytes=260)),
        ("manifest says float64", lambda m: m["tensors"]["w"].update(dtype="float64")),
        ("not in the manifest", drop_b),
        ("size .* is not a non-negative", lambda m: m["shards"][0].update(size=-1)),
        ("truncated", lambda m: m["shards"][0].update(size=m["shards"][0]["size"] + 1)),
        ("checksum mismatch in tensor 'b'", lambda m: m["tensors"]["b"].update(xxh3_64="0" * 16)),
        ("not among the listed shards", lambda m: m["tensors"]["b"].update(shard="other.safetensors")),
        ("does not list", lambda m: m.update(structure={"tensor": "nope"})),
        ("unknown tag", lambda m: m.update(structure={"pickle": "x"})),
        ("not a tagged value", lambda m: m.update(structure={"a": 1, "b": 2})),
        ("format version", lambda m: m.update(version=99)),
        ("format is", lambda m: m.update(format="other")),
        ("keys are", lambda m: m.pop("metadata")),
        ("16 lowercase hex", lambda m: m["shards"][0].update(xxh3_64="XYZ")),
        ("has no dtype", lambda m: m["tensors"]["w"].update(dtype="float99")),
        ("kind", lambda m: m["tensors"]["w"].update(kind="pickle")),
    ]
    for match, change in cases:
        m = json.loads(json.dumps(good))
        change(m)
        write_manifest(ck, m)
        corrupt(match, ck)
    for raw in (b"", b"\xff\xfe", b"[1, 2]", b'{"format": "sfstore-checkpoint", "format": 1}', b"[" * 100000):
        (ck / MANIFEST_NAME).write_bytes(raw)
        corrupt(MANIFEST_NAME, ck)


@pytest.mark.parametrize("name", ["../evil.safetensors", "/etc/passwd", "a/b.safetensors", "..", ".", "", "x\x00y"])
def test_manifest_paths_that_escape_are_refused_before_any_read(tmp_path: Path, name: str) -> None:
    ck = make(tmp_path)
    m = manifest(ck)
    m["shards"][0]["file"] = name
    for t in m["tensors"].values():
        t["shard"] = name
    write_manifest(ck, m)
    err = corrupt("escapes the checkpoint directory|is not a file name", ck)
    assert isinstance(err, ValueError)


def test_a_shard_that_links_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    ck = make(tmp_path)
    outside = tmp_path / "outside.safetensors"
    os.replace(ck / SHARD, outside)
    os.symlink(outside, ck / SHARD)
    corrupt("links out of the checkpoint directory", ck)


def test_headers_that_lie(tmp_path: Path) -> None:
    ck = make(tmp_path)
    data = (ck / SHARD).read_bytes()
    obj, rest = header_json(data)
    w, b = obj["w"], obj["b"]
    assert w["data_offsets"][0] == 0 and b["data_offsets"][0] == w["data_offsets"][1]
    end = b["data_offsets"][1]
    pad = rest[end:]
    assert pad == b""

    def variant(change: Callable[[dict[str, Any]], None]) -> bytes:
        o = json.loads(json.dumps(obj))
        change(o)
        return with_header(o, rest)

    cases: list[tuple[str, bytes]] = [
        ("takes 256 bytes but its offsets span", variant(lambda o: o["w"].update(data_offsets=[0, 200]))),
        ("overlaps", variant(lambda o: o["b"].update(data_offsets=[250, 266]))),
        ("leaves a gap", variant(lambda o: o["b"].update(data_offsets=[260, 276]))),
        ("past the", variant(lambda o: o["b"].update(data_offsets=[256, 272 + 4096], shape=[8 + 2048]))),
        ("unknown dtype", variant(lambda o: o["w"].update(dtype="F128"))),
        ("shape", variant(lambda o: o["w"].update(shape=[-64]))),
        ("shape", variant(lambda o: o["w"].update(shape=[True]))),
        ("data_offsets", variant(lambda o: o["w"].update(data_offsets=[0, 256, 3]))),
        ("end before they begin", variant(lambda o: o["w"].update(data_offsets=[256, 0]))),
        ("entry keys", variant(lambda o: o["w"].update(extra=1))),
        ("__metadata__", variant(lambda o: o.update(__metadata__={"a": 1}))),
        ("not a JSON object", variant(lambda o: o.update(w=[1]))),
        ("not valid JSON", struct.pack("<Q", 4) + b'{"a"' + rest),
        ("not UTF-8", struct.pack("<Q", 4) + b"{\xff\xfe}" + rest),
        ("does not start", struct.pack("<Q", 4) + b"[12]" + rest),
        ("duplicate key", struct.pack("<Q", 11) + b'{"":1,"":2}' + rest),
        ("exceeds the limit", struct.pack("<Q", (100 << 20) + 1) + b"{}" + rest),
        ("exceeds the .* bytes after the length", struct.pack("<Q", len(data)) + data[8:]),
        ("exceeds the limit", struct.pack("<Q", 2**64 - 1) + data[8:]),
        ("not a whole number", variant(lambda o: o["b"].update(dtype="F4", shape=[3], data_offsets=[256, 272]))),
    ]
    for match, crafted in cases:
        replace_shard(ck, crafted)
        with pytest.raises(errors.CorruptCheckpointError, match=match):
            checkpoint.load(ck)
        with pytest.raises(errors.CorruptCheckpointError, match=match):
            stf.parse_header(crafted, len(crafted), shard=SHARD)


def test_plain_safetensors_files_that_lie(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    for raw in (b"", b"\x00" * 7, struct.pack("<Q", 10**12) + b"{}", struct.pack("<Q", 2) + b"{}junk"):
        path.write_bytes(raw)
        with pytest.raises(errors.CorruptCheckpointError):
            checkpoint.load(path)
    path.write_bytes(with_header({"x": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, b"abc"))
    with pytest.raises(errors.InvalidRequestError, match="torch has no dtype"):
        checkpoint.load(path)


def test_random_header_mutations_never_escape_as_other_errors(tmp_path: Path) -> None:
    """Fuzz: mutate header bytes (and sometimes the length), keep the manifest's size/checksum in step, so
    only the structural checks stand between the bytes and the tensors."""
    ck = make(tmp_path)
    data = (ck / SHARD).read_bytes()
    header = stf.parse_header(data, len(data), shard=SHARD)
    rng = random.Random(1234)
    outcomes = {"corrupt": 0, "loaded": 0}
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            where = rng.randrange(0, header.data_start if rng.random() < 0.9 else len(data))
            mutated[where] = rng.randrange(256)
        if rng.random() < 0.2:
            mutated = mutated[: rng.randrange(len(mutated))]
        replace_shard(ck, bytes(mutated))
        try:
            out = checkpoint.load(ck)
        except errors.CorruptCheckpointError:
            outcomes["corrupt"] += 1
        else:
            outcomes["loaded"] += 1  # the mutation hit padding (and the manifest agreed): still exact
            assert torch.equal(out["w"], torch.arange(64, dtype=torch.float32))
    assert outcomes["corrupt"] > 100
