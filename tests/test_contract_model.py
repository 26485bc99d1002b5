"""The Hypothesis contract model of resident-qpacked-cache-v1 (runmap/residency/contract_model.py) and `runmap contract`.

The model must pass on the real cache and must catch every deliberately broken variant (MUTANTS); a
model that cannot fail would prove nothing.
"""
import json
import os
import sys

import pytest
import torch
from jsonschema import Draft202012Validator

from runmap.residency import contract_model as cm
from runmap.residency.cache import ExpertCache
from runmap.cli.main import main
from runmap.conformance.schemas import load_schemas

DEVICE = "cpu"
SHRINK = not os.environ.get("RUNMAP_MUTATION")  # benchmarks/mutation.sh: a killed mutant needs no minimal example


def test_contract_holds_for_the_cache(test_device):
    # 150 examples: seed 0 then meets every outcome below (a prefetch on a faulted cache is the rarest; 100 did not
    # since the run stopped drawing constants from the process's modules)
    stats, exc = cm.run_contract(examples=150, steps=25, seed=0, device=test_device, shrink=SHRINK)
    assert exc is None, exc
    assert stats.examples >= 100
    for name in cm.INVARIANTS:
        if name != "faulted_admits_nothing":
            assert stats.invariants[name] > 0, name
    assert stats.outcomes["miss"] > 0 and stats.outcomes["hit"] > 0 and stats.outcomes["abort"] > 0
    # every injection point was met, both as an Exception and as a BaseException
    for kind in cm.FAIL_KINDS + ("interrupt", "kernel", "kernel-interrupt", "cpu-site", "cpu-site-interrupt"):
        assert stats.rules[f"inject_{kind}"] > 0, kind
    assert stats.outcomes["block_kernel-interrupt"] > 0 and stats.outcomes["interrupt_abort"] > 0
    # mixed placements (issue 25): some absent experts at the CPU site, some transferred, failures in either
    assert stats.rules["placed_on_cpu"] > 0 and stats.rules["placed_none_on_cpu"] > 0
    assert stats.outcomes["block_cpu-site-interrupt"] > 0 and stats.outcomes["block_cpu-site"] > 0
    # next-layer prefetch (issue 24 item 5): published, skipped for room, aborted, interrupted, all resident
    for outcome in ("miss", "busy", "abort", "interrupt", "resident", "fault", "refused_faulted"):
        assert stats.outcomes[f"prefetch_{outcome}"] > 0, outcome
    # the host-read site: steps counted against their request's generation; promotions published, declined (below the
    # margin or nothing absent), aborted and interrupted like any transaction
    assert stats.rules["host_read_step"] > 0
    assert stats.configs["lent"] > 0  # caches whose spares were lent to residency at startup (host_read_spares)
    # two-site steps (some absent experts at the CPU site) counted apart, and a CPU share naming a resident or unrouted
    # expert refused
    assert stats.invariants["two_site_counts_cpu_apart"] > 0 and stats.rules["host_read_step_refused"] > 0
    for outcome in ("miss", "none", "abort", "interrupt", "faulted"):
        assert stats.outcomes[f"promote_{outcome}"] > 0, outcome


@pytest.mark.parametrize("name", sorted(cm.MUTANTS))
def test_model_catches_mutant(name, test_device):
    if "controlled" not in cm.mutant_modes(cm.MUTANTS[name]):
        pytest.skip(f"{name} shows only in the cuda events mode")
    stats, exc = cm.run_contract(examples=800, steps=30, seed=0, device=test_device, cache_cls=cm.MUTANTS[name],
                                 shrink=False)
    assert isinstance(exc, cm.ContractViolation), f"mutant {name} not caught in {stats.examples} examples: {exc!r}"


