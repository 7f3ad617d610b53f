"""Image data for the experiments: IDX files and CIFAR pickles, splits, in-memory batches.

Sections: IDX reader; CIFAR pickles (restricted unpickler); the four data sets (where their
files live, or random stand-ins); DeepOBS splits; batching, standardisation and augmentation.

Pre-processing follows DeepOBS's PyTorch data sets: pixels scaled to [0, 1]; CIFAR standardised
per channel with DeepOBS's means and stds and, for training batches, augmented (pad 2 + random
crop, horizontal flip, brightness/contrast/saturation jitter); 10 000 training samples held out
for validation; the last incomplete training batch dropped. Where this differs from DeepOBS:
the validation split is the same for every run (fixed permutation, seed 0); the training loss
and accuracy are evaluated on the first 10 000 training samples without augmentation; every
evaluation uses all samples (DeepOBS drops the last incomplete evaluation batch); the colour
jitter is applied in a fixed order instead of a random one.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

# --- Reader for the IDX format of (Fashion-)MNIST, plain or gzipped ------------------------------

_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file; gzip compression is detected from the content, not the name."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return parse_idx(raw, name=str(path))


def parse_idx(raw: bytes, name: str = "<bytes>") -> np.ndarray:
    """Decode IDX bytes: magic ``00 00 <dtype> <ndim>``, big-endian uint32 dims, then data."""
    if len(raw) < 4 or raw[0] or raw[1] or raw[2] not in _DTYPES:
        raise ValueError(f"{name}: not an IDX file (magic number {raw[:4].hex()})")
    dtype = np.dtype(_DTYPES[raw[2]])
    ndim = raw[3]
    start = 4 + 4 * ndim
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = start + dtype.itemsize * math.prod(shape)
    if len(raw) < start or len(raw) != expected:
        raise ValueError(
            f"{name}: IDX header announces shape {shape} ({expected} bytes), file has {len(raw)}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=start).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


# --- CIFAR-10/100 python pickles, read with an unpickler that only rebuilds plain arrays ---------

_reconstruct = np.empty(0).__reduce__()[0]  # numpy's ndarray rebuild function, without importing it


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """Python 3's protocol-2 spelling of a bytes object: ``_codecs.encode(text, 'latin1')``."""
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


#: The only globals a CIFAR pickle needs: ndarray reconstruction, dtypes and (protocol 2 from
#: Python 3) bytes.
_ALLOWED = {
    ("_codecs", "encode"): _latin1_bytes,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR100_DIR = "cifar-100-python"
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))


class _PlainUnpickler(pickle.Unpickler):
    """Accepts dict/list/bytes/numbers and numpy arrays; refuses every other global."""

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: a CIFAR pickle holds only plain "
                "containers and numpy arrays"
            ) from None


def load_pickle(path: str | Path) -> dict:
    """Load one CIFAR pickle into a dict with ``str`` keys."""
    with open(path, "rb") as f:
        obj = _PlainUnpickler(f, encoding="bytes").load()
    if not isinstance(obj, dict):
        raise pickle.UnpicklingError(f"{path}: expected a dict, got {type(obj).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _images_and_labels(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    batch = load_pickle(path)
    data, labels = batch.get("data"), batch.get(label_key)
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
        or labels is None
        or len(labels) != len(data)
    ):
        raise ValueError(
            f"{path}: not a CIFAR batch (need uint8 'data' [N, 3072] and '{label_key}')"
        )
    return data.reshape(-1, 3, 32, 32), np.asarray(labels, dtype=np.int64)


def _concat(parts):
    xs, ys = zip(*parts)
    return np.concatenate(xs), np.concatenate(ys)


def read_cifar10(folder: Path):
    """Return ``(train_x, train_y, test_x, test_y)`` from ``cifar-10-batches-py``."""
    train = _concat([_images_and_labels(folder / n, "labels") for n in CIFAR10_TRAIN])
    return (*train, *_images_and_labels(folder / "test_batch", "labels"))


