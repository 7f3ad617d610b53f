"""A reentrant checkpoint's segment run again, from the private state torch's
``CheckpointFunction`` keeps on its node (``checkpointing``; ``tests/test_torch_internals.py``
checks it against the installed torch)."""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import set_device_states


def rerun_checkpoint(node):
    """The segment of a reentrant checkpoint (``node``: its ``CheckpointFunctionBackward``, the
    ``ctx`` of ``torch.utils.checkpoint.CheckpointFunction``) run again as that function's own
    backward runs it: its saved inputs, the forward's CPU (and device) RNG state restored where
    ``preserve_rng_state``, the forward's autocast, grad enabled; but the inputs are not
    detached, so the new graph hangs from the graph upstream of the checkpoint.

    Returns ``(outputs, drew)``: the outputs as a tuple (entry ``i`` is the node's input ``i``)
    and whether the run drew random numbers from a generator it did not restore to the
    forward's state (``preserve_rng_state=False``), i.e. whether it may differ from the forward.
    The global generators are left as they were either way.
    """
    inputs = list(node.inputs)
    for index, tensor in zip(node.tensor_indices, node.saved_tensors):
        inputs[index] = tensor
    preserve, device_type = node.preserve_rng_state, node.device_type
    device = getattr(torch, device_type, None) if device_type != "cpu" else None
    watch_device = device is not None and getattr(device, "_initialized", False)
    if preserve and node.had_device_in_fwd:
        devices = node.fwd_devices
    else:
        devices = [device.current_device()] if watch_device else []
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        if preserve:
            torch.set_rng_state(node.fwd_cpu_state)
            if node.had_device_in_fwd:
                set_device_states(node.fwd_devices, node.fwd_device_states, device_type=device_type)
        before = (torch.get_rng_state(), device.get_rng_state() if watch_device else None)
        if torch.amp.is_autocast_available(device_type):
            device_autocast = torch.amp.autocast(device_type, **node.device_autocast_kwargs)
        else:
            device_autocast = contextlib.nullcontext()
        with (
            torch.enable_grad(),
            device_autocast,
            torch.amp.autocast("cpu", **node.cpu_autocast_kwargs),
        ):
            outputs = node.run_function(*inputs)
        after = (torch.get_rng_state(), device.get_rng_state() if watch_device else None)
    drew = not preserve and any(
        a is not None and not torch.equal(a, b) for a, b in zip(before, after)
    )
    return (outputs if isinstance(outputs, tuple) else (outputs,)), drew
