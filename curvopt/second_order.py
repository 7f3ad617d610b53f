"""Second-order quantities: placeholder until the curvature propagation lands."""


class LossRecord:
    __slots__ = ("module", "args", "kwargs")

    def __init__(self, module, args, kwargs, output):
        self.module, self.args, self.kwargs = module, args, kwargs

    def on_grad(self, grad):
        from curvopt.state import STATE

        if STATE.suspended or STATE.collecting is None or self.args is None:
            return
        STATE.collecting.backward_pass().loss_seen = True
        self.args = self.kwargs = None