def read_cifar100(folder: Path):
    """Return ``(train_x, train_y, test_x, test_y)`` (fine labels) from ``cifar-100-python``."""
    return (
        *_images_and_labels(folder / "train", "fine_labels"),
        *_images_and_labels(folder / "test", "fine_labels"),
    )


# --- The four image data sets: where their files live, loading them, or random stand-ins ---------

#: Where Debian's ``dataset-fashion-mnist`` package installs its files.
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
FETCH_HINT = "Run `python -m experiments fetch_data` (make data)"
SYNTHETIC_HINT = "or pass --synthetic to run on random data of the same shape (marked synthetic)"


class DataMissingError(FileNotFoundError):
    """A data set's files are not where the loader looks; the message says what to do."""


@dataclass
class ImageData:
    """A labelled image data set held in memory: uint8 images ``[N, C, H, W]``, int64 labels."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    synthetic: bool = False


@dataclass(frozen=True)
class DatasetSpec:
    """Shape, size, statistics and file lookup of one data set."""

    title: str
    shape: tuple[int, int, int]
    num_classes: int
    sizes: tuple[int, int]
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    read: Callable[[Path], tuple]


def default_root() -> Path:
    """The data root: ``$CURVOPT_DATA`` if set, else ``./data``."""
    return Path(os.environ.get("CURVOPT_DATA", "data"))


def _idx_file(folder: Path, split: str, kind: str) -> Path | None:
    """Find e.g. ``train-images-idx3-ubyte`` (or ``.idx3-ubyte`` spelling), gzipped or not."""
    tag = "idx3" if kind == "images" else "idx1"
    for stem in (f"{split}-{kind}-{tag}-ubyte", f"{split}-{kind}.{tag}-ubyte"):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


def _idx_reader(title: str, subdirs: tuple[str, ...], extra: tuple[Path, ...] = ()):
    def read(root: Path):
        folders = [root / s for s in subdirs] + list(extra)
        for folder in folders:
            files = [
                _idx_file(folder, s, k) for s in ("train", "t10k") for k in ("images", "labels")
            ]
            if all(files):
                images_tr, labels_tr, images_te, labels_te = (read_idx(f) for f in files)
                return images_tr[:, None], labels_tr, images_te[:, None], labels_te
        looked = ", ".join(str(f) for f in folders)
        raise DataMissingError(
            f"{title} not found: no folder among [{looked}] holds train-images-idx3-ubyte, "
            "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte "
            "(.gz or not). "
            f"{FETCH_HINT} to fetch it, set CURVOPT_DATA/--data-root to where it is, "
            f"{SYNTHETIC_HINT}."
        )

    return read


def _cifar_reader(title: str, folder_name: str, files: tuple[str, ...], reader, archive: str):
    def read(root: Path):
        folder = root / folder_name
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise DataMissingError(
                f"{title} not found: {folder} lacks {', '.join(missing)}. It cannot be downloaded "
                f"here. Get {archive} (https://www.cs.toronto.edu/~kriz/cifar.html), put it into "
                f"{root} and run `python -m experiments fetch_data --root {root}` to unpack and "
                f"check it (or unpack it there yourself), {SYNTHETIC_HINT}."
            )
        return reader(folder)

    return read


SPECS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec(
        "MNIST",
        (1, 28, 28),
        10,
        (60000, 10000),
        None,
        None,
        _idx_reader("MNIST", ("mnist", "MNIST/raw")),
    ),
    "fmnist": DatasetSpec(
        "Fashion-MNIST",
        (1, 28, 28),
        10,
        (60000, 10000),
        None,
        None,
        _idx_reader("Fashion-MNIST", ("fashion-mnist", "FashionMNIST/raw"), (DEBIAN_FMNIST,)),
    ),
    "cifar10": DatasetSpec(
        "CIFAR-10",
        (3, 32, 32),
        10,
        (50000, 10000),
        (0.49139968, 0.48215841, 0.44653091),
        (0.24703223, 0.24348513, 0.26158784),
        _cifar_reader(
            "CIFAR-10",
            CIFAR10_DIR,
            CIFAR10_TRAIN + ("test_batch",),
            read_cifar10,
            "cifar-10-python.tar.gz",
        ),
    ),
    "cifar100": DatasetSpec(
        "CIFAR-100",
        (3, 32, 32),
        100,
        (50000, 10000),
        (0.50707516, 0.48654887, 0.44091784),
        (0.26733429, 0.25643846, 0.27615047),
        _cifar_reader(
            "CIFAR-100", CIFAR100_DIR, ("train", "test"), read_cifar100, "cifar-100-python.tar.gz"
        ),
    ),
}


def load_dataset(name: str, root: str | Path | None = None, synthetic: bool = False) -> ImageData:
    """Load data set ``name`` from ``root`` (default :func:`default_root`), or random stand-ins."""
    spec = SPECS[name]
    if synthetic:
        return synthetic_dataset(name)
    arrays = spec.read(Path(root) if root is not None else default_root())
    train_x, train_y, test_x, test_y = (torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
    for x, y in ((train_x, train_y), (test_x, test_y)):
        if x.dtype != torch.uint8 or tuple(x.shape[1:]) != spec.shape or len(x) != len(y):
            raise ValueError(
                f"{spec.title}: got images {tuple(x.shape)} {x.dtype}, labels "
                f"{tuple(y.shape)}; expected uint8 [N, {spec.shape}] and N labels"
            )
        if int(y.min()) < 0 or int(y.max()) >= spec.num_classes:
            raise ValueError(f"{spec.title}: labels outside 0..{spec.num_classes - 1}")
    return ImageData(name, train_x, train_y.long(), test_x, test_y.long(), spec.num_classes)


def synthetic_dataset(name: str, seed: int = 0) -> ImageData:
    """Uniform random images and labels with the real data set's shapes and sizes."""
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(seed)

    def draw(n):
        x = torch.randint(0, 256, (n, *spec.shape), generator=gen, dtype=torch.uint8)
        return x, torch.randint(0, spec.num_classes, (n,), generator=gen)

    (train_x, train_y), (test_x, test_y) = draw(spec.sizes[0]), draw(spec.sizes[1])
    return ImageData(name, train_x, train_y, test_x, test_y, spec.num_classes, synthetic=True)


