"""Triton as a GPU user runs it (no ``TRITON_INTERPRET``), checked without a GPU: what CPU tensors get.

Run by tests/test_kernels_triton.py in a fresh process (the test process defines its Triton kernels
interpreted): prints, as one JSON line, the errors of the backend selection and of a kernel call for CPU
tensors. ``python -m tests.triton_compiled``. (Every kernel's ahead-of-time compilation:
``python -m lightning_lowmem.kernels.triton_aot``.)
"""

from __future__ import annotations

import json

import torch

from lightning_lowmem import kernels
from lightning_lowmem.kernels import triton_ops


def refusals() -> list[str]:
    """The messages of the backend selection and of a kernel call for CPU tensors."""
    messages = []
    for call in (lambda: kernels.backend("cpu"), lambda: triton_ops.act_codes(torch.ones(4), (0.0,))):
        try:
            call()
        except RuntimeError as err:
            messages.append(str(err))
    return messages


if __name__ == "__main__":
    print(json.dumps({"refusals": refusals()}))
