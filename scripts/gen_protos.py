"""Regenerate the committed protobuf and gRPC stubs from protos/.

The stubs are committed so that `pip install .` needs no protoc step;
tests/test_proto.py regenerates them into a temporary directory and fails
when the committed copies differ. Run `make protos` after editing a .proto.

Two packages carry the same stubs: the daemon's (sidecar._proto) and the
Python client's (memory_sidecar_client._proto, in clients/python), which must
not import the server. Each copy's imports are rewritten to live under its
own package.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_ROOT = ROOT / "sidecar" / "_proto"
PY_PACKAGE = "sidecar._proto"
CLIENT_PACKAGE_ROOT = ROOT / "clients" / "python" / "src" / "memory_sidecar_client" / "_proto"
CLIENT_PY_PACKAGE = "memory_sidecar_client._proto"
# Where each copy goes -> the Python package it is imported as.
TARGETS = {PACKAGE_ROOT: PY_PACKAGE, CLIENT_PACKAGE_ROOT: CLIENT_PY_PACKAGE}

# grpc_tools writes `from memory.v1 import memory_pb2`, an import that only
# works with protos/'s layout on sys.path; rewrite it to live under our package.
_IMPORT = re.compile(r"^from (memory(?:\.\w+)*) import (\w+_pb2)", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path, py_package: str = PY_PACKAGE) -> list[Path]:
    """Write the stubs for every .proto under protos/ into out_dir, which is
    imported as `py_package`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in sorted(out_dir.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        text = _IMPORT.sub(rf"from {py_package}.\1 import \2", path.read_text())
        path.write_text(text)
        written.append(path)
    # Every directory on the way down is a regular package.
    for directory in {p.parent for p in written}:
        while directory != out_dir.parent and directory.is_relative_to(out_dir):
            (directory / "__init__.py").touch()
            directory = directory.parent
    return written


def main() -> int:
    for out_dir, py_package in TARGETS.items():
        for path in generate(out_dir, py_package):
            print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
