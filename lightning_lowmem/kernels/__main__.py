"""``python -m lightning_lowmem.kernels build``: prebuild the extensions (e.g. once before a DDP launch)."""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from lightning_lowmem.kernels import backend, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_lowmem.kernels", description=__doc__)
    parser.add_argument("command", choices=["build"], help="build the CPU (and, with a GPU, CUDA) kernels")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    parser.add_argument(
        "--cuda",
        action="store_true",
        help="build the CUDA kernels also where no GPU is: for TORCH_CUDA_ARCH_LIST, else "
        f"{build.AHEAD_OF_TIME_ARCHS} (an image for GPUs elsewhere, a CI runner with nvcc)",
    )
    args = parser.parse_args(argv)
    kinds = ["cpu"] + (["cuda"] if args.cuda or (torch.version.cuda and torch.cuda.is_available()) else [])
    failed = False
    for kind in kinds:
        try:
            with build.ahead_of_time() if kind == "cuda" else contextlib.nullcontext():
                library = build.build(kind, verbose=args.verbose)
        except build.BuildError as err:
            print(f"{kind}: FAILED: {err}")
            failed = True
        else:
            print(f"{kind}: built {library}")
    if "cuda" not in kinds:
        print("cuda: skipped (no CUDA GPU, or torch without CUDA; --cuda builds for GPUs elsewhere)")
    print(f"backend: cpu tensors -> {backend('cpu')}")
    if torch.cuda.is_available():
        print(f"backend: cuda tensors -> {backend('cuda')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
