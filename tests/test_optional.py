"""Optional packages: a face whose package is missing raises ``MissingDependencyError`` naming the extra to install.

Each case runs in a fresh interpreter in which the package cannot be imported: ``sys.modules[name] = None`` makes
every ``import name`` (and ``import name.sub``) raise ``ModuleNotFoundError`` before sfstore is imported, the real
``ImportError`` path of a package that is not installed, with the package itself still on disk for the other
tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(blocked: list[str], code: str, tmp_path: Path) -> dict[str, object]:
    """Run ``code`` with ``blocked`` unimportable; it sets ``result`` (JSON-able), which is returned."""
    script = "import json, sys\n"
    script += "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    script += textwrap.dedent(code)
    script += "\nprint('RESULT=' + json.dumps(result))\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFSTORE_")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), SFSTORE_ROOT=str(tmp_path / "root"))
    (tmp_path / "root").mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT=")][-1]
    return dict(json.loads(line[len("RESULT="):]))


_CATCH = """
from sfstore import errors
try:
    {action}
except errors.MissingDependencyError as exc:
    result = {{"type": type(exc).__name__, "message": str(exc), "name": exc.name, "extra": exc.extra,
               "import_error": isinstance(exc, ImportError), "sfstore_error": isinstance(exc, errors.SfstoreError)}}
except BaseException as exc:
    result = {{"type": type(exc).__name__, "message": str(exc)}}
else:
    result = {{"type": None}}
"""


def _expect(result: dict[str, object], package: str, extra: str, purpose: str) -> None:
    assert result["type"] == "MissingDependencyError", result
    assert result["import_error"] and result["sfstore_error"], result
    assert result["name"] == package and result["extra"] == extra, result
    message = str(result["message"])
    assert message.startswith(f"{purpose} needs {package}"), message
    assert message.endswith(f"pip install 'sfstore[{extra}]'"), message


# (what is done, the package blocked, the extra named, how the message starts)
CASES = [
    ("import sfstore.fs", ["fsspec"], "fsspec", "data", "sf:// (sfstore.fs)"),
    ("import sfstore.integrations.upath", ["upath"], "upath", "data", "UPath for sf:// (sfstore.integrations.upath)"),
    ("import sfstore.checkpoint.dcp", ["torch"], "torch", "torch",
     "sfstore.checkpoint.dcp (torch.distributed.checkpoint)"),
    ("import sfstore.checkpoint.lightning", ["lightning"], "lightning", "lightning", "sfstore.checkpoint.lightning"),
    ("from sfstore.checkpoint.hf_trainer import SfstoreTrainerCallback", ["transformers"], "transformers", "hf",
     "sfstore.checkpoint.hf_trainer's SfstoreTrainerCallback"),
    ("import sfstore.checkpoint.hf_trainer_callback", ["transformers"], "transformers", "hf",
     "sfstore.checkpoint.hf_trainer's SfstoreTrainerCallback"),
    ("import sfstore.kvcache.vllm", ["vllm"], "vllm", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)"),
    ("import sfstore.kvcache.vllm_offload", ["vllm"], "vllm", "vllm",
     "sfstore's vLLM offloading tier (sfstore.kvcache.vllm_offload)"),
    ("import sfstore.kvcache.lmcache", ["lmcache"], "lmcache", "lmcache",
     "sfstore's LMCache storage plugin (sfstore.kvcache.lmcache)"),
    ("import sfstore.kvcache.sglang", ["sglang"], "sglang", "sglang",
     "sfstore's SGLang HiCache backend (sfstore.kvcache.sglang)"),
    ("import sfstore.checkpoint; sfstore.checkpoint.save({'w': [1.0]}, 'sf://c/one')", ["torch"], "torch", "torch",
     "sfstore.checkpoint.save"),
    ("import sfstore.checkpoint; sfstore.checkpoint.load('sf://c/one')", ["torch"], "torch", "torch",
     "sfstore.checkpoint.load"),
]


@pytest.mark.parametrize("action, blocked, package, extra, purpose", CASES, ids=[c[0] for c in CASES])
def test_a_face_whose_import_is_blocked_names_the_extra(
    action: str, blocked: list[str], package: str, extra: str, purpose: str, tmp_path: Path
) -> None:
    _expect(_run(blocked, _CATCH.format(action=action), tmp_path), package, extra, purpose)


def test_require_with_an_import_blocked_raises_the_typed_error_with_its_cause(tmp_path: Path) -> None:
    code = """
    from sfstore import errors
    from sfstore._optional import require
    try:
        require("pandas.io", "data", "reading tables")
    except ImportError as exc:  # what callers that know only ImportError catch
        result = {"type": type(exc).__name__, "message": str(exc), "name": exc.name, "extra": exc.extra,
                  "import_error": True, "sfstore_error": isinstance(exc, errors.SfstoreError),
                  "cause": type(exc.__cause__).__name__}
    json_module = require("json", "data", "nothing")
    result["present"] = json_module.__name__
    """
    result = _run(["pandas"], code, tmp_path)
    _expect(result, "pandas", "data", "reading tables")
    assert result["cause"] == "ModuleNotFoundError"
    assert result["present"] == "json"


def test_require_says_when_an_installed_package_fails_on_its_own_dependency(tmp_path: Path) -> None:
    """The package is there, but a package it imports is not: the message says which import failed."""
    pkg = tmp_path / "site" / "needs_missing"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import not_installed_anywhere_sfstore\n")
    code = f"""
    import sys
    sys.path.insert(0, {str(tmp_path / "site")!r})
    from sfstore._optional import require
    from sfstore import errors
    try:
        require("needs_missing", "data", "a face")
    except errors.MissingDependencyError as exc:
        result = {{"message": str(exc), "name": exc.name}}
    """
    result = _run([], code, tmp_path)
    assert result["name"] == "needs_missing"
    assert "not_installed_anywhere_sfstore" in str(result["message"]), result
    assert str(result["message"]).startswith("a face needs needs_missing, which cannot be imported"), result


def test_last_committed_checkpoint_works_with_transformers_torch_and_fsspec_blocked(tmp_path: Path) -> None:
    """A resume script picks its checkpoint before importing transformers: the commit records need none of it."""
    out = tmp_path / "out"
    for step in (2, 4):
        d = out / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(bytes(range(256)) * step)
    code = f"""
    from sfstore.checkpoint.hf_trainer import commit_checkpoint, last_committed_checkpoint
    commit_checkpoint({str(out / "checkpoint-2")!r})
    result = {{"latest": last_committed_checkpoint({str(out)!r}),
               "imported": sorted(m for m in ("transformers", "torch", "fsspec") if sys.modules.get(m))}}
    """
    result = _run(["transformers", "torch", "fsspec"], code, tmp_path)
    # checkpoint-4 has no commit record (its save was never committed): checkpoint-2 is the one to resume from
    assert result == {"latest": str(out / "checkpoint-2"), "imported": []}

