"""pyxfer's one build definition: sources, flags and CUDA architectures live here (CMakeLists.txt
only delegates). Build with the torch you will run against, installed first:

    pip install torch && pip install --no-build-isolation -e .      # a checkout
    pip install torch && pip install --no-build-isolation pyxfer-*.tar.gz   # an sdist

Only building the extension needs torch: an sdist and the metadata are made without it (so
``python -m build --sdist`` works in an isolated environment), and building the extension without
torch stops with a message saying to install torch first.

Environment:
    PYXFER_CUDA_ARCHS   named CUDA architectures, e.g. "90" or "80;90;100" (default below);
                        never probed from the local GPU, so a build is the same on every machine.
    PYXFER_WITH_CUDA    "auto" (default: when torch has CUDA and nvcc is found), "1" (required), "0".
    PYXFER_KERNEL_CHECK "auto" (default), "1", "0": with a CPU-only torch, still compile the
                        torch-free CUDA kernels with nvcc (objects are discarded) so they cannot rot.
"""
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # an sdist or the metadata: fine; building the extension: NeedsTorch says what to do
    torch = None

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
DEFAULT_CUDA_ARCHS = "80;90;100;120"  # Ampere, Hopper, Blackwell datacenter, Blackwell workstation


def cuda_archs():
    text = os.environ.get("PYXFER_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
    archs = [a.replace(".", "") for a in re.split(r"[;,\s]+", text.strip()) if a]
    bad = [a for a in archs if not re.fullmatch(r"\d{2,3}a?", a)]
    if not archs or bad:
        raise SystemExit(f"PYXFER_CUDA_ARCHS: expected a list such as '90;100', got {text!r}")
    return archs


def gencode_flags(archs):
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    newest = max(archs, key=lambda a: int(a.rstrip("a")))
    return flags + [f"-gencode=arch=compute_{newest},code=compute_{newest}"]  # PTX for newer GPUs


def nvcc_path():
    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def want_cuda():
    mode = os.environ.get("PYXFER_WITH_CUDA", "auto")
    possible = torch.version.cuda is not None and nvcc_path() is not None
    if mode == "1" and not possible:
        raise SystemExit("PYXFER_WITH_CUDA=1 needs a CUDA build of torch and nvcc "
                         f"(torch.version.cuda={torch.version.cuda}, nvcc={nvcc_path()})")
    return possible and mode != "0"


def sources(*patterns):
    return sorted(str(p.relative_to(ROOT)) for pattern in patterns for p in ROOT.glob(pattern))


NVCC_FLAGS = ["-O3", "-lineinfo", "-std=c++17"]
CPU_SOURCES = ("csrc/*.cpp", "csrc/transfer/*.cpp", "csrc/gather/*.cpp", "csrc/cpu/*.cpp")  # every build
CUDA_SOURCES = ("csrc/cuda/*.cpp", "csrc/kernels/*.cu")  # CUDA builds


class NeedsTorch(build_ext):
    """build_ext without torch: stops with what to do (the extension is built against the installed torch)."""

    def run(self):
        raise SystemExit("pyxfer: building the native extension needs torch, which is not importable here. Install "
                         "the torch you will run first (pip install torch), then build pyxfer against it without "
                         "build isolation: pip install --no-build-isolation pyxfer (a checkout: -e .; an sdist: its "
                         ".tar.gz). Build isolation would build against another torch, or none.")


def extension_without_torch():
    """pyxfer._C as declared without torch: enough for an sdist and the metadata, never built."""
    return Extension("pyxfer._C", sources=sources(*CPU_SOURCES)), NeedsTorch


def extension_with_torch():
    """pyxfer._C built against the installed torch (CUDA when torch has it and nvcc is found), and its build_ext."""
    class BuildWithKernelCheck(BuildExtension):
        """With a CPU-only torch, compile csrc/kernels/*.cu with nvcc anyway (a check; objects discarded)."""

        def run(self):
            mode = os.environ.get("PYXFER_KERNEL_CHECK", "auto")
            nvcc = nvcc_path()
            if not with_cuda and mode != "0" and (nvcc or mode == "1"):
                if not nvcc:
                    raise SystemExit("PYXFER_KERNEL_CHECK=1 but nvcc was not found")
                with tempfile.TemporaryDirectory() as out:
                    for cu in sources("csrc/kernels/*.cu"):
                        cmd = [nvcc, "-c", *NVCC_FLAGS, *gencode_flags(archs), f"-I{CSRC / 'include'}", cu,
                               "-o", str(Path(out) / (Path(cu).stem + ".o"))]
                        print("kernel check:", " ".join(cmd), flush=True)
                        subprocess.run(cmd, check=True, cwd=ROOT)
            super().run()

    with_cuda = want_cuda()
    archs = cuda_archs()
    # Match torch's libstdc++ ABI explicitly: recent cpp_extension assumes the compiler default, and a
    # mismatch makes every std::string crossing into torch (error messages, str results) crash.
    abi_flag = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cxx_flags = ["-O3", abi_flag, f"-DPYXFER_WITH_CUDA={int(with_cuda)}"]
    common = dict(name="pyxfer._C", include_dirs=[str(CSRC), str(CSRC / "include")])
    if with_cuda:
        arch_macro = "-DPYXFER_CUDA_ARCH_LIST=" + ",".join(a.rstrip("a") for a in archs)
        ext = CUDAExtension(
            sources=sources(*CPU_SOURCES, *CUDA_SOURCES),
            extra_compile_args={"cxx": cxx_flags + [arch_macro], "nvcc": NVCC_FLAGS + gencode_flags(archs)},
            **common,
        )
    else:
        ext = CppExtension(sources=sources(*CPU_SOURCES), extra_compile_args={"cxx": cxx_flags}, **common)
    return ext, BuildWithKernelCheck


ext, build_ext_class = extension_without_torch() if torch is None else extension_with_torch()
setup(
    packages=find_packages(include=["pyxfer", "pyxfer.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext_class},
)
