#!/usr/bin/env python3
"""Build the sfstore testbed guest and run ``tests/integration`` inside it over real RDMA.

The guest is Debian bookworm with Debian's stock kernel, booted under QEMU TCG (KVM on this kind of host
cannot boot that kernel). Inside it ``guest-init`` brings up soft-RoCE (``rxe0``), an NVMe-oF target on an
``rdma`` port and an NFS server exporting over ``rdma 20049`` with a ``proto=rdma`` mount, then runs pytest.

Scenarios (``--scenario``, default ``all``: one, then the other):

- ``single``: one guest runs ``tests/integration`` (the pytest args given) against its own endpoints.
- ``two-node``: two guests boot the same base image and payload with a role each on the kernel command line:
  node A, ``prefill``, is also the storage server (NFS over RDMA export, NVMe-oF target with one subsystem per
  node) and node B, ``decode``, mounts A's export over RDMA; each has its own soft-RoCE device on its one NIC,
  and the two NICs are joined by QEMU's UDP socket netdev on the host's loopback (a network with nothing else
  on it). Both run ``tests/integration/test_two_nodes.py``, each its role's half of every test, meeting at a
  coordinator on node A; the steps' timings come back as stages of the summary.

Caching (``.testbed/`` in the repository, or ``$SFSTORE_TESTBED_DIR``):

- ``base-<hash>/``: root image, uncompressed kernel, busybox initramfs. ``<hash>`` covers ``base.toml`` and
  ``initramfs-init``; it is rebuilt only when they change (or with ``--rebuild``). The guest boots it with
  ``snapshot=on``, so runs never modify it.
- ``debs/``: debootstrap's package cache, kept across base rebuilds.
- ``run/``: this run's payload disk (sfstore wheel, ``tests/``, ``guest-init``, settings) and console logs
  (``console.log``, ``console-prefill.log``, ``console-decode.log``), made anew on every run.

Usage: ``tools/testbed/run [testbed options] [--] [pytest args]`` (see ``--help``). The exit status is
pytest's inside the guests (the first scenario's that failed), or one of :data:`EXIT_CODES` when no pytest
result came back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import lzma
import os
import queue
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import tomllib

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RECIPE = HERE / "base.toml"
INITRAMFS_INIT = HERE / "initramfs-init"
GUEST_INIT = HERE / "guest-init"

EXIT_SETUP_FAILED = 1  # pytest passed but a guest setup stage failed
EXIT_BUILD_FAILED = 10  # the guest could not be built (a download or a build step failed)
EXIT_NO_RESULT = 11  # the guest stopped without reporting a pytest result
EXIT_TIMEOUT = 124  # the guest was killed at the timeout
EXIT_CODES = {
    EXIT_SETUP_FAILED: "pytest passed but a guest setup stage failed",
    EXIT_BUILD_FAILED: "the guest image could not be built",
    EXIT_NO_RESULT: "the guest stopped without a pytest result",
    EXIT_TIMEOUT: "the guest was killed at the timeout",
}

# Host commands the testbed needs, and the Debian package that brings each.
HOST_TOOLS = {
    "qemu-system-x86_64": "qemu-system-x86",
    "debootstrap": "debootstrap",
    "cpio": "cpio",
    "mkfs.ext4": "e2fsprogs",
    "dpkg-deb": "dpkg",
    "chroot": "coreutils",
}
GUEST_PYTHON = "3.11"  # Debian bookworm's python3: the wheel is built for it
BUSYBOX = Path("/bin/busybox")  # busybox-static: the initramfs and the guest's poweroff use it

# Guest network and endpoints (qemu user networking: the NIC gets 10.0.2.15; restrict=on keeps the guest off
# the host's network, so every RDMA, NVMe and NFS packet stays inside the guest).
GUEST_SETTINGS = {
    "IP": "10.0.2.15",
    "RDMA_DEVICE": "rxe0",
    "NQN": "nqn.2024-01.io.sfstore:testbed",
    "NVME_PORT": "4420",
    "NVME_SIZE": os.environ.get("SFSTORE_TESTBED_NVME_SIZE", "256M"),
    "NFS_EXPORT": "/export",
    "NFS_MOUNT": "/mnt/nfs",
    "NFS_PORT": "20049",
    # the two-node scenario: node A (prefill) serves NFS and NVMe-oF on its NIC, one NVMe-oF subsystem per node;
    # the tests' coordinator (a torch TCPStore, also gloo's rendezvous) listens on node A
    "PREFILL_IP": "10.0.3.1",
    "DECODE_IP": "10.0.3.2",
    "NQN_PREFILL": "nqn.2024-01.io.sfstore:prefill",
    "NQN_DECODE": "nqn.2024-01.io.sfstore:decode",
    "TWO_NODE_NVME_SIZE": "64M",
    "COORD_PORT": "29500",
}
# What both guests of the two-node scenario run (each its own role's half of every test).
TWO_NODE_PYTEST_ARGS = ["tests/integration/test_two_nodes.py", "-v", "-p", "no:randomly"]
SCENARIOS = ("all", "single", "two-node")

STAGE_BEGIN = re.compile(r"SFSTORE-STAGE-BEGIN (\S+)")
STAGE_END = re.compile(r"SFSTORE-STAGE-END (\S+) (-?\d+) ([\d.]+)(?: (.*))?")
SETUP_FAILED = re.compile(r"SFSTORE-SETUP-FAILED (\S+)")
PYTEST_EXIT = re.compile(r"SFSTORE-PYTEST-EXIT=(-?\d+)")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1bc")
BOOT_FAILED = re.compile(r"SFSTORE-TESTBED-BOOT-FAILED: (.*)|Kernel panic - not syncing: (.*)")


class TestbedError(Exception):
    """A testbed step failed; the message says which and what to look at."""

    __test__ = False  # not a pytest test class


class FetchError(TestbedError):
    """A download failed after every retry."""


@dataclass
class Options:
    """Settings of one run (from the command line, else ``SFSTORE_TESTBED_*`` variables, else defaults)."""

    cache_dir: Path
    timeout: float
    cpus: int
    memory: str
    mirror: str
    python: str
    rebuild: bool = False
    build_only: bool = False
    require_wheel: bool = False
    scenario: str = "all"
    pytest_args: list[str] = field(default_factory=list)


@dataclass
class Stage:
    """A timed step of the run."""

    name: str
    seconds: float
    note: str = ""


class Timer:
    """Prints what each stage does and keeps its duration for the summary."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.stages: list[Stage] = []

    @contextlib.contextmanager
    def stage(self, name: str, what: str) -> Iterator[Stage]:
        """Time a host stage; the yielded :class:`Stage` may get a ``note`` for the summary."""
        say(f"{name}: {what}")
        entry = Stage(name, 0.0)
        t0 = time.monotonic()
        ok = False
        try:
            yield entry
            ok = True
        finally:
            entry.seconds = time.monotonic() - t0
            if not ok:
                entry.note = (entry.note + " " if entry.note else "") + "FAILED"
            self.stages.append(entry)
            say(f"{name}: {'done' if ok else 'FAILED'} after {entry.seconds:.1f}s"
                + (f" ({entry.note})" if entry.note and ok else ""))

    def add(self, name: str, seconds: float, note: str = "") -> None:
        """Record a stage timed elsewhere (the guest's stages)."""
        self.stages.append(Stage(name, seconds, note))

    def summary(self) -> str:
        """A table of every stage and the total."""
        width = max([len(s.name) for s in self.stages] + [5])
        lines = ["stage timings:"]
        lines += [f"  {s.name:<{width}}  {s.seconds:7.1f}s  {s.note}".rstrip() for s in self.stages]
        lines.append(f"  {'total':<{width}}  {time.monotonic() - self.start:7.1f}s")
        return "\n".join(lines)


