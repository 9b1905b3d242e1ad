"""Builds kvlink._kvlink with CMake for `pip install .` (see pyproject.toml).

The extension is the CMake target _kvlink (python/CMakeLists.txt), built in
build/pip/cmake-<python> with Release settings, tests, examples and benches
off, for the interpreter running pip; its .so is copied where setuptools
expects it. Nothing is downloaded: CMake finds pybind11 and kvlink's
dependencies among Debian's packages. KVLINK_CMAKE_ARGS adds options
(e.g. "-DKVLINK_WITH_RDMA=OFF"); KVLINK_JOBS sets the build's parallelism.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def version() -> str:
    text = (ROOT / "include" / "kvlink" / "version.hpp").read_text()
    return ".".join(re.search(rf"#define KVLINK_VERSION_{p} (\d+)", text).group(1)
                    for p in ("MAJOR", "MINOR", "PATCH"))


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        tag = f"py{sys.version_info.major}{sys.version_info.minor}"
        build = ROOT / "build" / "pip" / f"cmake-{tag}"
        configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                     f"-DPython3_EXECUTABLE={sys.executable}", "-DKVLINK_BUILD_PYTHON=ON",
                     "-DKVLINK_BUILD_TESTS=OFF", "-DKVLINK_BUILD_EXAMPLES=OFF",
                     "-DKVLINK_BUILD_BENCH=OFF", "-DKVLINK_INSTALL=OFF"]
        if not (build / "CMakeCache.txt").exists() and shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("KVLINK_CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        jobs = os.environ.get("KVLINK_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build), "--target", "_kvlink", "-j", jobs],
                       check=True)
        built = next((build / "python" / "site" / "kvlink").glob("_kvlink*"))
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, dest)


setup(
    version=version(),
    ext_modules=[Extension("kvlink._kvlink", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # setuptools' own build tree, beside CMake's, out of the way of other builds.
    options={"build": {"build_base": str(Path("build") / "pip")}},
)
