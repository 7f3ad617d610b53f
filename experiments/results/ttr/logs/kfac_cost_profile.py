"""CPU ms per step of the 2C2D KFAC winner, in blocks of 10 steps over its first 300 steps."""

import time
import torch
from experiments.ttr.report import load_entries, winner_setting
from experiments.data import load_dataset, make_splits, train_batches
from experiments.problems import get_problem
from experiments.optimizers import make_optimizer
from experiments.timing import timed_step

torch.set_num_threads(1)
e = {
    x["optimizer"]: winner_setting(x)
    for x in load_entries("experiments/results/ttr")
    if x["problem"] == "fmnist_2c2d"
}
sp = make_splits(load_dataset("fmnist"), eval_size=1)
p = get_problem("fmnist_2c2d")
m = p.model(0)
lossfunc = p.loss()
o, c = make_optimizer(e["kfac"].config("fmnist_2c2d", 0), p, m, lossfunc)
g = torch.Generator().manual_seed(0)
it = train_batches(sp.train, 128, p.preprocess(False), g)
out = []
for b in range(30):
    t = time.process_time()
    for _ in range(10):
        x, y = next(it)
        timed_step(m, lossfunc, o, c, x, y, time.perf_counter)
    out.append(round((time.process_time() - t) * 100, 0))
    print(b, out[-1], flush=True)
print("ms/step per block of 10:", out, "mean", sum(out) / len(out))
