"""Build torch_lazymem: the C++ core as one shared library (linked by the Python module and by the
GoogleTest binary) and the thin pybind11 module torch_lazymem._C.

Install with ``pip install --no-build-isolation -e .`` so the build uses the torch already installed.
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths, library_paths

ROOT = os.path.dirname(os.path.abspath(__file__))
CORE_DIRS = ["core", "ir", "ops", "plan", "execute", "device", "record", "record/composite", "sync"]
CORE_NAME = "torch_lazymem.lib.lazymem_core"
CXX_FLAGS = ["-O2", "-g0", "-fvisibility-inlines-hidden", "-Wall", "-Wno-unused-parameter", "-Wno-unused-function"]


def _sources(*dirs):
    out = []
    for d in dirs:
        out += sorted(glob.glob(os.path.join("csrc", d, "*.cpp")))
    return out


core = CppExtension(
    CORE_NAME,
    _sources(*CORE_DIRS),
    include_dirs=[os.path.join(ROOT, "csrc")] + include_paths(),
    library_dirs=library_paths(),
    # libtorch only: the core must load without Python (GoogleTest links it too).
    libraries=["c10", "torch_cpu", "torch"],
    extra_compile_args={"cxx": CXX_FLAGS},
)
# CppExtension adds torch_python; the core does not use it.
core.libraries = [lib for lib in core.libraries if lib != "torch_python"]

module = CppExtension(
    "torch_lazymem._C",
    _sources("python"),
    include_dirs=[os.path.join(ROOT, "csrc")],
    libraries=["lazymem_core"],
    extra_compile_args={"cxx": CXX_FLAGS},
    extra_link_args=["-Wl,-rpath,$ORIGIN/lib"],
)


class Build(BuildExtension):
    """Builds the core first under a plain library name, then links the module against it."""

    def get_ext_filename(self, ext_name):
        # distutils asks with the full dotted name or with its last component only.
        if ext_name == CORE_NAME:
            return os.path.join("torch_lazymem", "lib", "liblazymem_core.so")
        if ext_name == CORE_NAME.rsplit(".", 1)[1]:
            return "liblazymem_core.so"
        return super().get_ext_filename(ext_name)

    def build_extensions(self):
        self.extensions.sort(key=lambda e: e.name != CORE_NAME)
        super().build_extensions()

    def build_extension(self, ext):
        if ext.name != CORE_NAME:
            ext.library_dirs = list(ext.library_dirs) + [os.path.dirname(self.get_ext_fullpath(CORE_NAME))]
        # One build directory (and ninja file) per extension: with a shared one each extension's
        # build.ninja replaces the other's, and every rebuild recompiles everything.
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


setup(
    name="torch_lazymem",
    version="0.1.0",
    description="A PyTorch device that records ops and runs them within a memory budget",
    packages=find_packages(include=["torch_lazymem", "torch_lazymem.*"]),
    ext_modules=[core, module],
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
