"""The parse cache (fedforget.parsecache): a Snakemake start with an unchanged config and
package loads the validated config without importing torch; any change validates again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedforget.parsecache import parse_key, parse_workflow
from fedforget.utils import FedForgetError

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys, yaml
from fedforget.parsecache import parse_workflow
wf, digests = parse_workflow(yaml.safe_load(open(sys.argv[1])), sys.argv[2])
print(json.dumps({"torch": "torch" in sys.modules, "runs": len(wf.runs()),
                  "training": sorted(digests["training"].values())}))
"""


def _probe(cfg: Path, cache: Path) -> dict:
    import json

    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(cfg), str(cache)], capture_output=True, text=True, check=True, cwd=REPO
    )
    return json.loads(out.stdout)


def test_second_parse_loads_the_cache_without_torch(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text((REPO / "config" / "config.yaml").read_text())
    cache = tmp_path / ".snakemake" / "fedforget"
    cache.parent.mkdir()
    first = _probe(cfg, cache)
    assert first["torch"] and len(list(cache.glob("parse-*.pickle"))) == 1  # validated: methods loaded
    second = _probe(cfg, cache)
    assert not second["torch"]  # loaded from the cache
    assert second["runs"] == first["runs"] and second["training"] == first["training"]


def test_the_workflows_own_imports_are_torch_free():
    """The modules the rules import at parse time (every ``from fedforget... import`` line of
    workflow/**/*.smk) import no torch: with the parse cached, a Snakemake start (each dry
    run) then costs no torch import (about 2.5 s on 2 cores; fedforget.aggregate, which
    imports it, was one of them)."""
    import re

    lines = sorted({m.group(0) for f in (REPO / "workflow").rglob("*.smk")
                    for m in re.finditer(r"^from fedforget\S* import .+$", f.read_text(), re.M)})  # fmt: skip
    assert any("fedforget.parsecache" in x for x in lines)
    code = "\n".join(x for x in lines if not x.endswith("(")) + "\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", lines


def test_key_follows_the_config_and_the_files_it_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    csv = tmp_path / "paper.csv"
    csv.write_text("a\n")
    raw["paper_results"] = str(csv)
    k = parse_key(raw)
    assert parse_key(dict(raw)) == k
    csv.write_text("b\n")  # a named file's contents
    assert parse_key(raw) != k
    changed = {**raw, "results_dir": "elsewhere"}
    assert parse_key(changed) != parse_key(raw)
    # `only` selects targets: the parse of the whole file serves every part of it
    assert parse_key({**raw, "only": "default/fedavg"}) == parse_key(raw)


def test_the_snakefile_parse_caches_where_no_snakemake_dir_exists_yet(tmp_path, monkeypatch):
    """Snakemake parses the Snakefile before it makes .snakemake/ in a new working directory:
    ``create`` (common.smk's call) caches that first parse; without it nothing is written
    outside a Snakemake working directory."""
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw["paper_results"] = str(REPO / "config" / "paper_results.csv")
    parse_workflow(raw, tmp_path / "a" / ".snakemake" / "fedforget")
    assert not (tmp_path / "a").exists()
    cache = tmp_path / "b" / ".snakemake" / "fedforget"
    parse_workflow(raw, cache, create=True)
    assert [p.name for p in cache.iterdir()] == [f"parse-{parse_key(raw)}.pickle"]


def test_bad_config_is_never_cached(tmp_path):
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw["experiments"][0]["methods"] = [{"name": "no_such_method"}]
    cache = tmp_path / ".snakemake" / "fedforget"
    cache.parent.mkdir()
    for _ in range(2):
        with pytest.raises(FedForgetError, match="no_such_method"):
            parse_workflow(raw, cache)
    assert not cache.exists() or not list(cache.glob("parse-*"))


def test_the_default_paper_results_file_is_part_of_the_key(tmp_path, monkeypatch):
    """Removing config/paper_results.csv (read by validation although no config key names
    it) must not let a cached parse hide the error."""
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw.pop("paper_results", None)
    (tmp_path / "config").mkdir()
    csv = tmp_path / "config" / "paper_results.csv"
    csv.write_text("a\n")
    k = parse_key(raw)
    csv.unlink()
    assert parse_key(raw) != k


def test_cached_run_configs_and_code_digests_equal_their_definitions(tmp_path, monkeypatch):
    """What the parse keeps for the rules (each run's config JSON, hash and client_state_mb,
    the other rules' code digests) is what RunConfig, parse and provenance compute, so the
    cache changes no job's params, resources or rerun trigger."""
    from fedforget.parse import client_state_mb
    from fedforget.parsecache import code_roots
    from fedforget.provenance import module_code
    from fedforget.utils import canonical_json

    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw["paper_results"] = str(REPO / "config" / "paper_results.csv")
    wf, digests = parse_workflow(raw, tmp_path / "none")  # no .snakemake/: not written
    runs = wf.runs()
    assert set(digests["runs"]) == {str(rc.run_dir) for rc in runs}
    for rc in runs:
        cached = digests["runs"][str(rc.run_dir)]
        assert cached["config"] == canonical_json(rc.to_dict()) and cached["hash"] == rc.hash
        assert cached["client_state_mb"] == client_state_mb(rc)
    roots = code_roots(wf)
    assert ("fedforget.partition",) in roots and any(r[-1] == "fedforget.data.base" for r in roots)
    assert digests["code"] == {r: module_code(*r).digest for r in roots}
    assert digests["code_bytes"] == {r: module_code(*r, form="bytes").digest for r in roots}
