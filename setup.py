"""Build torch_lazymem: the C++ core as one shared library (linked by the Python module and by the
GoogleTest binary) and the thin pybind11 module torch_lazymem._C.

Install with ``pip install --no-build-isolation -e .`` so the build uses the torch already installed.
"""

import glob
import hashlib
import os
import subprocess
import sysconfig

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths, library_paths

ROOT = os.path.dirname(os.path.abspath(__file__))


def _torch_cxx_std() -> str:
    """The C++ standard BuildExtension compiles with when a build names none (c++17 in torch 2.11,
    c++20 in 2.13): named explicitly, so the precompiled header and every file agree on it."""
    import inspect
    import re

    from torch.utils import cpp_extension

    m = re.search(r"cpp_flag_prefix \+ '(c\+\+\d+)'", inspect.getsource(cpp_extension.BuildExtension))
    return "-std=" + (m.group(1) if m else "c++17")

CORE_DIRS = ["core", "ir", "ops", "plan", "execute", "device", "record", "record/composite", "sync", "distributed"]
CORE_NAME = "torch_lazymem.lib.lazymem_core"
CXX_FLAGS = ["-O2", "-g0", "-fvisibility-inlines-hidden", "-Wall", "-Wno-unused-parameter", "-Wno-unused-function",
             _torch_cxx_std()]
LINK_FLAGS = []
# LAZYMEM_SANITIZE=address: AddressSanitizer + UndefinedBehaviorSanitizer (tools/test.sh --sanitize
# builds this way into build/asan and runs the tests with the runtimes preloaded). vptr checks are
# off: torch's libraries are not built with them, and their type info is not ours to check. The null
# and alignment checks are off too: a null dereference faults and ASan reports it with its stack, and
# a misaligned load is no fault on x86-64 (type punning here goes through memcpy); they instrument
# every member access of every inlined torch template and took a third of the build's time (CI).
SANITIZE_CHECKS = ["-fsanitize=address,undefined", "-fno-sanitize=vptr,null,alignment"]
if os.environ.get("LAZYMEM_SANITIZE") == "address":
    SANITIZE = SANITIZE_CHECKS + ["-fno-omit-frame-pointer"]
    CXX_FLAGS = ["-O1", "-g1"] + [f for f in CXX_FLAGS if f not in ("-O2", "-g0")] + SANITIZE
    LINK_FLAGS = SANITIZE
elif os.environ.get("LAZYMEM_SANITIZE"):
    raise SystemExit(f"LAZYMEM_SANITIZE={os.environ['LAZYMEM_SANITIZE']!r}: only 'address' is supported")


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
    extra_link_args=LINK_FLAGS,
)
# CppExtension adds torch_python; the core does not use it.
core.libraries = [lib for lib in core.libraries if lib != "torch_python"]

module = CppExtension(
    "torch_lazymem._C",
    _sources("python"),
    include_dirs=[os.path.join(ROOT, "csrc")],
    libraries=["lazymem_core"],
    extra_compile_args={"cxx": CXX_FLAGS},
    extra_link_args=["-Wl,-rpath,$ORIGIN/lib"] + LINK_FLAGS,
)


# liblazymem_cuda.so (csrc/cuda/): CUDA graph capture and the caching allocator's trace, which have no
# device-generic interface. Built only against a torch with CUDA and a CUDA toolkit's headers; the core
# loads it at run time (core/cuda_backend.h) and runs without it.
CUDA_NAME = "torch_lazymem.lib.lazymem_cuda"
EXTENSIONS = [core, module]


