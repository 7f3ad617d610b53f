"""Build one optimizer of a problem through ``experiments.optimizers`` and time 12 steps on one
random batch of 128. Arguments: PROBLEM OPTIMIZER LR DAMPING (``-`` for none) [KEY=VALUE ...]."""

import sys
import time

import torch

from experiments.optimizers import make_optimizer
from experiments.peers import compile_info
from experiments.problems import get_problem
from experiments.timing import timed_step
from experiments.ttr.grids import Setting

problem, name, lr = sys.argv[1], sys.argv[2], float(sys.argv[3])
damping = None if sys.argv[4] == "-" else float(sys.argv[4])
options = dict(a.split("=") for a in sys.argv[5:])
setting = Setting(name, lr, damping, options=tuple(options.items()))
prob = get_problem(problem)
model, loss = prob.model(0), prob.loss()
start = time.time()
opt, collects = make_optimizer(setting.config(problem, 0), prob, model, loss)
print("build", time.time() - start, compile_info(opt), flush=True)
x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
for i in range(12):
    start = time.process_time()
    step = timed_step(model, loss, opt, collects, x, y, time.perf_counter)
    ms = 1e3 * (time.process_time() - start)
    print(i, step.diverged, round(step.loss.item(), 4), f"{ms:.1f} ms", flush=True)
