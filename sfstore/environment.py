"""The ``SFSTORE_*`` environment, checked as a whole: every setting's variable parses, and a name sfstore does not
know (``SFSTORE_QUEUEDEPTH``) is warned about, with the name it probably meant.

:func:`check_environment` lists the problems (:class:`ConfigProblem`); :func:`validate_environment` is what
``sfstore.open()`` and the file path call before they use any setting: it raises
:class:`~sfstore.errors.ConfigError` naming every bad variable, and warns (:class:`~sfstore.errors.ConfigWarning`)
once per process about each unknown name.
"""

from __future__ import annotations

import difflib
import os
import threading
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from sfstore import defaults
from sfstore.errors import ConfigError, ConfigWarning

__all__ = [
    "Severity",
    "ConfigProblem",
    "NON_SETTING_VARIABLES",
    "NON_SETTING_PREFIXES",
    "check_environment",
    "validate_environment",
    "did_you_mean",
    "problems_text",
]

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class ConfigProblem:
    """One problem with the configuration.

    Attributes
    ----------
    severity : {"error", "warning"}
        An error stops sfstore from opening; a warning is reported and ignored.
    source : str
        Where: ``"environment variable SFSTORE_QUEUE_DEPTH"``, ``"config file /etc/sfstore.toml"``.
    key : str
        What: the variable, the config key (``"settings.queue_depth"``, ``"classes.hot.target"``), or ``""`` for
        the whole file.
    message : str
        What is wrong and what is expected, in words.
    line : int or None
        The config file's line, where known (TOML syntax errors).
    """

    severity: Severity
    source: str
    key: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = self.source + (f", line {self.line}" if self.line else "")
        return f"{self.severity}: {where}: {self.message}"


NON_SETTING_VARIABLES: Mapping[str, str] = {
    "SFSTORE_CONFIG": "the config file to read (instead of ./sfstore.toml or ~/.config/sfstore/sfstore.toml)",
    "SFSTORE_ROOT": "the root directory of every file-backed data class (wins over the config file's root)",
    "SFSTORE_VENV": "the virtual environment tools/dev.sh and the tools' env scripts build",
    "SFSTORE_FUZZ_SEED": "the seed of the reliability suite's fuzz tests",
    "SFSTORE_RELIABILITY_SCALE": "how long the reliability suite runs (a multiplier)",
    "SFSTORE_RELIABILITY_SECONDS": "how long the reliability suite runs (seconds)",
    "SFSTORE_TESTBED": "set inside the testbed VM",
}
"""The ``SFSTORE_*`` variables sfstore (its tools and tests included) reads that are not settings of
:mod:`sfstore.defaults`."""

NON_SETTING_PREFIXES = ("SFSTORE_TEST_", "SFSTORE_TESTBED_")
"""Prefixes of the variables the testbed and integration tests pass to one another."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """``" (did you mean X?)"`` for the closest of ``candidates`` to ``name``, or ``""`` when none is close."""
    pool = list(candidates)
    folded = {c.lower(): c for c in pool}
    close = difflib.get_close_matches(name.lower(), list(folded), n=1, cutoff=0.75)
    return f" (did you mean {folded[close[0]]}?)" if close else ""


def _known_variables() -> dict[str, str]:
    known = {s.env: f"the {s.name} setting" for s in defaults.SETTINGS.values()}
    known.update(NON_SETTING_VARIABLES)
    return known


def check_environment(environ: Mapping[str, str] | None = None, *,
                      unknown: Severity = "warning") -> list[ConfigProblem]:
    """Every problem with the ``SFSTORE_*`` variables of ``environ`` (default ``os.environ``).

    A setting's variable that does not parse is an error; an ``SFSTORE_*`` name sfstore does not read is a
    problem of severity ``unknown`` (with the closest known name): a warning where sfstore runs, an error for the
    commands whose job is to check (``sfstore config check``, ``sfstore probe``), since the setting it was meant
    to be is not in force. Whether ``SFSTORE_ROOT`` exists is checked where the root is used
    (:mod:`sfstore.config_check`, the router).
    """
    env = os.environ if environ is None else environ
    known = _known_variables()
    by_env = {s.env: s for s in defaults.SETTINGS.values()}
    problems: list[ConfigProblem] = []
    for name in sorted(k for k in env if k.startswith("SFSTORE_")):
        value = env[name]
        source = f"environment variable {name}"
        setting = by_env.get(name)
        if setting is not None:
            if value == "":
                continue  # an empty variable is unset (as defaults.get has it)
            reason = setting.explain(value)
            if reason:
                problems.append(ConfigProblem("error", source, name, reason))
        elif name not in known and not name.startswith(NON_SETTING_PREFIXES):
            # Matched without the common prefix, which would make every name look close to every other.
            hint = did_you_mean(name[len("SFSTORE_"):], [k[len("SFSTORE_"):] for k in known])
            hint = hint.replace("(did you mean ", "(did you mean SFSTORE_") if hint else ""
            problems.append(ConfigProblem(
                unknown, source, name,
                f"not a variable sfstore reads{hint}; `python -m sfstore.defaults` lists the settings"))
    return problems


def problems_text(problems: Iterable[ConfigProblem]) -> str:
    """One line per problem, under a count when there are several."""
    items = list(problems)
    if len(items) == 1:
        p = items[0]
        return f"{p.source}" + (f", line {p.line}" if p.line else "") + f": {p.message}"
    lines = [f"{len(items)} configuration problems:"]
    lines += ["  " + p.source + (f", line {p.line}" if p.line else "") + f": {p.message}" for p in items]
    return "\n".join(lines)


_lock = threading.Lock()
_warned: set[str] = set()
_last_good: tuple[tuple[str, str], ...] | None = None


def validate_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`~sfstore.errors.ConfigError` naming every ``SFSTORE_*`` variable that does not parse; warn
    (:class:`~sfstore.errors.ConfigWarning`, once per name and process) about each unknown ``SFSTORE_*`` name.

    Cheap when called again with the same variables (``sfstore.open()`` and every file path call it).
    """
    global _last_good
    env = os.environ if environ is None else environ
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith("SFSTORE_")))
    with _lock:
        if key == _last_good:
            return
    problems = check_environment(env)
    for p in problems:
        if p.severity != "warning":
            continue
        with _lock:
            if p.key in _warned:
                continue
            _warned.add(p.key)
        warnings.warn(ConfigWarning(f"{p.source}: {p.message}"), stacklevel=3)
    bad = [p for p in problems if p.severity == "error"]
    if bad:
        raise ConfigError(problems_text(bad) + ("" if len(bad) == 1 else "\n(`sfstore config check` lists them)"))
    with _lock:
        _last_good = key
