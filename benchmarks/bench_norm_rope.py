"""RMSNorm and RoPE forward + backward at the training benchmark's shapes: the model's versions
(``glm5_core.model.norm`` / ``rope``) against the plain torch compositions they replaced (bitwise the same
results: tests/model/test_norm_rope_bitwise.py). Interleaved rounds (who goes first alternates), medians.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_norm_rope.py --out benchmarks/results/norm_rope.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _results import write_json  # benchmarks/, the script's folder

from glm5_core.model.norm import RMSNorm
from glm5_core.model.rope import apply_rope


def _composition_norm(x, weight, eps):
    xc = x.to(torch.float32)
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xc.to(x.dtype)


def _composition_rope(x, cos, sin):
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _cases(batch: int, tokens: int):
    cases = {}
    for width in (256, 128):  # hidden / q_lora_rank, kv_lora_rank
        x = torch.randn(batch, tokens, width, requires_grad=True)
        grad = torch.randn(batch, tokens, width)
        norm = RMSNorm(width, 1e-5)
        cases[f"rms_norm [{batch}, {tokens}, {width}]"] = (
            lambda x=x, g=grad, n=norm: _composition_norm(x, n.weight, n.eps).backward(g),
            lambda x=x, g=grad, n=norm: n(x).backward(g))
    cos, sin = torch.randn(batch, tokens, 8), torch.randn(batch, tokens, 8)
    q = torch.randn(batch, tokens, 8, 48, requires_grad=True)  # the rope slice is the last 16 (as q_pe)
    grad_q = torch.randn(batch, tokens, 8, 16)
    cases[f"rope q [{batch}, {tokens}, 8, 16]"] = (
        lambda: _composition_rope(q[..., 32:], cos, sin).backward(grad_q),
        lambda: apply_rope(q[..., 32:], cos, sin, interleave=True).backward(grad_q))
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", default="benchmarks/results/norm_rope.json")
    args = parser.parse_args(argv)
    rows = []
    for name, (composition, model) in _cases(args.batch, args.tokens).items():
        times = {"composition": [], "model": []}
        for fn in (composition, model, composition, model):  # warm-up
            fn()
        for r in range(args.rounds):
            order = [("composition", composition), ("model", model)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"case": name, "median_s": med, "speedup": med["composition"] / med["model"]})
        print(f"{name} fwd+bwd: composition {med['composition'] * 1e3:.3f} ms, model {med['model'] * 1e3:.3f} ms "
              f"({rows[-1]['speedup']:.2f}x)")
    write_json(args.out, {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                          "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                          "load_average": os.getloadavg(), "rounds": args.rounds, "cases": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
