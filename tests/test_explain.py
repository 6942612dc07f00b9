"""`graphdiff explain` on every site of the recorded scan (fixtures/scans/tiny-qwen3, from a real run), and
`graphdiff replay` reproducing a kernel's replay from the scan directory's recorded buffers."""

from __future__ import annotations

import re

import pytest

from graphdiff.artifacts import ScanDir
from graphdiff.errors import GraphdiffError
from graphdiff.report.explain import explain_lines, find_site, replay_one
from tests.conftest import FIXTURES
from tests.test_cli_errors import one_error_line, run_cli

SCAN = FIXTURES / "scans" / "tiny-qwen3"


@pytest.fixture(scope="module")
def scan():
    return ScanDir(SCAN).load_scan()


def test_every_site_of_the_fixture_explains_on_one_screen(scan):
    assert len(scan.sites) >= 20
    for site in scan.sites:
        lines = explain_lines(SCAN, scan, site)
        text = "\n".join(lines)
        assert len(lines) <= 24, site.id
        assert lines[0] == f"site     {site.id}"
        assert site.region in text and site.train.node in text
        assert f"{site.train.source.line}" in text and site.train.source.code in text  # the trainer's source line
        assert re.search(r"^rule     (matched|inside-kernel|opaque-registry)", text, re.M), site.id
        if site.kind == "attention":
            assert "registry" in text
            continue
        kernel = next(d for d in scan.plan if d.id == site.id and d.site).evidence.kernel
        assert f"kernel   {kernel} @ " in text and "predicted 100.00%" in text, site.id
        assert f"graphdiff replay {SCAN} {kernel} --shape " in text, site.id
        if site.matched:  # both values, both source lines
            assert site.engine.node in text and str(site.engine.source.line) in text


def test_a_site_is_found_by_a_unique_part_of_its_id(scan):
    site = next(s for s in scan.sites if s.kind == "gated_act" and s.layer == 1)
    assert find_site(scan, "layers.1.mlp.act_fn") is site
    with pytest.raises(GraphdiffError, match="matches 2 sites"):
        find_site(scan, "mlp.act_fn")
    with pytest.raises(GraphdiffError, match="is not a site"):
        find_site(scan, "no-such-site")


def test_the_printed_replay_command_reproduces_the_scans_numbers(scan):
    site = next(s for s in scan.sites if s.kind == "gated_act")
    d = next(d for d in scan.plan if d.id == site.id and d.site)
    evidence = next(r for r in scan.replay if r.kernel == d.evidence.kernel and not r.error)
    one = replay_one(SCAN, d.evidence.kernel, evidence.shape)
    again = one.evidence
    assert not again.error and again.shape == evidence.shape
    assert (round(again.predicted_bitexact, 6), round(again.naive_bitexact, 6), again.elements) == (
        evidence.predicted_bitexact, evidence.naive_bitexact, evidence.elements)
    assert one.stores and all(again.per_output[b][0] == 1.0 for b in one.stores)


def test_explain_cli_prints_the_site_and_refuses_an_unknown_one():
    site = ScanDir(SCAN).load_scan().sites[0]
    proc = run_cli("explain", site.id, str(SCAN))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith(site.id)
    assert "not a site" in one_error_line(run_cli("explain", "nope", str(SCAN)))
