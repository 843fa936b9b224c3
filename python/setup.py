"""Builds libkvrelay with cargo (release, default features: admission, snapshots, policy, copy
engine, KV agent over TCP) and puts it inside the package, so the wheel carries it. Set
KVRELAY_LIBRARY to a built libkvrelay.so to package that one instead (no cargo run)."""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        lib = os.environ.get("KVRELAY_LIBRARY")
        if not lib:
            if not (ROOT / "Cargo.toml").is_file():
                raise SystemExit("kvrelay: build from a clone of the repository (python/ beside Cargo.toml), or set KVRELAY_LIBRARY")
            target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
            subprocess.run(["cargo", "build", "--release", "--locked", "--lib"], cwd=ROOT, check=True)
            lib = target / "release" / "libkvrelay.so"
        dst = Path(self.build_lib) / "kvrelay" / "libkvrelay.so"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lib, dst)


class BinaryDistribution(Distribution):
    """A platform wheel: it carries a native library."""

    def has_ext_modules(self):
        return True


# The compiled helper for the per-request calls (admit, a fetch submission): optional, so that a
# machine without a C compiler still installs the package (every call then goes through ctypes).
FAST = Extension(
    "kvrelay._fast",
    sources=["src/kvrelay/_fast.c"],
    include_dirs=[str(ROOT / "include")],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
    optional=True,
)

setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution, ext_modules=[FAST])
