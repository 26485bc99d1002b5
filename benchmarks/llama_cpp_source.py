"""The llama.cpp source a device call carries: the parts of the pinned `llama-cpp-python` sdist that building
`llama-bench` / `llama-quantize` and converting a Hugging Face checkpoint to GGUF need (issue 25 item 5).

The GPU machine reaches no package registry, and the sdist (76.6 MB) is above what one device call carries
(64 MiB of ignored paths). This script, run on a machine that reaches PyPI, downloads the sdist with pip
(`pip download llama-cpp-python==PIN --no-binary :all: --no-deps`), checks its sha256 against the pin, and
writes from its `vendor/llama.cpp/` only the CMake build (`CMakeLists.txt`, `LICENSE`, `licenses/`, `cmake/`,
`ggml/`, `src/`, `include/`, `common/`, `tools/`, `vendor/`, `app/`, `examples/`, `tests/`, `pocs/`) and the
converter (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`) into a reproducible tarball (sorted entries,
fixed mtimes and owners, gzip without a timestamp: the same sdist gives the same bytes):

    .llama-cpp/llama-cpp-src.tar.gz     (ignored by git; carried by `run(..., carry=[".llama-cpp"])`)
    .llama-cpp/llama-cpp-src.json       (its size and sha256, the sdist's, the vendored llama.cpp commit)

The tarball unpacks to `llama.cpp/` with `RUNMAP_SOURCE.json` (the same provenance) at its top. --check also
configures the unpacked tree with CMake here, CPU only (`-DGGML_CUDA=OFF`, default options, nothing built), to
prove the extracted set is complete for the configure step.

    python benchmarks/llama_cpp_source.py [--sdist PATH] [--check]       (from the repository root)
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_ROOT = f"llama_cpp_python-{VERSION}"
VENDOR = f"{SDIST_ROOT}/vendor/llama.cpp"
# the vendored submodule's commit is in the sdist's git metadata, not in the tree (its build-info says "unknown")
SUBMODULE_HEAD = f"{SDIST_ROOT}/.git/modules/vendor/llama.cpp/HEAD"
KEEP_DIRS = ("cmake", "ggml", "src", "include", "common", "tools", "vendor", "app", "examples", "tests", "pocs",
             "licenses", "conversion", "gguf-py")
KEEP_FILES = ("CMakeLists.txt", "LICENSE", "convert_hf_to_gguf.py")
TOP = "llama.cpp"  # the tarball's one top-level folder
OUT_DIR = Path(".llama-cpp")
TARBALL = "llama-cpp-src.tar.gz"
META = "llama-cpp-src.json"
MTIME = 1_700_000_000  # fixed, so that the tarball's bytes depend on the sdist alone


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(dest: Path) -> Path:
    """pip-download the pinned sdist into dest (no build, no dependencies)."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / SDIST
    if not path.is_file():
        cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-binary", ":all:",
               "--no-deps", "-d", str(dest)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return path


def kept(name: str) -> str | None:
    """The path inside llama.cpp/ of an sdist member that the build or the converter needs, else None."""
    if not name.startswith(VENDOR + "/"):
        return None
    rel = name[len(VENDOR) + 1:]
    first = rel.split("/", 1)[0]
    if rel in KEEP_FILES or (first in KEEP_DIRS and "/" in rel):
        return rel
    return None


