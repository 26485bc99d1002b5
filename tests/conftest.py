"""Test setup shared by every test module.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, i.e. before ``kernels``
is imported anywhere; conftest.py is imported by pytest before the test modules, so it is set here.
On a machine with a GPU, run with RUNMAP_TEST_DEVICE=cuda to exercise the compiled kernels instead.
"""
import os

if os.environ.get("RUNMAP_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's command: one worker process per core of CI's 2-core machine) BLAS, OpenMP and torch
# thread pools sized to every core in each worker oversubscribe the cores, and their spinning threads then wait on
# each other: tests/test_host_read.py + tests/test_placement.py took 294 s with -n 2 on the 2-core VM, 120 s with one
# thread per worker. A worker therefore starts its pools at one thread unless OMP_NUM_THREADS says otherwise (tests that
# are about thread counts set them explicitly); set before numpy and torch are imported.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Sweeps whose every point runs on a GPU (RUNMAP_TEST_DEVICE=cuda) but only a representative part in the CPU
# interpreter, where each point costs seconds to minutes: ``@pytest.mark.sweep(predicate)`` on a parametrized test,
# ``predicate(params) -> bool`` (params: the point's parameter dict) naming the points the CPU run leaves out. They are
# deselected (listed by ``-ra``'s summary as deselected, never as passed), and RUNMAP_TEST_SWEEP=1 runs them on the CPU
# too. Why: CI's 2-core machine must finish the suite in 25 minutes (README, "Tests").
SWEEP_ENV = "RUNMAP_TEST_SWEEP"


def pytest_configure(config):
    config.addinivalue_line("markers", "sweep(predicate): the points of a parameter sweep for which predicate(params) "
                                       "is true run on a GPU or with RUNMAP_TEST_SWEEP=1 only (tests/conftest.py)")
    config.addinivalue_line("markers", "cpu_device: builds engines on the CPU device whatever RUNMAP_TEST_DEVICE says; "
                                       "skipped in a GPU run (tests/conftest.py)")


# A test marked cpu_device runs its Triton kernels on CPU tensors, which only the interpreter can do, and the
# interpreter is chosen once per process, before any kernel is defined (above): a GPU run (RUNMAP_TEST_DEVICE=cuda)
# compiles them for the GPU instead, so there such a test would fail on "cannot be accessed from Triton (cpu tensor?)"
# (the GPU run of 2026-12-07) and leave the CUDA context in a state that failed later tests too.
CPU_DEVICE_SKIP = "builds engines on the CPU device, whose Triton kernels need the interpreter this GPU run leaves off"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RUNMAP_TEST_DEVICE", "cpu") != "cpu":
        for item in items:
            if item.get_closest_marker("cpu_device") is not None:
                item.add_marker(pytest.mark.skip(reason=CPU_DEVICE_SKIP))
        return
    if os.environ.get(SWEEP_ENV) == "1":
        return
    kept, left_out = [], []
    for item in items:
        mark = item.get_closest_marker("sweep")
        params = getattr(getattr(item, "callspec", None), "params", None)
        if mark is not None and params is not None and mark.args[0](params):
            left_out.append(item)
        else:
            kept.append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture(scope="session")
def test_device() -> str:
    return os.environ.get("RUNMAP_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def seed3_tiny_packs(tmp_path_factory):
    """Packs of the tiny OLMoE and Qwen2-MoE synthetic checkpoints (seed 3): {preset: (pack dir, ModelConfig)}.
    Shared by the CPU-site and placement tests, which read them only."""
    from runmap.arch.config import load_preset
    from runmap.format.pack import pack_checkpoint
    from runmap.synth.checkpoint import write_synthetic

    root, out = tmp_path_factory.mktemp("seed3-tiny-packs"), {}
    for name in ("tiny-olmoe", "tiny-qwen2-moe"):
        cfg, _ = load_preset(name)
        ck = write_synthetic(cfg, root / f"ck-{name}", seed=3)
        pack_checkpoint(ck, root / f"pk-{name}", device="cpu")
        out[name] = (root / f"pk-{name}", cfg)
    return out


@pytest.fixture
def tiny_olmoe_campaign(seed3_tiny_packs):
    """A function (name, params, decode_len=4) -> (group, spec): a one-group CPU campaign of the seed-3 tiny OLMoE
    pack, top_k resident, grouped executor, batch 1, 4-token prompts, one repeat and no warm-up; the test edits
    ``group["params"]`` between expand / run_campaign calls."""
    pack, cfg = seed3_tiny_packs["tiny-olmoe"]

    def make(name: str, params: dict, decode_len: int = 4):
        group = {"name": name, "kind": "engine", "models": ["m"], "resident": [cfg.top_k], "executors": ["grouped"],
                 "batch": [1], "prompt_len": 4, "decode_len": decode_len, "params": dict(params)}
        spec = {"name": name, "description": f"one group ({name})", "device": "cpu",
                "defaults": {"repeats": 1, "warmup": 0},
                "models": {"m": {"preset": "tiny-olmoe", "pack": str(pack)}}, "groups": [group]}
        return group, spec
    return make


def _record_decode(eng):
    """Keep a copy of every decode step's logits (float32 (B, V)) of ``eng`` in ``eng.decoded``; returns eng."""
    eng.decoded, decode = [], eng.decode

    def recording(*a, **k):
        out = decode(*a, **k)
        eng.decoded.append(out.detach().to("cpu").clone())
        return out
    eng.decode = recording
    return eng


@pytest.fixture
def record_decode():
    """The function that makes an engine keep its decode steps' logits (``_record_decode``)."""
    return _record_decode
