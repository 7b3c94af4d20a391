"""BENCHMARKS.md is the report the README's numbers come from.

Every performance number the README quotes (a ratio such as 0.56× or 2.8-4.4× anywhere
in it, a share such as 100% in its Numbers section) appears in BENCHMARKS.md, as a whole
number (0.56× is not found inside 10.56×); BENCHMARKS.md links the dated journal, which
exists; the README stays under 150 lines."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RATIO = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)\s?[×x](?!\w)")
PERCENT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)%")


def _norm(text: str) -> str:
    return text.replace("×", "x")


def readme_numbers(text: str) -> set[str]:
    """The ratios of the whole README and the shares of its Numbers section."""
    text = _norm(text)
    numbers = {f"{m.group(1)}x" for m in RATIO.finditer(text)}
    section = text[text.index("## Numbers"):text.index("\n## ", text.index("## Numbers") + 1)]
    numbers |= {f"{m.group(1)}%" for m in PERCENT.finditer(section)}
    return numbers


def quoted_in(number: str, report: str) -> bool:
    return re.search(rf"(?<![\d.\-]){re.escape(number)}(?![\w])", _norm(report)) is not None


def test_the_extraction() -> None:
    text = ("## Numbers\n- **0.56×** the best peer; 2.8-4.4× and 1.04x, 100% reused; "
            "x86_64 and 8,192 tokens are not numbers of the report\n## Next\n75% of memory")
    assert readme_numbers(text) == {"0.56x", "2.8-4.4x", "1.04x", "100%"}
    assert quoted_in("0.56x", "| S3 | 0.56× |") and not quoted_in("0.56x", "10.56×")
    assert not quoted_in("4x", "14.6x") and quoted_in("4x", "KV is 4× the budget")
    assert not quoted_in("2.8-4.4x", "2.8-4.45×")


def test_every_performance_number_of_the_readme_is_in_benchmarks() -> None:
    numbers = readme_numbers((ROOT / "README.md").read_text())
    # the README's headline numbers (a change that drops one from the README drops it here)
    assert {"100%", "0.56x", "1.04x", "2.9-3.7x", "2.8-4.4x", "1.09-1.47x", "1.10-1.46x",
            "0.99x", "1.12x", "12-34x"} <= numbers
    report = (ROOT / "BENCHMARKS.md").read_text()
    missing = sorted(n for n in numbers if not quoted_in(n, report))
    assert missing == [], f"README numbers not in BENCHMARKS.md: {missing}"


def test_the_report_links_its_journal_and_the_readme_stays_short() -> None:
    report = (ROOT / "BENCHMARKS.md").read_text()
    assert "](docs/benchmarks-history.md)" in report
    journal = (ROOT / "docs" / "benchmarks-history.md").read_text()
    assert journal.startswith("# Benchmarks: the journal\n")
    assert "](../BENCHMARKS.md)" in journal
    assert len((ROOT / "README.md").read_text().splitlines()) < 150