def say(message: str) -> None:
    """Print a line of the testbed's own (as opposed to the guest's) output."""
    print(f"[testbed {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: Sequence[str | Path], log: TextIO | None = None, **kwargs: Any) -> None:
    """Run ``cmd``, its output going to ``log`` (or inherited); raise :class:`TestbedError` on failure."""
    argv = [str(c) for c in cmd]
    if argv[0] == "chroot" and "env" not in kwargs:
        # the host's pip settings (index, find-links, constraints) mean nothing inside the guest root
        kwargs["env"] = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    if log is not None:
        log.write(f"\n$ {shlex.join(argv)}\n")
        log.flush()
    result = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT if log else None, check=False, **kwargs)
    if result.returncode != 0:
        raise TestbedError(f"command failed with exit status {result.returncode}: {shlex.join(argv)}")


def fetch(what: str, cmd: Sequence[str | Path], log: TextIO, tries: int = 3, before_retry: Any = None,
          **kwargs: Any) -> None:
    """Run a download command, retrying; raise :class:`FetchError` naming ``what`` after the last try."""
    for attempt in range(1, tries + 1):
        try:
            run(cmd, log, **kwargs)
            return
        except TestbedError as exc:
            if attempt == tries:
                raise FetchError(f"could not fetch {what} after {tries} tries ({exc})") from None
            delay = 5 * attempt
            say(f"fetching {what} failed (try {attempt} of {tries}); retrying in {delay}s")
            time.sleep(delay)
            if before_retry is not None:
                before_retry()


