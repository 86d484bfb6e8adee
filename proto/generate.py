"""Regenerate the gRPC/protobuf stubs in ``aggsrv/v1/`` from ``proto/aggsrv/v1/*.proto``.

Equivalent to running, from the repository root::

    python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. \
        proto/aggsrv/v1/*.proto

Use grpcio-tools 1.81.x (docs/design.md "Measured platform facts"): its stubs import under protobuf
6.33 and 7.x. The committed stubs must equal this script's output (tests/transport/test_proto.py
checks it).

Usage: ``python proto/generate.py [OUT_DIR]`` (default: the repository root).
"""

from __future__ import annotations

import importlib.resources
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "aggsrv" / "v1"
# grpcio-tools release the committed stubs were generated with.
GRPC_TOOLS_VERSION = "1.81.1"


def proto_files() -> list[Path]:
    """The .proto files of the package, in a fixed order."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path | str = ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) into ``out_dir``; return the files it wrote, sorted."""
    from grpc_tools import protoc  # dev dependency only

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    stems = [p.stem for p in proto_files()]
    suffixes = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    return sorted(out / "aggsrv" / "v1" / f"{s}{x}" for s in stems for x in suffixes)


if __name__ == "__main__":
    for path in generate(sys.argv[1] if len(sys.argv) > 1 else ROOT):
        print(path)