# --- Train / validation / test splits as DeepOBS makes them, moved to a device once --------------

#: The split into train and validation is the same for every run (DeepOBS holds out 10 000).
SPLIT_SEED = 0
VALID_SIZE = 10_000
TRAIN_EVAL_SIZE = 10_000


@dataclass
class Split:
    """Images (uint8) and labels of one split."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    def head(self, n: int | None) -> Split:
        return self if n is None else Split(self.x[:n], self.y[:n])


@dataclass
class Splits:
    """``train`` is trained on; ``train_eval`` (a subset of it), ``valid``, ``test`` evaluated."""

    train: Split
    train_eval: Split
    valid: Split
    test: Split
    synthetic: bool


def make_splits(
    data: ImageData,
    valid_size: int = VALID_SIZE,
    train_size: int | None = None,
    eval_size: int | None = None,
    device: str | torch.device = "cpu",
) -> Splits:
    """Hold out ``valid_size`` random training samples for validation.

    ``train_size`` keeps only that many of the remaining training samples (budgeted runs);
    ``eval_size`` caps the evaluation sets. The training loss and accuracy are evaluated on the
    first ``min(10 000, train size)`` training samples, as DeepOBS's train-eval set.
    """
    n = len(data.train_y)
    if not 0 < valid_size < n:
        raise ValueError(f"valid_size must be in 1..{n - 1} for {data.name} ({n} training samples)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    valid_idx, train_idx = perm[:valid_size], perm[valid_size:]
    if train_size is not None:
        if not 0 < train_size <= len(train_idx):
            raise ValueError(f"train_size must be in 1..{len(train_idx)} for {data.name}")
        train_idx = train_idx[:train_size]

    def take(x, y, idx=None):
        if idx is not None:
            x, y = x[idx], y[idx]
        return Split(x.to(device), y.to(device))

    train = take(data.train_x, data.train_y, train_idx)
    cap = TRAIN_EVAL_SIZE if eval_size is None else min(eval_size, TRAIN_EVAL_SIZE)
    return Splits(
        train=train,
        train_eval=train.head(cap),
        valid=take(data.train_x, data.train_y, valid_idx).head(eval_size),
        test=take(data.test_x, data.test_y).head(eval_size),
        synthetic=data.synthetic,
    )


# --- In-memory mini-batches: scaling to [0, 1], per-channel standardisation, CIFAR augmentation --

_GRAY = (0.299, 0.587, 0.114)


@dataclass(frozen=True)
class Preprocess:
    """Turns uint8 images into network inputs; ``augment`` only applies to training batches."""

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augment: bool = False

    def __call__(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        x = x.float() / 255.0
        if gen is not None and self.augment:
            x = augment(x, gen)
        if self.mean is not None:
            shape = (1, -1, 1, 1)
            mean = torch.tensor(self.mean, device=x.device).view(shape)
            std = torch.tensor(self.std, device=x.device).view(shape)
            x = (x - mean) / std
        return x


def _uniform(n: int, low: float, high: float, gen: torch.Generator, device) -> torch.Tensor:
    return (low + (high - low) * torch.rand(n, generator=gen)).view(n, 1, 1, 1).to(device)


def _gray(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(1)
    return (_GRAY[0] * r + _GRAY[1] * g + _GRAY[2] * b).unsqueeze(1)


def augment(x: torch.Tensor, gen: torch.Generator, pad: int = 2) -> torch.Tensor:
    """DeepOBS's CIFAR augmentation on a batch in [0, 1].

    Zero-pad by ``pad`` and crop a random window of the original size, flip horizontally with
    probability 1/2, then scale brightness by U(1 - 63/255, 1 + 63/255), contrast by U(0.2, 1.8)
    and saturation by U(0.5, 1.5), clamping to [0, 1] after each (torchvision's ColorJitter
    formulas, applied in this fixed order rather than a random one). Random numbers come from
    the CPU generator ``gen``.
    """
    n, _, h, w = x.shape
    dev = x.device
    padded = F.pad(x, (pad,) * 4).permute(0, 2, 3, 1)
    oy, ox = (torch.randint(0, 2 * pad + 1, (n, 1), generator=gen).to(dev) for _ in range(2))
    rows = (oy + torch.arange(h, device=dev))[:, :, None]
    cols = (ox + torch.arange(w, device=dev))[:, None, :]
    x = padded[torch.arange(n, device=dev)[:, None, None], rows, cols].permute(0, 3, 1, 2)
    flip = (torch.rand(n, generator=gen) < 0.5).view(n, 1, 1, 1).to(dev)
    x = torch.where(flip, x.flip(-1), x)
    x = (x * _uniform(n, 1 - 63 / 255, 1 + 63 / 255, gen, dev)).clamp(0, 1)
    c = _uniform(n, 0.2, 1.8, gen, dev)
    x = (c * x + (1 - c) * _gray(x).mean((1, 2, 3), keepdim=True)).clamp(0, 1)
    s = _uniform(n, 0.5, 1.5, gen, dev)
    return (s * x + (1 - s) * _gray(x)).clamp(0, 1)


def train_batches(
    split: Split, batch_size: int, prep: Preprocess, gen: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled, augmented batches; the last incomplete batch is dropped (DeepOBS)."""
    perm = torch.randperm(len(split), generator=gen).to(split.y.device)
    for start in range(0, len(split) - batch_size + 1, batch_size):
        idx = perm[start : start + batch_size]
        yield prep(split.x[idx], gen), split.y[idx]


def eval_batches(
    split: Split, batch_size: int, prep: Preprocess
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """All samples in order, without augmentation; the last batch may be smaller."""
    for start in range(0, len(split), batch_size):
        yield prep(split.x[start : start + batch_size]), split.y[start : start + batch_size]


def num_train_batches(split: Split, batch_size: int) -> int:
    return len(split) // batch_size
