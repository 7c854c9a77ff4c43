r"""Numbers in the docs, filled in from the benchmark results they come from, so they cannot
drift from them.

A number in a Markdown file is written between two markers naming its source::

    streamed pool <!--@ cpu-2026-11-25/streaming.json:stream_over_device | .2f -->0.97<!--@-->x
    <!--@ h100-2026-11-24/profile-graphs1.txt~GPU busy (\d+)% -->103<!--@--> %

``FILE:PATH``: a JSON file under ``benchmarks/results/`` and the dotted path to a number in
it, or ``PATH/PATH`` for the ratio of two numbers of that file; ``* K`` after it scales the
value (``* 100`` for a percentage). ``FILE~REGEX``: a text file there (a log, a profile) and
a Python regex with one group, searched for in it; the group's text of the first match, as
a number. ``| SPEC`` a Python format spec (default ``g`` for JSON; for text, the group as it
is), after a space in the text form; ``\|`` instead of ``|`` inside a Markdown table.
``python benchmarks/render_docs.py`` rewrites every marked value in README.md and
docs/*.md; ``--check`` changes nothing and exits 1, listing each stale or unresolvable value
(tests/test_docs_numbers.py runs it).

It also writes the generated page docs/coverage.md (``benchmarks/paper_coverage.py``: every
table and figure of the papers, its config, its transcribed numbers, the reasons for the
gaps), which ``--check`` reports when stale (tests/test_coverage.py checks it too).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARK = re.compile(
    r"<!--@ (?P<file>[^:~\s]+)"
    r"(?::(?P<path>[^\s|*\\]+)\s*(?:\*\s*(?P<scale>[0-9.eE+-]+)\s*)?"  # FILE:PATH [* K]
    r"|~(?P<regex>.+?)(?:\s+(?=\\?\|)|\s*(?=-->)))"  # FILE~REGEX, up to " |" or "-->"
    r"(?:\\?\|\s*(?P<spec>\S+?)\s*)?-->"
    r"(?P<value>.*?)<!--@-->"
)


def lookup(file: str, path: str) -> float:
    """The number at the dotted ``path`` of ``benchmarks/results/<file>`` (``a/b``: the
    number at ``a`` over the number at ``b``)."""
    if "/" in path:
        num, den = path.split("/")
        return lookup(file, num) / lookup(file, den)
    node = json.loads((RESULTS / file).read_text())
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise ValueError(f"{file}:{path} is {node!r}, not a number")
    return node


def search(file: str, regex: str) -> str:
    """The text of ``regex``'s group in its first match in ``benchmarks/results/<file>``."""
    m = re.search(regex, (RESULTS / file).read_text(), re.MULTILINE)
    if m is None:
        raise ValueError(f"{regex!r} matches nothing")
    return m.group(1)


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every marked value recomputed, and a line per marker that changed or
    could not be resolved."""
    problems: list[str] = []

    def one(m: re.Match) -> str:
        source = f"{m['file']}~{m['regex']}" if m["regex"] else f"{m['file']}:{m['path']}"
        try:
            if m["regex"]:
                found = search(m["file"], m["regex"])
                shown = format(float(found), m["spec"]) if m["spec"] else found
            else:
                value = lookup(m["file"], m["path"])
                if m["scale"]:
                    value *= float(m["scale"])
                shown = format(value, m["spec"] or "g")
        except (OSError, KeyError, IndexError, ValueError, re.error) as e:
            problems.append(f"{source}: cannot be read ({type(e).__name__}: {e})")
            return m.group(0)
        if shown != m["value"]:
            problems.append(f"{source}: the doc says {m['value']!r}, the result {shown!r}")
        return m.group(0).replace(f"-->{m['value']}<!--@-->", f"-->{shown}<!--@-->")

    # an opening the pattern does not read (a space in a JSON path, a missing closer) would
    # otherwise be skipped in silence and its number never checked
    starts = {m.start() for m in MARK.finditer(text)}
    for at in (m.start() for m in re.finditer(re.escape("<!--@ "), text)):
        if at not in starts:
            problems.append(f"a marker that cannot be parsed: {text[at : at + 80]!r}")
    return MARK.sub(one, text), problems


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a value is stale"
    )
    args = ap.parse_args()
    bad = 0
    for path in docs():
        text = path.read_text()
        new, problems = render(text)
        for p in problems:
            print(f"{path.relative_to(ROOT)}: {p}", file=sys.stderr)
        bad += len(problems)
        if not args.check and new != text:
            path.write_text(new)
    coverage = _coverage()
    if args.check:
        for p in coverage.check(ROOT):
            print(p, file=sys.stderr)
            bad += 1
    elif coverage.write(ROOT):
        print(f"wrote {coverage.PAGE}", file=sys.stderr)
    return 1 if args.check and bad else 0


def _coverage():
    """benchmarks/paper_coverage.py (loaded here: it imports fedforget, the markers do not)."""
    spec = importlib.util.spec_from_file_location(
        "paper_coverage", Path(__file__).with_name("paper_coverage.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    sys.exit(main())
