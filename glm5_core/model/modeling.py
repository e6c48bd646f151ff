"""GLM5ForCausalLM: embedding, decoder layers (dense then MoE), final norm, lm_head, and the MTP module.

Legend: B batch, T tokens, V vocab_size, D hidden_size, E n_routed_experts.

Parameter names follow HF ``glm_moe_dsa``: ``model.embed_tokens``, ``model.layers.N.*``, ``model.norm``,
``lm_head``; the MTP module is ``model.layers.{num_hidden_layers}`` (it runs only when mtp_depths > 0).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Optional, Union

import torch
from torch import nn

from glm5_core import registry
from glm5_core.model import replay
from glm5_core.model.block import DecoderLayer, HybridDecoderLayer
from glm5_core.model.cache import KVCache
from glm5_core.model.config import GLM5Config
from glm5_core.model.indexer_loss import KL_TARGETS
from glm5_core.model.moe import MoE
from glm5_core.model.mtp import HybridMTPLayer, MTPLayer
from glm5_core.model.norm import RMSNorm
from glm5_core.model.rope import RotaryEmbedding, positions_of
from glm5_core.model.state import ATTENTION_MODES, ForwardState
from glm5_core.ops import _checks
from glm5_core.ops import moe as moe_ops
from glm5_core.ops._checks import value_checks_enabled

StartPos = Union[int, torch.Tensor]


@dataclasses.dataclass
class GLM5Output:
    logits: Optional[torch.Tensor]  # float32 [B, T, V] (float64 for a float64 model); None with return_logits=False
    mtp_logits: list[torch.Tensor]  # per depth d: [B, T, V], predicts token t + 1 + d (none with return_logits=False)
    indexer_kl: Optional[torch.Tensor]  # scalar, mean over the layers that ran an indexer
    expert_counts: torch.Tensor  # int64 [num_moe_layers, E] (rows as model.router_biases())
    topk_idx: list[torch.Tensor]  # sparse mode: per full-indexer main layer, int32 [B, T, K]
    topk_recall: Optional[torch.Tensor]  # scalar, with indexer_loss=True and measure_recall=True
    hidden: Optional[torch.Tensor] = None  # [B, T, D] last main layer's output (before model.norm): the MTP input
    expert_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per main MoE layer, int32 [B, T, K]


class GLM5Model(nn.Module):
    """The ``model.*`` part: embed_tokens, layers (main + MTP), norm."""

    def __init__(self, cfg: GLM5Config, backend: registry.BackendArg, expert_shard: Optional[tuple[int, int]] = None):
        super().__init__()
        self.num_main_layers = cfg.num_hidden_layers
        self.hc_mult = cfg.hc_mult if cfg.is_hybrid else None  # mHC streams (GLM-5.3); None: one residual stream
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = cfg.layer_indexer_types()
        layers: list[nn.Module]
        if cfg.is_hybrid:
            layers = [HybridDecoderLayer(cfg, i, backend, expert_shard) for i in range(cfg.num_hidden_layers)]
            if cfg.num_nextn_predict_layers:
                layers.append(HybridMTPLayer(cfg, backend, expert_shard))
        else:
            layers = [DecoderLayer(cfg, i, types[i], backend, expert_shard) for i in range(cfg.num_hidden_layers)]
            if cfg.num_nextn_predict_layers:
                layers.append(MTPLayer(cfg, backend, expert_shard))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta)

    def streams_in(self, embeds: torch.Tensor) -> torch.Tensor:
        """The main layers' input: the embeddings, copied into hc_mult streams [B, T, N, D] for GLM-5.3."""
        if self.hc_mult is None:
            return embeds
        return embeds.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()

    def streams_out(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last main layer's output [B, T, D] (GLM-5.3: the mean of its streams, transformers' HyperHead)."""
        return hidden if self.hc_mult is None else hidden.mean(dim=2)

    @property
    def mtp(self) -> Optional[Union[MTPLayer, HybridMTPLayer]]:
        return self.layers[self.num_main_layers] if len(self.layers) > self.num_main_layers else None

    def main_layers(self) -> list[DecoderLayer]:
        return list(self.layers[:self.num_main_layers])


class GLM5ForCausalLM(nn.Module):
    """The model. Its layers bind their kernels when it is built (``backend`` argument > ``use_backend`` context
    / ``GLM5_BACKEND`` > auto-detection, as they stand then); :meth:`bind_backend` rebinds them. Moving the
    model (``.to()``) keeps the binding: resolution depends on the backend, not on where tensors live (a kernel
    declines tensors on a device it cannot take, through its ``supports`` hook)."""

    def __init__(self, cfg: GLM5Config, backend: Optional[str] = None, *,
                 expert_shard: Optional[tuple[int, int]] = None):
        """``expert_shard`` (rank, size), expert parallelism: every MoE layer gives memory only to the experts rank
        ``rank`` of a group of ``size`` holds, the others live on the meta device (:class:`MoE`), so a rank never
        holds the whole model; :meth:`reset_parameters` still draws every expert's values in order (the held
        ones are bitwise those of a whole build); then :meth:`shard_experts` with the matching group, before
        moving the model or the first forward. None: the whole model."""
        super().__init__()
        if not isinstance(cfg, GLM5Config):
            raise TypeError(f"cfg: expected a GLM5Config, got {type(cfg).__name__}")
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend: expected a backend name (str) or None, got {type(backend).__name__}")
        self.config = cfg.validate()
        self.backend = backend  # as asked for (None: resolved at construction, see self.kernels)
        self.kernels = registry.bind(backend)
        self.model = GLM5Model(cfg, self.kernels, expert_shard)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.num_moe_layers = len(self.moe_layers())  # fixed by the architecture; a module walk per forward is not
        self.mtp_absent_reason: Optional[str] = None  # set by load_pretrained when config.json declares an MTP
        # module the shards do not hold (transformers writes none)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    # ---- construction helpers ------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: Optional[int] = None) -> None:
        """Normal(0, initializer_range) matrices and embeddings, unit norms, zero biases and router biases."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                values = torch.randn(module.weight.shape, generator=generator)  # drawn for a meta (other rank's)
                if not module.weight.is_meta:  # expert too: the generator then stands where a whole build leaves it
                    module.weight.copy_(values * std)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, MoE):
                module.gate.weight.copy_(torch.randn(module.gate.weight.shape, generator=generator) * std)
                module.gate.e_score_correction_bias.zero_()

    def bind_backend(self, backend: Optional[str] = None) -> GLM5ForCausalLM:
        """Resolve every layer's kernels again, on ``backend`` (the resolution order applied now). Returns self."""
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend: expected a backend name (str) or None, got {type(backend).__name__}")
        kernels = registry.bind(backend)
        for module in self.modules():
            if isinstance(getattr(module, "kernels", None), registry.Binding):
                module.kernels = kernels
        self.backend = backend
        return self

    def moe_layers(self) -> list[MoE]:
        """MoE layers in expert_counts row order (main layers, then the MTP layer)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def shard_experts(self, group) -> GLM5ForCausalLM:
        """Expert parallelism over ``group`` (a ProcessGroup of N ranks, or None for N = 1): every MoE layer keeps
        only this rank's E/N experts and moves tokens to their experts with ``ep.dispatch`` / ``ep.combine``
        (``MoE.shard_experts``). Call it on every rank, right after building and initialising the model the same
        way everywhere (the seed), before FSDP2 or the optimizer. Returns self."""
        for layer in self.moe_layers():
            layer.shard_experts(group)
        return self

    def reuse_stacked_expert_weights(self, enabled: bool = True) -> GLM5ForCausalLM:
        """Inference servers: keep each MoE layer's stacked expert weights between no-grad forwards
        (see ``MoE._stacked``; weights written through ``param.data`` are not detected). Returns self."""
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
        for layer in self.moe_layers():
            layer.reuse_stacked_weights = enabled
            layer.drop_stacked_weights()
        return self

    def drop_stacked_expert_weights(self) -> None:
        """Forget every MoE layer's kept stacked expert weights (the next no-grad forward stacks them again).
        A weight push calls it: the kept copies follow in-place writes by their version counters, and this makes
        a push safe whichever way it wrote the parameters."""
        for layer in self.moe_layers():
            layer.drop_stacked_weights()

    def indexer_parameters(self) -> Iterator[nn.Parameter]:
        for layer in self.model.layers:
            if getattr(layer.self_attn, "indexer", None) is not None:
                yield from layer.self_attn.indexer.parameters()

    def router_biases(self) -> list[torch.Tensor]:
        return [m.gate.e_score_correction_bias for m in self.moe_layers()]

    @torch.no_grad()
    def update_router_biases(self, expert_counts: torch.Tensor, gamma: float) -> None:
        """Aux-loss-free balancing: bias += gamma * sign(mean load - load), per MoE layer."""
        layers = self.moe_layers()
        E = self.config.n_routed_experts
        if not isinstance(expert_counts, torch.Tensor) or tuple(expert_counts.shape) != (len(layers), E):
            got = (tuple(expert_counts.shape) if isinstance(expert_counts, torch.Tensor)
                   else type(expert_counts).__name__)
            raise ValueError(f"expert_counts: expected a tensor [{len(layers)}, {E}] (num_moe_layers, "
                             f"n_routed_experts), got {got}")
        for layer, counts in zip(layers, expert_counts):
            bias = layer.gate.e_score_correction_bias
            bias.copy_(moe_ops.update_bias(bias, counts.to(bias.device), gamma))

    def new_cache(self, batch_size: int, max_len: int, *, record_routing: bool = False,
                  record_index_topk: bool = False) -> KVCache:
        """A cache for ``batch_size`` rows of ``max_len`` positions; ``record_routing`` / ``record_index_topk``
        also keep each position's experts / selected keys (what a rollout engine returns for replay)."""
        weight = self.model.embed_tokens.weight
        return KVCache.new(self.config, batch_size, max_len, dtype=weight.dtype, device=weight.device,
                           record_routing=record_routing, record_index_topk=record_index_topk)

    # ---- forward ---------------------------------------------------------------------------------------
    def _check_call(self, input_ids, attention, mtp_depths, cache, start_pos) -> None:
        int_dtypes = (torch.int64, torch.int32)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in int_dtypes:
            got = (f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
                   else type(input_ids).__name__)
            raise ValueError(f"input_ids: expected an int64 tensor [B, T], got {got}")
        if input_ids.shape[1] < 1:
            raise ValueError(f"input_ids: expected at least one token, got shape {tuple(input_ids.shape)}")
        if value_checks_enabled() and input_ids.numel():  # one device sync; off under GLM5_CHECK_VALUES=0
            lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()  # [2]: both bounds in one host read
            if lo < 0 or hi >= self.config.vocab_size:  # else an IndexError here, a device-side assert on a GPU
                raise ValueError(f"input_ids: expected token ids in [0, {self.config.vocab_size}), got [{lo}, {hi}]")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention: expected one of {ATTENTION_MODES}, got {attention!r}")
        if isinstance(mtp_depths, bool) or not isinstance(mtp_depths, int) or mtp_depths < 0:
            raise ValueError(f"mtp_depths: expected an int >= 0, got {mtp_depths!r}")
        if mtp_depths and self.model.mtp is None:
            why = self.mtp_absent_reason or "a config with num_nextn_predict_layers=0 has no MTP module"
            raise ValueError(f"mtp_depths: expected 0 ({why}), got {mtp_depths}")
        if mtp_depths and cache is not None:
            raise ValueError("mtp_depths: expected 0 when decoding with a cache (MTP runs in training forwards)")
        if isinstance(start_pos, torch.Tensor):
            if start_pos.dim() != 1 or start_pos.shape[0] != input_ids.shape[0] or start_pos.dtype not in int_dtypes:
                raise ValueError(f"start_pos: expected an int or an int64 tensor [B={input_ids.shape[0]}], "
                                 f"got {start_pos.dtype} {tuple(start_pos.shape)}")
        elif isinstance(start_pos, bool) or not isinstance(start_pos, int):
            raise TypeError(f"start_pos: expected an int or an int64 tensor [B], got {type(start_pos).__name__}")
        if cache is None:
            if not isinstance(start_pos, int) or start_pos != 0:
                raise ValueError(f"start_pos: expected 0 without a cache (positions come from the cache), "
                                 f"got {start_pos}")
            limit = self.config.max_position_embeddings
            if input_ids.shape[1] > limit:
                raise ValueError(f"input_ids: expected at most max_position_embeddings={limit} tokens, "
                                 f"got {input_ids.shape[1]}")
        else:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache: expected a KVCache (model.new_cache), got {type(cache).__name__}")
            if cache.num_layers != self.config.num_hidden_layers:
                raise ValueError(f"cache: expected {self.config.num_hidden_layers} layers, got {cache.num_layers}")
            cache.check_window(input_ids.shape[0], input_ids.shape[1], start_pos)

    def _check_replay(self, input_ids, attention, start_pos, routing_replay, index_replay) -> None:
        cfg = self.config
        B, T = input_ids.shape
        if routing_replay is not None:
            replay.check_routing(routing_replay, batch=B, tokens=T, moe_layers=self._num_main_moe_layers(),
                                 top_k=cfg.num_experts_per_tok, num_experts=cfg.n_routed_experts)
            _checks.same_device(input_ids=input_ids, routing_replay=routing_replay)
        if index_replay is not None:
            if cfg.is_hybrid:
                raise ValueError("index_replay: expected None for a glm5_next model (its k-pool indexer's selection "
                                 "is not replayed; routing_replay is)")
            if attention != "sparse":
                raise ValueError(f"index_replay: expected attention='sparse' (the keys it replays are what sparse "
                                 f"attention reads), got attention={attention!r}")
            replay.check_index(index_replay, batch=B, tokens=T, full_layers=cfg.layer_indexer_types().count("full"),
                               topk=cfg.index_topk, start_pos=start_pos)
            _checks.same_device(input_ids=input_ids, index_replay=index_replay)

    def _num_main_moe_layers(self) -> int:
        return sum(self.config.is_moe_layer(i) for i in range(self.config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention: str = "sparse", indexer_loss: bool = False,
                mtp_depths: int = 0, cache: Optional[KVCache] = None, start_pos: StartPos = 0,
                routing_replay: Optional[torch.Tensor] = None,
                index_replay: Optional[torch.Tensor] = None, indexer_kl_target: str = "selected",
                measure_recall: bool = True, return_logits: bool = True) -> GLM5Output:
        """``attention="sparse"`` (the default) is DSA as the checkpoint defines it (each query attends to the
        top ``index_topk`` keys of its "full" indexer layer, reused by "shared" layers), what transformers'
        glm_moe_dsa computes; ``"dense"`` attends to every causal key (the first pretraining stage).

        ``routing_replay`` int [B, T, M, K] / ``index_replay`` int [B, T, F, Ki]: use these experts per main MoE
        layer / these keys per full-indexer layer instead of selecting them (rows of -1: select as usual);
        see ``glm5_core.model.replay``. The chosen experts come back in ``expert_ids``.

        With ``indexer_loss``: ``indexer_kl_target`` ("selected" | "causal") is the sparse attention's KL target
        (``glm5_core.model.indexer_loss``: each head's softmax over the selected keys, or over every causal key);
        ``measure_recall`` reports ``topk_recall`` (the dense target's mass on the selected keys: in sparse
        attention with the "selected" target it costs one more pass over every key, so pass False on steps
        that do not log it).

        ``return_logits=False`` skips the final norms and the lm_head (main and MTP depths): ``logits`` is None and
        ``mtp_logits`` empty, everything else as with True (the indexer warm-up stage trains on the KL alone)."""
        self._check_call(input_ids, attention, mtp_depths, cache, start_pos)
        if indexer_kl_target not in KL_TARGETS:
            raise ValueError(f"indexer_kl_target: expected one of {', '.join(map(repr, KL_TARGETS))}, "
                             f"got {indexer_kl_target!r}")
        self._check_replay(input_ids, attention, start_pos, routing_replay, index_replay)
        B, T = input_ids.shape
        embeds = self.model.embed_tokens(input_ids)  # [B, T, D]
        cos, sin = self.model.rotary(positions_of(start_pos, B, T, input_ids.device), embeds.dtype)  # [B, T, Dr/2]
        state = ForwardState(attention=attention, start_pos=start_pos, cache=cache, indexer_loss=bool(indexer_loss),
                             indexer_kl_target=indexer_kl_target, measure_recall=bool(measure_recall), cos=cos, sin=sin,
                             expert_counts=[None] * self.num_moe_layers,
                             routing_replay=list(routing_replay.unbind(2)) if routing_replay is not None else None,
                             index_replay=list(index_replay.unbind(2)) if index_replay is not None else None)
        hidden = self.model.streams_in(embeds)
        for layer in self.model.main_layers():
            hidden = layer(hidden, state)
        hidden = self.model.streams_out(hidden)
        main_hidden = hidden
        logits = self._logits(self.model.norm(hidden)) if return_logits else None

        mtp_logits: list[torch.Tensor] = []
        if mtp_depths:
            mtp = self.model.mtp
            state.record_topk = False
            state.shared_topk = None
            for depth in range(1, mtp_depths + 1):
                hidden = mtp.predict(hidden, self.model.embed_tokens(_shift_left(input_ids, depth)), state)
                if return_logits:
                    mtp_logits.append(self._logits(mtp.shared_head.norm(hidden)))

        zeros = torch.zeros(self.config.n_routed_experts, dtype=torch.int64, device=input_ids.device)
        counts = [c if c is not None else zeros for c in state.expert_counts]
        expert_counts = torch.stack(counts) if counts else zeros.new_zeros(0, self.config.n_routed_experts)
        kl = torch.stack(state.kl_terms).mean() if state.kl_terms else None
        recall = torch.stack(state.recall_terms).mean() if state.recall_terms else None
        return GLM5Output(logits=logits, mtp_logits=mtp_logits, indexer_kl=kl, expert_counts=expert_counts,
                          topk_idx=state.topk_idx, topk_recall=recall, hidden=main_hidden,
                          expert_ids=state.expert_ids)

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.float64 if normed.dtype == torch.float64 else torch.float32
        return self.lm_head(normed).to(out_dtype)


def _shift_left(input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """Token t + depth at position t; positions past the end get token 0 (their predictions are unused)."""
    B, T = input_ids.shape
    pad = input_ids.new_zeros(B, min(depth, T))
    return torch.cat((input_ids[:, depth:], pad), dim=1)  # [B, T]