def default_mirror() -> str:
    """The Debian mirror: ``$SFSTORE_TESTBED_MIRROR``, else the host's own apt source."""
    env = os.environ.get("SFSTORE_TESTBED_MIRROR")
    if env:
        return env
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in line:
                return parts[1]
    raise SystemExit("testbed: no Debian mirror found in the host's apt sources; set SFSTORE_TESTBED_MIRROR")


def default_python() -> str:
    """The host Python that builds the wheels: the repository's venv if there is one, else this one."""
    venv = REPO / ".venv" / "bin" / "python"
    return os.environ.get("SFSTORE_TESTBED_PYTHON") or (str(venv) if venv.exists() else sys.executable)


USAGE = """usage: tools/testbed/run [testbed options] [--] [pytest args]

Build (once, cached) and boot the sfstore testbed guest and run pytest tests/integration in it; then boot two
guests, node A (prefill, also the NFS and NVMe-oF server) and node B (decode), on a network of their own, and
run tests/integration/test_two_nodes.py on both (each node its half of every test).
pytest args that name no path under tests/ run tests/integration with those options (e.g. -k probe -x); they
apply to the single-node run only.

testbed options (each also read from the variable shown):
  --rebuild          rebuild the cached base image even if its recipe did not change
  --build-only       build the base image, wheel and payload, but do not boot
  --require-wheel    fail when sfstore's wheel does not build (SFSTORE_TESTBED_REQUIRE_WHEEL=1); without it
                     the guest falls back to the pure-Python source tree, with a warning
  --scenario NAME    all (the default: single, then two-node), single or two-node (SFSTORE_TESTBED_SCENARIO)
  --timeout SECONDS  kill the guests of a scenario after this long (SFSTORE_TESTBED_TIMEOUT, default 1200)
  --cpus N           CPUs of each guest (SFSTORE_TESTBED_CPUS, default 2)
  --memory SIZE      memory of each guest (SFSTORE_TESTBED_MEMORY, default 2G)
  --dir PATH         cache folder (SFSTORE_TESTBED_DIR, default .testbed in the repository)
  -h, --help         show this and exit
other variables: SFSTORE_TESTBED_MIRROR (Debian mirror), SFSTORE_TESTBED_PYTHON (host Python building the
wheels), SFSTORE_TESTBED_NVME_SIZE (NVMe-oF namespace size, default 256M).
exit status: pytest's in the guest, else """ + ", ".join(f"{k} ({v})" for k, v in EXIT_CODES.items())


def parse_args(argv: Sequence[str]) -> Options:
    """Split ``argv`` into testbed options (leading) and pytest arguments (the rest)."""
    env = os.environ
    opts = Options(
        cache_dir=Path(env.get("SFSTORE_TESTBED_DIR") or REPO / ".testbed"),
        timeout=float(env.get("SFSTORE_TESTBED_TIMEOUT") or 1200),
        cpus=int(env.get("SFSTORE_TESTBED_CPUS") or 2),
        memory=env.get("SFSTORE_TESTBED_MEMORY") or "2G",
        mirror=default_mirror(),
        python=default_python(),
        require_wheel=env.get("SFSTORE_TESTBED_REQUIRE_WHEEL", "") not in ("", "0"),
        scenario=env.get("SFSTORE_TESTBED_SCENARIO") or "all",
    )
    args = list(argv)
    valued = {"--timeout", "--cpus", "--memory", "--dir", "--scenario"}
    while args:
        arg = args[0]
        if arg in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        if arg == "--":
            args.pop(0)
            break
        if arg == "--rebuild":
            opts.rebuild = True
        elif arg == "--build-only":
            opts.build_only = True
        elif arg == "--require-wheel":
            opts.require_wheel = True
        elif arg.split("=", 1)[0] in valued:
            name, _, value = arg.partition("=")
            if not value:
                if len(args) < 2:
                    raise SystemExit(f"testbed: {name} needs a value")
                value = args.pop(1)
            if name == "--timeout":
                opts.timeout = float(value)
            elif name == "--cpus":
                opts.cpus = int(value)
            elif name == "--memory":
                opts.memory = value
            elif name == "--scenario":
                opts.scenario = value
            else:
                opts.cache_dir = Path(value)
        else:
            break
        args.pop(0)
    if not any(a.startswith("tests/") or a.startswith("tests" + os.sep) or a == "tests" for a in args):
        args.insert(0, "tests/integration")
    opts.pytest_args = args
    opts.cache_dir = opts.cache_dir.resolve()
    if opts.scenario not in SCENARIOS:
        raise SystemExit(f"testbed: --scenario must be one of {', '.join(SCENARIOS)}, not {opts.scenario!r}")
    return opts


# ---------------------------------------------------------------------------------------------------------
# host prerequisites


