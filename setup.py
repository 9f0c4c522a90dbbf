"""Build hook: generate the gRPC/protobuf Python code from protos/ at install/build time.

The generated modules (protos/stagemesh/**/_pb2*.py) are never committed or hand-edited.
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted((ROOT / "protos").rglob("*.proto"))
    for source in sources:
        # Paths relative to the repository root give importable modules under `protos.`.
        rel = source.relative_to(ROOT).as_posix()
        args = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={ROOT}",
                f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", rel]
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {rel}")
        finally:
            os.chdir(cwd)
        # Package markers so regular (non-namespace) package discovery finds the modules.
        for parent in source.relative_to(ROOT / "protos").parents:
            init = ROOT / "protos" / parent / "__init__.py"
            if not init.exists():
                init.write_text('"""Generated: gRPC/protobuf code (see setup.py)."""\n')


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