def _info(name: str, size: int, mode: int, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.type, ti.mtime = size, mode, kind, MTIME
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def build_tarball(sdist: Path, out: Path) -> dict:
    """Write the trimmed source tarball from sdist to out; returns its provenance (also inside it)."""
    sdist_sha = sha256_file(sdist)
    if sdist_sha != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {sdist_sha}, expected {SDIST_SHA256} (pinned for {PACKAGE} {VERSION})")
    files: dict[str, tuple[bytes, int]] = {}
    links: dict[str, str] = {}
    commit = None
    with tarfile.open(sdist, "r:gz") as tf:
        for m in tf:
            if m.name == SUBMODULE_HEAD:
                commit = tf.extractfile(m).read().decode().strip()
                continue
            rel = kept(m.name)
            if rel is None:
                continue
            if m.issym():
                links[rel] = m.linkname
            elif m.isfile():
                files[rel] = (tf.extractfile(m).read(), 0o755 if m.mode & 0o111 else 0o644)
    missing = [f for f in KEEP_FILES if f not in files] + [
        d for d in KEEP_DIRS if not any(r.startswith(d + "/") for r in files)]
    if missing or not commit:
        raise SystemExit(f"{sdist}: not the expected layout (missing {missing}, submodule commit {commit})")
    meta = {
        "package": PACKAGE, "version": VERSION, "sdist": SDIST, "sdist_sha256": sdist_sha,
        "sdist_bytes": sdist.stat().st_size, "llama_cpp_commit": commit,
        "kept": sorted(KEEP_FILES + KEEP_DIRS), "files": len(files) + len(links),
    }
    files["RUNMAP_SOURCE.json"] = ((json.dumps(meta, indent=2) + "\n").encode(), 0o644)
    dirs = sorted({"/".join(r.split("/")[:i]) for r in [*files, *links] for i in range(1, r.count("/") + 1)})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(_info(TOP, 0, 0o755, tarfile.DIRTYPE))
        for d in dirs:
            tf.addfile(_info(f"{TOP}/{d}", 0, 0o755, tarfile.DIRTYPE))
        for rel in sorted([*files, *links]):
            if rel in links:
                ti = _info(f"{TOP}/{rel}", 0, 0o777, tarfile.SYMTYPE)
                ti.linkname = links[rel]
                tf.addfile(ti)
            else:
                data, mode = files[rel]
                tf.addfile(_info(f"{TOP}/{rel}", len(data), mode), io.BytesIO(data))
    tmp.replace(out)
    return meta


def cmake_check(tarball: Path) -> float:
    """Unpack tarball into a temporary folder and configure it CPU-only with CMake (no build). Returns seconds."""
    if not shutil.which("cmake"):
        raise SystemExit("--check: cmake not found")
    with tempfile.TemporaryDirectory(prefix="llama-cpp-check-") as d:
        with tarfile.open(tarball) as tf:
            tf.extractall(d, filter="data")
        src, build = Path(d) / TOP, Path(d) / "build"
        cmd = ["cmake", "-S", str(src), "-B", str(build), "-DGGML_CUDA=OFF"]
        print("+", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        secs = time.perf_counter() - t0
        log = r.stdout + r.stderr
        if r.returncode != 0:
            sys.stderr.write(log[-6000:])
            raise SystemExit(f"--check: cmake configure failed (exit {r.returncode})")
        warnings = [ln for ln in log.splitlines() if "CMake Warning" in ln]
        print(f"cmake configure (CPU only) succeeded in {secs:.1f} s; {len(warnings)} CMake warnings", flush=True)
        for ln in log.splitlines():
            if "not found" in ln.lower() and "license" in ln.lower():
                print("  ", ln)
    return secs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sdist", type=Path, help=f"an already downloaded {SDIST} (default: pip download it)")
    p.add_argument("--download-dir", type=Path, default=Path(tempfile.gettempdir()) / "llama-cpp-sdist",
                   help="where pip puts the sdist (default: %(default)s)")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR, help="default: %(default)s")
    p.add_argument("--check", action="store_true", help="configure the unpacked tree with CMake, CPU only")
    args = p.parse_args(argv)
    sdist = args.sdist or download(args.download_dir)
    out = args.out_dir / TARBALL
    meta = build_tarball(sdist, out)
    record = {
        "tarball": str(out), "bytes": out.stat().st_size, "sha256": sha256_file(out), **meta,
        "made_with": f"python benchmarks/llama_cpp_source.py{' --check' if args.check else ''}",
    }
    if args.check:
        record["cmake_configure_cpu_s"] = round(cmake_check(out), 1)
    (args.out_dir / META).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{out}: {record['bytes']} bytes ({record['bytes'] / 2**20:.2f} MiB), sha256 {record['sha256']}")
    print(f"{PACKAGE} {VERSION} (sdist sha256 {meta['sdist_sha256']}), llama.cpp {meta['llama_cpp_commit']}, "
          f"{meta['files']} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
