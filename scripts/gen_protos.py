"""Regenerate the committed protobuf and gRPC stubs from protos/.

The stubs are committed so that `pip install .` needs no protoc step;
tests/test_proto.py regenerates them into a temporary directory and fails
when the committed copies differ. Run `make protos` after editing a .proto.
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

# grpc_tools writes `from memory.v1 import memory_pb2`, an import that only
# works with protos/'s layout on sys.path; rewrite it to live under our package.
_IMPORT = re.compile(r"^from (memory(?:\.\w+)*) import (\w+_pb2)", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every .proto under protos/ into out_dir."""
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
        text = _IMPORT.sub(rf"from {PY_PACKAGE}.\1 import \2", path.read_text())
        path.write_text(text)
        written.append(path)
    # Every directory on the way down is a regular package.
    for directory in {p.parent for p in written}:
        while directory != out_dir.parent and directory.is_relative_to(out_dir):
            (directory / "__init__.py").touch()
            directory = directory.parent
    return written


def main() -> int:
    for path in generate(PACKAGE_ROOT):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