def _cuda_include():
    """The CUDA runtime's headers: a toolkit's, or those of the nvidia wheel torch's CUDA build
    depends on (nvidia/cu13, nvidia/cuda_runtime); None without a torch built with CUDA."""
    import torch

    if torch.version.cuda is None or os.environ.get("LAZYMEM_NO_CUDA_LIB"):
        return None
    # The wheel's first: they match the CUDA torch was built with; a toolkit's may be another version.
    # A wheel may lack the compiler's headers (crt/host_config.h, which cuda_runtime.h includes).
    site = os.path.dirname(os.path.dirname(torch.__file__))
    candidates = sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "include")))
    candidates += [os.path.join(site, "nvidia", "cuda_runtime", "include")]
    candidates += [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    needed = ("cuda_runtime_api.h", os.path.join("crt", "host_config.h"))
    return next((c for c in candidates if all(os.path.exists(os.path.join(c, f)) for f in needed)), None)


if _cuda_include():
    cuda_lib = CppExtension(
        CUDA_NAME,
        _sources("cuda"),
        include_dirs=[os.path.join(ROOT, "csrc"), _cuda_include()] + include_paths(),
        library_dirs=library_paths(),
        libraries=["lazymem_core", "c10_cuda", "torch_cuda", "c10", "torch_cpu", "torch"],
        extra_compile_args={"cxx": CXX_FLAGS + ["-DUSE_CUDA"]},
        extra_link_args=["-Wl,-rpath,$ORIGIN"] + LINK_FLAGS,
    )
    cuda_lib.libraries = [lib for lib in cuda_lib.libraries if lib != "torch_python"]
    EXTENSIONS.append(cuda_lib)


class Build(BuildExtension):
    """Builds the core first under a plain library name, then links the module against it."""

    def get_ext_filename(self, ext_name):
        # distutils asks with the full dotted name or with its last component only.
        if ext_name == CORE_NAME:
            return os.path.join("torch_lazymem", "lib", "liblazymem_core.so")
        if ext_name == CORE_NAME.rsplit(".", 1)[1]:
            return "liblazymem_core.so"
        if ext_name == CUDA_NAME:
            return os.path.join("torch_lazymem", "lib", "liblazymem_cuda.so")
        if ext_name == CUDA_NAME.rsplit(".", 1)[1]:
            return "liblazymem_cuda.so"
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
            if ext.name == CORE_NAME:
                self.precompile_header(ext)
            super().build_extension(ext)
        except Exception as e:
            if ext.name != CUDA_NAME:
                raise
            # Optional: without it lazymem runs every plan plainly (no CUDA graphs, sampled peaks).
            print(f"warning: torch_lazymem's CUDA library (CUDA graphs) was not built: {e}")
        finally:
            self.build_temp = base

    def precompile_header(self, ext):
        """Compiles csrc/core/precompiled.h with the core's exact flags (BuildExtension has added its
        own to extra_compile_args by now) and force-includes it in every file of the core: torch's
        headers are parsed once, not once per file (half the build time). GCC uses the .gch only when
        it matches the flags; otherwise it reads the header itself (-Winvalid-pch says so)."""
        flags = [f for f in ext.extra_compile_args["cxx"] if f not in ("-include", "-Winvalid-pch") and
                 not f.endswith("lazymem_pch.h")]
        pch_dir = os.path.abspath(os.path.join(self.build_temp, "pch"))
        header = os.path.join(pch_dir, "lazymem_pch.h")
        includes = [f"-I{d}" for d in list(ext.include_dirs) + include_paths() + [sysconfig.get_paths()["include"]]]
        cmd = ["c++"] + self.compiler.compiler_so[1:] + includes + ["-x", "c++-header", header, "-o", header + ".gch"]
        cmd += flags
        source = os.path.join(ROOT, "csrc", "core", "precompiled.h")
        with open(source, "rb") as f:
            stamp = hashlib.sha256(f.read() + " ".join(cmd).encode()).hexdigest()
        stamp_file = header + ".stamp"
        current = os.path.exists(stamp_file) and open(stamp_file).read() == stamp and os.path.exists(header + ".gch")
        if not current:
            os.makedirs(pch_dir, exist_ok=True)
            with open(source) as f, open(header, "w") as out:  # (compiled as a main file: no #pragma once)
                out.write(f.read().replace("#pragma once\n", ""))
            subprocess.check_call(cmd)
            with open(stamp_file, "w") as f:
                f.write(stamp)
        ext.extra_compile_args["cxx"] = flags + ["-include", header, "-Winvalid-pch"]


setup(
    name="torch_lazymem",
    version="0.1.0",
    description="A PyTorch device that records ops and runs them within a memory budget",
    packages=find_packages(include=["torch_lazymem", "torch_lazymem.*"]),
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
    python_requires=">=3.9",
    # Built and tested on torch 2.11 (the GPU machines, tools/check_torch.sh 2.11.0) and 2.13 (CI).
    install_requires=["torch>=2.11,<2.14"],
)
