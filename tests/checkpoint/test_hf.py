"""Hugging Face both ways, against the real ``transformers``: ``load`` reads what ``save_pretrained`` writes
(sharded with its index, or one ``model.safetensors``; a shard ``into=`` a model), and ``from_pretrained`` reads
what ``save`` writes of a flat state dict (Hugging Face shard names and index beside sfstore's manifest)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from ckpt_helpers import same

from sfstore import checkpoint, errors
from sfstore.checkpoint import MANIFEST_NAME, hf, location
from sfstore.checkpoint.manifest import SUM_KEY, seal

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SHARD_SIZE = "200KB"
IDS = torch.tensor([[1, 7, 42, 300, 511, 0, 5, 9], [3, 3, 3, 100, 200, 300, 400, 500]])


def _config(**overrides: Any) -> Any:
    args = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512)
    args.update(overrides)
    return transformers.LlamaConfig(**args)


def _model(seed: int = 0, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(**overrides)).eval()


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(IDS).logits
    return out


def _bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # everything here is local: a download attempt is a failure
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, offline: None) -> tuple[Any, Path, Path]:
    """A tiny Llama and the two directories ``save_pretrained`` made of it: sharded, and one file."""
    model = _model()
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "sharded", max_shard_size=SHARD_SIZE)
    model.save_pretrained(root / "single")
    return model, root / "sharded", root / "single"


def test_load_reads_a_sharded_save_pretrained_directory(pretrained: tuple[Any, Path, Path]) -> None:
    model, sharded, _ = pretrained
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and (sharded / hf.INDEX_NAME).is_file() and not (sharded / MANIFEST_NAME).exists()
    fp = location.locate(sharded, create=False).fp
    before = fp.counters.for_class("checkpoint").snapshot()
    got = checkpoint.load(sharded)
    _bits_equal(got, model.state_dict())
    after = fp.counters.for_class("checkpoint").snapshot()
    # Through the file path: the index, then every shard whole (its header read ahead as well).
    assert after["files"] - before["files"] == 1 + len(shards)
    assert after["bytes_read"] - before["bytes_read"] >= sum((sharded / s).stat().st_size for s in shards)
    assert list(got) == list(json.loads((sharded / hf.INDEX_NAME).read_text())["weight_map"])


def test_load_reads_a_single_file_save_pretrained_directory(pretrained: tuple[Any, Path, Path]) -> None:
    model, _, single = pretrained
    assert [p.name for p in single.glob("*.safetensors")] == [hf.WEIGHTS_NAME]
    _bits_equal(checkpoint.load(single), model.state_dict())
    _bits_equal(checkpoint.load(single / hf.WEIGHTS_NAME), model.state_dict())  # the file itself, too


def test_load_of_one_shard_into_a_model_fills_what_it_holds(pretrained: tuple[Any, Path, Path]) -> None:
    model, sharded, _ = pretrained
    want = model.state_dict()
    fresh = _model(seed=1)
    with torch.no_grad():
        for t in fresh.state_dict().values():
            t.fill_(-7.0)
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    held = set(json.loads((sharded / hf.INDEX_NAME).read_text())["weight_map"].items())
    names = {name for name, file in held if file == shard.name}
    out = checkpoint.load(shard, into=fresh)
    assert set(out) == names
    now = fresh.state_dict()
    for name in want:
        if name in names:
            assert torch.equal(now[name], want[name]) and out[name].data_ptr() == now[name].data_ptr(), name
        else:
            assert bool((now[name] == -7.0).all()), name  # the others are left as they were
    for shard in sorted(sharded.glob("model-*.safetensors")):
        checkpoint.load(shard, into=fresh)
    assert torch.equal(_logits(fresh), _logits(model))


def test_load_of_a_directory_into_a_model_or_state_dict(pretrained: tuple[Any, Path, Path]) -> None:
    model, sharded, single = pretrained
    for where in (sharded, single):
        fresh = _model(seed=2)
        checkpoint.load(where, into=fresh)
        assert torch.equal(_logits(fresh), _logits(model))
        sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        checkpoint.load(where, into=sd)
        _bits_equal(sd, model.state_dict())


def test_a_whole_directory_into_a_model_it_does_not_fill_is_refused(pretrained: tuple[Any, Path, Path]) -> None:
    _, sharded, _ = pretrained
    with pytest.raises(errors.InvalidRequestError, match="has no tensors for extra"):
        checkpoint.load(sharded, into={**_model(seed=3).state_dict(), "extra": torch.zeros(3)})


def test_a_shard_tensor_without_a_matching_destination_is_refused(pretrained: tuple[Any, Path, Path]) -> None:
    _, _, single = pretrained
    sd = _model(seed=3).state_dict()
    del sd["lm_head.weight"]
    with pytest.raises(errors.InvalidRequestError, match=r"nothing at lm_head\.weight"):
        checkpoint.load(single / hf.WEIGHTS_NAME, into=sd)
    sd = _model(seed=3).state_dict()
    sd["lm_head.weight"] = torch.zeros(3, 4)
    with pytest.raises(errors.InvalidRequestError, match=r"lm_head.weight is float32\[3, 4\]"):
        checkpoint.load(single / hf.WEIGHTS_NAME, into=sd)


def test_tied_weights_stored_once_fill_both_names(tmp_path: Path, offline: None) -> None:
    model = _model(tie_word_embeddings=True)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    model.save_pretrained(tmp_path / "hf", max_shard_size=SHARD_SIZE)
    weight_map = json.loads((tmp_path / "hf" / hf.INDEX_NAME).read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map  # save_pretrained stores a tied weight once
    fresh = _model(seed=4, tie_word_embeddings=True)
    checkpoint.load(tmp_path / "hf", into=fresh)  # the tied name is the memory of a filled one: allowed
    assert torch.equal(_logits(fresh), _logits(model))
    # state_dict() gives each tied name a tensor of its own over the same memory: sfstore stores both (as it does
    # distinct tensors sharing memory), and from_pretrained takes either.
    checkpoint.save(sd, tmp_path / "ours", max_shard_bytes=200_000)
    model.config.save_pretrained(tmp_path / "ours")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert torch.equal(_logits(back), _logits(model))
    loaded = checkpoint.load(tmp_path / "ours")
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    # The same tensor object under two names is stored once, and the index maps the first name only.
    w = sd["model.embed_tokens.weight"]
    checkpoint.save({"a": w, "b": w, "c": torch.zeros(3)}, tmp_path / "once", max_shard_bytes=1)
    index = json.loads((tmp_path / "once" / hf.INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == ["a", "c"]
    again = checkpoint.load(tmp_path / "once")
    assert again["a"] is again["b"] and torch.equal(again["a"], w)


@pytest.mark.parametrize("max_shard_bytes", [200_000, None])
def test_from_pretrained_reads_what_save_wrote(tmp_path: Path, offline: None, max_shard_bytes: int | None) -> None:
    model = _model()
    sd = model.state_dict()
    ck = tmp_path / "ck"
    info = checkpoint.save(sd, ck, max_shard_bytes=max_shard_bytes)
    model.config.save_pretrained(ck)
    files = sorted(p.name for p in ck.glob("*.safetensors"))
    if max_shard_bytes is None:
        assert files == [hf.WEIGHTS_NAME] and not (ck / hf.INDEX_NAME).exists()  # as save_pretrained: no index
    else:
        n = info.num_shards
        assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        index = json.loads((ck / hf.INDEX_NAME).read_text())
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
        assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(files)
    from safetensors import safe_open

    for f in files:
        with safe_open(str(ck / f), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
    back = transformers.LlamaForCausalLM.from_pretrained(ck).eval()
    assert torch.equal(_logits(back), _logits(model))
    assert same(checkpoint.load(ck), sd)  # sfstore's load goes by the manifest, sums checked
    assert checkpoint.latest(tmp_path) == info


def test_the_manifest_sums_still_guard_a_hugging_face_named_save(tmp_path: Path) -> None:
    model = _model()
    ck = tmp_path / "ck"
    checkpoint.save(model.state_dict(), ck, max_shard_bytes=200_000)
    victim = ck / "model-00002-of-00003.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(errors.CorruptCheckpointError, match="checksum mismatch") as info:
        checkpoint.load(ck)
    assert info.value.shard == victim.name
    with pytest.raises(errors.CorruptCheckpointError, match="checksum mismatch"):
        checkpoint.load(ck, into=_model(seed=5))


def test_overwrite_and_save_async_keep_the_layout(tmp_path: Path) -> None:
    sd = _model().state_dict()
    ck = tmp_path / "ck"
    checkpoint.save(sd, ck)
    checkpoint.save_async(sd, ck, max_shard_bytes=200_000, overwrite=True).get(60)
    assert (ck / hf.INDEX_NAME).is_file() and not (ck / hf.WEIGHTS_NAME).exists()
    assert same(checkpoint.load(ck), sd)


def test_other_state_dicts_keep_sfstore_names(tmp_path: Path) -> None:
    w = torch.arange(10.0)
    for name, state in {
        "nested": {"model": {"w": w}, "step": 3},
        "slash": {"a/b": w},
        "numpy": {"w": w.numpy()},
        "list": [w],
    }.items():
        checkpoint.save(state, tmp_path / name)
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [MANIFEST_NAME, "shard-00000.safetensors"]
        assert same(checkpoint.load(tmp_path / name), state)


def test_a_flat_checkpoint_with_the_old_shard_names_still_loads(tmp_path: Path) -> None:
    sd = {"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.int64)}
    ck = tmp_path / "ck"
    checkpoint.save(sd, ck)
    (ck / hf.WEIGHTS_NAME).rename(ck / "shard-00000.safetensors")
    raw = (ck / MANIFEST_NAME).read_bytes()
    manifest = json.loads(raw)
    del manifest[SUM_KEY]
    manifest["shards"][0]["file"] = "shard-00000.safetensors"
    for t in manifest["tensors"].values():
        t["shard"] = "shard-00000.safetensors"
    (ck / MANIFEST_NAME).write_bytes(seal(json.dumps(manifest, indent=1).encode("ascii")))
    assert same(checkpoint.load(ck), sd)
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    checkpoint.load(ck, into=into)
    assert same(into, sd)


@pytest.mark.parametrize("name", [hf.INDEX_NAME, MANIFEST_NAME, "config.json"])
def test_a_json_file_given_as_a_shard_says_what_to_pass(pretrained: tuple[Any, Path, Path], tmp_path: Path,
                                                        name: str) -> None:
    model, sharded, _ = pretrained
    if name == MANIFEST_NAME:
        checkpoint.save(model.state_dict(), tmp_path / "ck")
        where = tmp_path / "ck"
    else:
        where = sharded
    for into in (None, _model(seed=6)):
        with pytest.raises(errors.InvalidRequestError, match="not a safetensors file: pass its directory") as info:
            checkpoint.load(where / name, into=into)
        assert str(where) in str(info.value)


def test_json_under_a_safetensors_name_is_refused_as_json(tmp_path: Path) -> None:
    (tmp_path / "index.safetensors").write_text('{"metadata": {}, "weight_map": {}}')
    with pytest.raises(errors.InvalidRequestError, match="is a JSON file, not a safetensors file"):
        checkpoint.load(tmp_path / "index.safetensors")


def test_a_directory_of_neither_kind_says_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"pickle: never read")
    pattern = f"neither {re.escape(MANIFEST_NAME)} .* nor {re.escape(hf.WEIGHTS_NAME)}"
    with pytest.raises(errors.PathNotFoundError, match=pattern):
        checkpoint.load(tmp_path / "d")


def _copy_hf(src: Path, dst: Path) -> None:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())


def _edit_index(d: Path, change: Any) -> None:
    index = json.loads((d / hf.INDEX_NAME).read_text())
    change(index["weight_map"])
    (d / hf.INDEX_NAME).write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: m.update({"lm_head.weight": "../model-00003-of-00003.safetensors"}), "escapes the directory"),
        (lambda m: m.update({"lm_head.weight": "/etc/passwd"}), "escapes the directory"),
        (lambda m: m.update({"lm_head.weight": 3}), "not a file name"),
        (lambda m: m.update({"lm_head.weight": "model-00009-of-00009.safetensors"}), "is missing"),
        (lambda m: m.update({"not.there": "model-00001-of-00003.safetensors"}), "which does not hold it"),
    ],
)
def test_a_bad_index_is_a_corrupt_checkpoint(pretrained: tuple[Any, Path, Path], tmp_path: Path, change: Any,
                                             match: str) -> None:
    _, sharded, _ = pretrained
    d = tmp_path / "d"
    _copy_hf(sharded, d)
    _edit_index(d, change)
    with pytest.raises(errors.CorruptCheckpointError, match=match):
        checkpoint.load(d)


@pytest.mark.parametrize("text", ["[]", "{", '{"weight_map": []}', '{"weight_map": {"a": "x", "a": "y"}}'])
def test_a_malformed_index_is_a_corrupt_checkpoint(tmp_path: Path, text: str) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / hf.INDEX_NAME).write_text(text)
    with pytest.raises(errors.CorruptCheckpointError, match=hf.INDEX_NAME):
        checkpoint.load(tmp_path / "d")


def test_a_shard_changed_between_its_header_read_and_its_load_is_caught(
    pretrained: tuple[Any, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, sharded, _ = pretrained
    d = tmp_path / "d"
    _copy_hf(sharded, d)
    real = hf.directory_manifest

    def then_grow(fp: Any, directory: str) -> Any:
        out = real(fp, directory)
        with open(d / "model-00001-of-00003.safetensors", "ab") as f:
            f.write(b"\0" * 8)
        return out

    monkeypatch.setattr(hf, "directory_manifest", then_grow)
    with pytest.raises(errors.CorruptCheckpointError, match="longer than recorded"):
        checkpoint.load(d)


def test_hub_cache_links_are_followed_beneath_the_root(pretrained: tuple[Any, Path, Path], tmp_path: Path) -> None:
    """The hub's cache links a snapshot's files to blobs; links that stay beneath the root are followed, one
    that leaves it is refused."""
    model, sharded, _ = pretrained
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snap = tmp_path / "snap"
    snap.mkdir()
    for p in sharded.iterdir():
        (blobs / p.name).write_bytes(p.read_bytes())
        (snap / p.name).symlink_to(Path("..") / "blobs" / p.name)
    _bits_equal(checkpoint.load(snap), model.state_dict())  # the root of an absolute url: its parent
    deep = tmp_path / "deep" / "snap"  # its root is tmp_path / "deep": ../../blobs leaves it
    deep.mkdir(parents=True)
    for p in sharded.iterdir():
        (deep / p.name).symlink_to(Path("..") / ".." / "blobs" / p.name)
    with pytest.raises(errors.PathEscapeError):
        checkpoint.load(deep)


# -- the hub's cache ---------------------------------------------------------------------------------------------

HUB_REPO = "sfstore-test/tiny-llama"
HUB_COMMIT = "5f0e1d2c3b4a59687766554433221100ffeeddcc"


class _Hub(http.server.BaseHTTPRequestHandler):
    """What ``hf_hub_download`` asks the hub for one file: ``HEAD`` (commit, etag, size), then ``GET``."""

    files: ClassVar[dict[str, bytes]] = {}

    def _meta(self) -> bytes | None:
        body = self.files.get(self.path.rsplit("/resolve/main/", 1)[-1])
        if body is None:
            self.send_response(404)
            self.end_headers()
            return None
        self.send_response(200)
        self.send_header("X-Repo-Commit", HUB_COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return body

    def do_HEAD(self) -> None:
        self._meta()

    def do_GET(self) -> None:
        body = self._meta()
        if body is not None:
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def hub_cache(pretrained: tuple[Any, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A hub cache that ``huggingface_hub`` itself lays out: ``hf_hub_download`` of every file of the sharded
    directory from a hub on 127.0.0.1 (nothing leaves the machine). Returns the cache and the snapshot."""
    hub = pytest.importorskip("huggingface_hub")
    if hub.constants.is_offline_mode():
        pytest.skip("HF_HUB_OFFLINE was set before huggingface_hub was imported: it downloads nothing")
    _, sharded, _ = pretrained
    files = {p.name: p.read_bytes() for p in sharded.iterdir()}
    handler = type("Hub", (_Hub,), {"files": files})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = tmp_path_factory.mktemp("hub")
    try:
        for name in files:
            hub.hf_hub_download(HUB_REPO, name, cache_dir=cache, endpoint=f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    repo = cache / ("models--" + HUB_REPO.replace("/", "--"))
    snap = repo / "snapshots" / HUB_COMMIT
    assert (repo / "refs" / "main").read_text() == HUB_COMMIT
    for p in snap.iterdir():  # the layout this is about: relative links into the repository's blobs
        assert p.is_symlink() and os.readlink(p).startswith("../../blobs/"), p
    return cache, snap


def _evil_snapshot(cache: Path, snap: Path, rev: str, target: str, *, shard: str | None = None) -> Path:
    """A snapshot beside ``snap`` whose links are ``snap``'s but one: ``shard`` (default: the first shard)
    links to ``target``."""
    evil = snap.parent / rev
    evil.mkdir()
    victim = shard or sorted(p.name for p in snap.glob("model-*.safetensors"))[0]
    for p in snap.iterdir():
        (evil / p.name).symlink_to(target if p.name == victim else os.readlink(p))
    return evil


def test_a_hub_cache_snapshot_loads(pretrained: tuple[Any, Path, Path], hub_cache: tuple[Path, Path]) -> None:
    """``load`` of ``<repo>/snapshots/<rev>`` (a host path) follows its links into ``<repo>/blobs``: the root is
    the repository folder, not ``snapshots``."""
    model, _, _ = pretrained
    cache, snap = hub_cache
    hub = pytest.importorskip("huggingface_hub")
    (info,) = hub.scan_cache_dir(cache).repos  # huggingface_hub reads it back as its own
    assert info.repo_id == HUB_REPO and {r.snapshot_path for r in info.revisions} == {snap}
    _bits_equal(checkpoint.load(snap), model.state_dict())
    _bits_equal(checkpoint.load(f"file://{snap}"), model.state_dict())
    shard = sorted(snap.glob("model-*.safetensors"))[0]
    assert set(checkpoint.load(shard)) <= set(model.state_dict())  # one shard file of it, too
    fresh = _model(seed=1)
    checkpoint.load(snap, into=fresh)
    _bits_equal(fresh.state_dict(), model.state_dict())
    # The same snapshot through a symlinked cache directory: the rule goes by the resolved parent.
    alias = cache.parent / f"{cache.name}-alias"
    alias.symlink_to(cache)
    _bits_equal(checkpoint.load(alias / snap.relative_to(cache)), model.state_dict())
    # And what from_pretrained reads from the same cache is what load gave.
    again = transformers.LlamaForCausalLM.from_pretrained(HUB_REPO, cache_dir=cache, local_files_only=True)
    _bits_equal(again.state_dict(), model.state_dict())


@pytest.mark.parametrize(
    "where",
    ["outside-the-repository", "absolute", "absolute-into-blobs-elsewhere", "weights-file"],
)
def test_a_hub_snapshot_linking_out_of_its_repository_is_refused(hub_cache: tuple[Path, Path], where: str) -> None:
    """A snapshot whose link leads out of ``<repo>`` (to another repository's blobs, an absolute path outside)
    is refused with :class:`PathEscapeError`, before a byte of it is read."""
    cache, snap = hub_cache
    repo = snap.parent.parent
    outside = cache / f"outside-{where}"
    outside.mkdir()
    shard = sorted(snap.glob("model-*.safetensors"))[0]
    (outside / shard.name).write_bytes(shard.read_bytes())
    if where == "outside-the-repository":  # ../../../ leaves models--org--name
        evil = _evil_snapshot(cache, snap, "evil1", f"../../../{outside.name}/{shard.name}")
    elif where == "absolute":
        evil = _evil_snapshot(cache, snap, "evil2", str(outside / shard.name))
    elif where == "absolute-into-blobs-elsewhere":  # another repository's blobs (a copy of this one)
        other = cache / "models--someone--else" / "blobs"
        other.mkdir(parents=True)
        (other / "b").write_bytes(shard.read_bytes())
        evil = _evil_snapshot(cache, snap, "evil3", str(other / "b"))
    else:  # a single-file snapshot whose model.safetensors leaves: refused as an escape, not "no weights"
        evil = snap.parent / "evil4"
        evil.mkdir()
        (evil / hf.WEIGHTS_NAME).symlink_to(f"../../../{outside.name}/{shard.name}")
    try:
        with pytest.raises(errors.PathEscapeError):
            checkpoint.load(evil)
        with pytest.raises(errors.PathEscapeError):
            checkpoint.load(evil, into=_model(seed=2))
    finally:
        for p in evil.iterdir():
            p.unlink()
        evil.rmdir()
    assert repo.is_dir()


def test_the_hub_rule_needs_snapshots_beside_a_blobs_directory(
    pretrained: tuple[Any, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root is widened to ``<repo>`` only for ``<repo>/snapshots/<rev>`` given as a host path with a real
    ``<repo>/blobs`` directory: without ``blobs``, with ``blobs`` a link out, or through ``sf://`` (whose root is
    never widened), the same links are refused."""
    model, sharded, _ = pretrained

    def layout(repo: Path, blobs_dir: str = "blobs") -> Path:
        (repo / blobs_dir).mkdir(parents=True)
        snap = repo / "snapshots" / "rev"
        snap.mkdir(parents=True)
        for p in sharded.iterdir():
            (repo / blobs_dir / p.name).write_bytes(p.read_bytes())
            (snap / p.name).symlink_to(f"../../{blobs_dir}/{p.name}")
        return snap

    _bits_equal(checkpoint.load(layout(tmp_path / "models--a--ok")), model.state_dict())  # made by hand: the same
    no_blobs = layout(tmp_path / "models--a--noblobs", blobs_dir="data")  # links into ../../data: not blobs
    with pytest.raises(errors.PathEscapeError):
        checkpoint.load(no_blobs)
    elsewhere = tmp_path / "elsewhere"
    linked = layout(elsewhere / "models--a--linked")
    (elsewhere / "models--a--linked" / "blobs").rename(elsewhere / "real-blobs")
    (elsewhere / "models--a--linked" / "blobs").symlink_to(elsewhere / "real-blobs")  # blobs leads out
    with pytest.raises(errors.PathEscapeError):
        checkpoint.load(linked)
    # sf://: the root is the sf:// root, here the snapshots folder, and it stays that.
    in_sf = layout(tmp_path / "models--a--sf")
    monkeypatch.setenv("SFSTORE_ROOT", str(in_sf.parent))
    monkeypatch.delenv("SFSTORE_CONFIG", raising=False)
    with pytest.raises(errors.PathEscapeError):
        checkpoint.load("sf://rev")
    monkeypatch.setenv("SFSTORE_ROOT", str(in_sf.parent.parent))  # the repository as the sf:// root: beneath it
    _bits_equal(checkpoint.load("sf://snapshots/rev"), model.state_dict())