def ensure_host_tools(log_path: Path) -> str:
    """Install missing host tools with apt-get (as root); return a note on what was done."""
    missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if shutil.which(tool) is None})
    if not BUSYBOX.exists():
        missing.append("busybox-static")
    if not missing:
        return "all present"
    if os.geteuid() != 0:
        raise TestbedError(f"missing host packages {', '.join(missing)}; install them (apt-get install -y ...)")
    with log_path.open("a") as log:
        fetch("the Debian package lists (apt-get update)", ["apt-get", "update"], log)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        fetch(f"host packages {', '.join(missing)}", ["apt-get", "install", "-y", *missing], log, env=env)
    return "installed " + ", ".join(missing)


# ---------------------------------------------------------------------------------------------------------
# base image


def recipe_hash() -> str:
    """Hash of everything the base image is built from: the recipe's settings (not its comments) and the
    initramfs init."""
    digest = hashlib.sha256()
    digest.update(json.dumps(load_recipe(), sort_keys=True).encode() + b"\0")
    digest.update(INITRAMFS_INIT.read_bytes())
    return digest.hexdigest()[:16]


def load_recipe() -> dict[str, Any]:
    """The base image recipe (``base.toml``)."""
    with RECIPE.open("rb") as f:
        return tomllib.load(f)


@contextlib.contextmanager
def proc_mounted(root: Path) -> Iterator[None]:
    """Mount /proc (and bind /dev) inside the chroot ``root`` for the duration."""
    mounted: list[Path] = []
    try:
        for kind, target in (("proc", root / "proc"), ("dev", root / "dev")):
            target.mkdir(exist_ok=True)
            cmd: list[str | Path] = ["mount", "-t", "proc", "proc", target] if kind == "proc" else [
                "mount", "--bind", "/dev", target]
            run(cmd)
            mounted.append(target)
        yield
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=False)


def pip_platform_args() -> list[str]:
    """pip download flags selecting CPython 3.11 wheels for bookworm's glibc 2.36."""
    flags = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"]
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)]
    platforms += ["manylinux2014_x86_64", "linux_x86_64"]
    for plat in platforms:
        flags += ["--platform", plat]
    return flags


def build_base(opts: Options, recipe: dict[str, Any], digest: str, log: TextIO, timer: Timer) -> Path:
    """Build the base image into ``base-<digest>/`` and return that folder."""
    if os.geteuid() != 0:
        raise TestbedError("building the base image needs root (debootstrap, chroot, mount)")
    final = opts.cache_dir / f"base-{digest}"
    work = opts.cache_dir / f"base-{digest}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root, kroot = work / "rootfs", work / "kroot"
    debs = opts.cache_dir / "debs"
    debs.mkdir(exist_ok=True)

    with timer.stage("base: debootstrap", f"Debian {recipe['suite']} {recipe['variant']} from {opts.mirror}"):
        cmd = ["debootstrap", f"--variant={recipe['variant']}", f"--cache-dir={debs}",
               "--include=" + ",".join(recipe["packages"]), recipe["suite"], root, opts.mirror]
        fetch(f"the guest's Debian packages (debootstrap {recipe['suite']} from {opts.mirror})", cmd, log,
              before_retry=lambda: shutil.rmtree(root, ignore_errors=True))

    with timer.stage("base: kernel", "Debian's stock kernel package") as st, proc_mounted(root):
        shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
        fetch("the Debian package lists in the guest root (apt-get update)", ["chroot", root, "apt-get", "update"],
              log)
        meta = recipe["kernel_meta_package"]
        out = subprocess.run(["chroot", str(root), "apt-cache", "depends", meta], capture_output=True, text=True,
                             check=False).stdout
        match = re.search(r"Depends: (linux-image-\S+)", out)
        if not match:
            raise TestbedError(f"cannot tell which kernel package {meta} depends on (apt-cache said: {out!r})")
        package = match.group(1)
        (root / "tmp" / "kernel").mkdir(parents=True, exist_ok=True)
        fetch(f"the kernel package {package}", ["chroot", root, "sh", "-c",
                                                f"cd /tmp/kernel && apt-get download {package}"], log)
        deb = next((root / "tmp" / "kernel").glob("*.deb"))
        run(["dpkg-deb", "-x", deb, kroot], log)
        kernel_version = sorted(p.name for p in (kroot / "lib" / "modules").iterdir())[0]
        st.note = f"{package}, {kernel_version}"

    with timer.stage("base: python packages", " ".join(recipe["python_packages"])), proc_mounted(root):
        wheels = work / "wheels"
        fetch(f"Python wheels {' '.join(recipe['python_packages'])} from PyPI",
              [opts.python, "-m", "pip", "download", "--quiet", *pip_platform_args(), "-d", wheels,
               *recipe["python_packages"]], log)
        shutil.copytree(wheels, root / "tmp" / "wheels")
        run(["chroot", root, "python3", "-m", "pip", "install", "--no-index", "--find-links", "/tmp/wheels",
             "--break-system-packages", "--root-user-action=ignore", "--no-warn-script-location",
             *recipe["python_packages"]], log)

    with timer.stage("base: modules", f"kernel modules and initramfs of {kernel_version}"):
        modules = root / "lib" / "modules"
        modules.mkdir(parents=True, exist_ok=True)
        excludes = [f"--exclude={kernel_version}/kernel/{tree}" for tree in recipe["exclude_module_trees"]]
        tar = subprocess.Popen(["tar", "-C", str(kroot / "lib" / "modules"), "-cf", "-", *excludes, kernel_version],
                               stdout=subprocess.PIPE)
        run(["tar", "-C", modules, "-xf", "-"], log, stdin=tar.stdout)
        if tar.wait() != 0:
            raise TestbedError("copying the kernel modules failed")
        run(["chroot", root, "depmod", kernel_version], log)
        shutil.copy(BUSYBOX, root / "bin" / "busybox")
        (root / "payload").mkdir(exist_ok=True)
        for junk in ("tmp/kernel", "tmp/wheels", "etc/resolv.conf"):
            path = root / junk
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        run(["chroot", root, "apt-get", "clean"], log)
        for lists in (root / "var" / "lib" / "apt" / "lists").glob("*_*"):
            lists.unlink()
        build_initramfs(kroot / "lib" / "modules" / kernel_version, recipe["initramfs_modules"],
                        work / "initramfs.cpio.gz", log)
        extract_vmlinux(kroot / "boot" / f"vmlinuz-{kernel_version}", work / "vmlinux")

    with timer.stage("base: image", f"ext4 root image ({recipe['image_size']}, sparse)"):
        run(["mkfs.ext4", "-q", "-F", "-L", "sfstore-root", "-d", root, work / "rootfs.img", recipe["image_size"]],
            log)
        shutil.rmtree(root)
        shutil.rmtree(kroot)
        shutil.rmtree(work / "wheels", ignore_errors=True)
        info = {"hash": digest, "kernel": kernel_version, "built": time.strftime("%Y-%m-%d %H:%M:%S"),
                "recipe": recipe}
        (work / "base.json").write_text(json.dumps(info, indent=2) + "\n")

    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    for old in opts.cache_dir.glob("base-*"):
        if old.is_dir() and old != final:  # an older recipe's image
            shutil.rmtree(old, ignore_errors=True)
    return final


