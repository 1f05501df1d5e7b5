"""``--report DIR``: the report of one run, and with ``all --readme docs/performance.md`` the table in the docs.

Per suite, ``DIR`` gets ``<bench>.json`` (the suite's document), ``<bench>.txt`` (its text table and goal lines)
and ``<bench>.png``: one horizontal bar per case, the ratio sfstore / reference (median of the pairwise ratios,
whiskers min-max), a dashed line at 1.0 and each goal's limit marked on its case, PASS green and MISS red
(matplotlib, Agg backend, imported only here; without matplotlib the charts are skipped and ``index.md`` says so).
``index.md`` holds the date, machine, commit and command of the run, a markdown table per suite (sfstore,
reference, ratio, goal with PASS/MISS) and the charts.

:func:`update_readme` replaces the block between ``<!-- bench-report:start -->`` and
``<!-- bench-report:end -->`` of a markdown file with :func:`render_summary`'s table, so
``python -m tools.bench all --quick --report docs/bench --readme docs/performance.md`` regenerates the figures of
the docs' performance page (README quotes a few of its rows).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tools.bench.common import GIB, Table, machine_info, render_ttft_table, ttft_cell

__all__ = ["README_START", "README_END", "Goal", "case_goals", "machine_summary", "render_summary",
           "update_readme", "write_report"]

README_START = "<!-- bench-report:start -->"
README_END = "<!-- bench-report:end -->"

#: an en dash, for ranges in the report
_DASH = "\N{EN DASH}"
_PASS_COLOUR = "#2e8b57"
_MISS_COLOUR = "#c0392b"
_PLAIN_COLOUR = "#5b84b1"


@dataclass(frozen=True)
class Goal:
    """One entry of a suite's ``acceptance`` list, read the same way whatever the suite.

    Attributes
    ----------
    text : str
        What the goal asks (``256k get >= 0.85x fio``).
    verdict : str
        ``PASS``, ``MISS``, ``n/a`` (measured nothing: a side did not run) or ``not run`` (case not selected).
    line : str
        The suite's own line for it, without its ``goal:`` / ``acceptance:`` prefix.
    target : float or None
        The ratio the goal's case must reach, for a goal on a case's ratio; None for the others (memory,
        blocking time ...).
    """

    text: str
    verdict: str
    line: str
    target: float | None = None


def _verdict(entry: Mapping[str, Any]) -> str:
    status, met = entry.get("status"), entry.get("met")
    if met is True or status == "met":
        return "PASS"
    if met is False or status == "missed":
        return "MISS"
    if status:
        return str(status)
    return "not run" if "not run" in str(entry.get("line", "")) else "n/a"


def _strip_prefix(line: str) -> str:
    for prefix in ("goal: ", "acceptance: "):
        if line.startswith(prefix):
            return line[len(prefix):]
    return line


def case_goals(doc: Mapping[str, Any]) -> tuple[dict[str, list[Goal]], list[Goal]]:
    """The goals of a suite document: those on one case's ratio by case name, and the rest.

    A goal belongs to a case when its entry names the case (``case``, or ``stand_in`` where another case stood
    in) and has a ratio ``target``, or, for suites whose entries name no case, when its measured ``value`` is
    that case's ratio.

    Parameters
    ----------
    doc : mapping
        A suite document in the common shape (``acceptance`` optional).

    Returns
    -------
    tuple
        ``({case name: [Goal, ...]}, [Goal, ...])``: ratio goals per case, then every other goal (memory,
        blocking time, goals whose case did not run).
    """
    cases = [c for c in doc.get("cases", []) if isinstance(c, dict)]
    by_name = {str(c.get("name")): c for c in cases}
    per_case: dict[str, list[Goal]] = {}
    other: list[Goal] = []
    for entry in doc.get("acceptance", []) or []:
        if not isinstance(entry, dict):
            continue
        text = str(entry.get("goal", ""))
        line = _strip_prefix(str(entry.get("line", text)))
        verdict = _verdict(entry)
        target = entry.get("target")
        name: str | None = None
        if isinstance(target, (int, float)) and not isinstance(target, bool):
            named = entry.get("stand_in") or entry.get("case")
            if named is not None:
                name = str(named) if str(named) in by_name else None
            elif "<=" not in text and isinstance(entry.get("value"), (int, float)):
                value = float(entry["value"])
                name = next((n for n, c in by_name.items() if c.get("ratio") is not None
                             and math.isclose(float(c["ratio"]), value, rel_tol=1e-12)), None)
        if name is not None and isinstance(target, (int, float)):
            per_case.setdefault(name, []).append(Goal(text, verdict, line, float(target)))
        else:
            other.append(Goal(text, verdict, line))
    return per_case, other


# ---------------------------------------------------------------------------------------------------------------
# Machine, date, commit


def _gather_machine(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    for doc in docs:
        machine = doc.get("machine")
        if isinstance(machine, dict) and machine.get("hostname"):
            return dict(machine)
    return machine_info()


def machine_summary(machine: Mapping[str, Any]) -> str:
    """One line about the machine: host, CPU, cores, memory, kernel, OS, filesystem, load at the start.

    Parameters
    ----------
    machine : mapping
        :func:`tools.bench.common.machine_info`'s facts (any of them may be missing).

    Returns
    -------
    str
        E.g. ``host: Intel Xeon ..., 2 CPUs, 23.4 GiB RAM, Linux 6.8.0 (Ubuntu 24.04), ext4 on vda``.
    """
    parts: list[str] = []
    if machine.get("cpu_model"):
        parts.append(str(machine["cpu_model"]))
    cpus, usable = machine.get("cpus"), machine.get("usable_cpus")
    if cpus:
        parts.append(f"{cpus} CPUs" + (f" ({usable} usable)" if usable and usable != cpus else ""))
    if machine.get("mem_total_bytes"):
        parts.append(f"{int(machine['mem_total_bytes']) / GIB:.1f} GiB RAM")
    if machine.get("kernel"):
        os_name = f" ({machine['os']})" if machine.get("os") else ""
        parts.append(f"Linux {machine['kernel']}{os_name}")
    fs = machine.get("filesystem")
    if isinstance(fs, dict) and fs.get("type"):
        where = fs.get("device") or fs.get("source")
        rot = {"0": ", non-rotational", "1": ", rotational"}.get(str(fs.get("rotational")), "")
        parts.append(f"{fs['type']} on {where}{rot}" if where else str(fs["type"]))
    load = machine.get("load_avg")
    if isinstance(load, list) and load:
        parts.append(f"load {float(load[0]):.2f} at the start")
    host = str(machine.get("hostname") or "unknown host")
    return f"{host}: " + ", ".join(parts) if parts else host


def _parse_date(text: Any) -> datetime | None:
    try:
        when = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _date_range(docs: Sequence[Mapping[str, Any]]) -> str:
    dates = [d for d in (_parse_date(doc.get("date")) for doc in docs) if d is not None]
    if not dates:
        raw = [str(doc["date"]) for doc in docs if doc.get("date")]
        return raw[0] if raw else datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    first, last = (d.astimezone(timezone.utc) for d in (min(dates), max(dates)))
    if first.date() == last.date():
        end = "" if last == first else f"{_DASH}{last:%H:%M}"
        return f"{first:%Y-%m-%d %H:%M}{end} UTC"
    return f"{first:%Y-%m-%d %H:%M} {_DASH} {last:%Y-%m-%d %H:%M} UTC"


def _short_date(text: Any) -> str:
    when = _parse_date(text)
    return f"{when.astimezone(timezone.utc):%Y-%m-%d %H:%M} UTC" if when else str(text or "")


def _commit(machine: Mapping[str, Any]) -> str | None:
    full = machine.get("git_commit")
    commit = str(full)[:7] if full else None
    if commit is None:
        root = Path(__file__).resolve().parents[2]
        try:
            res = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        commit = res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None
    if commit and machine.get("git_dirty"):
        commit += " (with uncommitted changes)"
    return commit


# ---------------------------------------------------------------------------------------------------------------
# Markdown


def _short_status(status: Any) -> str:
    """A side's ``status`` short enough for a table cell (its first clause), or "" (none, ``ok`` or too long)."""
    if not isinstance(status, str) or status == "ok":
        return ""
    text = re.split(r";|: | \(", status, maxsplit=1)[0].strip()
    return text if len(text) <= 40 else ""


