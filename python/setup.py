"""pip install ./python: builds the zeroplan extension with CMake (the repository's own build,
only the targets the module needs) and installs the package. Offline: nothing is downloaded;
the C++ dependencies are tools/setup.sh's Debian packages.

ZEROPLAN_BUILD_DIR=<dir> reuses a configured build tree (tools/test.sh passes build/), else
the build goes to build/python-wheel under the checkout. ZEROPLAN_JOBS caps the parallel jobs.
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def version():
    # The project's version, from the top-level CMakeLists.txt's project() line.
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("project(zeroplan VERSION "):
                return line.split()[2]
    raise RuntimeError("CMakeLists.txt: no 'project(zeroplan VERSION x.y.z' line")


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = os.environ.get("ZEROPLAN_BUILD_DIR") or os.path.join(ROOT, "build", "python-wheel")
        if not os.path.exists(os.path.join(build, "build.ninja")):
            subprocess.run(
                ["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DZP_BUILD_TESTS=OFF", "-DZP_BUILD_BENCH=OFF", "-DZP_ENABLE_CUDA=OFF",
                 "-DZP_BUILD_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}"],
                check=True, stdout=subprocess.DEVNULL)
        jobs = os.environ.get("ZEROPLAN_JOBS") or str(os.cpu_count() or 1)
        print(f"zeroplan: building the extension in {build} ({jobs} jobs)", flush=True)
        subprocess.run(["cmake", "--build", build, "--target", "zp_python", "-j", jobs], check=True)
        built = os.path.join(build, "python", "zeroplan", os.path.basename(self.get_ext_filename(ext.name)))
        if not os.path.exists(built):
            sys.exit(f"zeroplan: the build made no {built} (is {build} configured for this Python?)")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built, target)


setup(
    name="zeroplan",
    version=version(),
    description="Plan ZeRO training memory before renting a GPU (Python module over zeroplan's planner)",
    packages=["zeroplan"],
    ext_modules=[Extension("zeroplan._zeroplan", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    zip_safe=False,
)