def build_initramfs(module_dir: Path, modules: Sequence[str], out: Path, log: TextIO) -> None:
    """Write a busybox initramfs that loads ``modules`` and runs ``initramfs-init``."""
    tree = out.parent / "initramfs"
    shutil.rmtree(tree, ignore_errors=True)
    for sub in ("bin", "mod", "proc", "sys", "dev", "newroot"):
        (tree / sub).mkdir(parents=True)
    shutil.copy(BUSYBOX, tree / "bin" / "busybox")
    for name in modules:
        found = sorted(module_dir.rglob(f"{name}.ko*"))
        if not found:
            raise TestbedError(f"initramfs module {name} is not in {module_dir}")
        ko = found[0]
        data = ko.read_bytes()
        if ko.suffix == ".xz":
            data = lzma.decompress(data)
        (tree / "mod" / f"{name}.ko").write_bytes(data)
    init = INITRAMFS_INIT.read_text().replace("@MODULES@", " ".join(modules))
    (tree / "init").write_text(init)
    (tree / "init").chmod(0o755)
    with out.open("wb") as f:
        find = subprocess.Popen(["find", "."], cwd=tree, stdout=subprocess.PIPE)
        cpio = subprocess.Popen(["cpio", "-o", "-H", "newc", "--quiet"], cwd=tree, stdin=find.stdout,
                                stdout=subprocess.PIPE, stderr=log)
        gz = subprocess.run(["gzip", "-1"], stdin=cpio.stdout, stdout=f, check=False)
        if find.wait() or cpio.wait() or gz.returncode:
            raise TestbedError("building the initramfs failed")
    shutil.rmtree(tree)


def extract_vmlinux(vmlinuz: Path, out: Path) -> None:
    """Write the uncompressed (PVH-bootable) kernel: TCG then skips decompressing it at every boot."""
    data = vmlinuz.read_bytes()
    start = data.find(b"\xfd7zXZ\x00")
    if start < 0:  # not xz-compressed: boot the bzImage as it is
        shutil.copy(vmlinuz, out)
        return
    out.write_bytes(lzma.LZMADecompressor().decompress(data[start:]))


