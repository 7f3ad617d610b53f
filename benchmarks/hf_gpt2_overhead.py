"""Overhead of BatchGrad, DiagGGNMC and KFAC on a tiny Hugging Face GPT-2, relative to the
plain model's forward + backward (needs ``transformers``; random init, no download).

    OMP_NUM_THREADS=1 python -m benchmarks.hf_gpt2_overhead [--reps 15]

Prints the median time of each case over ``--reps`` runs (after two warm-up runs), interleaved
so that load on the machine hits every case alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import curvopt
from curvopt import extensions as ext


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=1000,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    plain = transformers.GPT2LMHeadModel(config).eval()
    model = curvopt.extend(copy.deepcopy(plain))
    ce = nn.CrossEntropyLoss()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    def lm_loss(net, loss):
        logits = net(input_ids=ids).logits
        return loss(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def run(net, loss, *extensions, labels=False):
        net.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if labels:
            objective = net(input_ids=ids, labels=ids).loss
        else:
            objective = lm_loss(net, loss)
        if extensions:
            with curvopt.collect(*extensions):
                objective.backward()
        else:
            objective.backward()
        return time.perf_counter() - start

    cases = {
        "plain forward+backward": lambda: run(plain, ce),
        "extended, outside collect": lambda: run(model, lossfunc),
        "BatchGrad": lambda: run(model, lossfunc, ext.BatchGrad()),
        "BatchGrad, HF labels= loss": lambda: run(model, None, ext.BatchGrad(), labels=True),
        "DiagGGNMC": lambda: run(model, lossfunc, ext.DiagGGNMC()),
        "KFAC": lambda: run(model, lossfunc, ext.KFAC()),
    }
    times = {name: [] for name in cases}
    for rep in range(args.reps + 2):
        for name, case in cases.items():
            elapsed = case()
            if rep >= 2:
                times[name].append(elapsed)
    base = statistics.median(times["plain forward+backward"])
    print(
        f"GPT-2 n_layer=2 n_embd=64 vocab=1000, batch {args.batch} x {args.seq} tokens, "
        f"float32, {torch.get_num_threads()} thread(s), median of {args.reps}"
    )
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:28s} {1e3 * median:8.1f} ms   {median / base:5.2f}x")


if __name__ == "__main__":
    main()
