"""JIT build and load of the compiled kernels in ``csrc/`` (ninja, via ``torch.utils.cpp_extension``).

Each extension builds once per machine into a directory keyed by torch version, CUDA
version, target (CPU capability or GPU archs) and a hash of the sources, so a changed
source or a torch upgrade never loads a stale binary. Processes (DDP ranks) build one at a
time under a lock file that names its owner's PID; a lock whose owner died is taken over.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = {
    "cpu": ("lowmem_bind.cpp", "lowmem_cpu.cpp"),
    "cuda": ("lowmem_bind.cpp", "lowmem_cuda.cu"),
}
HEADERS = ("lowmem_kernels.h", "lowmem_math.h")
CACHE_ENV = "LIGHTNING_LOWMEM_CACHE"
STALE_LOCK_SECONDS = 30 * 60  # longer than any build; a lock this old is abandoned even if its PID lives on
_POLL_SECONDS = 0.5


class BuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


def cpu_flags() -> list[str]:
    """AVX2 code (ATen's Vectorized AVX2 path) where the CPU has it, portable code otherwise."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def cuda_archs() -> str:
    """The archs to build for: TORCH_CUDA_ARCH_LIST, else the GPUs present (torch adds PTX for the newest)."""
    explicit = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if explicit:
        return explicit
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(capabilities))


def source_hash(kind: str) -> str:
    digest = hashlib.sha256()
    for name in sorted({*SOURCES[kind], *HEADERS}):
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """LIGHTNING_LOWMEM_CACHE, else TORCH_EXTENSIONS_DIR/lightning_lowmem, else ~/.cache/lightning_lowmem."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "lightning_lowmem"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_lowmem"


def build_dir(kind: str) -> Path:
    target = torch.backends.cpu.get_cpu_capability() if kind == "cpu" else "sm" + cuda_archs().replace(";", "_")
    key = f"{kind}-torch{torch.__version__}-cuda{torch.version.cuda or 'none'}-{target}-{source_hash(kind)}"
    return cache_root() / key.replace("+", "_").replace(" ", "")


def _lock_is_stale(lock: Path) -> bool:
    """True when the lock's owner is dead (same host) or the lock is older than STALE_LOCK_SECONDS."""
    try:
        age = time.time() - lock.stat().st_mtime
        pid_text, _, host = lock.read_text().partition(" ")
    except FileNotFoundError:
        return False  # released meanwhile: just retry
    if age > STALE_LOCK_SECONDS:
        return True
    if host.strip() != socket.gethostname() or not pid_text.isdigit():
        return False  # another machine on a shared file system, or being written: only age can tell
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, owned by another user
    return False


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Exclusive across processes; takes over a lock left by a killed build instead of waiting forever."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lowmem.lock"
    announced = False
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            if _lock_is_stale(lock):
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
                continue
            if not announced:
                print(f"lightning_lowmem: waiting for another process building in {directory}", file=sys.stderr)
                announced = True
            time.sleep(_POLL_SECONDS)
    try:
        os.write(fd, f"{os.getpid()} {socket.gethostname()}".encode())
        os.close(fd)
        # Older torch (FileBaton) waits forever on a 'lock' file left by a killed build; under our lock none is live.
        with contextlib.suppress(FileNotFoundError):
            (directory / "lock").unlink()
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def _ninja_dirs() -> list[Path]:
    """Where a ninja installed with this interpreter lives: its bin dir, and the ninja package's."""
    dirs = [Path(sys.executable).parent]
    with contextlib.suppress(ImportError, AttributeError):
        import ninja

        dirs.append(Path(ninja.BIN_DIR))
    return dirs


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """Put this environment's ninja on PATH for the build, even when its bin dir is not activated."""
    if shutil.which("ninja"):
        yield
        return
    found = next((d for d in _ninja_dirs() if shutil.which("ninja", path=str(d))), None)
    if found is None:
        raise BuildError("ninja was not found (pip install ninja)")
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{found}{os.pathsep}{old}"
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _check_can_build(kind: str) -> None:
    from torch.utils import cpp_extension

    if not CSRC.is_dir():
        raise BuildError(f"the kernel sources are not installed (no {CSRC})")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler ({compiler!r} is not on PATH)")
    if kind == "cuda":
        if torch.version.cuda is None:
            raise BuildError("this torch build has no CUDA")
        if not torch.cuda.is_available():
            raise BuildError("no CUDA GPU is available")
        if cpp_extension.CUDA_HOME is None:
            raise BuildError("the CUDA toolkit (nvcc) was not found; set CUDA_HOME")


def build(kind: str, verbose: bool = False) -> ModuleType:
    """Build (if needed) and import the ``kind`` ("cpu" or "cuda") extension; raises BuildError."""
    from torch.utils import cpp_extension

    _check_can_build(kind)
    directory = build_dir(kind)
    fresh = not any(directory.glob("*.so")) and not any(directory.glob("*.pyd"))
    if fresh:
        print(
            f"lightning_lowmem: compiling the {kind} kernels into {directory} (first use; about a minute)",
            file=sys.stderr,
        )
    flags = ["-O3", *(cpu_flags() if kind == "cpu" else [])]
    try:
        with ninja_on_path(), build_lock(directory):
            return cpp_extension.load(
                name=f"lightning_lowmem_{kind}",
                sources=[str(CSRC / s) for s in SOURCES[kind]],
                extra_cflags=flags,
                extra_include_paths=[str(CSRC)],
                build_directory=str(directory),
                with_cuda=kind == "cuda",
                extra_cuda_cflags=["-O3"],
                verbose=verbose,
            )
    except BuildError:
        raise
    except Exception as err:  # compiler errors, a missing toolchain piece, an import failure
        raise BuildError(_summary(err)) from err


def _summary(err: Exception) -> str:
    """The first compiler error line (the whole log is long), then the log's tail."""
    text = str(err).strip()
    first_error = next((line.strip() for line in text.splitlines() if "error" in line.lower()), "")
    return f"{first_error or type(err).__name__}\n{text[-2000:]}"


@functools.cache
def load(kind: str) -> ModuleType | BuildError:
    """The extension, or the reason it cannot be had, computed once per process."""
    try:
        return build(kind)
    except BuildError as err:
        return err
