"""Builds the tensorverbs Python package for pip (`pip install --no-build-isolation .`).

The extension module is built by the project's CMake build, as `make build` does, into
build/pip (or the configured build folder that TENSORVERBS_CMAKE_BUILD_DIR names), for the
interpreter running pip; its Python half is python/tensorverbs. It needs what
scripts/install-deps.sh installs, and nothing from the network.
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def version():
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(tensorverbs VERSION ([0-9.]+)", f.read())
    if match is None:
        raise RuntimeError("no version in CMakeLists.txt's project()")
    return match.group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("TENSORVERBS_CMAKE_BUILD_DIR") or os.path.join(ROOT, "build",
                                                                                  "pip")
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.run(["cmake", "-S", ROOT, "-B", build_dir, *generator,
                            "-DCMAKE_BUILD_TYPE=Release", "-DTENSORVERBS_BUILD_TESTS=OFF",
                            f"-DPython3_EXECUTABLE={sys.executable}"], check=True)
        subprocess.run(["cmake", "--build", build_dir, "--target", "_tensorverbs",
                        "--parallel", str(os.cpu_count() or 1)], check=True)
        # The torch.distributed backend's module, where the build has it (libtorch-dev).
        subprocess.run(["cmake", "--build", build_dir, "--target", "_tensorverbs_torch",
                        "--parallel", str(os.cpu_count() or 1)], check=False)
        package_dir = os.path.join(build_dir, "python", "tensorverbs")
        built = [f for f in os.listdir(package_dir)
                 if f.startswith("_tensorverbs.") and f.endswith(".so")]
        if len(built) != 1:
            raise RuntimeError(f"expected one _tensorverbs module in {package_dir}, found {built}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(package_dir, built[0]), target)
        # Beside it, under the name its soname gives, which the backend's module links to.
        for f in os.listdir(package_dir):
            if f.startswith("_tensorverbs_torch.") and f.endswith(".so"):
                shutil.copyfile(os.path.join(package_dir, f),
                                os.path.join(os.path.dirname(target), f))


setup(
    name="tensorverbs",
    version=version(),
    description="Tensors between training tasks over gRPC and RDMA (TensorFlow's grpc+verbs "
                "design), from Python",
    packages=["tensorverbs"],
    package_dir={"tensorverbs": "python/tensorverbs"},
    ext_modules=[Extension("tensorverbs._tensorverbs", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["numpy"],
    # setuptools' own build folders stay clear of the CMake build in build/.
    options={"build": {"build_base": os.path.join("build", "setuptools")},
             "egg_info": {"egg_base": os.path.join("build", "setuptools")}},
    zip_safe=False,
)