def ensure_base(opts: Options, timer: Timer) -> Path:
    """Return the cached base folder, building it first when its recipe changed or ``--rebuild`` asks."""
    digest = recipe_hash()
    base = opts.cache_dir / f"base-{digest}"
    ready = all((base / name).exists() for name in ("rootfs.img", "vmlinux", "initramfs.cpio.gz", "base.json"))
    if ready and not opts.rebuild:
        kernel = json.loads((base / "base.json").read_text())["kernel"]
        timer.add("base image", 0.0, f"cached {base.name}, kernel {kernel}")
        say(f"base image: cached {base} (kernel {kernel})")
        return base
    log_path = opts.cache_dir / "base-build.log"
    say(f"base image: building {base.name} (recipe changed or not built yet); log: {log_path}")
    with log_path.open("w") as log:
        try:
            return build_base(opts, load_recipe(), digest, log, timer)
        except TestbedError:
            log.flush()
            shutil.rmtree(opts.cache_dir / f"base-{digest}.partial", ignore_errors=True)
            tail = log_path.read_text(errors="replace").splitlines()[-30:]
            say("base image build failed; last lines of its log:\n    " + "\n    ".join(tail))
            raise


# ---------------------------------------------------------------------------------------------------------
# per-run payload


def build_wheel(opts: Options, out: Path, log: TextIO) -> str:
    """Build sfstore's wheel into ``out``; on failure return a note (the guest then uses the source tree)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    version = subprocess.run([opts.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=False).stdout.strip()
    if version != GUEST_PYTHON:
        return (f"FAILED ({opts.python} is Python {version or '?'}, the guest's is {GUEST_PYTHON}: set "
                "SFSTORE_TESTBED_PYTHON to a 3.11); the guest runs the pure-Python source tree")
    have_backend = subprocess.run([opts.python, "-c", "import scikit_build_core, nanobind"],
                                  capture_output=True, check=False).returncode == 0
    # With the build backend at hand, build without isolation: no downloads, and the CMake build folder
    # (build/{wheel_tag}) is reused, so a warm wheel build only relinks what changed.
    cmd: list[str | Path] = [opts.python, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-w", out,
           *(["--no-build-isolation"] if have_backend else []), REPO]
    try:
        run(cmd, log)
    except TestbedError as exc:
        return f"FAILED ({exc}); the guest runs the pure-Python source tree"
    wheels = sorted(out.glob("sfstore-*.whl"))
    if not wheels:
        return "FAILED (pip made no sfstore wheel); the guest runs the pure-Python source tree"
    return wheels[0].name


def build_payload(opts: Options, wheels: Path, run_dir: Path) -> Path:
    """Write this run's payload disk: guest-init, settings, pytest args, the wheel, tests/ and pyproject."""
    tree = run_dir / "payload"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    shutil.copy(GUEST_INIT, tree / "guest-init")
    (tree / "guest-init").chmod(0o755)
    (tree / "testbed.env").write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in GUEST_SETTINGS.items()))
    (tree / "pytest-args").write_bytes(b"".join(a.encode() + b"\0" for a in opts.pytest_args))
    (tree / "pytest-args-two-node").write_bytes(b"".join(a.encode() + b"\0" for a in TWO_NODE_PYTEST_ARGS))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    if any(wheels.glob("sfstore-*.whl")):
        shutil.copytree(wheels, tree / "wheels")
    else:
        shutil.copytree(REPO / "sfstore", tree / "src" / "sfstore", ignore=ignore)
    (tree / "work").mkdir()
    shutil.copytree(REPO / "tests", tree / "work" / "tests", ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", tree / "work" / "pyproject.toml")
    size = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
    image = run_dir / "payload.img"
    image.unlink(missing_ok=True)
    mib = max(64, 2 * size // (1 << 20) + 32)
    with (run_dir / "payload.log").open("w") as log:
        run(["mkfs.ext4", "-q", "-F", "-L", "sfstore-payload", "-d", tree, image, f"{mib}M"], log)
    return image


# ---------------------------------------------------------------------------------------------------------
# boot and watch the guest


@dataclass
class GuestResult:
    """What a guest's console said."""

    pytest_exit: int | None = None
    setup_failed: list[str] = field(default_factory=list)
    boot_failure: str | None = None
    stages: dict[str, tuple[float, str]] = field(default_factory=dict)
    first_marker: float | None = None
    last_stage: str = "boot"
    seconds: float = 0.0
    killed: str = ""


@dataclass
class Guest:
    """One QEMU guest of a scenario: its name in the summary and the console, role and network."""

    name: str
    role: str  # guest-init's sfstore.role: single, prefill, decode
    netdev: str  # QEMU -netdev value (id n0)
    mac: str = "52:54:00:12:34:56"


def qemu_command(opts: Options, base: Path, payload: Path, guest: Guest | None = None) -> list[str]:
    """The QEMU command line booting the base image (read-only, snapshot) with the payload disk."""
    guest = guest or single_guest()
    return [
        "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max",
        "-m", opts.memory, "-smp", str(opts.cpus), "-nographic", "-no-reboot",
        "-kernel", str(base / "vmlinux"), "-initrd", str(base / "initramfs.cpio.gz"),
        "-drive", f"file={base / 'rootfs.img'},if=virtio,format=raw,snapshot=on,cache=unsafe",
        "-drive", f"file={payload},if=virtio,format=raw,readonly=on",
        "-netdev", guest.netdev, "-device", f"virtio-net-pci,netdev=n0,mac={guest.mac}",
        "-append", f"console=ttyS0 panic=-1 loglevel=4 quiet sfstore.role={guest.role}",
    ]


def single_guest() -> Guest:
    """The one-guest scenario: qemu user networking (the NIC gets 10.0.2.15), restricted to the guest."""
    return Guest("guest", "single", "user,id=n0,restrict=on")


def free_udp_ports(count: int) -> list[int]:
    """``count`` distinct UDP ports of 127.0.0.1 free right now."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def two_node_guests() -> list[Guest]:
    """The two-node scenario: node A (prefill, NFS and NVMe-oF server too) and node B (decode), each with one NIC
    on a network of their own (QEMU's socket netdev over UDP on the host's loopback: one guest's frames are the
    other's, and nothing else is on it)."""
    a, b = free_udp_ports(2)
    return [
        Guest("prefill", "prefill", f"socket,id=n0,udp=127.0.0.1:{b},localaddr=127.0.0.1:{a}", "52:54:00:5f:00:01"),
        Guest("decode", "decode", f"socket,id=n0,udp=127.0.0.1:{a},localaddr=127.0.0.1:{b}", "52:54:00:5f:00:02"),
    ]


def watch_console(line: str, result: GuestResult, t0: float) -> None:
    """Update ``result`` from one console line."""
    if m := STAGE_BEGIN.search(line):
        if result.first_marker is None:
            result.first_marker = time.monotonic() - t0
        result.last_stage = m.group(1)
    elif m := STAGE_END.search(line):
        result.stages[m.group(1)] = (float(m.group(3)), (m.group(4) or "").strip())
    elif m := SETUP_FAILED.search(line):
        result.setup_failed.append(m.group(1))
    elif m := PYTEST_EXIT.search(line):
        result.pytest_exit = int(m.group(1))
    elif m := BOOT_FAILED.search(line):
        result.boot_failure = (m.group(1) or m.group(2) or "").strip()


# A guest whose peer stopped gets this long to finish on its own before it is killed (node B waits on node A's
# NFS server; node A on node B's tests).
PEER_GRACE_S = 90.0


def boot(opts: Options, base: Path, payload: Path, run_dir: Path, timer: Timer,
         guests: Sequence[Guest] | None = None) -> dict[str, GuestResult]:
    """Boot the guests together, stream their consoles, and return what each reported (killing them at the
    timeout, and one whose peer stopped after :data:`PEER_GRACE_S`)."""
    guests = list(guests or [single_guest()])
    env = dict(os.environ, TMPDIR=str(run_dir))  # qemu's snapshot overlays go here
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    results = {g.name: GuestResult() for g in guests}
    width = max(len(g.name) for g in guests)
    t0 = time.monotonic()
    for g in guests:
        cmd = qemu_command(opts, base, payload, g)
        say(f"boot {g.name}: {shlex.join(cmd)}")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env)
        procs[g.name] = proc

        def reader(name: str = g.name, out: Any = proc.stdout) -> None:
            for raw in out:
                lines.put((name, raw.decode("utf-8", "replace").rstrip("\r\n").replace("\r", "")))
            lines.put((name, None))

        threading.Thread(target=reader, daemon=True).start()
    say(f"boot: console logs {run_dir}/console*.log; timeout {opts.timeout:.0f}s")
    timed_out = False
    running = {g.name for g in guests}
    first_stop: float | None = None
    plain = not sys.stdout.isatty()  # logs (CI) get no terminal escapes from the BIOS or pytest's colours
    consoles = {g.name: (run_dir / ("console.log" if len(guests) == 1 else f"console-{g.name}.log")).open("w")
                for g in guests}
    try:
        while running:
            now = time.monotonic()
            remaining = opts.timeout - (now - t0)
            if remaining <= 0:
                timed_out = True
                break
            if first_stop is not None and now - first_stop > PEER_GRACE_S:
                for name in sorted(running):
                    procs[name].kill()
                    results[name].killed = f"killed {PEER_GRACE_S:.0f}s after its peer stopped"
                    say(f"{name}: still running {PEER_GRACE_S:.0f}s after its peer stopped; killed it")
                first_stop = None
            try:
                name, line = lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                running.discard(name)
                results[name].seconds = time.monotonic() - t0
                first_stop = first_stop or time.monotonic()
                continue
            consoles[name].write(line + "\n")
            prefix = "  | " if len(guests) == 1 else f"  {name:<{width}} | "
            print(f"{prefix}{ANSI.sub('', line) if plain else line}", flush=True)
            watch_console(line, results[name], t0)
    finally:
        for f in consoles.values():
            f.close()
    if timed_out:
        for name in sorted(running):
            procs[name].kill()
            say(f"TIMEOUT: {name} did not finish within {opts.timeout:.0f}s (last stage: "
                f"{results[name].last_stage}); killed it")
    for name, proc in procs.items():
        proc.wait()
        if not results[name].seconds:
            results[name].seconds = time.monotonic() - t0
    for g in guests:
        r = results[g.name]
        boot_s = r.first_marker if r.first_marker is not None else r.seconds
        timer.add(f"{g.name}: boot", boot_s, "qemu start to guest-init")
        for stage, (seconds, note) in r.stages.items():
            timer.add(f"{g.name}: {stage}", seconds, note)
        timer.add(f"{g.name}: total", r.seconds, "qemu start to power-off" + (
            " (killed at timeout)" if timed_out and g.name in running else f" ({r.killed})" if r.killed else ""))
        if timed_out and g.name in running:
            r.pytest_exit = None
            r.boot_failure = "timeout"
    return results


def verdict(scenario: str, results: dict[str, GuestResult], run_dir: Path, timeout: float) -> int:
    """The exit status of one scenario from its guests' results (the first failing guest's), saying why."""
    for name, r in results.items():
        if r.boot_failure == "timeout":
            say(f"FAILED ({scenario}): {name} was killed after {timeout:.0f}s in stage {r.last_stage}")
            return EXIT_TIMEOUT
        if r.pytest_exit is None:
            why = r.boot_failure or r.killed or "it stopped without printing SFSTORE-PYTEST-EXIT"
            say(f"FAILED ({scenario}): no pytest result from {name}: {why}. Console logs in {run_dir}")
            return EXIT_NO_RESULT
    for name, r in results.items():
        if r.setup_failed:
            say(f"{scenario}: {name}'s setup failed in: {', '.join(r.setup_failed)} (see its console log)")
            if r.pytest_exit == 0:
                return EXIT_SETUP_FAILED
    for name, r in results.items():
        say(f"{scenario}: pytest in {name} exited with {r.pytest_exit}")
    return next((r.pytest_exit for r in results.values() if r.pytest_exit), 0)


# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(cache_dir: Path) -> Iterator[None]:
    """Hold the cache folder's lock so two runs do not build or boot from it at once."""
    with (cache_dir / "lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another testbed run holding {cache_dir / 'lock'}")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tools/testbed/run``; returns the exit status."""
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    opts.cache_dir.mkdir(parents=True, exist_ok=True)
    timer = Timer()
    run_dir = opts.cache_dir / "run"
    with locked(opts.cache_dir):
        try:
            with timer.stage("host tools", "checking qemu, debootstrap, busybox, cpio, mkfs.ext4") as st:
                st.note = ensure_host_tools(opts.cache_dir / "host-tools.log")
            base = ensure_base(opts, timer)
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir()
            with timer.stage("wheel", f"building sfstore's wheel with {opts.python}") as st, \
                    (run_dir / "wheel.log").open("w") as log:
                st.note = build_wheel(opts, run_dir / "wheels", log)
                if st.note.startswith("FAILED"):
                    if opts.require_wheel:
                        raise TestbedError(f"sfstore's wheel did not build (--require-wheel): {st.note}; "
                                           f"log: {run_dir / 'wheel.log'}")
                    say(f"WARNING: sfstore wheel {st.note}; log: {run_dir / 'wheel.log'}")
            with timer.stage("payload", "payload disk: wheel, tests/, guest-init, settings"):
                payload = build_payload(opts, run_dir / "wheels", run_dir)
        except TestbedError as exc:
            say(f"FAILED: {exc}")
            print(timer.summary(), flush=True)
            return EXIT_BUILD_FAILED
        if opts.build_only:
            say(f"built; not booting (--build-only). Base {base}, payload {payload}")
            print(timer.summary(), flush=True)
            return 0
        runs: list[tuple[str, dict[str, GuestResult]]] = []
        if opts.scenario in ("all", "single"):
            say(f"single-node scenario: running pytest {shlex.join(opts.pytest_args)}")
            runs.append(("single-node", boot(opts, base, payload, run_dir, timer)))
        if opts.scenario in ("all", "two-node"):
            say(f"two-node scenario: prefill and decode guests running pytest {shlex.join(TWO_NODE_PYTEST_ARGS)}")
            runs.append(("two-node", boot(opts, base, payload, run_dir, timer, two_node_guests())))
    print(timer.summary(), flush=True)
    codes = [verdict(name, results, run_dir, opts.timeout) for name, results in runs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
