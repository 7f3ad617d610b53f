"""The time-to-result benchmark's two non-classification workloads (issue 53 item 2).

* ``fortunes_gpt``: a character-level GPT on English quotations, Debian's ``fortunes`` package.
  Metric: bits per character on the held-out fortunes (lower is better).
* ``mnist_autoencoder``: the deep autoencoder of Hinton & Salakhutdinov (2006) on MNIST,
  784-1000-500-250-30-250-500-1000-784, the benchmark of Martens (2010) and of KFAC (Martens &
  Grosse 2015). Metric: the squared reconstruction error per test image (lower is better).

**The corpus** (:data:`FORTUNE_FILES`, :data:`FORTUNES_MD5`): every fortune file of Debian 12's
``fortunes`` and ``fortunes-min`` (1:1.99.1-7.3) under ``/usr/share/games/fortunes/``, in sorted
name order, except ``ascii-art`` (drawings, not prose) and ``translate-me`` (not English): 41
files, 2,569,010 bytes, 15,195 fortunes. Each file is checked against its md5 when it is read,
so a different version of the package fails loudly instead of changing the numbers. Nothing
is downloaded at run time: the files come from ``apt-get install fortunes`` (``python -m
experiments fetch_data`` / ``make data`` runs it as root and copies the files into
``ROOT/fortunes/``); the loader looks in ``ROOT/fortunes/``, then in
``/usr/share/games/fortunes/``.

**Text normalisation**: UTF-8; overstrike pairs ``c\\b`` (a character followed by a
backspace, old terminal underlining; 218 in the corpus) are dropped, keeping the overstruck
character; a tab becomes a space; any other character outside printable ASCII and the newline
is dropped (126 in the corpus: bells, a few accented letters and broken encodings). The
vocabulary is fixed, not read from the data: the newline and the 95 printable ASCII characters,
:data:`VOCAB` = 96.

**Split**: the files are cut into fortunes at their ``%`` lines; the fortunes are numbered in
corpus order (file by file) and every tenth one (number ``k`` with ``k % 10 == 9``) is held out
for validation, the other 90 % train: validation fortunes come from every file, the same for
every run. Each side is the concatenation of its fortunes, each followed by a blank line.
A sample is a window of ``T + 1 = 65`` characters at a stride of ``T`` from the start of its
side's text (input the first 64, targets the last 64), so the training windows tile the training
text exactly once (35,791 windows); the batches reshuffle them every epoch (1,118 steps of
batch 32). The validation windows are evaluated in order; ``eval_size`` takes the first ones.

**The model** (:class:`CharGPT`): token embedding and learned positions (``nn.Embedding`` each,
positions looked up with one ``arange(T)``), 2 pre-LayerNorm blocks of width 128 with 4 causal
heads and a GELU MLP of 512, a final LayerNorm and an untied output layer: 0.43 M parameters.
Its output is ``[N, V, T]`` (PyTorch's K-dim form), so that ``nn.CrossEntropyLoss`` (mean over
the ``N T`` characters, in nats) takes ``y [N, T]`` as it is; bits per character = nats / ln 2.

**The autoencoder** (:func:`mnist_autoencoder`): logistic hidden units, a linear 30-unit code,
output logits (``784 -> 1000 -> 500 -> 250 -> 30 -> 250 -> 500 -> 1000 -> 784``; 2.83 M
parameters). Initialisation: Martens (2010)'s sparse one, as in his and in KFAC's
experiments (15 nonzero standard-normal incoming weights per unit, biases 0; with PyTorch's
default initialisation the first layer's gradient is 1e-9 at the start, and PSGD-Kron cannot
even initialise its preconditioner). Loss: ``nn.BCEWithLogitsLoss`` (mean over
pixels and images) against the pixel intensities in [0, 1], as Martens & Grosse. The metric is
the classic one: ``sum over pixels (sigmoid(logit) - x)^2``, averaged over the test images.
Training on the 50,000 training images left after the 10,000 held out (as the other problems);
evaluated on the first ``eval_size`` test images.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .data import (
    SYNTHETIC_HINT,
    DataMissingError,
    Preprocess,
    Split,
    Splits,
    default_root,
    load_dataset,
    make_splits,
)
from .problem import EncoderBlock, Problem

# --- the fortunes corpus -------------------------------------------------------------------------

#: Where Debian's ``fortunes`` package installs its files.
DEBIAN_FORTUNES = Path("/usr/share/games/fortunes")
FORTUNES_PACKAGE = "fortunes"
FORTUNES_INSTALL = "apt-get install fortunes (as root), then python -m experiments fetch_data"
#: md5 of each file of the corpus as Debian 12 ships it (fortunes 1:1.99.1-7.3), in corpus order
FORTUNES_MD5 = {
    "art": "24fe30c0e3e3b39d399b485d5ded5bd6",
    "computers": "d5f19647f924b7a243c11a6dd1420ebd",
    "cookie": "e383d32753b2552373ccf69951fcce3a",
    "debian": "8d6a24bbb79c8cfbf8167ddd04cf3e30",
    "definitions": "a1c486c8047131b69446e197851ce121",
    "disclaimer": "546cdb71ec053e5c58feba8316c2ef08",
    "drugs": "b9f6ee841159ef1650e0d730fe689e9b",
    "education": "5b6991e34fdfbb18e48aa24f09cf39c8",
    "ethnic": "e96b48fe71f22332d8f3699d7c5d2f1b",
    "food": "3c6dbd6eddbc17a8d113d7a58f6e433b",
    "fortunes": "5005c1e4fe6f07038c4d95ae44194724",
    "goedel": "6b4077b82069fe6506ead822a099c9a4",
    "humorists": "6a3773e284582e90ea48fe8d0843cf16",
    "kids": "e6e47b56efca575f684e193be7e2c187",
    "knghtbrd": "c25573864ab84cedb32443fe2e8af2c5",
    "law": "f932dc72c5212f16e57a2c382bb82af2",
    "linux": "99db26f3c2f1b43712ab3af0224aaec0",
    "linuxcookie": "21c35b8e2add2e840f85fd0345748e91",
    "literature": "62bbf5b141669b3fd2a13b333543e73f",
    "love": "17b72c752d9881c127ed7d73c27d7fc1",
    "magic": "fdb4ec12fba1e3505e9aade989cb9640",
    "medicine": "a2f11bb0587b1503720f861e627656b8",
    "men-women": "a3abc0c09c7145c371859584b1e7f902",
    "miscellaneous": "040486d9953d010877146b68bd7fe607",
    "news": "8f6e63fc3a3b7f1fd5aa1ea10c41a2ff",
    "paradoxum": "fe245e239360d73ac3cb68a35fcde361",
    "people": "19ecf62c9de0438ba3330904e8782874",
    "perl": "c3a8976c32debd2c935c31e56a267752",
    "pets": "e9bd83fd8daee6f10f9a41aa71409589",
    "platitudes": "8f03d1c326f4c39b62f86bba06d85f6c",
    "politics": "4e30eeee18c3cd112aa7f3dfaf8c483e",
    "pratchett": "056d59f771867d59df56c8489d18e22e",
    "riddles": "e32d06e64673635ce8de7f34df7dffc9",
    "science": "8f2eab053e7d93e12c187bccf9d07edb",
    "songs-poems": "a8682f56086017ebdd8132baeb61ca83",
    "sports": "2f843e5aaf0e970cbfa04b18ff04d1e9",
    "startrek": "ac068c1f7fc860956e1030774964b2b4",
    "tao": "26046fbfc512f6d854b83cddf753fca2",
    "wisdom": "0a6a446cd47f519c590ed6486689c118",
    "work": "3ca4b40555380b1c5d873ac273c08fa9",
    "zippy": "afb6b3ef671ae5fd2a588198ea32031e",
}
#: md5 of the normalised training and validation texts (ASCII), as :func:`read_corpus` makes them
#: from the files above: 2,290,680 and 262,518 characters of 15,195 fortunes
TEXT_MD5 = ("d2d5cead8db2710e516347a02f9e5b66", "f044fe505764eec38b8118413cc5a30b")
#: left out of the corpus: ``ascii-art`` (drawings), ``translate-me`` (not English)
EXCLUDED_FORTUNES = ("ascii-art", "translate-me")
#: every ``VALIDATION_EVERY``-th fortune (``k % 10 == 9``) is held out for validation
VALIDATION_EVERY = 10
#: characters per sample (the context); a window holds ``CONTEXT + 1``
CONTEXT = 64
#: the vocabulary: the newline, then printable ASCII 32..126
VOCAB = 96
_OVERSTRIKE = re.compile(r".\x08", re.DOTALL)
_OUTSIDE = re.compile(r"[^\n\x20-\x7e]")


def normalize(text: str) -> str:
    """Overstrike pairs dropped (the overstruck character kept), tabs to spaces, everything
    outside the newline and printable ASCII dropped (see the module doc)."""
    text = _OVERSTRIKE.sub("", text).replace("\t", " ")
    return _OUTSIDE.sub("", text)


def split_fortunes(text: str) -> list[str]:
    """The fortunes of one file: the texts between its ``%`` lines, empty ones dropped."""
    parts = re.split(r"^%\n", text, flags=re.MULTILINE)
    return [p for p in parts if p.strip()]


def encode(text: str) -> torch.Tensor:
    """Characters to int64 ids: ``\\n`` -> 0, ``chr(c)`` -> ``c - 31`` for printable ASCII."""
    raw = torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()
    return torch.where(raw == 10, torch.zeros_like(raw), raw - 31)


def decode(ids: torch.Tensor) -> str:
    return "".join("\n" if i == 0 else chr(i + 31) for i in ids.tolist())


def md5_bytes(raw: bytes) -> str:
    return hashlib.md5(raw).hexdigest()


def fortunes_folder(root: Path) -> tuple[Path, list[Path]]:
    """The first folder of ``ROOT/fortunes``, ``/usr/share/games/fortunes`` holding every file
    of :data:`FORTUNES_MD5`, and the folders looked in; ``DataMissingError`` naming the install
    command if none does."""
    folders = [root / "fortunes", DEBIAN_FORTUNES]
    for folder in folders:
        if all((folder / name).is_file() for name in FORTUNES_MD5):
            return folder, folders
    looked = ", ".join(str(f) for f in folders)
    raise DataMissingError(
        f"the fortunes corpus was not found: no folder among [{looked}] holds its "
        f"{len(FORTUNES_MD5)} files ({', '.join(list(FORTUNES_MD5)[:3])}, ...). Install Debian's "
        f"{FORTUNES_PACKAGE} package: {FORTUNES_INSTALL}; nothing is downloaded at run time. "
        f"Or set CURVOPT_DATA/--data-root to a root whose fortunes/ holds them, {SYNTHETIC_HINT}."
    )


def read_corpus(
    folder: Path, sums: dict[str, str] | None = None, every: int = VALIDATION_EVERY
) -> tuple[str, str]:
    """``(train text, validation text)`` of the files of ``sums`` (default
    :data:`FORTUNES_MD5`) in ``folder``, each checked against its md5 (see the module doc)."""
    sums = FORTUNES_MD5 if sums is None else sums
    train, valid, k = [], [], 0
    for name, digest in sums.items():
        raw = (folder / name).read_bytes()
        if md5_bytes(raw) != digest:
            raise ValueError(
                f"{folder / name}: md5 {md5_bytes(raw)}, expected {digest} (Debian 12's "
                f"fortunes 1:1.99.1-7.3); another version would change the corpus"
            )
        for fortune in split_fortunes(raw.decode("utf-8")):
            text = normalize(fortune).rstrip("\n") + "\n\n"
            (valid if k % every == every - 1 else train).append(text)
            k += 1
    return "".join(train), "".join(valid)


def windows(ids: torch.Tensor, context: int = CONTEXT) -> Split:
    """Samples ``x = ids[s : s + T]``, ``y = ids[s + 1 : s + T + 1]`` at ``s = 0, T, 2T, ...``."""
    n = (len(ids) - 1) // context
    x = ids[: n * context].view(n, context)
    y = ids[1 : n * context + 1].view(n, context)
    return Split(x.contiguous(), y.contiguous())


@dataclass
class TextData:
    """Token ids of the training and validation texts."""

    train: torch.Tensor
    valid: torch.Tensor
    synthetic: bool = False


def load_fortunes(root: str | Path | None = None, synthetic: bool = False) -> TextData:
    """The corpus as ids (see the module doc), or random ids of the same lengths."""
    if synthetic:
        gen = torch.Generator().manual_seed(0)
        draw = lambda n: torch.randint(0, VOCAB, (n,), generator=gen)  # noqa: E731
        return TextData(draw(2_400_000), draw(270_000), synthetic=True)
    folder, _ = fortunes_folder(Path(root) if root is not None else default_root())
    train, valid = read_corpus(folder)
    return TextData(encode(train), encode(valid))


def text_splits(
    data: TextData, eval_size: int | None = None, device: str | torch.device = "cpu"
) -> Splits:
    """Training windows (``train``; ``train_eval`` their first ``eval_size``) and validation
    windows (``valid`` and ``test``, the first ``eval_size``: the benchmark evaluates ``test``)."""
    train, valid = windows(data.train), windows(data.valid)
    moved = lambda s: Split(s.x.to(device), s.y.to(device))  # noqa: E731
    train, valid = moved(train), moved(valid)
    held = valid.head(eval_size)
    return Splits(train, train.head(eval_size), held, held, data.synthetic)


# --- the models ----------------------------------------------------------------------------------


class CausalEncoderBlock(EncoderBlock):
    """:class:`experiments.problem.EncoderBlock` with causal attention."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        n, t, d = h.shape
        attn = self.attn
        q, k, v = attn.qkv(h).split(d, dim=-1)
        q, k, v = (z.reshape(n, t, attn.heads, d // attn.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.proj(a.transpose(1, 2).reshape(n, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharGPT(nn.Module):
    """Decoder-only character model ``ids [N, T] -> logits [N, V, T]`` (see the module doc)."""

    def __init__(
        self,
        vocab: int = VOCAB,
        context: int = CONTEXT,
        d: int = 128,
        depth: int = 2,
        heads: int = 4,
        mlp: int = 512,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*(CausalEncoderBlock(d, heads, mlp) for _ in range(depth)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.norm(self.blocks(self.tok(ids) + self.pos(positions)))
        return self.head(h).transpose(1, 2)


#: the autoencoder's widths, input to code (the decoder mirrors them)
AUTOENCODER_WIDTHS = (784, 1000, 500, 250, 30)


#: Martens (2010)'s sparse initialisation: nonzero incoming weights per unit
SPARSE_INCOMING = 15


def sparse_init_(weight: torch.Tensor, nonzero: int = SPARSE_INCOMING) -> torch.Tensor:
    """Martens (2010)'s sparse initialisation, as in his and in KFAC's autoencoder experiments:
    each unit (row) gets ``nonzero`` incoming weights drawn from a standard normal at random
    columns (all columns where there are fewer), the others 0. Uses the global RNG."""
    out_features, in_features = weight.shape
    k = min(nonzero, in_features)
    with torch.no_grad():
        weight.zero_()
        for row in range(out_features):
            cols = torch.randperm(in_features)[:k]
            weight[row, cols] = torch.randn(k)
    return weight


def mnist_autoencoder() -> nn.Sequential:
    """784-1000-500-250-30-250-500-1000-784: logistic hidden units, a linear code, logits out;
    Martens's sparse initialisation (:func:`sparse_init_`), biases 0."""
    widths = AUTOENCODER_WIDTHS + AUTOENCODER_WIDTHS[-2::-1]
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        linear = nn.Linear(a, b)
        sparse_init_(linear.weight)
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if b != AUTOENCODER_WIDTHS[-1] and i < len(widths) - 2:
            layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


# --- metrics -------------------------------------------------------------------------------------


@torch.no_grad()
def bits_per_character(model, lossfunc, split: Split, batch_size: int, prep) -> float:
    """Mean cross-entropy over every character of ``split``, in bits."""
    total, count = 0.0, 0
    for start in range(0, len(split), batch_size):
        x, y = prep(split.x[start : start + batch_size]), split.y[start : start + batch_size]
        total += F.cross_entropy(model(x), y, reduction="sum").item()
        count += y.numel()
    return total / count / math.log(2)


@torch.no_grad()
def squared_error_per_image(model, lossfunc, split: Split, batch_size: int, prep) -> float:
    """``sum over pixels (sigmoid(logit) - x)^2``, averaged over the images of ``split``."""
    total = 0.0
    for start in range(0, len(split), batch_size):
        x, y = prep(split.x[start : start + batch_size]), split.y[start : start + batch_size]
        total += (torch.sigmoid(model(x)) - y).square().sum().item()
    return total / len(split)


# --- the problems --------------------------------------------------------------------------------


class Identity(Preprocess):
    """Token ids go in as they are."""

    def __call__(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        return x


def _text_splits(root, synthetic, eval_size, device) -> Splits:
    return text_splits(load_fortunes(root, synthetic), eval_size, device)


def pixel_targets(splits: Splits) -> Splits:
    """The image splits with each target the image itself, flattened, in [0, 1] (float32)."""

    def own(s: Split) -> Split:
        return Split(s.x, s.x.flatten(1).float() / 255.0)

    return Splits(
        *(own(getattr(splits, k)) for k in ("train", "train_eval", "valid", "test")),
        splits.synthetic,
    )


def _mnist_splits(root, synthetic, eval_size, device) -> Splits:
    data = load_dataset("mnist", root, synthetic)
    return pixel_targets(make_splits(data, eval_size=eval_size, device=device))


@dataclass(frozen=True)
class Workload(Problem):
    """A problem whose data, loss, pre-processing and metric are its own: ``load(root,
    synthetic, eval_size, device) -> Splits``; ``metric`` names what ``score(model, lossfunc,
    split, batch_size, prep)`` returns, ``lower_is_better`` its direction."""

    load: Callable[..., Splits] = field(default=None, compare=False)
    make_loss: Callable[[], nn.Module] = field(default=nn.CrossEntropyLoss, compare=False)
    score: Callable[..., float] = field(default=None, compare=False)
    metric: str = "accuracy"
    lower_is_better: bool = False
    shape: tuple[int, ...] = ()
    tokens: bool = False

    def loss(self) -> nn.Module:  # type: ignore[override]
        return self.make_loss()

    def preprocess(self, augment: bool | None = None) -> Preprocess:
        return Identity() if self.tokens else Preprocess()

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.shape

    def splits(self, root, synthetic: bool, eval_size: int | None, device) -> Splits:
        return self.load(root, synthetic, eval_size, device)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "fortunes_gpt",
            "fortunes",
            CharGPT,
            batch_size=32,
            epochs=1,
            load=_text_splits,
            score=bits_per_character,
            metric="bits per character",
            lower_is_better=True,
            shape=(CONTEXT,),
            tokens=True,
        ),
        Workload(
            "mnist_autoencoder",
            "mnist",
            mnist_autoencoder,
            batch_size=128,
            epochs=1,
            load=_mnist_splits,
            make_loss=nn.BCEWithLogitsLoss,
            score=squared_error_per_image,
            metric="squared error per image",
            lower_is_better=True,
            shape=(1, 28, 28),
        ),
    )
}
