"""Test setup shared by every test module.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, i.e. before ``kernels``
is imported anywhere; conftest.py is imported by pytest before the test modules, so it is set here.
On a machine with a GPU, run with RUNMAP_TEST_DEVICE=cuda to exercise the compiled kernels instead.
"""
import os

if os.environ.get("RUNMAP_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
