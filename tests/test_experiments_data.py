"""Data loading of the experiments package, on tiny files written here (never the real sets)."""

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from experiments.data import (
    DataMissingError,
    Preprocess,
    Split,
    augment,
    eval_batches,
    load_dataset,
    load_pickle,
    make_splits,
    parse_idx,
    read_idx,
    train_batches,
)


def write_idx(path, array, gz=False):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape
    )
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def write_mnist(folder, n_train=40, n_test=10, gz=True, dotted=False, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        arrays[split] = (rng.integers(0, 256, (n, 28, 28)), rng.integers(0, 10, n))
        for kind, tag, arr in (
            ("images", "idx3", arrays[split][0]),
            ("labels", "idx1", arrays[split][1]),
        ):
            name = f"{split}-{kind}{'.' if dotted else '-'}{tag}-ubyte" + (".gz" if gz else "")
            write_idx(folder / name, arr, gz)
    return arrays


def write_cifar10(folder, per_batch=3, protocol=2):
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    content = {}
    for name in names:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        content[name] = (data, labels)
        with open(folder / name, "wb") as f:
            pickle.dump(
                {
                    b"batch_label": b"x",
                    b"labels": labels,
                    b"data": data,
                    b"filenames": [b"a.png"] * per_batch,
                },
                f,
                protocol=protocol,
            )
    return content


@pytest.mark.parametrize("gz", [False, True])
def test_idx_roundtrip(tmp_path, gz):
    arr = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    write_idx(tmp_path / "f", arr, gz)
    out = read_idx(tmp_path / "f")
    assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, arr)


def test_idx_rejects_bad_magic_and_truncation():
    with pytest.raises(ValueError, match="not an IDX file"):
        parse_idx(b"\x01\x02\x08\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ValueError, match="announces shape"):
        parse_idx(b"\x00\x00\x08\x01\x00\x00\x00\x05\x01\x02")


def test_idx_big_endian_types():
    raw = b"\x00\x00\x0c\x01\x00\x00\x00\x02" + struct.pack(">ii", -3, 70000)
    assert parse_idx(raw).tolist() == [-3, 70000]


@pytest.mark.parametrize("layout", ["mnist", "MNIST/raw"])
@pytest.mark.parametrize("gz,dotted", [(True, False), (False, True)])
def test_mnist_layouts(tmp_path, layout, gz, dotted):
    arrays = write_mnist(tmp_path / layout, gz=gz, dotted=dotted)
    data = load_dataset("mnist", tmp_path)
    assert data.train_x.shape == (40, 1, 28, 28) and data.train_x.dtype == torch.uint8
    assert data.test_y.dtype == torch.int64 and not data.synthetic
    np.testing.assert_array_equal(data.train_x[:, 0].numpy(), arrays["train"][0])
    np.testing.assert_array_equal(data.test_y.numpy(), arrays["t10k"][1])


def test_fashion_mnist_torchvision_layout(tmp_path):
    write_mnist(tmp_path / "FashionMNIST" / "raw", n_train=20)
    assert load_dataset("fmnist", tmp_path).train_x.shape == (20, 1, 28, 28)


def test_missing_data_says_what_to_do(tmp_path):
    with pytest.raises(DataMissingError) as err:
        load_dataset("mnist", tmp_path)
    msg = str(err.value)
    assert "python -m experiments fetch_data" in msg and "--synthetic" in msg
    assert str(tmp_path) in msg
    with pytest.raises(DataMissingError, match="cannot be downloaded here.*cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path)


def test_data_root_from_environment(tmp_path, monkeypatch):
    write_mnist(tmp_path / "mnist", n_train=12)
    monkeypatch.setenv("CURVOPT_DATA", str(tmp_path))
    assert len(load_dataset("mnist").train_y) == 12


@pytest.mark.parametrize("protocol", [2, 4])
def test_cifar10_pickles(tmp_path, protocol):
    content = write_cifar10(tmp_path / "cifar-10-batches-py", protocol=protocol)
    data = load_dataset("cifar10", tmp_path)
    assert data.train_x.shape == (15, 3, 32, 32) and data.test_x.shape == (3, 3, 32, 32)
    first, labels = content["data_batch_1"]
    np.testing.assert_array_equal(data.train_x[:3].reshape(3, -1).numpy(), first)
    assert data.train_y[:3].tolist() == labels


def test_cifar100_pickles_and_legacy_numpy_name(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    data = np.full((2, 3072), 7, dtype=np.uint8)
    for name in ("train", "test"):
        raw = pickle.dumps(
            {b"data": data, b"fine_labels": [99, 3], b"coarse_labels": [1, 2]}, protocol=2
        )
        # Pickles written by numpy < 2 name the module numpy.core.multiarray.
        (folder / name).write_bytes(
            raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        )
    loaded = load_dataset("cifar100", tmp_path)
    assert loaded.num_classes == 100 and loaded.train_y.tolist() == [99, 3]


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.path),)


def test_malicious_pickle_is_refused(tmp_path):
    target = tmp_path / "pwned"
    bad = tmp_path / "data_batch_1"
    bad.write_bytes(pickle.dumps({b"data": _Evil(target)}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
        load_pickle(bad)
    assert not target.exists()
    codec = tmp_path / "codec"
    codec.write_bytes(b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x06\x00\x00\x00rot_13\x86R.")
    with pytest.raises(pickle.UnpicklingError, match="rot_13"):
        load_pickle(codec)


def test_synthetic_has_real_shapes():
    data = load_dataset("cifar100", "/nonexistent", synthetic=True)
    assert data.synthetic and data.train_x.shape == (50000, 3, 32, 32)
    assert data.test_x.shape == (10000, 3, 32, 32) and data.test_y.max() < 100


def test_splits_are_disjoint_and_sized(tmp_path):
    write_mnist(tmp_path / "mnist", n_train=50, n_test=10)
    data = load_dataset("mnist", tmp_path)
    data.train_y = torch.arange(50)  # label = index, to trace samples
    s = make_splits(data, valid_size=10, train_size=30, eval_size=8)
    assert (len(s.train), len(s.train_eval), len(s.valid), len(s.test)) == (30, 8, 8, 8)
    assert not set(s.train.y.tolist()) & set(make_splits(data, valid_size=10).valid.y.tolist())
    assert torch.equal(s.train.y, make_splits(data, valid_size=10, train_size=30).train.y)
    with pytest.raises(ValueError, match="valid_size"):
        make_splits(data, valid_size=50)


def test_batches_scale_standardise_and_drop_last():
    x = torch.full((10, 3, 4, 4), 255, dtype=torch.uint8)
    split = Split(x, torch.arange(10))
    prep = Preprocess((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    batches = list(train_batches(split, 4, prep, torch.Generator().manual_seed(0)))
    assert [len(y) for _, y in batches] == [4, 4]
    assert torch.allclose(batches[0][0], torch.full((4, 3, 4, 4), 2.0))
    assert [len(y) for _, y in eval_batches(split, 4, prep)] == [4, 4, 2]
    assert Preprocess()(x[:1]).max() == 1.0


def test_augment_keeps_shape_and_range():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(16, 3, 32, 32, generator=gen)
    out = augment(x, gen)
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
    assert not torch.allclose(out, x)
    # A constant image stays constant up to the border that a shifted crop lets in.
    const = augment(torch.full((4, 3, 32, 32), 0.5), gen)
    assert torch.allclose(const[:, :, 2:-2, 2:-2].std((2, 3)), torch.zeros(4, 3), atol=1e-6)