def _side_cell(case: Mapping[str, Any], key: str, use_iops: bool) -> str:
    side = case.get(key)
    if isinstance(side, dict) and "median_s" in side:  # a time (the vllm suite's TTFT), not a throughput
        return ttft_cell(side, spread=False) + " TTFT"
    if not isinstance(side, dict) or "bytes_per_s" not in side:
        why = _short_status(side.get("status") or side.get("error")) if isinstance(side, dict) else ""
        return f"n/a ({why})" if why else "n/a"
    if use_iops and side.get("iops") is not None:
        iops = float(side["iops"])
        return f"{iops / 1000:.1f}k IOPS" if iops >= 1000 else f"{iops:.0f} IOPS"
    return f"{float(side['bytes_per_s']) / GIB:.3f} GiB/s"


def _fmt_ratio(r: float, goals: Sequence[Goal] = ()) -> str:
    """``r`` to two decimals, or more where two would make it look equal to a goal's limit it misses or meets."""
    text = f"{r:.2f}"
    for digits in range(3, 7):
        if not any(g.target is not None and r != g.target and float(text) == round(g.target, digits - 1)
                   for g in goals):
            break
        text = f"{r:.{digits}f}"
    return text


def _ratio_cell(case: Mapping[str, Any], goals: Sequence[Goal] = ()) -> str:
    r, lo, hi = case.get("ratio"), case.get("ratio_min"), case.get("ratio_max")
    if r is None:
        return "n/a"
    if lo is None or hi is None:
        return _fmt_ratio(float(r), goals)
    return f"{_fmt_ratio(float(r), goals)} ({float(lo):.2f}{_DASH}{float(hi):.2f})"


