"""Numbers the docs quote from benchmark results are the results' (benchmarks/render_docs.py):
every marked value in README.md and docs/ equals its JSON source, and a drifted one is caught."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "render_docs.py"


def _module():
    spec = importlib.util.spec_from_file_location("render_docs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_quoted_number_is_its_results():
    mod = _module()
    marks = 0
    for path in mod.docs():
        text = path.read_text()
        marks += len(mod.MARK.findall(text))
        _, problems = mod.render(text)
        assert not problems, (path.name, problems)
    assert marks >= 20


def test_a_drifted_or_unreadable_number_is_reported():
    mod = _module()
    ok = "<!--@ cpu-2026-11-25/streaming.json:stream_over_device | .2f -->0.97<!--@-->"
    assert mod.render(ok)[1] == []
    new, problems = mod.render(ok.replace("0.97", "0.99"))
    assert "0.97<!--@-->" in new and "the doc says '0.99'" in problems[0]
    ratio = "<!--@ cpu-2026-11-25/streaming.json:stream_samples_per_s.median/device_samples_per_s.median | .2f -->0.97<!--@-->"
    assert mod.render(ratio)[1] == []
    assert "cannot be read" in mod.render(ok.replace("stream_over_device", "nope"))[1][0]
