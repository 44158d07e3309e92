"""Pick the BLAS that MLX's CPU backend uses on Linux, before `mlx.core` first loads.

The `mlx[cpu]` wheel links the netlib *reference* BLAS from `mlx_cpu.libs`: about
2.5 GFLOP/s for the model's matmuls at every batch size, so batching cannot pay. libmlx
resolves `cblas_sgemm` through the process's global symbol scope first, so an OpenBLAS
loaded with RTLD_GLOBAL before the first `import mlx.core` serves every matmul instead
(10 to 150 GFLOP/s on 2 cores). After MLX has loaded, nothing can change it any more:
hence one idempotent `select()`, called by the worker CLI, the engine, the tiny-model
builder, the benchmarks and the test suite before anything imports MLX.

Order for `auto`: Intel's MKL where the worker extra installs it (the `mkl` wheel, Linux
x86_64: it dispatches on the CPU it finds, AVX-512 included, and exports plain `cblas_*`
names; about as fast as numpy's own OpenBLAS, benchmarks/gemm.py), then the system
OpenBLAS (distribution packages), then the OpenBLAS that the opencv-python wheel ships (a
dependency of mlx-vlm; it carries its own libgfortran and exports plain names, but at
0.3.15 it predates this CPU and runs 4-5x slower), else the reference BLAS with one
warning line saying how to fix it. Other wheels were weighed and fail: scipy-openblas32/64
prefix every symbol (`scipy_cblas_sgemm`), cmeel-openblas and ngsolve-openblas need a
libgfortran.so.5 that slim images lack. macOS is left alone (MLX uses Accelerate and
Metal there).

MKL runs sequential with one thread and on its OpenMP layer with more; its OpenMP threads
wait 1 ms after a call before they sleep (KMP_BLOCKTIME=1: the default 200 ms spins on
the cores the prep threads need, and 0 puts them to sleep between the hundreds of calls
of one decode step, which ran the bench model at 102 tok/s against 367). Any of these set
in the environment wins. What vlmq sets there for its own library, a process it starts
must not inherit as if a user had chosen it (child_env).
"""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("vlmq.worker")

ENV_CHOICE = "VLMQ_BLAS"
ENV_THREADS = "OPENBLAS_NUM_THREADS"
MKL_THREADS = "MKL_NUM_THREADS"
AUTO = "auto"
REFERENCE = "reference"

# Debian/Ubuntu (libopenblas0-pthread / -openmp / -serial), then Fedora/RHEL/Arch names.
_SYSTEM_DIRS = ("openblas-pthread", "openblas-openmp", "openblas-serial")
_SYSTEM_NAMES = ("libopenblasp.so.0", "libopenblas.so.0")
# Wheels that ship a plain-named OpenBLAS with everything it needs beside it.
_WHEELS = ("opencv-python", "opencv-python-headless", "opencv-contrib-python",
           "opencv-contrib-python-headless")

# The wheel that installs MKL's single dynamic library (Linux x86_64, the worker extra).
_MKL_WHEEL = "mkl"

FIX_HINT = ("install OpenBLAS (apt-get install libopenblas0-pthread, or pip install "
            "opencv-python-headless) or pass --blas PATH / VLMQ_BLAS=PATH")


@dataclass(frozen=True)
class BlasInfo:
    """What serves MLX's matmuls in this process."""

    kind: str            # "mkl", "openblas", "reference", "library" (a PATH given), "platform"
    path: str | None     # the library loaded; None when MLX keeps what it links
    source: str          # why: "system", "wheel opencv-python", "--blas/VLMQ_BLAS", ...
    threads: int | None  # the BLAS's threads, when known

    def describe(self) -> str:
        if self.path is None:
            return f"{self.kind} ({self.source})"
        threads = ""
        if self.threads:
            threads = f", {self.threads} thread{'s' if self.threads > 1 else ''}"
        return f"{self.kind} {self.path} ({self.source}{threads})"


_selected: BlasInfo | None = None
_own_env: set[str] = set()  # environment variables set here for this process's library
_set_threads: Any = None  # openblas_set_num_threads of the library loaded, if any


def system_candidates() -> list[Path]:
    """Distribution OpenBLAS libraries, most specific first, for this machine's multiarch."""
    arch = platform.machine()
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu",
               "arm64": "aarch64-linux-gnu"}.get(arch, f"{arch}-linux-gnu")
    roots = [Path("/usr/lib") / triplet, Path("/usr/lib64"), Path("/usr/lib")]
    out = [root / sub / "libopenblas.so.0" for root in roots[:1] for sub in _SYSTEM_DIRS]
    out += [root / name for root in roots for name in _SYSTEM_NAMES]
    return out


def wheel_candidates() -> list[tuple[str, Path]]:
    """(wheel, path) of OpenBLAS copies inside installed wheels, from their RECORD."""
    out: list[tuple[str, Path]] = []
    for dist_name in _WHEELS:
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            continue
        for f in dist.files or ():
            name = f.name
            if name.startswith("libopenblas") and ".so" in name:
                out.append((dist_name, Path(str(dist.locate_file(f)))))
    return out


def mkl_candidates() -> list[Path]:
    """MKL's runtime library (libmkl_rt), from the `mkl` wheel's RECORD, if installed."""
    try:
        dist = md.distribution(_MKL_WHEEL)
    except md.PackageNotFoundError:
        return []
    return [Path(str(dist.locate_file(f))).resolve() for f in dist.files or ()
            if f.name.startswith("libmkl_rt.so")]


def cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# How a worker sizes OpenBLAS (worker_threads, _load), as --blas's help and
# docs/install.md say it (tests/worker/test_worker_help.py holds them to it).
WORKER_THREADS_RULE = ("the cores this process may use minus --prep-threads, at least 1, "
                       "unless MKL_NUM_THREADS (for MKL) or OPENBLAS_NUM_THREADS is set")


def worker_threads(prep_threads: int) -> int:
    """OpenBLAS threads for a worker: the cores its prep pool leaves, at least 1.

    The MLX thread is the only BLAS caller and it waits on each call, so it counts as
    one of the OpenBLAS threads. OpenBLAS threads spin and meet at a barrier on every
    call: one descheduled by a busy prep thread stalls the whole matmul, which costs far
    more than the second core gains on the small decode matmuls (benchmarks/README.md).
    """
    return max(1, cores() - prep_threads)


def _mlx_loaded() -> bool:
    return "mlx.core" in sys.modules


def _load(path: Path, kind: str, source: str, threads: int | None) -> BlasInfo:
    # An explicit OPENBLAS_NUM_THREADS (MKL_NUM_THREADS for MKL) wins, then the caller's
    # count, then every core.
    mkl = path.name.startswith("libmkl_rt")
    env = os.environ.get(MKL_THREADS if mkl else ENV_THREADS, "")
    n = (int(env) if env.isdigit() else 0) or threads or cores()
    # Each library reads these once, when it loads; the setters below also cover a
    # library that was already in the process.
    settings = {MKL_THREADS: str(n), "MKL_THREADING_LAYER": "SEQUENTIAL" if n == 1 else "INTEL",
                "KMP_BLOCKTIME": "1"} if mkl else {ENV_THREADS: str(n)}
    for name, value in settings.items():
        if name not in os.environ:
            _own_env.add(name)
            os.environ[name] = value
        elif name in (MKL_THREADS, ENV_THREADS):
            os.environ[name] = value
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    if not hasattr(lib, "cblas_sgemm"):
        raise OSError(f"{path} exports no cblas_sgemm")
    global _set_threads
    for name, named in (("MKL_Set_Num_Threads", "mkl"),
                        ("openblas_set_num_threads", "openblas")):
        setter = getattr(lib, name, None)
        if setter is not None:
            setter.argtypes = [ctypes.c_int]
            setter.restype = None
            setter(n)
            _set_threads = setter
            return BlasInfo(named, str(path), source, n)
    return BlasInfo(kind, str(path), source, None)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) without what select() set for this process's own
    library, so that a process started from here chooses its BLAS and threads itself."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if k not in _own_env}


def set_threads(n: int) -> bool:
    """Change the loaded library's thread count now; False when none was loaded."""
    if _set_threads is None:
        return False
    _set_threads(max(1, n))
    return True


def _auto(threads: int | None) -> BlasInfo:
    tried: list[str] = []
    found = [(f"wheel {_MKL_WHEEL}", p) for p in mkl_candidates()]
    found += [("system", p) for p in system_candidates()]
    found += [(f"wheel {dist}", p) for dist, p in wheel_candidates()]
    for source, path in found:
        if not path.exists():
            continue
        try:
            return _load(path, "library", source, threads)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
    for line in tried:
        log.info("BLAS candidate rejected: %s", line)
    log.warning("vlmq: no optimized BLAS found, MLX uses the slow reference BLAS "
                "(about 12x slower on CPU); %s", FIX_HINT)
    return BlasInfo(REFERENCE, None, "no OpenBLAS found", None)


def select(choice: str | None = None, threads: int | None = None) -> BlasInfo:
    """Load the BLAS for `choice` (auto, reference or a library path) once per process.

    `threads`: OpenBLAS threads unless $OPENBLAS_NUM_THREADS says otherwise (default:
    every core this process may use).
    `choice` None means $VLMQ_BLAS, else auto. A second call returns the first answer,
    as does any call once MLX has loaded (it is too late then to change).
    """
    global _selected
    if _selected is not None:
        return _selected
    choice = choice or os.environ.get(ENV_CHOICE) or AUTO
    if sys.platform != "linux":
        _selected = BlasInfo("platform", None, f"{sys.platform}: MLX's own", None)
    elif _mlx_loaded():
        _selected = BlasInfo("unknown", None, "MLX was imported before vlmq chose", None)
        log.warning("vlmq: mlx.core was imported before the BLAS choice; keeping what it "
                    "bound (import vlmq.worker.model.blas and call select() first)")
    elif choice == REFERENCE:
        _selected = BlasInfo(REFERENCE, None, "requested", None)
    elif choice == AUTO:
        _selected = _auto(threads)
    else:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise BlasError(f"--blas/{ENV_CHOICE}: {choice!r} is neither auto, reference "
                            "nor an existing library file")
        try:
            _selected = _load(path, "library", "requested", threads)
        except OSError as exc:
            raise BlasError(f"--blas/{ENV_CHOICE}: cannot use {choice}: {exc}") from exc
    return _selected


def mlx_backends() -> list[str]:
    """Installed MLX backend wheels. More than one is a broken install: each writes
    mlx/lib/libmlx.so, and the one unpacked last is the backend MLX runs on."""
    out = []
    for name in ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13", "mlx-cuda", "mlx-metal"):
        try:
            out.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            continue
    return out


def mapped_libraries(pid: int | str = "self") -> set[str]:
    """Paths of the shared libraries mapped into a process (Linux /proc)."""
    out: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and ".so" in parts[5]:
                    out.add(parts[5].strip())
    except OSError:
        return out
    return out


class BlasError(ValueError):
    """A --blas / VLMQ_BLAS value that cannot be used."""
