"""Build one optimizer of a problem through experiments.optimizers and time 12 steps on one random batch of 128:
args PROBLEM OPTIMIZER LR DAMPING(- for none) [KEY=VALUE options]."""
import sys, time, torch
from experiments.ttr.grids import Setting
from experiments.problems import get_problem
from experiments.optimizers import make_optimizer
from experiments.peers import compile_info
from experiments.timing import timed_step
problem, name, lr = sys.argv[1], sys.argv[2], float(sys.argv[3])
opts = dict(a.split("=") for a in sys.argv[5:])
damping = None if sys.argv[4] == "-" else float(sys.argv[4])
s = Setting(name, lr, damping, options=tuple(opts.items()))
prob = get_problem(problem); cfg = s.config(problem, 0)
model = prob.model(0); loss = prob.loss()
t = time.time(); opt, col = make_optimizer(cfg, prob, model, loss); print("build", time.time()-t, compile_info(opt), flush=True)
x = torch.randn(128, 1, 28, 28); y = torch.randint(0, 10, (128,))
for i in range(12):
    t = time.process_time(); st = timed_step(model, loss, opt, col, x, y, time.perf_counter); 
    print(i, st.diverged, round(st.loss.item(), 4), round(1e3*(time.process_time()-t), 1), "ms", flush=True)
