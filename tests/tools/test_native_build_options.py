"""The native helper's optional parts: built without io_uring (liburing) and without native checksums (xxhash.h),
the helper still builds, sfstore runs on it, and ``sfstore probe`` names both fallbacks.

A real build (CMake, the C++ compiler, nanobind), about a minute on two cores: ``SFSTORE_WITH_URING=OFF`` and
``SFSTORE_WITH_XXHASH=OFF`` compile the same sources as a machine without liburing-dev and libxxhash-dev does
(``SFSTORE_HAVE_LIBURING`` and ``SFSTORE_HAVE_XXHASH`` undefined). The helper lands in a copy of the package
in a temporary directory; nothing of the checkout's own build is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The venv's editable install of sfstore puts a finder first on sys.meta_path that maps ``sfstore`` to the checkout
# it was installed from; the copy under test is imported instead by leaving that finder out.
_RUN = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildInplaceFinder"]
sys.path.insert(0, sys.argv.pop(1))
sys.argv[0] = "sfstore"
runpy.run_module("sfstore.cli", run_name="__main__")
"""

_CHECK = """
import errno, mmap, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildInplaceFinder"]
sys.path.insert(0, sys.argv[1])
import sfstore, xxhash
from sfstore.engine import Request, get_engine
assert os.path.dirname(sfstore.__file__) == os.path.join(sys.argv[1], "sfstore"), sfstore.__file__
eng = get_engine("threads")
path = os.path.join(sys.argv[2], "f.bin")
data = os.urandom(1 << 16)
with open(path, "wb") as f:
    f.write(data)
fd = os.open(path, os.O_RDONLY)
buf = mmap.mmap(-1, len(data))
half = len(data) // 2
reqs = [Request.read(fd, 0, half, buf, 0), Request.read(fd, half, half, buf, half)]
sums = [xxhash.xxh3_64_intdigest(data[:half]), xxhash.xxh3_64_intdigest(data[half:]) ^ 1]
assert eng.submit(reqs, checksums=sums).results() == [half, -errno.EBADMSG]
assert bytes(buf) == data
print("READ-OK", eng.name)
"""


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: the native build cannot run here")
    return found


@pytest.fixture(scope="module")
def bare_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package whose native helper was built with both optional parts off."""
    cmake = _tool("cmake")
    _tool("c++")
    pytest.importorskip("nanobind", reason="nanobind (a build requirement) is not installed in this venv")
    work = tmp_path_factory.mktemp("bare-native")
    build = work / "build"
    configure = [cmake, "-S", str(REPO / "native"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython_EXECUTABLE={sys.executable}", "-DSFSTORE_WITH_URING=OFF", "-DSFSTORE_WITH_XXHASH=OFF"]
    p = subprocess.run(configure, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "io_uring backend turned off" in p.stdout and "native read checksums turned off" in p.stdout, p.stdout
    p = subprocess.run([cmake, "--build", str(build), "-j", str(min(2, os.cpu_count() or 1))],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = list(build.rglob(f"_native{suffix}"))
    assert len(built) == 1, list(build.rglob("_native*"))
    pkg = work / "pkg"
    shutil.copytree(REPO / "sfstore", pkg / "sfstore", ignore=shutil.ignore_patterns("_native*.so", "__pycache__"))
    shutil.copy2(built[0], pkg / "sfstore" / built[0].name)
    return pkg


def test_a_build_without_liburing_and_xxhash_runs_and_probe_names_both_fallbacks(
    bare_build: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFSTORE_")}
    env["SFSTORE_ROOT"] = str(tmp_path)
    p = subprocess.run([sys.executable, "-c", _RUN, str(bare_build), "probe", "--json"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.stdout, p.stderr[-4000:]
    engine = json.loads(p.stdout)["engine"]
    assert engine["status"] == "ok", engine
    assert engine["engines"]["uring"]["available"] is False
    assert "built without liburing" in engine["engines"]["uring"]["reason"], engine
    assert engine["engines"]["threads"]["available"] is True
    assert engine["selected"] == "threads", engine  # auto: the first engine that works, io_uring is not built
    assert engine["checksums"] == "caller", engine
    assert "built without xxhash.h" in engine["checksums_why"] and "libxxhash-dev" in engine["checksums_why"], engine
    # The threads engine of this build reads a file and checks its checksum (on the caller's thread).
    p = subprocess.run([sys.executable, "-c", _CHECK, str(bare_build), str(tmp_path)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0 and "READ-OK threads" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
