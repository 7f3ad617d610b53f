"""Exact curvature below a language model's attention from ``T·min(d, V)`` columns per sample
instead of ``T·V``: a prototype on ``fixtures.zoo.GPT`` (one block), for KFLR's output-side
factor ``B`` of the attention's input layer ``qkv``.

    OMP_NUM_THREADS=1 python -m benchmarks.lm_compressed_columns [--batch 2] [--vocab 256]
        [--seq 32] [--reps 3]

Everything above the residual stream ``h = x + attn(ln1(x))`` acts on each position alone:
``logits_t = top(h_t)``. So the GGN with respect to ``h`` is block diagonal over positions, with
``d × d`` blocks ``M_t = J_tᵀ H_t J_t`` (``J_t = ∂logits_t/∂h_t``, ``H_t = β (diag(p) − ppᵀ)``),
whose rank is at most ``min(d, V − 1)``. The ``V`` loss-Hessian columns of a position, pulled
back to ``h_t``, can therefore be replaced by ``d`` columns ``L_t`` with ``L_t L_tᵀ = M_t``
(an eigendecomposition) before they enter the attention, which mixes positions; every quantity
below (``qkv``'s factor here, any diagonal or factor of a lower layer) is unchanged, because it
depends on the columns only through ``Σ_k c_k c_kᵀ``. Attention then carries ``T·d`` columns per
sample instead of ``T·V``: the exact cost stops growing with ``V`` below the residual stream.
The positions cannot be compressed further: the GGN with respect to a sample's attention input
``[T·d]`` has full rank ``T·d`` in general.

:func:`qkv_output_factor` computes ``B`` both ways (``compress=False``: the ``V`` columns of each
position's ``diag(√p) − p√pᵀ``); :func:`reference_qkv_output_factor` from the full Jacobian
(torch.func) for the tests. The loss is ``CrossEntropyLoss(reduction="mean")`` over all ``N·T``
rows (no ignored targets).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.func import jacrev, vjp, vmap

from fixtures.zoo import GPT


def _embed(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    return model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=idx.device))


def _mid(model: GPT, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The residual stream ``h = x + proj(attention(q, k, v))`` of one sample from
    ``u = qkv(ln1(x))`` (``[T, 3d]``)."""
    attn = model.block.attn
    t, d = x.shape
    q, k, v = (z.reshape(t, attn.heads, d // attn.heads).transpose(0, 1) for z in u.split(d, -1))
    h = F.scaled_dot_product_attention(q, k, v, is_causal=attn.causal)
    return x + attn.proj(h.transpose(0, 1).reshape(t, d))


def _top(model: GPT, h: torch.Tensor) -> torch.Tensor:
    """Logits of one position from its residual stream ``h`` (``[d]``)."""
    block = model.block
    h = h + block.out(F.gelu(block.fc(block.ln2(h))))
    return model.head(model.ln_f(h))


def _sqrt_loss_hessian(logits: torch.Tensor, rows: int) -> torch.Tensor:
    """``S`` (``[..., V, V]``) with ``S Sᵀ = (diag(p) − ppᵀ) / rows`` (mean over ``rows``)."""
    p = logits.softmax(-1)
    eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
    return (eye - p.unsqueeze(-1)) * (p / rows).sqrt().unsqueeze(-2)


def qkv_output_factor(model: GPT, idx: torch.Tensor, compress: bool = True) -> torch.Tensor:
    """KFLR's ``B`` of ``model.block.attn.qkv`` (``[3d, 3d]``): the sum over samples, positions
    and exact columns of ``δ δᵀ`` at qkv's output; ``compress`` re-factors each position's
    columns to ``min(d, V)`` at the residual stream (module docstring)."""
    n, t = idx.shape
    with torch.no_grad():
        x = _embed(model, idx)
        u = model.block.attn.qkv(model.block.ln1(x))
        h = vmap(lambda u_n, x_n: _mid(model, u_n, x_n))(u, x)
        top_jac = vmap(jacrev(lambda h_r: _top(model, h_r)))(h.reshape(n * t, -1))  # [NT, V, d]
        logits = vmap(lambda h_r: _top(model, h_r))(h.reshape(n * t, -1))
        cols = top_jac.transpose(1, 2) @ _sqrt_loss_hessian(logits, n * t)  # [NT, d, V]
        if compress and cols.shape[1] < cols.shape[2]:
            eigvals, eigvecs = torch.linalg.eigh(cols @ cols.transpose(1, 2))
            cols = eigvecs * eigvals.clamp(min=0).sqrt().unsqueeze(1)  # [NT, d, d]
        d, k = cols.shape[1], cols.shape[2]
        # per sample, column (s, j) sits at position s: [N, T·k, T, d]
        cols = cols.reshape(n, t, d, k).permute(0, 1, 3, 2)
        placed = torch.zeros(n, t, k, t, d, dtype=cols.dtype, device=cols.device)
        placed[:, torch.arange(t), :, torch.arange(t)] = cols.permute(1, 0, 2, 3)
        placed = placed.reshape(n, t * k, t, d)

        def pullback(u_n, x_n, columns):
            _, back = vjp(lambda z: _mid(model, z, x_n), u_n)
            return vmap(lambda c: back(c)[0])(columns)  # [T·k, T, 3d]

        delta = vmap(pullback)(u, x, placed).reshape(-1, u.shape[-1])
    return delta.T @ delta


def reference_qkv_output_factor(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """``B = Σ_n Σ_p J_{n,p}ᵀ H_n J_{n,p}`` with ``J_{n,p} = ∂logits_n/∂u_{n,p}`` from the full
    Jacobian (torch.func) and the block-diagonal mean cross-entropy Hessian ``H_n``."""
    n, t = idx.shape
    x = _embed(model, idx)
    u = model.block.attn.qkv(model.block.ln1(x))

    def logits_of(u_n, x_n):
        return vmap(lambda h_r: _top(model, h_r))(_mid(model, u_n, x_n))  # [T, V]

    out = torch.zeros(u.shape[-1], u.shape[-1], dtype=u.dtype)
    for i in range(n):
        jac = jacrev(logits_of)(u[i], x[i])  # [T, V, T, 3d]
        p = logits_of(u[i], x[i]).softmax(-1)
        hess = (torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)) / (n * t)  # [T, V, V]
        out += torch.einsum("tvpa,tvw,twpb->ab", jac, hess, jac)
    return out.detach()


def _median_time(run, reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(vocab: int, seq: int, batch: int, reps: int) -> str:
    """Time and compare both ways at one (V, T), d = 64."""
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=64, heads=4, t_max=seq).eval()
    idx = torch.randint(vocab, (batch, seq))
    full = _median_time(lambda: qkv_output_factor(model, idx, compress=False), reps)
    short = _median_time(lambda: qkv_output_factor(model, idx), reps)
    a, b = qkv_output_factor(model, idx, False), qkv_output_factor(model, idx)
    diff = ((a - b).abs().max() / a.abs().max()).item()
    return (
        f"| {vocab} | {seq} | {1e3 * full:.0f} | {1e3 * short:.0f} | "
        f"{full / short:.1f} | {diff:.1e} |"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seq", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"torch.set_num_threads({torch.get_num_threads()}), N = {args.batch}, d = 64\n")
    print("| V | T | T·V columns ms | T·d columns ms | speed-up | max rel. difference |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for seq in args.seq:
            print(_row(vocab, seq, args.batch, args.reps), flush=True)


if __name__ == "__main__":
    main()