def _verdict_md(verdict: str) -> str:
    return {"PASS": "PASS", "MISS": "**MISS**"}.get(verdict, verdict)


def _goal_cell(goals: Sequence[Goal]) -> str:
    return "; ".join(f"≥ {g.target:.3g}x {_verdict_md(g.verdict)}" for g in goals if g.target is not None) or "—"


def _case_rows(doc: Mapping[str, Any], with_suite: bool) -> list[str]:
    per_case, _ = case_goals(doc)
    table = Table("reference")
    suite = str(doc.get("bench", "bench"))
    rows = []
    for case in doc.get("cases", []):
        if not isinstance(case, dict):
            continue
        name = str(case.get("name", "?"))
        tool = str(case.get("reference_tool", "reference"))
        use_iops = table.use_iops(case)
        cells = [f"`{name}`", _side_cell(case, "sfstore", use_iops),
                 f"{tool}: {_side_cell(case, 'reference', use_iops)}", _ratio_cell(case, per_case.get(name, [])),
                 _goal_cell(per_case.get(name, []))]
        rows.append("| " + " | ".join(([suite] if with_suite else []) + cells) + " |")
    return rows


def _common_shape(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with only cases in the common shape: cases that compare several sides by time (``sides``, as the
    ``vllm`` suite wrote them before it added one common-shape case per pair) move to its ``ttft`` list."""
    out = dict(doc)
    cases = [c for c in doc.get("cases", []) if isinstance(c, dict)]
    timed = [c for c in cases if "sides" in c and not {"sfstore", "reference"} <= set(c)]
    if timed:
        out["ttft"] = [*(doc.get("ttft") or []), *timed]
        out["cases"] = [c for c in cases if c not in timed]
    return out


def _ttft_md(side: Any) -> str:
    text = ttft_cell(side)
    return text.replace("-", _DASH) if isinstance(side, dict) and "median_s" in side else text


def _ttft_lines(doc: Mapping[str, Any]) -> list[str]:
    """Markdown of a suite's time-to-first-token table (the ``vllm`` suite's ``ttft``): one row per prompt length,
    one column per side, the median TTFT and min-max; then the files each side loaded from."""
    entries = [e for e in doc.get("ttft") or [] if isinstance(e, dict)]
    if not entries:
        return []
    sides: list[str] = []
    for e in entries:
        sides += [s for s in e.get("sides", {}) if s not in sides]
    lines = ["Time to first token, median (min" + _DASH + "max) of the prompts of each model and length. Each side "
             "ran in its own engine process, the sides interleaved prompt by prompt; a case's ratio above is the other "
             "side's TTFT over sfstore's, the median of the per-prompt ratios.", "",
             "| prompt | " + " | ".join(f"`{s}`" for s in sides) + " |", "|---" * (len(sides) + 1) + "|"]
    for e in entries:
        cells = [_ttft_md(e.get("sides", {}).get(s)) for s in sides]
        lines.append(f"| `{e.get('name', '?')}` | " + " | ".join(cells) + " |")
    files = (doc.get("params") or {}).get("files")
    if isinstance(files, dict):
        facts = []
        for side, f in files.items():
            if isinstance(f, dict):
                res = f.get("resident_bytes_after_evict")
                facts.append(f"{side}: {f.get('files')} files, {int(f.get('bytes') or 0) / (1 << 20):.1f} MiB"
                             + ("" if res is None else f", {int(res)} bytes resident after the eviction"))
        if facts:
            lines += ["", "Files loaded from: " + "; ".join(facts) + "."]
    return ["", *lines]


def _other_goal_lines(doc: Mapping[str, Any], with_suite: bool) -> list[str]:
    _, other = case_goals(doc)
    prefix = f"{doc.get('bench', 'bench')}: " if with_suite else ""
    lines = [f"- {prefix}{_verdict_md(g.verdict)} — {g.line}" for g in other if g.verdict != "not run"]
    skipped = [g.text for g in other if g.verdict == "not run"]
    if skipped:
        lines.append(f"- {prefix}not run (case not selected): " + "; ".join(skipped))
    return lines


def _header_lines(docs: Sequence[Mapping[str, Any]], command: str | None) -> list[str]:
    machine = _gather_machine(docs)
    lines = [f"- **Date:** {_date_range(docs)}", f"- **Machine:** {machine_summary(machine)}"]
    commit = _commit(machine)
    if commit:
        lines.append(f"- **Commit:** `{commit}`")
    if command:
        lines.append(f"- **Command:** `{command}`")
    return lines


_RATIO_NOTE = (f"Ratio: sfstore / reference throughput, median of the pairwise ratios of interleaved runs "
               f"(min{_DASH}max in brackets); > 1 means sfstore is faster. Goals are the issues' acceptance limits.")


def render_summary(docs: Sequence[Mapping[str, Any]], chart_dir: str, charts: Mapping[str, str],
                   command: str | None = None, chart_note: str | None = None) -> str:
    """The README block: date, machine, commit, command, one table of every suite's cases, links to the charts.

    Parameters
    ----------
    docs : sequence of mapping
        Suite documents in the common shape.
    chart_dir : str
        The report directory as the README links it (relative, ``/``-separated).
    charts : mapping
        Suite name to its chart's file name, for the suites that got one.
    command : str or None
        The command that produced the run.
    chart_note : str or None
        Why there are no charts (e.g. matplotlib missing).

    Returns
    -------
    str
        Markdown, without the markers.
    """
    base = chart_dir.rstrip("/") + "/" if chart_dir not in ("", ".") else ""
    lines = [*_header_lines(docs, command), "", _RATIO_NOTE, "",
             f"| suite | case | sfstore | reference | ratio (min{_DASH}max) | goal |", "|---|---|---|---|---|---|"]
    errors: list[str] = []
    other: list[str] = []
    for doc in map(_common_shape, docs):
        if doc.get("error"):
            errors.append(f"- {doc.get('bench', 'bench')}: did not run ({doc['error']})")
            continue
        lines += _case_rows(doc, with_suite=True)
        other += _other_goal_lines(doc, with_suite=True)
    if other:
        lines += ["", "Goals not on one case's ratio:", "", *other]
    if errors:
        lines += ["", *errors]
    lines.append("")
    if charts:
        links = " · ".join(f"[{name}]({base}{file})" for name, file in charts.items())
        lines.append(f"Charts (one bar per case, whiskers min{_DASH}max, goal limits marked): {links}. "
                     f"Full report with each suite's JSON: [{base}index.md]({base}index.md).")
    else:
        lines.append(f"No charts: {chart_note or 'none written'}. Full report: [{base}index.md]({base}index.md).")
    return "\n".join(lines)


def _render_index(docs: Sequence[Mapping[str, Any]], charts: Mapping[str, str], texts: Mapping[str, str],
                  command: str | None, chart_note: str | None) -> str:
    lines = ["# sfstore benchmark report", "", *_header_lines(docs, command), "", _RATIO_NOTE, ""]
    if chart_note:
        lines += [f"Charts skipped: {chart_note}.", ""]
    for doc in map(_common_shape, docs):
        name = str(doc.get("bench", "bench"))
        lines += [f"## {name} ({_short_date(doc.get('date'))})", ""]
        if doc.get("error"):
            lines += [f"Did not run: {doc['error']}", ""]
            continue
        if name in charts:
            lines += [f"![{name}: sfstore / reference per case]({charts[name]})", ""]
        if doc.get("cases") or not doc.get("ttft"):
            lines += [f"| case | sfstore | reference | ratio (min{_DASH}max) | goal |", "|---|---|---|---|---|",
                      *_case_rows(doc, with_suite=False)]
        lines += _ttft_lines(doc)
        other = _other_goal_lines(doc, with_suite=False)
        if other:
            lines += ["", *other]
        lines += ["", f"Data: [{name}.json]({name}.json); text table: [{name}.txt]({name}.txt)", ""]
        if name in texts:
            lines += ["```", texts[name], "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Charts


def _matplotlib_missing() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the project's bench or test extra)"
    return None


def _chart(doc: Mapping[str, Any], path: str, machine: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    cases = [c for c in doc.get("cases", []) if isinstance(c, dict)]
    per_case, _ = case_goals(doc)
    n = len(cases)
    fig = Figure(figsize=(10, 1.9 + 0.55 * n), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    values = [1.0]
    for case in cases:
        values += [float(case[k]) for k in ("ratio", "ratio_min", "ratio_max") if case.get(k) is not None]
        values += [g.target for g in per_case.get(str(case.get("name")), []) if g.target is not None]
    values = [v for v in values if v > 0]
    log = max(values) > 4 or min(values) < 0.2  # ratios far apart: a log axis keeps the small ones readable
    x0, xmax = (min(values) / 1.5, max(values) * 2.5) if log else (0.0, max(values) * 1.45)
    labels = []
    used: set[str] = set()
    have_goal = False
    for i, case in enumerate(cases):
        name = str(case.get("name", "?"))
        tool = str(case.get("reference_tool", "reference"))
        labels.append(name if tool in name else f"{name}\nvs {tool}")
        goals = [g for g in per_case.get(name, []) if g.target is not None]
        verdicts = {g.verdict for g in goals}
        colour = _MISS_COLOUR if "MISS" in verdicts else _PASS_COLOUR if "PASS" in verdicts else _PLAIN_COLOUR
        for g in goals:
            have_goal = True
            t = float(g.target or 0.0)
            ax.plot([t, t], [i - 0.42, i + 0.42], color="black", linewidth=2.5, zorder=4)
        r = case.get("ratio")
        if r is None:
            why = next((_short_status(s.get("status")) for s in (case.get("reference"), case.get("sfstore"))
                        if isinstance(s, dict) and _short_status(s.get("status"))), "")
            ax.annotate(f"n/a ({why})" if why else "n/a", (x0, i), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=8, color="dimgray", zorder=5,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
            continue
        r = float(r)
        lo, hi = case.get("ratio_min"), case.get("ratio_max")
        xerr = [[r - float(lo)], [float(hi) - r]] if lo is not None and hi is not None else None
        used.add(colour)
        ax.barh(i, r - x0, left=x0, height=0.6, color=colour, xerr=xerr, capsize=3, error_kw={"elinewidth": 1},
                zorder=3)
        tag = " ".join(sorted(verdicts & {"PASS", "MISS"}))
        limits = ", ".join(f"≥ {g.target:g}x" for g in goals)
        label = _fmt_ratio(r, goals) + "x" + (f" {tag}" if tag else "") + (f" (goal {limits})" if limits else "")
        ax.annotate(label, (max(r, float(hi) if hi is not None else r), i), xytext=(5, 0), textcoords="offset points",
                    va="center", fontsize=8, fontweight="bold" if tag else "normal", zorder=5,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    ax.axvline(1.0, color="gray", linestyle="--", linewidth=1, zorder=2)
    ax.set_yticks(range(n), labels, fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)
    if log:
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

        ax.set_xscale("log", base=2)
        ticks = [2.0**k for k in range(-8, 10) if x0 <= 2.0**k <= xmax]
        if len(ticks) < 5:  # a few octaves only: halfway ticks too
            ticks = sorted(ticks + [1.5 * 2.0**k for k in range(-8, 10) if x0 <= 1.5 * 2.0**k <= xmax])
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}x"))
    ax.set_xlim(x0, xmax)
    ax.set_xlabel(f"sfstore / reference throughput (median of pairwise ratios, whiskers min{_DASH}max; "
                  "> 1: sfstore faster)" + ("; log scale" if log else ""), fontsize=8)
    ax.grid(axis="x", linestyle=":", linewidth=0.5, zorder=0)
    title = f"{doc.get('bench', 'bench')}: sfstore vs reference, {_short_date(doc.get('date'))}"
    ax.set_title(title + "\n" + "\n".join(textwrap.wrap(machine, 110)), fontsize=9)
    handles: list[Any] = [Patch(color=c, label=label) for c, label in
                          ((_PASS_COLOUR, "goal met (PASS)"), (_MISS_COLOUR, "goal missed (MISS)"),
                           (_PLAIN_COLOUR, "no goal on this case")) if c in used]
    handles.append(Line2D([], [], color="gray", linestyle="--", label="1.0 = as fast as the reference"))
    if have_goal:
        handles.append(Line2D([], [], color="black", linewidth=2.5, label="goal limit"))
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.6 / (n + 2)),
              ncol=len(handles), frameon=False)
    fig.tight_layout()
    fig.savefig(path, format="png")


# ---------------------------------------------------------------------------------------------------------------
# Files


def update_readme(path: str, block: str) -> None:
    """Replace what lies between :data:`README_START` and :data:`README_END` in ``path`` with ``block``.

    Parameters
    ----------
    path : str
        A markdown file holding both markers, in that order, each on its own line.
    block : str
        The new content (the markers stay).

    Raises
    ------
    ValueError
        When the markers are missing, repeated or out of order (the file is left alone).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.count(README_START) != 1 or text.count(README_END) != 1:
        raise ValueError(f"{path} needs exactly one '{README_START}' and one '{README_END}' line, where the "
                         "benchmark table goes")
    head, rest = text.split(README_START, 1)
    if README_END not in rest or not rest.startswith("\n"):
        raise ValueError(f"{path}: '{README_START}' must be on its own line, before '{README_END}'")
    tail = rest.split(README_END, 1)[1]
    new = f"{head}{README_START}\n{block.strip(chr(10))}\n{README_END}{tail}"
    if new != text:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(new)
        os.replace(tmp, path)


