"""``--report DIR``: the hook for richer reports (plots, history across commits) to come.

For now it writes, per suite, ``<bench>.json`` (the suite's document) and ``<bench>.txt`` (its table, followed by
the suite's goal lines when its document has ``acceptance``), and an ``index.md`` listing them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from tools.bench.common import Table

__all__ = ["write_report"]


def write_report(directory: str, docs: Sequence[dict[str, Any]]) -> list[str]:
    """Write the report of ``docs`` (one JSON document per suite) into ``directory``.

    Parameters
    ----------
    directory : str
        Created if missing.
    docs : sequence of dict
        Suite documents in the common JSON shape.

    Returns
    -------
    list of str
        The paths written.
    """
    os.makedirs(directory, exist_ok=True)
    written: list[str] = []
    index = ["# sfstore benchmark report", ""]
    for doc in docs:
        name = str(doc.get("bench", "bench"))
        json_path = os.path.join(directory, f"{name}.json")
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        cases = doc.get("cases", [])
        tool = str(cases[0].get("reference_tool", "reference")) if cases else "reference"
        goals = [str(a["line"]) for a in doc.get("acceptance", []) if isinstance(a, dict) and a.get("line")]
        text = "\n".join([Table(tool).render(cases), *(["", *goals] if goals else [])])
        txt_path = os.path.join(directory, f"{name}.txt")
        with open(txt_path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        written += [json_path, txt_path]
        index += [f"## {name} ({doc.get('date', '')})", "", "```", text, "```", ""]
    index_path = os.path.join(directory, "index.md")
    with open(index_path, "w", encoding="utf-8") as f:
        f.write("\n".join(index))
    written.append(index_path)
    return written
