"""KVCache: what incremental decoding keeps per layer.

Legend: B batch, L max_len (key slots), C kv_lora_rank, Dr qk_rope_head_dim, Di index_head_dim.

Per main decoder layer: the compressed latent ``c_kv [B, L, C]`` (after kv_a_layernorm) and the roped
shared key ``k_pe [B, L, Dr]`` (576 values per token at GLM-5 size), plus the indexer keys
``index_k [B, L, Di]`` for layers that run their own indexer ("full"; ``None`` for "shared" layers).
With ``record_routing`` / ``record_index_topk`` (a rollout engine recording for routing / index replay) it
also keeps, per position, the experts each main MoE layer chose (``expert_ids [B, L, K]``, compact ids, see
``glm5_core.model.replay``) and the keys each full-indexer layer selected (``index_topk [B, L, K_idx]``); being
cache fields, they follow the KV wherever the engine copies it (prefix cache, slots).
The cache never holds expanded per-head keys or values. Slot ``s`` holds the token at absolute position
``s``; rows may be ragged (each row's own ``start_pos``): slots past a row's last token are ignored by
the causal mask, so right-padded prompts can be prefilled together.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from glm5_core.model import replay
from glm5_core.model.config import GLM5Config
from glm5_core.model.rope import positions_of

StartPos = Union[int, torch.Tensor]


@dataclasses.dataclass
class KVCache:
    c_kv: list[torch.Tensor]
    k_pe: list[torch.Tensor]
    index_k: list[Optional[torch.Tensor]]
    expert_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per main MoE layer (if recorded)
    index_topk: list[Optional[torch.Tensor]] = dataclasses.field(default_factory=list)  # per layer, None: shared
    # GLM-5.3 (glm5_next): per layer, the k-pool indexer's gate scores [B, L, Di] beside index_k (full indexed
    # layers), and each KDA layer's conv + recurrent state (None until its first prefill; indexed layers None)
    index_gate: list[Optional[torch.Tensor]] = dataclasses.field(default_factory=list)
    kda: list[Optional[Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def new(cls, cfg: GLM5Config, batch_size: int, max_len: int, *, dtype: torch.dtype = torch.float32,
            device: Union[str, torch.device] = "cpu", record_routing: bool = False,
            record_index_topk: bool = False) -> KVCache:
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len: expected <= max_position_embeddings={cfg.max_position_embeddings}, "
                             f"got {max_len}")

        def zeros(width: int) -> torch.Tensor:
            return torch.zeros(batch_size, max_len, width, dtype=dtype, device=device)

        def ids(width: int, id_dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(batch_size, max_len, width, dtype=id_dtype, device=device)

        types = cfg.layer_indexer_types()
        num_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        expert_dtype, key_dtype = replay.expert_id_dtype(cfg.n_routed_experts), replay.key_id_dtype(max_len)
        if cfg.is_hybrid:
            return cls._new_hybrid(cfg, zeros, ids, expert_dtype, key_dtype, num_moe, record_routing,
                                   record_index_topk, batch_size, dtype, device)
        return cls(
            c_kv=[zeros(cfg.kv_lora_rank) for _ in range(cfg.num_hidden_layers)],
            k_pe=[zeros(cfg.qk_rope_head_dim) for _ in range(cfg.num_hidden_layers)],
            index_k=[zeros(cfg.index_head_dim) if kind == "full" else None for kind in types],
            expert_ids=[ids(cfg.num_experts_per_tok, expert_dtype) for _ in range(num_moe)] if record_routing else [],
            index_topk=([ids(cfg.index_topk, key_dtype) if kind == "full" else None for kind in types]
                        if record_index_topk else []),
        )

    @classmethod
    def _new_hybrid(cls, cfg: GLM5Config, zeros, ids, expert_dtype, key_dtype, num_moe: int, record_routing: bool,
                    record_index_topk: bool, batch_size: int, dtype: torch.dtype, device) -> KVCache:
        """GLM-5.3: latent c_kv (no rope key: NoPE) for indexed layers, zero-width placeholders for KDA layers (their
        conv + recurrent state lives in ``kda``: zeros, fp32 or fp64 as the model computes, per batch row),
        indexer keys and gate scores for full indexed layers."""
        from glm5_core.model.linear_attention import KDAState

        kinds = cfg.layer_kinds()
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        qkv = cfg.linear_num_heads * cfg.linear_head_dim

        def kda_state() -> KDAState:
            return KDAState(
                torch.zeros(batch_size, cfg.linear_conv_kernel_dim - 1, 3 * qkv, dtype=state_dtype, device=device),
                torch.zeros(batch_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim,
                            dtype=state_dtype, device=device))
        full = set(cfg.full_indexer_layers())
        width = cfg.index_topk + (cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail else 0)
        indexed = [kind == "indexed_attention" for kind in kinds]
        return cls(
            c_kv=[zeros(cfg.kv_lora_rank if indexed[i] else 0) for i in range(cfg.num_hidden_layers)],
            k_pe=[zeros(0) for _ in range(cfg.num_hidden_layers)],
            index_k=[zeros(cfg.index_head_dim) if i in full else None for i in range(cfg.num_hidden_layers)],
            index_gate=[zeros(cfg.index_head_dim) if i in full else None for i in range(cfg.num_hidden_layers)],
            kda=[kda_state() if kind == "linear_attention" else None for kind in kinds],
            expert_ids=[ids(cfg.num_experts_per_tok, expert_dtype) for _ in range(num_moe)] if record_routing else [],
            index_topk=([ids(width, key_dtype) if i in full else None for i in range(cfg.num_hidden_layers)]
                        if record_index_topk else []),
        )

    def kda_state(self, layer: int) -> Any:
        """KDA layer ``layer``'s state (conv + recurrent, ``linear_attention.KDAState``, per batch row)."""
        return self.kda[layer]

    def set_kda_state(self, layer: int, state: Any) -> None:
        """Store KDA layer ``layer``'s new state, in place (a cache of row views, ``kv_slots.row_window``, writes
        through to the rows it views)."""
        store = self.kda[layer]
        store.conv_state.copy_(state.conv_state)
        store.recurrent_state.copy_(state.recurrent_state)

    def write_pool_keys(self, layer: int, index_k: torch.Tensor, gate: torch.Tensor,
                        start_pos: StartPos) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the k-pool indexer's keys and gate scores [B, T, Di]; return their visible prefixes [B, S, Di]."""
        store = self.index_gate[layer]
        assert store is not None, f"layer {layer} has no k-pool indexer"
        return self.write_index_keys(layer, index_k, start_pos), self._write(store, gate, start_pos)

    @property
    def batch_size(self) -> int:
        return self.c_kv[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.c_kv[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.c_kv)

    def check_window(self, batch: int, num_tokens: int, start_pos: StartPos) -> None:
        """ValueError unless ``num_tokens`` tokens at ``start_pos`` fit in the cache for a batch of ``batch``."""
        if batch != self.batch_size:
            raise ValueError(f"input_ids: expected batch {self.batch_size} (the cache's), got {batch}")
        hi = int(start_pos.max()) if isinstance(start_pos, torch.Tensor) else start_pos
        lo = int(start_pos.min()) if isinstance(start_pos, torch.Tensor) else start_pos
        if lo < 0 or hi + num_tokens > self.max_len:
            raise ValueError(f"start_pos: expected 0 <= start_pos and start_pos + T <= max_len={self.max_len} "
                             f"(T={num_tokens}), got start_pos in [{lo}, {hi}]")

    @staticmethod
    def _write(store: torch.Tensor, values: torch.Tensor, start_pos: StartPos) -> torch.Tensor:
        """Write values [B, T, W] at slots start_pos.. of store [B, L, W]; return the visible prefix [B, S, W]."""
        B, T, _ = values.shape
        values = values.to(store.dtype)
        if isinstance(start_pos, torch.Tensor):
            slots = positions_of(start_pos, B, T, store.device)  # [B, T]
            rows = torch.arange(B, device=store.device).unsqueeze(1).expand(B, T)  # [B, T]
            store[rows, slots] = values
            end = int(start_pos.max()) + T
        else:
            store[:, start_pos:start_pos + T] = values
            end = start_pos + T
        return store[:, :end]

    def write_latent(self, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     start_pos: StartPos) -> tuple[torch.Tensor, torch.Tensor]:
        return self._write(self.c_kv[layer], c_kv, start_pos), self._write(self.k_pe[layer], k_pe, start_pos)

    def write_index_keys(self, layer: int, index_k: torch.Tensor, start_pos: StartPos) -> torch.Tensor:
        store = self.index_k[layer]
        assert store is not None, f"layer {layer} has no indexer keys (a 'shared' layer)"
        return self._write(store, index_k, start_pos)

    def write_expert_ids(self, moe_layer: int, ids: torch.Tensor, start_pos: StartPos) -> None:
        """Record the experts [B, T, K] main MoE layer ``moe_layer`` chose for the current tokens."""
        self._write(self.expert_ids[moe_layer], ids, start_pos)

    def write_index_topk(self, layer: int, topk_idx: torch.Tensor, start_pos: StartPos) -> None:
        """Record the keys [B, T, K_idx] full-indexer layer ``layer`` selected for the current tokens."""
        store = self.index_topk[layer]
        assert store is not None, f"layer {layer} has no indexer (a 'shared' layer)"
        self._write(store, topk_idx, start_pos)
