"""Puts kvlink_mooncake_alias.pth into the wheel beside the module: a .pth
file in site-packages is read when Python starts (setuptools ships its own
distutils-precedence.pth the same way)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kvlink_mooncake_alias.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).resolve().parent / PTH), str(Path(self.build_lib) / PTH))


setup(
    cmdclass={"build_py": BuildWithPth},
    # Build trees under the repository's build/ (ignored by git), not here.
    options={"build": {"build_base": str(Path(__file__).resolve().parents[2] / "build" / "pip" / "alias")}},
)
