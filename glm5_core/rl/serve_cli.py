"""``glm5 serve``: glm5-core's rollout engine as a standalone server with SGLang's HTTP API, so ``glm5 rl
--engine-url`` (or any SGLang client) can roll out on engines started elsewhere, on other machines.

    glm5 serve --checkpoint runs/tiny/final --port 30000 [--host 127.0.0.1] [--api-key KEY]
        [--speculative-draft-tokens D] [--enable-return-routed-experts] [--enable-return-indexer-topk]

The checkpoint is an HF-format ``glm_moe_dsa`` directory (``save_pretrained``, what ``glm5 pretrain``
exports). The weight version starts as SGLang's ``"default"``; ``/update_weights_from_disk`` (an HF directory,
under ``--weights-dir`` when given) and the ``/init_weights_update_group`` + ``/update_weights_from_distributed``
path replace the weights. It binds 127.0.0.1 unless ``--host`` says otherwise; SIGTERM or Ctrl-C stops it.
"""
from __future__ import annotations

import argparse
import signal
import sys

from glm5_core.cli import add_backend_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="HF-format model directory (save_pretrained)")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free one, printed at start)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (SGLang's --api-key)")
    parser.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default: %(default)s)")
    parser.add_argument("--max-len", type=int, default=None,
                        help="positions per request, prompt included (default: the model's max_position_embeddings)")
    parser.add_argument("--prefix-cache-entries", type=int, default=256,
                        help="trajectories whose KV is kept between turns (default: %(default)s)")
    parser.add_argument("--weights-dir", default=None,
                        help="only load /update_weights_from_disk paths under this directory (default: any)")
    parser.add_argument("--device", default=None, help="torch device, e.g. <type>:1 (default: the backend's)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--torch-threads", type=int, default=1, help="CPU threads (default: %(default)s)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="record every position's experts, returned on request (SGLang's flag; routing replay)")
    parser.add_argument("--enable-return-indexer-topk", action="store_true",
                        help="record every position's DSA keys, returned on request (SGLang's flag; index replay)")
    parser.add_argument("--speculative-draft-tokens", type=int, default=None,
                        help="MTP speculative decoding with this many draft tokens per step (default: off)")
    add_backend_argument(parser)


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected a port in [0, 65535], got {args.port}")
    for name in ("max_batch", "torch_threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.prefix_cache_entries < 0:
        raise ValueError(f"--prefix-cache-entries: expected an int >= 0, got {args.prefix_cache_entries}")
    if args.api_key == "":
        raise ValueError("--api-key: expected a non-empty key")
    from glm5_core.rl.serving.client import is_loopback

    if args.api_key is None and not is_loopback(args.host):
        print(f"glm5 serve: warning: --host {args.host} is reachable from other machines and no --api-key is set: "
              "anyone who can connect may generate and replace the weights", file=sys.stderr)
    speculative_setting(args)  # a bad count is refused before the checkpoint is read


def speculative_setting(args: argparse.Namespace):
    """The engine's ``speculative`` setting from ``--speculative-draft-tokens`` (None: off)."""
    from glm5_core.rl.serving.speculative import MAX_DRAFT_TOKENS

    d = args.speculative_draft_tokens
    if d is None:
        return None
    if not 1 <= d <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--speculative-draft-tokens: expected an int in [1, {MAX_DRAFT_TOKENS}], got {d}")
    return {"draft_tokens": d}


def build(args: argparse.Namespace):
    """The (not yet started) server ``args`` describe."""
    import torch

    from glm5_core.model import load_pretrained
    from glm5_core.model.checkpoint import check_checkpoint_dir
    from glm5_core.registry import require_available, resolve_backend_name
    from glm5_core.rl.config import torch_device_name
    from glm5_core.rl.device import runtime_device
    from glm5_core.rl.fleet.placement import check_visible, parse_device, pin_trainer, probe_accelerators
    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.server import EngineServer

    _check(args)
    check_checkpoint_dir(args.checkpoint, "--checkpoint")
    backend = resolve_backend_name(args.backend)
    require_available(backend)
    if args.device is not None:
        parse_device(args.device, "--device")
        check_visible([args.device], "--device", probe_accelerators)
    pin_trainer(args.device, args.torch_threads)  # a CPU core set (--device cpu:0-1): pinned, one thread a core
    model = load_pretrained(args.checkpoint, backend=backend)
    model = model.to(torch.device(torch_device_name(args.device)) if args.device else runtime_device(backend))
    engine = RolloutEngine(model, max_batch=args.max_batch, max_len=args.max_len,
                           prefix_cache_entries=args.prefix_cache_entries, seed=args.seed,
                           reuse_stacked_weights=True,  # the server owns its model
                           speculative=speculative_setting(args),
                           record_routing=args.enable_return_routed_experts,
                           record_index_topk=args.enable_return_indexer_topk)
    try:
        return EngineServer(engine, host=args.host, port=args.port, api_key=args.api_key, weight_version="default",
                            model_path=args.checkpoint, weights_dir=args.weights_dir)
    except OSError as exc:  # the port is taken, the address is not ours (only binding is blamed on them)
        raise ValueError(f"--host/--port: cannot bind {args.host}:{args.port} ({exc.strerror or exc})") from None


def run(args: argparse.Namespace) -> int:
    server = build(args)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(f"glm5 serve: serving {args.checkpoint} on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown_from_main()
    print("glm5 serve: stopped", file=sys.stderr, flush=True)
    return 0
