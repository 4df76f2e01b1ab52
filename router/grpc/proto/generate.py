"""Regenerate the checked-in gRPC modules from fleetserve.proto.

    python router/grpc/proto/generate.py          # rewrite fleetserve_pb2.py, .pyi, _pb2_grpc.py
    python router/grpc/proto/generate.py --check  # exit 1 when the checked-in files are stale

grpc_tools.protoc (grpcio-tools, a test dependency) names the module after the proto's
path, `router.grpc.proto.fleetserve_pb2`; the package installs as `fleetserve.router.grpc.proto`, so
the generated module name and the stub's import are rewritten to that.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
NAMES = ("fleetserve_pb2.py", "fleetserve_pb2.pyi", "fleetserve_pb2_grpc.py")
_FIXUPS = {
    "fleetserve_pb2.py": [("'router.grpc.proto.fleetserve_pb2'", "'fleetserve.router.grpc.proto.fleetserve_pb2'")],
    "fleetserve_pb2_grpc.py": [("from router.grpc.proto import", "from fleetserve.router.grpc.proto import")],
}


def generate() -> dict[str, str]:
    """File name -> the text protoc (plus the fix-ups) makes of fleetserve.proto now."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{ROOT}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(HERE / "fleetserve.proto"),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc})")
        texts = {}
        for name in NAMES:
            text = (Path(out) / "router" / "grpc" / "proto" / name).read_text()
            for old, new in _FIXUPS.get(name, []):
                if old not in text:
                    raise RuntimeError(f"{name}: expected {old!r} in protoc's output")
                text = text.replace(old, new)
            texts[name] = text
    return texts


def stale() -> list[str]:
    return [name for name, text in generate().items() if (HERE / name).read_text() != text]


def main() -> int:
    if "--check" in sys.argv[1:]:
        names = stale()
        if names:
            print(f"stale: {', '.join(names)}; run python router/grpc/proto/generate.py")
        return 1 if names else 0
    for name, text in generate().items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
