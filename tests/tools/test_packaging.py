"""Packaging rules that the files themselves can check: extras install into a user's environment without pinning
(torch above all), the dev and CI pins live in tools/constraints-dev.txt, and every install hint sfstore gives
names an extra that exists."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
CONSTRAINTS = REPO / "tools" / "constraints-dev.txt"
AGREED = {"torch", "data", "hf", "lightning", "vllm", "gpu", "nvme", "docs", "demo", "test"}
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(.*)$")


def _split(requirement: str) -> tuple[str, str, str]:
    m = _NAME.match(requirement.split(";")[0])
    assert m, requirement
    return m.group(1).lower().replace("_", "-"), m.group(2) or "", m.group(3).strip()


def _closure(extra: str) -> set[str]:
    """The packages an extra installs, through the extras of sfstore it names (``sfstore[a,b]``)."""
    found: set[str] = set()
    for req in EXTRAS[extra]:
        name, inner, _spec = _split(req)
        if name == "sfstore":
            for sub in inner.strip("[]").split(","):
                found |= _closure(sub.strip())
        else:
            found.add(name + inner)
    return found


def test_the_agreed_extras_exist() -> None:
    assert AGREED <= set(EXTRAS), AGREED - set(EXTRAS)


def test_no_extra_pins_a_version_and_none_bounds_torch() -> None:
    """Extras go into the user's environment: an ``==`` pin (or any bound on torch) would make pip replace the
    torch (or transformers, ...) the user already has. Pins belong in tools/constraints-dev.txt."""
    for extra, reqs in EXTRAS.items():
        for req in reqs:
            name, _inner, spec = _split(req)
            assert "==" not in spec, f"[{extra}] pins {req!r}: pins go in tools/constraints-dev.txt"
            if name == "torch":
                assert spec == "", f"[{extra}] bounds torch ({req!r}): users keep the torch they have"
    deps = PYPROJECT["project"]["dependencies"]
    assert not any(_split(d)[0] == "torch" for d in deps), deps


def test_the_dev_constraints_pin_torch_and_the_integrations_tested_against() -> None:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _inner, spec = _split(line)
            pins[name] = spec
    assert pins.get("torch") == "==2.13.0", pins
    for name in ("transformers", "lightning", "accelerate"):
        assert pins.get(name, "").startswith("=="), (name, pins)


def test_the_test_extra_holds_every_other_extra_the_tests_use() -> None:
    test = _closure("test")
    for extra in ("torch", "data", "hf", "lightning", "demo", "docs"):
        assert _closure(extra) <= test, (extra, _closure(extra) - test)
    assert {"pytest", "ruff", "mypy"} <= {_split(r)[0] for r in test}


def test_dev_and_ci_installs_go_through_the_constraints() -> None:
    """Every pip install in tools/dev.sh, and the torch of tools/wheel-check.sh, is given the constraints file
    (an unconstrained torch resolves to a CUDA build: gigabytes of downloads)."""
    dev = (REPO / "tools" / "dev.sh").read_text()
    code = [line for line in dev.splitlines() if not line.lstrip().startswith("#")]
    installs = [line for line in code if "pip" in line and "install" in line and "apt" not in line]
    assert installs, "tools/dev.sh installs nothing with pip?"
    for line in installs:
        assert '-c "$CONSTRAINTS"' in line or '"${pip[@]}"' in line, line
    assert 'local pip=("$VENV/bin/pip" install -q --disable-pip-version-check -c "$CONSTRAINTS")' in dev
    check = (REPO / "tools" / "wheel-check.sh").read_text()
    torch_lines = [line for line in check.splitlines()
                   if not line.lstrip().startswith("#") and "pip" in line and " install" in line and "torch" in line]
    assert torch_lines and all('-c "$CONSTRAINTS"' in line for line in torch_lines), torch_lines


def _hinted_extras() -> list[tuple[str, str]]:
    """(where, extra) for every ``require(..., extra, ...)`` call and every ``sfstore[extra]`` in sfstore/."""
    found = []
    for path in sorted((REPO / "sfstore").rglob("*.py")):
        text = path.read_text()
        rel = str(path.relative_to(REPO))
        for m in re.finditer(r"sfstore\[([a-z0-9_,-]+)\]", text):
            found += [(rel, e) for e in m.group(1).split(",")]
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "require"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                found.append((f"{rel}:{node.lineno}", str(node.args[1].value)))
    return found


def test_every_install_hint_names_an_extra_that_exists() -> None:
    hints = _hinted_extras()
    assert len({where.split(":")[0] for where, _ in hints}) >= 8, hints  # the faces that use require()
    unknown = [(where, extra) for where, extra in hints if extra not in EXTRAS]
    assert not unknown, unknown
