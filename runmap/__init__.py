"""Horizon RunMap: MoE inference with INT4 qpacked routed experts and a strict residency cache."""
from pathlib import Path as _Path

__version__ = "0.1.0"

# The repository's top-level kernels/ folder is the subpackage runmap.kernels. An install maps it there
# (pyproject's package-dir: a wheel holds runmap/kernels/, an editable install's finder points at the
# folder). A bare source tree on PYTHONPATH (the GPU machine, which installs nothing) has no mapping, so
# there the repository root joins this package's search path, where kernels/ is found by its own name.
_here = _Path(__file__).resolve().parent
if not (_here / "kernels").is_dir() and (_here.parent / "kernels" / "__init__.py").is_file():
    __path__.append(str(_here.parent))
