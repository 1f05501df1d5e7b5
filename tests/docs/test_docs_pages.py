"""What the docs promise to hold: README within its size, the settings table as sfstore.defaults prints it, README's
figures taken from the generated performance report, every key of the vLLM connector and of the config file."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _between(text: str, start: str, end: str) -> str:
    m = re.search(re.escape(start) + r"\n(.*?)\n" + re.escape(end), text, re.S)
    assert m, f"the markers {start} ... {end} are missing"
    return m.group(1)


def test_readme_is_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= 12288, f"README.md is {size} bytes: at most 12 KiB; move the detail to docs/"


def test_settings_table_is_the_generated_table() -> None:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    table = _between(text, "<!-- defaults-table:start -->", "<!-- defaults-table:end -->")
    out = subprocess.run([sys.executable, "-m", "sfstore.defaults"], capture_output=True, text=True, check=True)
    assert table.strip() == out.stdout.strip(), (
        "docs/configuration.md's settings table is stale: paste the output of python -m sfstore.defaults")


def test_readme_figures_come_from_the_generated_report() -> None:
    from tools.bench import report

    block = _between((DOCS / "performance.md").read_text(encoding="utf-8"), report.README_START, report.README_END)
    generated = {line for line in block.splitlines() if line.startswith("| ")}
    section = README.read_text(encoding="utf-8").split("## Performance", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) >= 3, "README's performance section lost its headline table"
    for row in rows:
        assert row in generated, f"README's row is not in docs/performance.md's generated report: {row}"


def _connector_keys() -> set[str]:
    """The keys ``sfstore/kvcache/vllm.py`` reads from ``kv_connector_extra_config``: the store's (one module for
    every engine) and its own (read from its source: the module imports vLLM, which the docs' tests do not
    need)."""
    from sfstore.kvcache.engine_options import STORE_KEYS

    tree = ast.parse((ROOT / "sfstore" / "kvcache" / "vllm.py").read_text(encoding="utf-8"))
    values = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)}
    every = values["_EXTRA_CONFIG_KEYS"]
    assert isinstance(every, ast.Call) and isinstance(every.args[0], ast.Set)
    keys = {e.value for e in every.args[0].elts if isinstance(e, ast.Constant)} | set(STORE_KEYS)
    assert len(keys) >= 10, f"the connector's keys were not found in its source: {sorted(keys)}"
    return {str(k) for k in keys}


def test_every_connector_key_is_documented() -> None:
    keys = _connector_keys()
    text = (DOCS / "vllm.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.M))
    assert documented == keys, (f"docs/vllm.md's key table differs from the connector's keys: missing "
                                f"{sorted(keys - documented)}, not the connector's {sorted(documented - keys)}")
    json_block = text.split("```json\n", 1)[1].split("```", 1)[0]
    assert set(json.loads(json_block)["kv_connector_extra_config"]) == keys


def _config_keys() -> tuple[set[str], set[str], set[str]]:
    """The config file's top-level keys, ``[classes.*]`` keys and target kinds, as sfstore reads them."""
    try:
        from sfstore import config_check
    except ImportError:  # before sfstore.config_check: the router and the block path hold them
        from sfstore import router
        from sfstore.paths import block

        return set(router._TOP_KEYS), set(router._CLASS_KEYS), set(block._TARGET_KINDS)
    return set(config_check.TOP_KEYS), set(config_check.CLASS_KEYS), set(config_check.TARGET_KINDS)


def test_every_config_key_is_documented() -> None:
    import dataclasses

    from sfstore import nvme

    top, per_class, kinds = _config_keys()
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.M))
    for key in top | per_class:
        assert key in rows, f"docs/configuration.md has no row for the config key {key!r}"
    for kind in kinds:
        assert f'| `"{kind}"` |' in text, f"docs/configuration.md has no row for target kind {kind!r}"
    for field in dataclasses.fields(nvme.NvmeofTarget):
        assert f"`{field.name}`" in text, f"docs/configuration.md does not name the nvmeof target key {field.name!r}"
    for var in ("SFSTORE_ROOT", "SFSTORE_CONFIG", "SFSTORE_DATA_DIR"):
        assert f"`{var}`" in text
