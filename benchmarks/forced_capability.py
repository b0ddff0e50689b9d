"""An AVX512 machine standing in for an AVX2 one (``ATEN_CPU_CAPABILITY=avx2``, how the tests and benchmarks are
checked on both kinds of machine) needs two more settings, which :func:`emulate` makes before torch's first use:

- oneDNN capped alike (``ONEDNN_MAX_CPU_ISA``): else oneDNN still reports AMX where the CPU has it, torch's bf16
  flash attention packs its blocks for it, and ATen's AVX2 code then refuses them ("pack_vnni2 is only supported
  when avx512 is supported", stock models included). oneDNN reads it once, at its first use.
- an inductor cache of its own: torch's FX graph cache key leaves out the vector ISA, so a graph compiled by a
  run at the default capability is served to a forced one, which builds its AVX512-shaped C++ kernels for AVX2
  vectors and segfaults (torch 2.14.1: ``cross_entropy.py --smoke`` after a default run; upstream fixed the
  thread count's twin of this, pytorch#184444). Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` at each compile.

No torch import here: it must run before torch is first used.
"""

from __future__ import annotations

import getpass
import os
import tempfile


def emulate() -> None:
    """The settings a forced ``ATEN_CPU_CAPABILITY`` needs; nothing without one (or where they are set)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if not capability:
        return
    if capability == "avx2":
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{capability}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