def write_report(directory: str, docs: Sequence[dict[str, Any]], command: str | None = None,
                 readme: str | None = None) -> list[str]:
    """Write the report of ``docs`` (one JSON document per suite) into ``directory``.

    Parameters
    ----------
    directory : str
        Created if missing.
    docs : sequence of dict
        Suite documents in the common JSON shape; one with an ``error`` (a suite that could not run) is listed
        with its reason.
    command : str or None
        The command line of the run, quoted in the report.
    readme : str or None
        A markdown file whose ``bench-report`` block gets the summary table (see :func:`update_readme`).

    Returns
    -------
    list of str
        The paths written.

    Raises
    ------
    ValueError
        From :func:`update_readme`, after the report itself is written.
    """
    os.makedirs(directory, exist_ok=True)
    written: list[str] = []
    chart_note = _matplotlib_missing()
    machine = machine_summary(_gather_machine(docs))
    charts: dict[str, str] = {}
    texts: dict[str, str] = {}
    problems: list[str] = []
    for doc in docs:
        name = str(doc.get("bench", "bench"))
        json_path = os.path.join(directory, f"{name}.json")
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        written.append(json_path)
        if doc.get("error"):
            continue
        doc = _common_shape(doc)
        cases = doc.get("cases", [])
        tools = {str(c.get("reference_tool", "reference")) for c in cases}
        tool = tools.pop() if len(tools) == 1 else "reference"
        width = max([20, *(len(str(c.get("name", ""))) for c in cases)])
        goals = [str(a["line"]) for a in doc.get("acceptance", []) if isinstance(a, dict) and a.get("line")]
        timed = [render_ttft_table(doc["ttft"]), ""] if doc.get("ttft") else []
        table = [Table(tool, name_width=width).render(cases)] if cases or not timed else []
        text = "\n".join([*timed, *table, *(["", *goals] if goals else [])]).strip("\n")
        texts[name] = text
        txt_path = os.path.join(directory, f"{name}.txt")
        with open(txt_path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        written.append(txt_path)
        if chart_note is None and cases:
            png_path = os.path.join(directory, f"{name}.png")
            try:
                _chart(doc, png_path, machine)
            except Exception as exc:  # a chart must never cost the rest of the report
                problems.append(f"{name}: {type(exc).__name__}: {exc}")
            else:
                charts[name] = f"{name}.png"
                written.append(png_path)
    if problems:
        chart_note = (chart_note + "; " if chart_note else "") + "chart failed for " + "; ".join(problems)
    index_path = os.path.join(directory, "index.md")
    with open(index_path, "w", encoding="utf-8") as f:
        f.write(_render_index(docs, charts, texts, command, chart_note) + "\n")
    written.append(index_path)
    if readme is not None:
        rel = os.path.relpath(os.path.abspath(directory), os.path.dirname(os.path.abspath(readme)))
        update_readme(readme, render_summary(docs, Path(rel).as_posix(), charts, command, chart_note))
        written.append(readme)
    return written
