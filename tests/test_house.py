"""House rules that the code itself can check: no module reaches into another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "sfstore"
# The native helper is private to the package as a whole (sfstore._native plus its .pyi): its users are sfstore's
# own modules, through the thin wrappers the paths, buffers and checksums hold.
PACKAGE_PRIVATE = {"sfstore._native"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return module
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _violations(path: Path) -> list[str]:
    current = _module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> sfstore module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(node.module or "", node.level, current, is_package)
            if not mod.startswith("sfstore"):
                continue
            for a in node.names:
                target = f"{mod}.{a.name}"
                if _private(a.name) and target not in PACKAGE_PRIVATE and mod != current:
                    found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: from {mod} import {a.name}")
                aliases[a.asname or a.name] = target
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("sfstore"):
                    if any(_private(p) for p in a.name.split(".")) and a.name not in PACKAGE_PRIVATE:
                        found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: import {a.name}")
                    if a.asname:  # import sfstore.a.b as x: x is sfstore.a.b
                        aliases[a.asname] = a.name
                    else:  # import sfstore.a.b: the name bound is sfstore
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
            owner = aliases.get(node.value.id)
            if owner is None or owner == current or f"{owner}.{node.attr}" in PACKAGE_PRIVATE:
                continue
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value.id}.{node.attr} (from {owner})")
    return found


def test_no_module_imports_another_modules_underscore_names() -> None:
    found = [v for path in sorted(ROOT.rglob("*.py")) for v in _violations(path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from sfstore.paths.file import _helper\n", 1),
    ("from sfstore import fs\nfs._strip_protocol('x')\n", 1),
    ("from sfstore import _native\n_native.foo()\n", 0),
    ("from sfstore.paths.file import helper\n", 0),
])
def test_the_rule_catches_what_it_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str,
                                       expected: int) -> None:
    fake = ROOT / "_house_rule_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == fake else Path.read_text(self))
    assert len(_violations(fake)) == expected


# -- layers: faces move bytes through paths, never through the engine or the native helper ---------------------------

#: the faces: what users call (sf://, checkpoints, the KV cache and its engine adapters, hot blocks, the CLI)
FACES = ("sfstore.fs", "sfstore.checkpoint", "sfstore.kvcache", "sfstore.blocks", "sfstore.cli",
         "sfstore.integrations", "sfstore.demo")
#: what a face may not import: the layers under the paths
BELOW_PATHS = ("sfstore._native", "sfstore.engine")


def _imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """The sfstore modules ``path`` imports (``from a import b`` counts as ``a.b`` and ``a``), with their lines."""
    current = _module_name(path)
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(node.module or "", node.level, current, path.name == "__init__.py")
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, m) for line, m in out if m.startswith("sfstore")]


def _layer_violations(path: Path, source: str | None = None) -> list[str]:
    module = _module_name(path)
    if not any(module == f or module.startswith(f + ".") for f in FACES):
        return []
    return [f"{path.relative_to(ROOT.parent)}:{line}: {module} imports {m}" for line, m in _imports(path, source)
            if any(m == b or m.startswith(b + ".") for b in BELOW_PATHS)]


def test_faces_import_neither_the_engine_nor_the_native_helper() -> None:
    found = [v for path in sorted(ROOT.rglob("*.py")) for v in _layer_violations(path)]
    assert not found, "faces reaching under the paths:\n" + "\n".join(found)




#: the runtime faces: they move data; the probe (a report of the host, for people and the CLI) is above them
RUNTIME_FACES = ("sfstore.fs", "sfstore.checkpoint", "sfstore.kvcache", "sfstore.blocks", "sfstore.integrations")


def _probe_violations(path: Path, source: str | None = None) -> list[str]:
    module = _module_name(path)
    if not any(module == f or module.startswith(f + ".") for f in RUNTIME_FACES):
        return []
    return [f"{path.relative_to(ROOT.parent)}:{line}: {module} imports {m}" for line, m in _imports(path, source)
            if m == "sfstore.probe" or m.startswith("sfstore.probe.")]


def test_runtime_faces_do_not_import_the_probe() -> None:
    found = [v for path in sorted(ROOT.rglob("*.py")) for v in _probe_violations(path)]
    assert not found, "runtime modules importing the probe:\n" + "\n".join(found)


#: names the code gives a path (a file path, the device path): what is counted on one is the path's to count
PATH_NAMES = {"fp", "dp", "device", "path", "file_path", "_fp", "_dp", "_device"}


def _owner_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _counter_violations(path: Path, source: str | None = None) -> list[str]:
    """Calls outside sfstore/paths that change a path's counters (``fp.counters.add(...)``): faces tell the path
    what happened (``file_done``, ``stage_to_gpu``) and the path counts."""
    module = _module_name(path)
    if module == "sfstore.paths" or module.startswith("sfstore.paths."):
        return []
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("add", "add_for", "reset")):
            continue
        counters = node.func.value
        if isinstance(counters, ast.Attribute) and counters.attr == "counters" \
                and _owner_name(counters.value) in PATH_NAMES:
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_only_the_paths_change_a_paths_counters() -> None:
    found = [v for path in sorted(ROOT.rglob("*.py")) for v in _counter_violations(path)]
    assert not found, "a path's counters changed outside sfstore/paths:\n" + "\n".join(found)


#: what of the name resolver a module outside the paths may use: folding a name's text, which opens nothing
NAME_TEXT_ONLY = {"sfstore.paths.beneath.fold_parts"}


def _namespace_violations(path: Path, source: str | None = None) -> list[str]:
    """Modules outside sfstore/paths (and sfstore/testing, the paths' own conformance suites) that resolve names
    around a path: its ``beneath`` resolver, or the resolver's functions imported. Faces name, list, make, move
    and remove files through the file path's namespace methods."""
    module = _module_name(path)
    if any(module == m or module.startswith(m + ".") for m in ("sfstore.paths", "sfstore.testing")):
        return []
    rel = path.relative_to(ROOT.parent)
    found = [f"{rel}:{line}: imports {m}" for line, m in _imports(path, source)
             if m.startswith("sfstore.paths.beneath.") and m not in NAME_TEXT_ONLY]
    found += [f"{rel}:{line}: imports {m}" for line, m in _imports(path, source)
              if m == "sfstore.paths.beneath" and not _only_names_from(path, source, m)]
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    found += [f"{rel}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr == "beneath"]
    return found


def _only_names_from(path: Path, source: str | None, module: str) -> bool:
    """Whether every import of ``module`` in ``path`` is ``from module import <names>`` (checked name by name)
    rather than the module itself bound to a name."""
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == module for a in node.names):
            return False
        if isinstance(node, ast.ImportFrom) and node.module == module.rsplit(".", 1)[0] \
                and any(a.name == module.rsplit(".", 1)[1] for a in node.names):
            return False
    return True


def test_only_the_paths_resolve_names() -> None:
    found = [v for path in sorted(ROOT.rglob("*.py")) for v in _namespace_violations(path)]
    assert not found, "names resolved around the file path:\n" + "\n".join(found)


# -- the floors: nothing lower imports anything higher ---------------------------------------------------------------

#: every module of the package on its floor, lowest first (docs/development.md draws the same picture); the package
#: itself (``sfstore.open``) stands on the router's floor
FLOORS = {
    "ground": ("sfstore._native", "sfstore._optional", "sfstore.arguments", "sfstore.defaults", "sfstore.errors",
               "sfstore.forks", "sfstore.environment", "sfstore.counters", "sfstore.futures", "sfstore.checksums",
               "sfstore.text_tables", "sfstore.temp_names", "sfstore.version"),
    "floor": ("sfstore.buffers", "sfstore.engine", "sfstore.mounts", "sfstore.nvme", "sfstore.records",
              "sfstore.quarantine_records", "sfstore.probe", "sfstore.device_verdict", "sfstore.config_check"),
    "paths": ("sfstore.paths",),
    "router": ("sfstore.router", "sfstore"),
    "faces": (*FACES, "sfstore.testing"),
}


def _floor(module: str) -> int | None:
    """The floor of ``module`` (its longest prefix in :data:`FLOORS`), ``None`` for one on no floor."""
    best: tuple[int, int] | None = None
    for i, prefixes in enumerate(FLOORS.values()):
        for p in prefixes:
            inside = module == p or (p != "sfstore" and module.startswith(p + "."))  # the package: itself only
            if inside and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def _floor_violations(path: Path, source: str | None = None) -> list[str]:
    """Imports (at the top or inside a function) of a module on a higher floor than ``path``'s."""
    module = _module_name(path)
    mine = _floor(module)
    rel = path.relative_to(ROOT.parent)
    if mine is None:
        return [f"{rel}: {module} stands on no floor: add it to FLOORS"]
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    names = list(FLOORS)
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(node.module or "", node.level, module, path.name == "__init__.py")
            # ``from sfstore import defaults`` imports the module sfstore.defaults, not the package's entry point
            targets = [f"{mod}.{a.name}" for a in node.names] if mod == "sfstore" else [mod]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            theirs = _floor(t) if t.startswith("sfstore") else None
            if theirs is not None and theirs > mine:
                found.append(f"{rel}:{node.lineno}: {module} ({names[mine]}) imports {t} ({names[theirs]})")
    return found


def test_nothing_lower_imports_anything_higher() -> None:
    found = [v for path in sorted(ROOT.rglob("*.py")) for v in _floor_violations(path)]
    assert not found, "imports up the floors:\n" + "\n".join(found)


# -- one module defines the checksum kinds and each format's codes for them ------------------------------------------

def _checksum_kind_violations(path: Path, source: str | None = None) -> list[str]:
    """Definitions of checksum kinds or codes outside sfstore.checksums: a ``SUM_*`` constant, an enum of
    sums, or a format's code table (``SumCodes(...)``)."""
    if _module_name(path) == "sfstore.checksums":
        return []
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    rel = path.relative_to(ROOT.parent)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            code = isinstance(node.value, ast.Constant) and type(node.value.value) is int  # a number, not a key
            for t in targets:
                if isinstance(t, ast.Name) and t.id.startswith("SUM_") and code:
                    found.append(f"{rel}:{node.lineno}: {t.id} defined")
        if isinstance(node, ast.Call) and _owner_name(node.func) == "SumCodes":
            found.append(f"{rel}:{node.lineno}: a table of checksum codes")
        if isinstance(node, ast.ClassDef) and "Sum" in node.name and any(
                "Enum" in (_owner_name(b) or "") for b in node.bases):
            found.append(f"{rel}:{node.lineno}: enum {node.name}")
    return found


def test_one_module_defines_the_checksum_kinds() -> None:
    found = [v for path in sorted(ROOT.rglob("*.py")) for v in _checksum_kind_violations(path)]
    assert not found, "checksum kinds or codes defined outside sfstore.checksums:\n" + "\n".join(found)


def test_the_version_is_pyprojects() -> None:
    import tomllib

    from sfstore import __version__

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    assert __version__ == project["version"]


LAYER_RULES = {"faces above the paths": _layer_violations, "runtime faces below the probe": _probe_violations,
               "only paths count": _counter_violations, "only paths resolve names": _namespace_violations,
               "nothing lower imports higher": _floor_violations, "one module of checksum kinds":
               _checksum_kind_violations}


@pytest.mark.parametrize("rule, module, source, expected", [
    ("faces above the paths", "kvcache/x.py", "from sfstore import _native\n", 1),
    ("faces above the paths", "kvcache/x.py", "def f():\n    import sfstore._native\n", 1),
    ("faces above the paths", "checkpoint/x.py", "from sfstore.engine import get_engine\n", 2),
    ("faces above the paths", "fs.py", "from .engine import Request\n", 2),
    ("faces above the paths", "kvcache/x.py", "from sfstore.paths import beneath\nfrom sfstore import buffers\n", 0),
    ("faces above the paths", "paths/x.py", "from sfstore import _native\nfrom sfstore.engine import get_engine\n",
     0),  # not a face
    ("runtime faces below the probe", "kvcache/x.py", "from sfstore import probe\n", 1),
    ("runtime faces below the probe", "kvcache/x.py", "from sfstore.probe import format_table\n", 2),
    ("runtime faces below the probe", "kvcache/x.py", "from sfstore import quarantine_records\n", 0),
    ("runtime faces below the probe", "cli.py", "from sfstore.probe import probe\n", 0),  # the CLI reports it
    ("only paths count", "kvcache/x.py", "self.fp.counters.add(files=1)\n", 1),
    ("only paths count", "checkpoint/x.py", "fp.counters.add_for('c', errors=1)\ndp.counters.reset()\n", 2),
    ("only paths count", "kvcache/x.py", "self.counters.add(opens=1)\nfp.file_done()\n", 0),  # its own counters
    ("only paths count", "paths/x.py", "self.fp.counters.add(files=1)\n", 0),  # a path counting
    ("only paths resolve names", "fs.py", "self.file_path.beneath.stat(name)\n", 1),
    ("only paths resolve names", "kvcache/x.py", "from sfstore.paths import beneath\nbeneath.open_at(d, n, 0)\n", 1),
    ("only paths resolve names", "kvcache/x.py", "from sfstore.paths.beneath import stat_many_at, open_at\n", 2),
    ("only paths resolve names", "fs.py", "from sfstore.paths.beneath import fold_parts\nfp.os_stat(name)\n", 0),
    ("only paths resolve names", "paths/x.py", "self.beneath.stat(name)\n", 0),  # the path itself
    ("nothing lower imports higher", "paths/x.py", "from sfstore.kvcache import store\n", 1),
    ("nothing lower imports higher", "engine/x.py", "def f():\n    from sfstore.paths.file import FilePath\n", 1),
    ("nothing lower imports higher", "probe.py", "import sfstore\nfrom sfstore import router\n", 2),
    ("nothing lower imports higher", "newmodule.py", "import os\n", 1),  # a module on no floor
    ("nothing lower imports higher", "kvcache/x.py", "from sfstore import defaults, router\nfrom ..paths import file\n",
     0),
    ("nothing lower imports higher", "probe.py", "from sfstore import defaults, nvme\n", 0),
    ("one module of checksum kinds", "blocks/layout.py", "SUM_XXH3 = 1\nSUM_KV64: int = 2\n", 2),
    ("one module of checksum kinds", "kvcache/x.py", "T = checksums.SumCodes({SumKind.XXH3: 0})\n", 1),
    ("one module of checksum kinds", "kvcache/x.py", "class SumKinds(enum.IntEnum):\n    A = 1\n", 1),
    ("one module of checksum kinds", "kvcache/x.py", "from sfstore.checksums import SumKind\nk = SumKind.XXH3\n", 0),
    ("one module of checksum kinds", "checksums.py", "SUM_XXH3 = 1\n", 0),  # the one module
    ("one module of checksum kinds", "checkpoint/x.py", "SUM_KEY = 'manifest_xxh3_64'\n", 0),  # a record's key
])
def test_each_layer_rule_catches_what_it_says(rule: str, module: str, source: str, expected: int) -> None:
    assert len(LAYER_RULES[rule](ROOT / module, source)) == expected
