"""Packaging beyond pyproject.toml: the start-up hook's ``plancache-startup.pth``.

A ``.pth`` file is read only from site-packages itself, where no package's data files go,
so the build copies it to the root of the build tree: a wheel installs that root into
site-packages (``pip install``, ``--target`` and ``--user`` alike) and lists the file in
its RECORD, so ``pip uninstall`` removes it. The file runs at every interpreter start-up
and does nothing unless ``PLANCACHE_PATCH_CUDNN=1`` (see ``_plancache_startup.py``).
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "plancache-startup.pth"


class BuildPyWithStartupHook(build_py):
    """``build_py`` that also puts the start-up ``.pth`` file at the root of the build."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):  # an editable install links sources instead
            self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
