"""Packaging beyond setup.cfg: the kernel sources travel inside the package.

``csrc/`` lives at the top of the repository; wheels and non-editable installs carry a copy as
``lightning_lowmem/kernels/csrc``, from which :mod:`lightning_lowmem.kernels.build` JIT-builds the
kernels on the user's machine.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernelSources(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads csrc/ where it is
            shutil.copytree(
                Path("csrc"), Path(self.build_lib) / "lightning_lowmem" / "kernels" / "csrc", dirs_exist_ok=True
            )


setup(cmdclass={"build_py": BuildPyWithKernelSources})
