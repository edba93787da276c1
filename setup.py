"""Packaging beyond pyproject.toml: the start-up hook's ``plancache-startup.pth``.

A ``.pth`` file is read only from site-packages itself, where no package's data files go,
so the build puts it at the root of the wheel it makes, which pip installs into
site-packages and lists in the wheel's RECORD (so ``pip uninstall`` removes it):

* a regular wheel (``pip install``, ``--target`` and ``--user`` alike): the root of the
  build tree, which becomes the wheel;
* an editable install (``pip install -e``, the README's set-up): setuptools builds an
  "editable wheel" holding only a finder that points at the sources; the ``.pth`` goes to
  the root of that wheel too (where setuptools puts every file an editable install copies
  rather than links), so the sources stay unchanged and the hook is in site-packages.

The file runs at every interpreter start-up and does nothing unless
``PLANCACHE_PATCH_CUDNN`` is set (see ``_plancache_startup.py``).
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "plancache-startup.pth"


class BuildPyWithStartupHook(build_py):
    """``build_py`` that also puts the start-up ``.pth`` file at the root of the wheel being
    built, editable or not."""

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self._wheel_root(), PTH), preserve_mode=False)

    def _wheel_root(self) -> str:
        # An editable build runs build_py with editable_mode set and points the install
        # command's install_lib at the unpacked editable wheel (setuptools' editable_wheel);
        # its build_lib is a scratch folder that never reaches site-packages.
        if getattr(self, "editable_mode", False):
            return str(self.get_finalized_command("install").install_lib)
        return str(self.build_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):  # editable outputs are linked from build_lib: the .pth is not there
            outputs.append(os.path.join(self.build_lib, PTH))
        return outputs


setup(cmdclass={"build_py": BuildPyWithStartupHook})
