"""The docs site builds with ``mkdocs build --strict`` (MkDocs Material, API pages from the docstrings) and loads
nothing from elsewhere (no web fonts, no analytics, no CDN)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDED = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _need_mkdocs() -> None:
    missing = [m for m in NEEDED if importlib.util.find_spec(m.split(".")[0]) is None
               or (m.count(".") and importlib.util.find_spec(m) is None)]
    if missing:
        why = f"the docs extra is not installed (missing {', '.join(missing)}): pip install '.[docs]'"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _need_mkdocs()
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-6000:]}\n{done.stderr[-10000:]}"
    return out


def test_site_builds_strict(site: Path) -> None:
    for page in ("index.html", "configuration/index.html", "vllm/index.html", "troubleshooting/index.html"):
        assert (site / page).is_file(), f"the site has no {page}"


@pytest.mark.parametrize(("page", "objects"), [
    # save and load share their names with submodules: docs/griffe_shadowed.py keeps the functions
    ("checkpoint", ["sfstore.checkpoint.save", "sfstore.checkpoint.load", "sfstore.checkpoint.latest",
                    "sfstore.checkpoint.dcp.StorageWriter", "sfstore.checkpoint.lightning.SfstoreCheckpointIO"]),
    ("kvcache", ["sfstore.kvcache.KVCacheStore.get_into", "sfstore.kvcache.KVGeometry"]),
    ("open", ["sfstore.router.open", "sfstore.router.Router"]),
    ("fs", ["sfstore.fs.SFFileSystem", "sfstore.fs.local_path"]),
    ("blocks", ["sfstore.blocks.BlockStore"]),
    ("defaults", ["sfstore.defaults.get", "sfstore.defaults.set"]),
    ("errors", ["sfstore.errors.SfstoreError", "sfstore.errors.PathExistsError"]),
])
def test_api_pages_come_from_the_docstrings(site: Path, page: str, objects: list[str]) -> None:
    html = (site / "api" / page / "index.html").read_text(encoding="utf-8")
    for name in objects:
        assert f'id="{name}"' in html, f"api/{page} does not document {name}"
    if page == "checkpoint":  # numpydoc sections rendered, with the parameters of save
        assert "Parameters:" in html and "overwrite" in html


def test_site_loads_nothing_from_elsewhere(site: Path) -> None:
    external = re.compile(r"""<(?:link|script|img)[^>]+(?:href|src)=["']https?://""", re.I)
    for page in site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        found = external.search(text)
        assert not found, f"{page.relative_to(site)} loads {found.group(0)!r}"
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text
