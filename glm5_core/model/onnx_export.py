"""``glm5 export-onnx``: export the prefill forward (logits only) of a checkpoint to ONNX.

The graph maps ``input_ids`` int64 [batch, seq] to ``logits`` float32 [batch, seq, vocab], with batch and
seq dynamic. By default it computes what the model computes (``attention="sparse"``, DSA): the indexer, an
ONNX TopK of width ``index_topk`` per query (ties to the lower key index, as ``dsa.indexer_topk``) and attention
over the selected keys (``MLA._sparse_for_export``). ``--attention dense`` exports the dense form instead (every
causal key; a different function past ``index_topk`` tokens), and says so. The model is traced with
``backend="cpu"``, whose dense MLA prefill is torch ops ending in ``scaled_dot_product_attention`` (which
torch.onnx exports itself); the MoE layers do not call the backend's
(native) routing kernels while exporting but switch to their export form (torch.topk routing, every expert on
every token, weighted by the scattered routing weights) because dispatch's per-expert row counts are
data-dependent.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

import torch
from torch import nn

from glm5_core.model.checkpoint import check_checkpoint_dir, load_pretrained
from glm5_core.model.modeling import GLM5ForCausalLM

DEFAULT_OPSET = 17
MIN_OPSET = 14  # the dense form's scaled_dot_product_attention exports from opset 14


ATTENTION_FORMS = ("sparse", "dense")
DENSE_NOTICE = ("the exported graph uses DENSE attention (every causal key), not the checkpoint's sparse DSA "
                "attention: its logits differ from the model's past index_topk={topk} tokens")


class PrefillLogits(nn.Module):
    """input_ids [B, T] -> logits [B, T, V] with ``attention`` ("sparse" | "dense"), no cache, no MTP."""

    def __init__(self, model: GLM5ForCausalLM, attention: str = "sparse"):
        super().__init__()
        self.model = model
        self.attention = attention

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, attention=self.attention).logits


def require_onnx() -> None:
    """ModuleNotFoundError in one line, with the install command, when the ``onnx`` package (the ``[onnx]``
    extra, which torch.onnx writes the graph with) cannot be imported."""
    try:
        importlib.import_module("onnx")
    except ImportError as exc:
        raise ModuleNotFoundError(f"the onnx package is not installed ({exc}); install the extra: "
                                  "pip install 'glm5-core[onnx]'", name="onnx") from None


def export_onnx(model: GLM5ForCausalLM, out_path: str, *, seq_len: int = 16, opset: int = DEFAULT_OPSET,
                attention: str = "sparse") -> str:
    """Trace ``model``'s prefill forward with an example of ``seq_len`` tokens and write ``out_path``.
    ``attention``: "sparse" (default, the model's own function) or "dense" (warns: another function)."""
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"attention: expected one of {ATTENTION_FORMS}, got {attention!r}")
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < MIN_OPSET:
        raise ValueError(f"opset: expected an int >= {MIN_OPSET} (torch.onnx exports the attention from opset "
                         f"{MIN_OPSET}), got {opset!r}")
    if attention == "dense":
        warnings.warn(DENSE_NOTICE.format(topk=model.config.index_topk), UserWarning, stacklevel=2)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len: expected an int >= 2 (the example length to trace), got {seq_len!r}")
    if seq_len > model.config.max_position_embeddings:
        raise ValueError(f"seq_len: expected <= max_position_embeddings={model.config.max_position_embeddings}, "
                         f"got {seq_len}")
    require_onnx()
    wrapper = PrefillLogits(model, attention).eval()
    # an example that is not all one token, so no routing decision is degenerate while tracing
    example = (torch.arange(2 * seq_len, dtype=torch.int64) % model.config.vocab_size).view(2, seq_len)
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about Python values (validation checks)
        torch.onnx.export(wrapper, (example,), tmp, dynamo=False, opset_version=opset,
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    os.replace(tmp, out_path)
    return out_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output .onnx file")
    parser.add_argument("--seq-len", type=int, default=16, help="example length traced (the graph takes any length)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset (default: %(default)s)")
    parser.add_argument("--attention", choices=ATTENTION_FORMS, default="sparse",
                        help="sparse (default): the checkpoint's DSA attention, what the model computes; dense: "
                             "every causal key (another function past index_topk tokens)")


def run(args: argparse.Namespace) -> int:
    try:
        require_onnx()  # before the checkpoint is read
    except ModuleNotFoundError as exc:
        print(f"glm5 export-onnx: error: {exc}", file=sys.stderr)
        return 2
    check_checkpoint_dir(args.checkpoint, "--checkpoint")
    model = load_pretrained(args.checkpoint, backend="cpu").float()
    if args.attention == "dense":
        print(f"glm5 export-onnx: warning: {DENSE_NOTICE.format(topk=model.config.index_topk)}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice above is the CLI's one line
        path = export_onnx(model, args.out, seq_len=args.seq_len, opset=args.opset, attention=args.attention)
    print(f"wrote {path} (input_ids int64 [batch, seq] -> logits float32 [batch, seq, {model.config.vocab_size}], "
          f"{args.attention} attention)")
    return 0

