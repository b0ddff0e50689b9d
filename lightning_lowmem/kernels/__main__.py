"""``python -m lightning_lowmem.kernels build``: prebuild the extensions (e.g. once before a DDP launch)."""

from __future__ import annotations

import argparse
import sys

import torch

from lightning_lowmem.kernels import backend, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_lowmem.kernels", description=__doc__)
    parser.add_argument("command", choices=["build"], help="build the CPU (and, with a GPU, CUDA) kernels")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    kinds = ["cpu"] + (["cuda"] if torch.version.cuda and torch.cuda.is_available() else [])
    failed = False
    for kind in kinds:
        try:
            library = build.build(kind, verbose=args.verbose)
        except build.BuildError as err:
            print(f"{kind}: FAILED: {err}")
            failed = True
        else:
            print(f"{kind}: built {library}")
    if "cuda" not in kinds:
        print("cuda: skipped (no CUDA GPU, or torch without CUDA)")
    print(f"backend: cpu tensors -> {backend('cpu')}")
    if torch.cuda.is_available():
        print(f"backend: cuda tensors -> {backend('cuda')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
