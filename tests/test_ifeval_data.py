"""The vendored IFEval data is what PROVENANCE.md says it is (hashes, line counts, licence)."""
import hashlib
import json
import re
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "data" / "ifeval"


def _provenance_hashes() -> dict[str, str]:
    """file -> sha256 from the table in PROVENANCE.md."""
    rows = re.findall(r"^\| `([^`]+)` \|.*\| ([0-9a-f]{64}) \|$", (DATA / "PROVENANCE.md").read_text(), re.M)
    return dict(rows)


def test_provenance_lists_every_vendored_data_file():
    listed = set(_provenance_hashes())
    present = {str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file()} - {"PROVENANCE.md", "LICENSE"}
    assert listed == present


@pytest.mark.parametrize("name", sorted(_provenance_hashes()))
def test_vendored_file_hash_matches_provenance(name):
    assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == _provenance_hashes()[name]


def test_licence_is_apache_2():
    assert "Apache License" in (DATA / "LICENSE").read_text() and "Version 2.0" in (DATA / "LICENSE").read_text()


@pytest.mark.parametrize("name", ["input_data.jsonl", "input_data_gpt4_20231107_145030.jsonl",
                                  "input_response_data_gpt4_20231107_145030.jsonl"])
def test_jsonl_has_541_objects(name):
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    assert len(lines) == 541
    assert all(isinstance(json.loads(line), dict) for line in lines)


def test_the_two_prompt_revisions_differ_only_at_key_2785():
    cur = {json.loads(l)["key"]: json.loads(l) for l in (DATA / "input_data.jsonl").read_text().splitlines()}
    old = {json.loads(l)["key"]: json.loads(l) for l in
           (DATA / "input_data_gpt4_20231107_145030.jsonl").read_text().splitlines()}
    assert cur.keys() == old.keys()
    assert [k for k in cur if cur[k] != old[k]] == [2785]
