"""Numbers the docs quote from benchmark results are the results' (benchmarks/render_docs.py):
every marked value in README.md and docs/ equals its source (a JSON key or a text log's regex),
and a drifted one is caught."""

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
    # a marker the pattern cannot read (here a space in its path) is reported, not skipped
    unread = mod.render(ok.replace("stream_over_device", "stream over device"))[1]
    assert len(unread) == 1 and "cannot be parsed" in unread[0]


def test_a_number_from_a_text_log_is_rendered_and_its_drift_reported(tmp_path, monkeypatch):
    mod = _module()
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    log = "s/round (median of 5): 0.0684\nGPU busy 29%; launches 2910 | 17\n"
    (tmp_path / "run.txt").write_text(log)
    text = (
        r"<!--@ run.txt~s/round \(median of \d+\): ([0-9.]+) | .3f -->0.068<!--@--> s, "
        r"<!--@ run.txt~busy (\d+)% -->29<!--@--> %, "
        r"<!--@ run.txt~launches (\d+) \| 17 \| ,.0f -->2,910<!--@--> launches"
    )
    assert mod.render(text) == (text, [])
    new, problems = mod.render(text.replace("-->0.068<", "-->0.07<").replace("-->29<", "-->30<"))
    assert new == text
    assert "the doc says '0.07', the result '0.068'" in problems[0]
    assert "the doc says '30', the result '29'" in problems[1] and len(problems) == 2
    assert "cannot be read" in mod.render(r"<!--@ run.txt~nowhere (\d+) -->1<!--@-->")[1][0]
    assert "cannot be read" in mod.render(r"<!--@ gone.txt~busy (\d+)% -->29<!--@-->")[1][0]
    table = "| <!--@ run.txt~busy (\\d+)% \\| .1f -->29.0<!--@--> |"
    assert mod.render(table) == (table, [])
