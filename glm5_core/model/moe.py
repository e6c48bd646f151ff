"""Mixture of experts: the sigmoid router (Gate) and the MoE layer (routed + shared SwiGLU experts).

Legend: B batch, T tokens, N = B*T, D hidden_size, E n_routed_experts, K num_experts_per_tok,
F moe_intermediate_size.

Routing, dispatch, the grouped expert FFN and combine are ``glm5_core.ops.moe`` calls. The selection
bias ``e_score_correction_bias`` (fp32 [E], a buffer updated by the aux-loss-free rule, never by
gradients) steers which experts are chosen; the weights come from the unbiased scores.

Under ONNX export the data-dependent dispatch (per-expert row counts) cannot be traced, so the export
path runs every expert on every token and weights the outputs with the routing weights scattered to
[N, E] (zero for unchosen experts): the same function, more FLOPs. The kernels are bound when a layer is
built (``registry.bind``).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from glm5_core import registry
from glm5_core.model.config import GLM5Config
from glm5_core.model.mlp import MLP
from glm5_core.ops import _checks, ep, moe


class Gate(nn.Module):
    def __init__(self, cfg: GLM5Config, backend: registry.BackendArg):
        super().__init__()
        self.kernels = registry.bind(backend)  # resolved once, here
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.renormalize = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        """Module.to / .half() / .double() move the selection bias but keep it fp32 (its contract dtype)."""
        super()._apply(fn, recurse)
        self.e_score_correction_bias = self.e_score_correction_bias.to(torch.float32)
        return self

    def forward(self, x: torch.Tensor, replay_ids: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights fp32 [N, K], expert ids int32 [N, K]); router logits in fp32 (fp64 for fp64).

        ``replay_ids`` int [N, K] (routing replay): rows holding expert ids use exactly those experts, with
        weights recomputed from these logits at those ids (gradients reach the router through them); a row
        equal to the router's own choice keeps ``route``'s weights (the same values, bit for bit what a forward
        without replay computes); rows of -1 are routed as usual. Checked by the model (``replay.check_routing``)."""
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        logits = F.linear(_checks.cast(x, compute), _checks.cast(self.weight, compute))  # [N, E]
        if torch.onnx.is_in_onnx_export():
            return self.route_for_export(logits)
        weights, ids = moe.route(logits, self.e_score_correction_bias, top_k=self.top_k, score_func="sigmoid",
                                 n_group=self.n_group, topk_group=self.topk_group, renormalize=self.renormalize,
                                 routed_scaling_factor=self.scaling, backend=self.kernels)
        if replay_ids is None:
            return weights, ids
        replayed = (replay_ids[:, :1] >= 0)  # [N, 1]: the row is replayed
        forced = torch.where(replayed, replay_ids.to(ids.dtype), ids)  # [N, K]
        differs = (forced != ids).any(-1, keepdim=True)  # [N, 1]; rows that agree keep route's own weights
        forced_weights = moe.route_weights(logits, forced, score_func="sigmoid", renormalize=self.renormalize,
                                           routed_scaling_factor=self.scaling)  # [N, K]
        return torch.where(differs, forced_weights, weights), forced


    def route_for_export(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """moe.route's contract written with torch.topk, which exports to ONNX TopK (whose spec breaks ties
        to the lower index, as the contract does); the stable sort of the reference has no ONNX export."""
        N, E = logits.shape
        scores = torch.sigmoid(logits)  # [N, E]
        select = scores + self.e_score_correction_bias.to(scores.dtype)  # [N, E]
        if self.n_group > 1:
            grouped = select.view(N, self.n_group, E // self.n_group)  # [N, G, E/G]
            group_score = grouped.topk(min(2, E // self.n_group), dim=-1).values.sum(-1)  # [N, G]
            kept = group_score.topk(self.topk_group, dim=-1).indices  # [N, topk_group]
            keep = torch.zeros_like(group_score).scatter(1, kept, 1.0).bool()  # [N, G]
            select = select.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        ids = select.topk(self.top_k, dim=-1).indices  # [N, K]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + moe.RENORM_EPS)
        return weights * self.scaling, ids.to(torch.int32)


class LocalExperts(nn.ModuleDict):
    """The routed experts one rank holds under expert parallelism, keyed by their GLOBAL ids (``"4"``, ``"5"``,
    ...), so the state-dict names are those of the whole model (``experts.5.gate_proj.weight``): checkpoints and
    the HF export name an expert the same whatever the expert-parallel size. Its ``forward`` runs the experts
    over expert-major rows (a module call, so FSDP2's hooks gather its parameters around it)."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [R, D] expert-major, counts int64 [L] -> [R, D] (``moe.experts_batch_invariant``)."""
        mlps = list(self.values())
        dtype = rows.dtype
        stacked = [torch.stack([getattr(m, name).weight for m in mlps]).to(dtype)
                   for name in ("gate_proj", "up_proj", "down_proj")]
        limit = getattr(mlps[0], "swiglu_limit", None) if mlps else None  # the layer's clamp, kept by its MLPs
        return moe.experts_batch_invariant(rows, counts, *stacked, swiglu_limit=limit)


def _held_experts(expert_shard: Optional[tuple[int, int]], n_experts: int) -> range:
    """The expert ids a rank of ``expert_shard`` = (rank, size) holds; every id for None."""
    if expert_shard is None:
        return range(n_experts)
    if (not isinstance(expert_shard, tuple) or len(expert_shard) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in expert_shard)):
        raise TypeError(f"expert_shard: expected a (rank, size) tuple of ints or None, got {expert_shard!r}")
    rank, size = expert_shard
    if size < 1 or n_experts % size or not 0 <= rank < size:
        raise ValueError(f"expert_shard: expected (rank, size) with size dividing n_routed_experts={n_experts} "
                         f"and 0 <= rank < size, got {expert_shard}")
    local = n_experts // size
    return range(rank * local, (rank + 1) * local)


def _expert(cfg: GLM5Config, swiglu_limit: Optional[float], held: bool) -> MLP:
    """One routed expert; one this rank does not hold is moved to the meta device as soon as it is built."""
    mlp = MLP(cfg.hidden_size, cfg.moe_intermediate_size, swiglu_limit)
    return mlp if held else mlp.to("meta")


class MoE(nn.Module):
    def __init__(self, cfg: GLM5Config, moe_index: int, backend: registry.BackendArg,
                 swiglu_limit: Optional[float] = None, expert_shard: Optional[tuple[int, int]] = None):
        """``swiglu_limit``: GLM-5.3's clamped SwiGLU in the routed and shared experts (None: the plain one).

        ``expert_shard`` (rank, size): build for rank ``rank`` of an expert-parallel group of ``size``. Only its
        experts [rank*E/size, (rank+1)*E/size) get memory; every other expert is built and then moved to the meta
        device at once (its constructor's draws from the global generator happen as in a whole build, so the
        values of everything built after it are the same), so no rank ever holds the whole layer. Call
        :meth:`shard_experts` with the matching group before the first forward. None: every expert."""
        super().__init__()
        self.moe_index = moe_index
        self.swiglu_limit = swiglu_limit  # row of this layer in expert_counts / router_biases()
        self.kernels = registry.bind(backend)  # resolved once, here
        self.n_experts = cfg.n_routed_experts
        self.gate = Gate(cfg, self.kernels)
        self.reuse_stacked_weights = False  # see _stacked
        self._stacked_cache: dict[str, tuple] = {}  # name -> (weakrefs, key, stacked tensor)
        held = _held_experts(expert_shard, self.n_experts)
        self.experts = nn.ModuleList(_expert(cfg, swiglu_limit, e in held) for e in range(self.n_experts))
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, swiglu_limit)
                               if cfg.n_shared_experts > 0 else None)
        # expert parallelism (shard_experts): off by default, the layer then runs moe.fused_experts as always
        self.expert_parallel = False
        self.ep_group = None

    def shard_experts(self, group) -> None:
        """Switch this layer to expert parallelism over ``group`` (a ProcessGroup, or None for a group of one):
        keep only this rank's experts [r*E/N, (r+1)*E/N) (the others are dropped), route tokens to their
        experts with ``ep.dispatch`` / ``ep.combine`` and run the experts batch-invariantly
        (``moe.experts_batch_invariant``), so the forward is bitwise the same at every group size. Call it on
        every rank of the group, on identically initialised layers, before any sharding (FSDP2) or optimizer."""
        rank, world = ep.group_rank_size(group)
        if self.n_experts % world:
            raise ValueError(f"group: expected an expert-parallel size dividing n_routed_experts="
                             f"{self.n_experts}, got {world}")
        local = self.n_experts // world
        held = dict(self.experts.items()) if isinstance(self.experts, LocalExperts) else \
            {str(e): m for e, m in enumerate(self.experts)}
        held = {e: m for e, m in held.items() if not any(p.is_meta for p in m.parameters())}  # expert_shard's
        wanted = [str(e) for e in range(rank * local, (rank + 1) * local)]
        missing = [e for e in wanted if e not in held]
        if missing:
            raise ValueError(f"group: rank {rank} of {world} needs experts {wanted[0]}..{wanted[-1]}, this layer "
                             f"holds only {sorted(held, key=int)}")
        self.experts = LocalExperts({e: held[e] for e in wanted})
        self.expert_parallel, self.ep_group = True, group
        self._stacked_cache.clear()

    def _stacked(self, name: str) -> torch.Tensor:
        """The experts' ``name`` weights as one tensor, [E, F, D] or [E, D, F].

        Rebuilt on every call by default (a training process) and in every grad-enabled forward. The rollout
        engine turns on ``reuse_stacked_weights`` (its default): with autograd off the stacked copy is kept while every
        expert weight is the same tensor object (held weakly: a replaced parameter, e.g. after ``.to()`` or
        ``load_state_dict(assign=True)``, never matches) with the same storage, dtype and in-place version
        counter (``load_state_dict`` and optimizer steps bump it), and the engine drops it on every weight push
        (:meth:`drop_stacked_weights`). A write through ``param.data`` bumps nothing: code that writes the
        weights that way must call :meth:`drop_stacked_weights`. It costs one extra copy of the expert weights.
        """
        weights = self._expert_weights(name)
        if not self.reuse_stacked_weights or torch.is_grad_enabled():  # a kept stack may be an inference tensor,
            return torch.stack(weights)  # which autograd cannot save: grad-enabled forwards always stack
        key = [(w.data_ptr(), w._version, w.dtype) for w in weights]
        cached = self._stacked_cache.get(name)
        if cached is None or cached[1] != key or any(ref() is not w for ref, w in zip(cached[0], weights)):
            cached = ([weakref.ref(w) for w in weights], key, torch.stack(weights))
            self._stacked_cache[name] = cached
        return cached[2]

    def _expert_weights(self, name: str) -> list[torch.Tensor]:
        """Every expert's ``name``.weight, read from the modules' registries (``Module.__getattr__``, ~4 us a
        lookup, made the kept stack's validity check cost more than a decode step's expert FFN); a weight that is
        not a plain registered parameter there (a parametrization) is read through ``getattr``."""
        out = []
        for expert in self.experts:
            linear = expert._modules.get(name)
            weight = linear._parameters.get("weight") if linear is not None else None
            out.append(weight if weight is not None else getattr(expert, name).weight)
        return out

    def drop_stacked_weights(self) -> None:
        """Forget the kept stacked expert weights (see :meth:`_stacked`); the next forward stacks them again."""
        self._stacked_cache.clear()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (y [B, T, D], tokens per expert int64 [E], detached)."""
        y, counts, _ = self.route_and_run(x)
        return y, counts

    def route_and_run(self, x: torch.Tensor, replay_ids: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` that also returns the chosen expert ids int32 [B, T, K]; ``replay_ids`` int [B, T, K]
        forces them (routing replay, see ``Gate.forward``)."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)  # [N, D]
        flat_replay = replay_ids.reshape(B * T, -1) if replay_ids is not None else None  # [N, K]
        weights, ids = self.gate(flat, flat_replay)  # [N, K]
        if self.expert_parallel:
            handle = ep.dispatch(flat, ids, weights.to(flat.dtype), group=self.ep_group, num_experts=self.n_experts,
                                 backend=self.kernels)
            routed = ep.combine(self.experts(handle.rows, handle.counts), handle, backend=self.kernels)  # [N, D]
            counts = self._tokens_per_expert(ids)
        elif torch.onnx.is_in_onnx_export():
            routed, counts = self._all_experts(flat, weights, ids)
        elif flat_replay is None:
            # the router's own ids (in range by construction) and shapes this layer builds: straight to the bound
            # kernel without the entry point's checks (~40 us a call, an index-range read of the ids among them),
            # as the mHC mix does; replayed ids go through the checked entry point below
            stacked = [self._stacked(name) for name in ("gate_proj", "up_proj", "down_proj")]
            _checks.same_dtype(x=flat, w_gate=stacked[0], w_up=stacked[1], w_down=stacked[2])
            limit = {} if self.swiglu_limit is None else {"swiglu_limit": float(self.swiglu_limit)}
            routed = registry.call("moe_fused_experts", flat, _checks.cast(weights, flat.dtype), ids, *stacked,
                                   backend=self.kernels, **limit)  # [N, D]
            counts = self._tokens_per_expert(ids)
        else:
            routed = moe.fused_experts(flat, weights.to(flat.dtype), ids, self._stacked("gate_proj"),
                                       self._stacked("up_proj"), self._stacked("down_proj"),
                                       swiglu_limit=self.swiglu_limit, backend=self.kernels)  # [N, D]
            counts = self._tokens_per_expert(ids)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(flat)
        return routed.view(B, T, D), counts.detach(), ids.view(B, T, -1)

    def _tokens_per_expert(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 [E]: how many of the N*K routed copies each expert got. A scatter-add of ones rather than
        ``bincount``, whose output shape depends on the ids (a torch.compile graph break); the counts are the same
        integers."""
        flat_ids = ids.reshape(-1).long()  # [N*K]
        zeros = torch.zeros(self.n_experts, dtype=torch.int64, device=ids.device)
        return zeros.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # [E]

    def _all_experts(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Export path: every expert on every token, weighted by the scattered routing weights."""
        dense_w = torch.zeros(flat.shape[0], self.n_experts, dtype=flat.dtype, device=flat.device)  # [N, E]
        dense_w = dense_w.scatter(1, ids.long(), weights.to(flat.dtype))
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):  # fixed expert order
            out = out + dense_w[:, e:e + 1] * expert(flat)
        counts = (dense_w != 0).sum(0)  # [E]
        return out, counts
