"""JIT build and load of the compiled kernels in ``csrc/`` (ninja, via ``torch.utils.cpp_extension``).

Loading an extension registers its CPU or CUDA kernels for the ``lowmem`` operators
(:mod:`.library`). Each extension builds once per machine into a cache directory keyed by torch
version, CUDA version, target (CPU capability or GPU archs) and a hash of the sources, so a
changed source or a torch upgrade never loads a stale binary.

The cache is safe to share and to interrupt:

- a build runs in a private staging directory that is renamed into place (atomically) only after
  the library loaded, with its checksum beside it: a killed build or a full disk leaves no
  half-written library where a later process would load it;
- a cached library is checked against its checksum before it is loaded (a damaged one would
  crash the process), and rebuilt when it does not match;
- a valid build is loaded without taking any lock, so a read-only cache (a shared image, a
  cluster file system) works;
- processes (DDP ranks) build one at a time under a file lock that the OS releases when its
  holder dies.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from filelock import FileLock, Timeout

SOURCES = {
    "cpu": ("lowmem_bind.cpp", "lowmem_autograd.cpp", "lowmem_cpu.cpp"),
    "cuda": ("lowmem_bind.cpp", "lowmem_autograd.cpp", "lowmem_cuda.cu"),
}
HEADERS = ("lowmem_kernels.h", "lowmem_math.h")
CACHE_ENV = "LIGHTNING_LOWMEM_CACHE"
CHECKSUM = "checksum.sha256"


class BuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


def source_dir() -> Path:
    """The kernel sources: ``csrc/`` of a source checkout (editable install), else the copy a wheel ships."""
    checkout = Path(__file__).resolve().parents[2] / "csrc"
    return checkout if checkout.is_dir() else Path(__file__).with_name("csrc")


CSRC = source_dir()


def cpu_flags() -> list[str]:
    """Code for the capability ATen runs at (its Vectorized AVX512 or AVX2 path; ``ATEN_CPU_CAPABILITY``
    lowers it), portable code otherwise. The capability is part of the cache key, so a cache shared by
    machines of different CPUs never loads code one of them cannot run."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        isa = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        return [*isa, "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if capability == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


AHEAD_OF_TIME_ARCHS = "8.0;9.0;10.0;12.0"  # A100; H100/H200; B200; RTX 50xx: a build for GPUs elsewhere


def cuda_archs() -> str:
    """The archs to build for: TORCH_CUDA_ARCH_LIST, else the GPUs present (torch adds PTX for the newest), else
    none (empty: a CUDA build then needs TORCH_CUDA_ARCH_LIST, see :func:`ahead_of_time`)."""
    explicit = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if explicit:
        return explicit
    if not torch.cuda.is_available():
        return ""
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(capabilities))


@contextlib.contextmanager
def ahead_of_time(archs: str = AHEAD_OF_TIME_ARCHS) -> Iterator[None]:
    """Build CUDA kernels for ``archs`` where no GPU is (a CI runner with nvcc, an image built for GPUs elsewhere),
    unless TORCH_CUDA_ARCH_LIST names some already."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.is_available():
        yield
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    try:
        yield
    finally:
        del os.environ["TORCH_CUDA_ARCH_LIST"]


def compiler_flags(kind: str) -> tuple[list[str], list[str], list[str]]:
    """The C++, CUDA and linker flags of a ``kind`` build. The CPU kernels split their work with
    ``at::parallel_for``, which runs on OpenMP threads only in code compiled with ``-fopenmp`` (serially
    otherwise); the library then uses the ``libgomp.so.1`` torch has already loaded."""
    if kind == "cpu":
        return ["-O3", "-fopenmp", *cpu_flags()], [], ["-fopenmp"]
    # LOWMEM_CUDA for the C++ files too: they register the CUDA kernels, under the CUDA keys
    return ["-O3", "-DLOWMEM_CUDA"], ["-O3", "-DLOWMEM_CUDA"], []


def source_hash(kind: str) -> str:
    """Hash of what the build is made of: the sources and the compiler flags."""
    digest = hashlib.sha256(repr(compiler_flags(kind)).encode())
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


def library_name(kind: str) -> str:
    return f"lightning_lowmem_{kind}.so"


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class DamagedBuild(Exception):
    """A cached library that does not match its checksum (a killed build of an older version, a bad disk)."""


def _valid_library(directory: Path, kind: str) -> Path | None:
    """The cached library of ``directory`` if it matches its checksum; ``None`` if there is none."""
    library = directory / library_name(kind)
    if not library.exists():
        return None
    try:
        expected = (directory / CHECKSUM).read_text().strip()
    except FileNotFoundError:
        raise DamagedBuild(f"{library} has no checksum beside it") from None
    if _checksum(library) != expected:
        raise DamagedBuild(f"{library} does not match its checksum")
    return library


def _writable(directory: Path) -> bool:
    """Whether builds can be written into ``directory`` (created if missing)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def _check_can_build(kind: str) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler ({compiler!r} is not on PATH)")
    if kind == "cuda":
        if torch.version.cuda is None:
            raise BuildError("this torch build has no CUDA")
        if not cuda_archs():
            raise BuildError(
                "no CUDA GPU is available to build for; set TORCH_CUDA_ARCH_LIST (e.g. 9.0) to build for GPUs elsewhere"
            )
        if cpp_extension.CUDA_HOME is None:
            raise BuildError("the CUDA toolkit (nvcc) was not found; set CUDA_HOME")
        if cuda_runtime_dir() is None:
            raise BuildError("the CUDA toolkit's runtime library (libcudart.so) was not found; set CUDA_HOME")


