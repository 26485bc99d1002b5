"""Where the package's data lives: ``specs/`` (architecture, presets, campaigns, pipeline configs),
``schemas/`` and the IFEval data.

In the source tree (and an editable install) they are the repository's top-level folders; a regular
``pip install .`` ships them as package data inside ``runmap/`` (``[tool.setuptools.package-dir]`` maps
them), so the same names resolve in both without a repository checkout.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The repository root when running from a checkout; None when installed as a wheel.
SOURCE_ROOT = PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "pyproject.toml").is_file() else None


def _data_dir(name: str) -> Path:
    installed = PACKAGE_DIR / name
    if installed.is_dir():
        return installed
    if SOURCE_ROOT is not None and (SOURCE_ROOT / name).is_dir():
        return SOURCE_ROOT / name
    raise FileNotFoundError(f"runmap: package data folder {name!r} is missing (looked in {installed}"
                            + (f" and {SOURCE_ROOT / name}" if SOURCE_ROOT else "") + "); reinstall the package")


SPECS_DIR = _data_dir("specs")
SCHEMAS_DIR = _data_dir("schemas")
ARCHITECTURE_SPEC = SPECS_DIR / "architecture.yaml"
PRESET_DIR = SPECS_DIR / "models"


def data_dir() -> Path:
    """The project's data folder (IFEval inputs, the GPT-4 reference responses, NLTK's punkt tables)."""
    return _data_dir("data")
