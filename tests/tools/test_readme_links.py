"""Every link README.md makes to a file resolves inside the repository (a fresh clone has nothing beside it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_links_resolve_inside_the_repository() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(text) if "://" not in t and not t.startswith("mailto:")]
    assert targets, "README links to no file: the pattern no longer matches its links"
    for t in targets:
        path = (ROOT / t).resolve()
        assert path.is_relative_to(ROOT), f"README links {t!r}, outside the repository"
        assert path.exists(), f"README links {t!r}, which does not exist"
    assert "../shared" not in text  # the shared folder is beside a checkout here, never in a user's clone
