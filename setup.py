"""Builds the optional C extension ``skippyd._chain`` (the warm-prefix chain, with vendored BLAKE3) and
packs the Redis scripts of the top-level ``lua/`` into the package as ``skippyd/lua/``.

Everything else is in pyproject.toml. If no C compiler is available the extension is skipped and
skippyd computes the same chain, more slowly, with the ``blake3`` package.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py


class BuildExt(build_ext):
    def build_extensions(self) -> None:
        self.compiler.src_extensions.append(".S")  # BLAKE3's SIMD kernels as plain assembly
        super().build_extensions()


class BuildPy(build_py):
    """The scripts live at the top of the repository (one file per atomic operation, documented in their
    headers); the wheel ships them inside the package, where ``skippyd.cluster.coordination`` reads them."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "skippyd" / "lua"
        target.mkdir(parents=True, exist_ok=True)
        for script in sorted(Path("lua").glob("*.lua")):
            shutil.copy2(script, target / script.name)


VENDOR = "skippyd/_native/blake3"
machine = platform.machine().lower()
sources = [
    "skippyd/_native/chain.c",
    f"{VENDOR}/blake3.c",
    f"{VENDOR}/blake3_dispatch.c",
    f"{VENDOR}/blake3_portable.c",
]
macros: list[tuple[str, str | None]] = []
if machine in ("x86_64", "amd64"):
    sources += [f"{VENDOR}/blake3_{isa}_x86-64_unix.S" for isa in ("sse2", "sse41", "avx2", "avx512")]
elif machine in ("aarch64", "arm64"):
    sources.append(f"{VENDOR}/blake3_neon.c")
    macros.append(("BLAKE3_USE_NEON", "1"))
else:
    macros += [(f"BLAKE3_NO_{isa}", "1") for isa in ("SSE2", "SSE41", "AVX2", "AVX512")]

setup(
    ext_modules=[
        Extension(
            "skippyd._chain",
            sources=sources,
            define_macros=macros,
            extra_compile_args=["-O3", "-fvisibility=hidden"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
)
