"""The pinned archive's GGML folder extracted on every Python the package accepts: tarfile's ``filter`` argument
came with 3.10.12 and 3.11.4, and Debian bookworm's python3 (3.11.2, the base ``tools/build_image.sh`` makes) has none;
there the build checks the members' names itself, refusing what the ``data`` filter would."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from ggml_hybrid_build import pin as pin_source


def _archive(path: Path, names: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in names.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(params=["filter", "no filter"])
def python_tarfile(request, monkeypatch):
    """tarfile as this Python has it, and as a Python before the extraction filters has it (no ``data_filter``, and
    ``extractall`` refusing the keyword as 3.11.2's does)."""
    if request.param == "no filter":
        if hasattr(tarfile, "data_filter"):
            monkeypatch.delattr(tarfile, "data_filter")
        original = tarfile.TarFile.extractall

        def extractall(self, path=".", members=None, *, numeric_owner=False, **kw):
            if kw:
                raise TypeError(f"TarFile.extractall() got an unexpected keyword argument {next(iter(kw))!r}")
            return original(self, path, members, numeric_owner=numeric_owner)

        monkeypatch.setattr(tarfile.TarFile, "extractall", extractall)
    return request.param


def test_the_ggml_folder_is_extracted(python_tarfile, tmp_path, monkeypatch):
    archive = _archive(tmp_path / "pin.tar.gz", {"pkg-1/vendor/ggml/CMakeLists.txt": b"project(ggml)\n",
                                                 "pkg-1/vendor/ggml/src/ggml.c": b"int x;\n",
                                                 "pkg-1/README.md": b"not ggml\n"})
    monkeypatch.setattr(pin_source, "fetch_archive", lambda pin: archive)
    dest = tmp_path / "out"
    pin_source.extract_ggml({"ggml_path": "pkg-1/vendor/ggml"}, dest, lambda rel: not rel.startswith("src/"))
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == ["CMakeLists.txt"]
    assert (dest / "CMakeLists.txt").read_bytes() == b"project(ggml)\n"


def test_a_member_outside_the_destination_is_refused(python_tarfile, tmp_path, monkeypatch):
    archive = _archive(tmp_path / "pin.tar.gz", {"pkg-1/vendor/ggml/ok.h": b"",
                                                 "pkg-1/vendor/ggml/../../../escaped": b"x"})
    monkeypatch.setattr(pin_source, "fetch_archive", lambda pin: archive)
    with pytest.raises((SystemExit, getattr(tarfile, "FilterError", SystemExit))):
        pin_source.extract_ggml({"ggml_path": "pkg-1/vendor/ggml"}, tmp_path / "out")
    assert not list(tmp_path.rglob("escaped"))