def test_a_seeded_run_draws_no_constants_from_the_process_modules(tmp_path, monkeypatch):
    """Hypothesis mixes integers from the process's own modules (|n| >= 100) into its draws, so a seeded run depended on
    what was imported before it (a mutant missed under pytest-xdist after the other tests' imports). run_contract runs
    its state machine inside contract_model._no_local_constants, where that pool is empty even with a module full of
    such constants imported; outside it, the pool has them again."""
    from hypothesis.internal.conjecture import providers

    (tmp_path / "runmap_many_constants.py").write_text("A = 1000\nB = 4096\nC = 255\nD = -12345\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("runmap_many_constants")
    try:
        assert {1000, 4096, 255, -12345} <= set(providers._get_local_constants().integers)
        with cm._no_local_constants():
            assert not list(providers._get_local_constants().integers)
        assert 4096 in set(providers._get_local_constants().integers)
        entered = []
        real = cm._no_local_constants

        def spy():
            entered.append(True)
            return real()

        monkeypatch.setattr(cm, "_no_local_constants", spy)
        stats, exc = cm.run_contract(examples=3, steps=5, seed=0, shrink=False)
        assert exc is None and stats.examples >= 3 and entered == [True]
    finally:
        sys.modules.pop("runmap_many_constants", None)


def test_mutants_are_real_subclasses():
    assert len(cm.MUTANTS) >= 3
    for cls in cm.MUTANTS.values():
        assert issubclass(cls, ExpertCache) and cls is not ExpertCache


def test_controlled_transport_defers_bytes_until_completion():
    import torch
    from runmap.residency.transport import CpuTransport

    tr = cm.ControlledTransport(CpuTransport())
    dst = torch.zeros(4, dtype=torch.uint8)
    stg = tr.alloc_staging(4)
    tr.stage(stg, torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    ev = tr.h2d(dst, stg)
    assert not tr.query(ev) and dst.sum() == 0  # not yet copied
    tr.stage(stg, torch.tensor([9, 9, 9, 9], dtype=torch.uint8))  # rewriting staging before its copy ends
    assert tr.staging_violations == 1
    tr.wait(ev)
    assert tr.query(ev) and dst.tolist() == [9, 9, 9, 9]  # the copy read the buffer at completion


def test_cli_writes_a_valid_report(tmp_path, monkeypatch):
    """The CLI's report: the run, each mutant's entry, the transport mutants listed as not applicable. Two mutants
    stand for the list here (each one's catch is test_model_catches_mutant's; all of them took ~2 min of CI)."""
    monkeypatch.setattr(cm, "MUTANTS", {n: cm.MUTANTS[n] for n in ("publish-before-transfer", "host-reads-as-hits")})
    out = tmp_path / "contract" / "report.json"
    rc = main(["contract", "--examples", "120", "--mutant-examples", "800", "--no-progress", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, doc["failure_details"]
    assert doc["passed"] and doc["failures"] == 0 and doc["device"]["requested"] == DEVICE
    assert all(m["caught"] for m in doc["mutants"].values()) and len(doc["mutants"]) == len(cm.MUTANTS)
    assert doc["device"]["events"] == "controlled" and set(doc["mutants_not_applicable"]) == set(cm.TRANSPORT_MUTANTS)
    schemas = load_schemas()
    assert [s.name for s in schemas.matching(out)] == ["contract-report.schema.json"]
    assert schemas.validate_document(doc, "contract-report") == []
    bad = dict(doc, failures=1)
    assert schemas.validate_document(bad, "contract-report") != []  # passed=true with a failure is invalid
    assert not list(tmp_path.glob("contract/.*"))  # no temp file left behind


def test_telemetry_matches_its_schema():
    from runmap.residency.host_source import HostSource
    from runmap.format.qpack import RowLayout
    import torch

    lay = RowLayout.build(8, 4, 4)
    rows = [torch.randint(0, 256, (4, lay.row_bytes), dtype=torch.uint8) for _ in range(2)]
    cache = ExpertCache.from_pack(cm.InMemoryPack(rows, lay), resident=2, max_group=2)
    with cache.admit() as r:
        r.acquire(1, [2, 3])
    schemas = load_schemas()
    v = Draft202012Validator({"$ref": "https://horizon-runmap.invalid/schemas/observations.schema.json#/$defs/cache_telemetry"}, registry=schemas.registry)
    errors = [e.message for e in v.iter_errors(cache.telemetry())]
    assert errors == []
    tel = cache.telemetry()
    tel["observations"]["writebacks"] = {"status": "UNKNOWN", "value": 0, "reason": "x"}  # a zero with no measurement
    assert list(v.iter_errors(tel))


@pytest.mark.parametrize("option", ["--examples", "--steps", "--mutant-examples"])
@pytest.mark.parametrize("value", ["0", "-2", "ten"])
def test_cli_refuses_a_count_below_one_in_one_line(tmp_path, capsys, option, value):
    """A count the state machine cannot run (Hypothesis would raise InvalidArgument only after the main run, for
    --mutant-examples 0) is refused before anything runs: exit 2, the option named, no report."""
    with pytest.raises(SystemExit) as e:
        main(["contract", option, value, "--no-progress", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and f"argument {option}:" in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_cli_refuses_cuda_events_without_cuda(tmp_path, capsys):
    rc = main(["contract", "--events", "cuda", "--no-progress", "--out", str(tmp_path / "r.json")])
    assert rc == 2 and not (tmp_path / "r.json").exists()
    with pytest.raises(ValueError, match="cuda event mode needs device='cuda'"):
        cm.make_machine(events="cuda")


def test_counter_mutants_are_caught_by_the_counter_comparison():
    for name in ("overcount-h2d-on-abort", "count-group-as-misses", "cpu-placed-as-hits"):
        _stats, exc = cm.run_contract(examples=800, steps=30, seed=0, cache_cls=cm.MUTANTS[name], shrink=False)
        assert isinstance(exc, cm.ContractViolation) and "differ from the model" in str(exc), (name, exc)


def test_a_leaky_request_block_is_caught():
    _stats, exc = cm.run_contract(examples=800, steps=30, seed=0, cache_cls=cm.MUTANTS["leak-lease-on-raise"],
                                  shrink=False)
    assert isinstance(exc, cm.ContractViolation) and "request block" in str(exc), exc


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda events mode needs a GPU (benchmarks/contract_cuda_h200.sh)")
def test_cuda_events_mode_holds_and_catches_an_early_event():
    stats, exc = cm.run_contract(examples=10, steps=15, seed=0, device="cuda", events="cuda", shrink=False)
    assert exc is None, exc
    assert stats.invariants["events_fence_their_copies"] > 0
    _s, exc = cm.run_contract(examples=40, steps=15, seed=0, device="cuda", events="cuda", shrink=False,
                              transport_cls=cm.TRANSPORT_MUTANTS["event-before-copy"])
    assert isinstance(exc, cm.ContractViolation), exc


def test_a_violation_that_did_not_recur_on_replay_still_catches_the_mutant():
    """On a GPU a copy-timing race can break the contract once and pass on Hypothesis' replay; the
    FlakyFailure group it raises holds the ContractViolation, which counts as the mutant caught."""
    from hypothesis.errors import FlakyFailure

    from runmap.cli.contract import _contract_violation
    from runmap.residency.contract_model import ContractViolation

    v = ContractViolation("row 3 read before its copy completed")
    assert _contract_violation(v) is v
    assert _contract_violation(FlakyFailure("Inconsistent results", [v])) is v
    assert _contract_violation(FlakyFailure("Inconsistent results", [ValueError("other")])) is None
    assert _contract_violation(RuntimeError("no")) is None and _contract_violation(None) is None


@pytest.mark.parametrize("report, rule", [("h200-controlled.json", "inject_copy"), ("h200-cuda-events.json", "inject_kernel")])
def test_contract_report_schema_requires_the_injections_of_its_mode(report, rule):
    """The controlled mode must have injected every transport failure; the cuda events mode kernel failures."""
    import copy
    import json
    from pathlib import Path

    from runmap.conformance.schemas import load_schemas

    doc = json.loads((Path(__file__).resolve().parent.parent / "results" / "contract" / report).read_text())
    assert load_schemas().validate_document(doc, "contract-report") == []
    broken = copy.deepcopy(doc)
    broken["rules"].pop(rule)
    assert load_schemas().validate_document(broken, "contract-report") != []