def cuda_runtime_dir() -> Path | None:
    """Where the toolkit's ``libcudart.so`` is, for the link: torch takes the toolkit's home from nvcc's location,
    which a wrapper script (``/usr/local/bin/nvcc`` running ``/usr/local/cuda-13.0/bin/nvcc``) misplaces."""
    from torch.utils import cpp_extension

    homes = (os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME, "/usr/local/cuda")
    dirs = (Path(home) / lib for home in homes if home for lib in ("lib64", "lib"))
    return next((d for d in dirs if (d / "libcudart.so").exists()), None)


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


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """One builder per cache key across processes; the OS drops the lock of a process that dies."""
    lock = FileLock(directory.with_name(directory.name + ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"lightning_lowmem: waiting for another process building {directory.name}", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _compile_into(directory: Path, kind: str, verbose: bool) -> Path:
    """Compile and load the extension in a staging directory, then rename it to ``directory``."""
    from torch.utils import cpp_extension

    print(f"lightning_lowmem: compiling the {kind} kernels into {directory} (about a minute)", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=f"{directory.name}.staging-", dir=directory.parent))
    cflags, cuda_cflags, ldflags = compiler_flags(kind)
    if kind == "cuda":
        ldflags = [*ldflags, f"-L{cuda_runtime_dir()}"]
    try:
        cpp_extension.load(
            name=library_name(kind).removesuffix(".so"),
            sources=[str(CSRC / s) for s in SOURCES[kind]],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            extra_ldflags=ldflags,
            extra_include_paths=[str(CSRC)],
            build_directory=str(staging),
            with_cuda=kind == "cuda",
            is_python_module=False,  # a library of TORCH_LIBRARY_IMPL registrations, loaded by torch.ops
            verbose=verbose,
        )
        (staging / CHECKSUM).write_text(_checksum(staging / library_name(kind)))
        if directory.exists():  # a damaged build (we hold the lock): out of the way first
            shutil.rmtree(directory)
        os.replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory / library_name(kind)


def build(kind: str, verbose: bool = False) -> Path:
    """Load the ``kind`` ("cpu" or "cuda") extension, building it first if the cache has no valid
    build; returns the library's path. Raises :class:`BuildError` saying why it cannot be had."""
    if not CSRC.is_dir():  # the sources name the build: without them no cached build can be found either
        raise BuildError(f"the kernel sources are not installed (no {CSRC})")
    directory = build_dir(kind)
    try:
        library = _valid_library(directory, kind)
    except DamagedBuild as err:
        warnings.warn(f"lightning_lowmem: {err}; rebuilding it", RuntimeWarning, stacklevel=2)
        library = None
    if library is None:
        _check_can_build(kind)
        if not _writable(directory.parent):
            raise BuildError(
                f"the kernel cache {directory.parent} is not writable and holds no valid build of this version; "
                f"set {CACHE_ENV} to a writable directory, or run `python -m lightning_lowmem.kernels build` "
                "where it is writable"
            )
        try:
            with ninja_on_path(), build_lock(directory):
                try:  # another process may have built it while this one waited
                    library = _valid_library(directory, kind)
                except DamagedBuild:
                    library = None
                if library is None:
                    return _compile_into(directory, kind, verbose)
        except BuildError:
            raise
        except Exception as err:  # compiler errors, a missing toolchain piece, a load failure
            raise BuildError(_summary(err)) from err
    try:
        torch.ops.load_library(str(library))
    except OSError as err:
        raise BuildError(f"{library} cannot be loaded: {err}") from err
    return library


def _summary(err: Exception) -> str:
    """The first compiler error line (the whole log is long), then the log's tail."""
    text = str(err).strip()
    first_error = next((line.strip() for line in text.splitlines() if "error" in line.lower()), "")
    return f"{first_error or type(err).__name__}\n{text[-2000:]}"


@functools.cache
def load(kind: str) -> Path | BuildError:
    """The loaded extension's path, or the reason it cannot be had, computed once per process."""
    try:
        return build(kind)
    except BuildError as err:
        return err
