"""Helpers shared by the sparse-attention kernel tests: outputs and input gradients of one call, fp64 inputs."""
import torch


def grads(fn, inputs, grad_out, names, scale=0.3):
    """``fn(*inputs[names], inputs["topk_idx"], scale=scale)`` backpropagated with ``grad_out``: the detached
    output and the gradient of every input in ``names``."""
    leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in names}
    out = fn(*(leaves[n] for n in names), inputs["topk_idx"], scale=scale)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), {n: leaves[n].grad for n in names}


def as_fp64(inputs):
    """The floating-point inputs in fp64 (the exact side of a comparison), indices unchanged."""
    return {n: (t.to(torch.float64) if t.is_floating_point() else t) for n, t in inputs.items()}
