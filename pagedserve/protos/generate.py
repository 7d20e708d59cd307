"""Regenerate the committed gRPC stubs from protos/pagedserve/v1/*.proto.

    python -m pagedserve.protos.generate            # rewrite pagedserve/protos/*_pb2*.py
    python -m pagedserve.protos.generate --out DIR  # write them elsewhere (the freshness test does)

grpc_tools names the generated modules after the proto's path (pagedserve/v1/...), which would clash
with this package; the stubs are written flat into pagedserve/protos/ with their module names rewritten.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    protos = sorted(PROTO_DIR.glob("pagedserve/v1/*.proto"))
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}",
               f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *[str(p.relative_to(PROTO_DIR)) for p in protos]]
        subprocess.run(cmd, check=True, cwd=PROTO_DIR)
        for f in sorted((Path(tmp) / "pagedserve" / "v1").iterdir()):
            text = re.sub(r"^from pagedserve\.v1 import (\w+)", r"from pagedserve.protos import \1", f.read_text(),
                          flags=re.M)
            # The message classes' __module__ too, or they cannot be pickled (Ray Serve pickles requests).
            text = re.sub(r"\bpagedserve\.v1\.(\w+_pb2)\b", r"pagedserve.protos.\1", text)
            target = out_dir / f.name
            target.write_text(text)
            written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
