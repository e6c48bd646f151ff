"""Executable statement of the documented semantics of torch_npu's MC2 fused ops ``npu_alltoallv_gmm`` and
``npu_gmm_alltoallv``, on simulated ranks in one process (one thread per rank, a barrier where the real ops
exchange). Written from ``op-plugin/docs/context/torch_npu-npu_alltoallv_gmm.md`` / ``torch_npu-npu_gmm_alltoallv.md``
and CANN ops-transformer ``aclnnAlltoAllvGroupedMatMul.md`` / ``aclnnGroupedMatMulAlltoAllv.md`` (none of
glm5-core's code inside):

  * argument contract (both ops): Atlas A3; gmm_x fp16/bf16 2-D, gmm_weight the same dtype 3-D (e, H1, N1), or
    (e, N1, H1) with trans_gmm_weight; hcom a name of length (0, 128); ep_world_size 8, 16, 32 or 64; send_counts /
    recv_counts lists of e * ep_world_size ints, e <= 32, e * ep_world_size <= 256; H1, N1 in (0, 65536); BSK
    (the rows of the token side) in (0, 52428800); a card's communication volume (here: the bytes it sends and
    the bytes it receives) in [2 MB, 100 MB]; the sum of A over the group equals the sum of BSK.
  * npu_alltoallv_gmm: ata_out = AlltoAllv(gmm_x): gmm_x is cut into e * ep_world_size blocks of send_counts rows,
    block r * e + j going to rank r's local expert j; a rank receives from each source s the block of each of its
    experts j, recv_counts[s * e + j] rows (the op fails when the sizes disagree). ata_out is rank-major (source s,
    then expert j); permute_out = Permute(ata_out) is expert-major (expert j, then source s), each block's rows in
    order; gmm_y = permute_out x gmm_weight per expert (here: fp32 products and sums rounded once to gmm_x's
    dtype; the documents state no precision). Returns (gmm_y [A, N1], None, permute_out or None).
  * npu_gmm_alltoallv: gmm_x [A, H1] expert-major, expert j's rows being the blocks send_counts[r * e + j] for
    r = 0..N-1; gmm_y = gmm_x x gmm_weight per expert; Unpermute(gmm_y) rank-major (destination r, expert j);
    y = AlltoAllv: block (r, j) goes to rank r, which receives from each source s its blocks in (s, j) order,
    recv_counts[s * e + j] rows. Returns (y [BSK, N1], None).
  * inference only: the stand-in returns tensors without a graph and refuses inputs that require grad.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

HALF = (torch.float16, torch.bfloat16)
EP_WORLD_SIZES = (8, 16, 32, 64)
VOLUME = (2 * 1024 * 1024, 100 * 1024 * 1024)


class VendorContractError(AssertionError):
    """The backend called a vendor op outside its documented contract."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise VendorContractError(message)


class MC2World:
    """The shared state of ``world`` simulated ranks; ``ops(rank)`` is rank ``rank``'s torch_npu stand-in."""

    def __init__(self, world: int, soc: str = "A3", timeout: float = 60.0):
        self.world, self.soc = world, soc
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.posted: list[Optional[list[torch.Tensor]]] = [None] * world
        self.calls: list[str] = []

    def ops(self, rank: int) -> MC2Ops:
        return MC2Ops(self, rank)


def _blocks(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    require(sum(sizes) == t.shape[0], f"the counts add up to {sum(sizes)} rows, the tensor has {t.shape[0]}")
    return list(torch.split(t, sizes))


class MC2Ops:
    def __init__(self, world: MC2World, rank: int):
        self.w, self.rank = world, rank

    def _check(self, gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, trans_gmm_weight,
               token_side_rows: int, expert_side_rows: int):
        require(self.w.soc == "A3", f"the MC2 fused ops are documented for Atlas A3 only, got {self.w.soc}")
        require(not gmm_x.requires_grad and not gmm_weight.requires_grad, "documented for inference: no backward")
        require(gmm_x.dtype in HALF and gmm_weight.dtype == gmm_x.dtype, f"dtypes {gmm_x.dtype}/{gmm_weight.dtype}")
        require(gmm_x.dim() == 2 and gmm_weight.dim() == 3, "gmm_x 2-D, gmm_weight 3-D")
        require(isinstance(hcom, str) and 0 < len(hcom) < 128, f"hcom {hcom!r}")
        require(ep_world_size == self.w.world and ep_world_size in EP_WORLD_SIZES, f"ep_world_size {ep_world_size}")
        e = gmm_weight.shape[0]
        require(e <= 32 and e * ep_world_size <= 256, f"e={e}")
        require(len(send_counts) == len(recv_counts) == e * ep_world_size, "counts: e * ep_world_size entries")
        H1 = gmm_x.shape[1]
        W = gmm_weight.transpose(1, 2) if trans_gmm_weight else gmm_weight  # (e, H1, N1)
        require(W.shape[1] == H1, f"gmm_weight's H1 {W.shape[1]} vs gmm_x's {H1}")
        N1 = W.shape[2]
        require(0 < H1 < 65536 and 0 < N1 < 65536, f"H1={H1}, N1={N1}")
        require(0 < token_side_rows < 52428800, f"BSK={token_side_rows}")
        return e, W

    def _volume(self, sent_rows: int, received_rows: int, row_bytes: int) -> None:
        for what, rows in (("sends", sent_rows), ("receives", received_rows)):
            require(VOLUME[0] <= rows * row_bytes <= VOLUME[1],
                    f"rank {self.rank} {what} {rows * row_bytes} bytes, outside [2 MB, 100 MB]")

    def _exchange(self, blocks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Post ``blocks`` (indexed r * e + j), then read, from every source s, the blocks it posted for this
        rank: [s][j]."""
        self.w.posted[self.rank] = blocks
        self.w.barrier.wait()
        world = self.w.world
        e = len(blocks) // world
        got = [[self.w.posted[s][self.rank * e + j] for j in range(e)] for s in range(world)]
        self.w.barrier.wait()
        return got

    @staticmethod
    def _gmm(rows_per_expert: list[torch.Tensor], W: torch.Tensor, dtype) -> torch.Tensor:
        outs = [(rows.float() @ W[j].float()).to(dtype) for j, rows in enumerate(rows_per_expert)]
        return torch.cat(outs) if outs else torch.zeros(0, W.shape[2], dtype=dtype)

    def npu_alltoallv_gmm(self, gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, *,
                          send_counts_tensor=None, recv_counts_tensor=None, mm_x=None, mm_weight=None,
                          trans_gmm_weight=False, trans_mm_weight=False, permute_out_flag=False):
        require(send_counts_tensor is None and recv_counts_tensor is None, "counts tensors: not supported yet")
        self.w.calls.append("npu_alltoallv_gmm")
        e, W = self._check(gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, trans_gmm_weight,
                           token_side_rows=gmm_x.shape[0], expert_side_rows=sum(recv_counts))
        self._volume(gmm_x.shape[0], sum(recv_counts), gmm_x.shape[1] * gmm_x.element_size())
        got = self._exchange(_blocks(gmm_x, list(send_counts)))  # ata_out: [s][j]
        world = self.w.world
        for s in range(world):
            for j in range(e):
                require(got[s][j].shape[0] == recv_counts[s * e + j],
                        f"recv_counts[{s * e + j}] = {recv_counts[s * e + j]}, {got[s][j].shape[0]} rows arrive")
        per_expert = [torch.cat([got[s][j] for s in range(world)]) for j in range(e)]  # Permute: expert-major
        permute_out = torch.cat(per_expert)
        gmm_y = self._gmm(per_expert, W, gmm_x.dtype)
        return gmm_y, None, permute_out if permute_out_flag else None

    def npu_gmm_alltoallv(self, gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, *,
                          send_counts_tensor=None, recv_counts_tensor=None, mm_x=None, mm_weight=None,
                          trans_gmm_weight=False, trans_mm_weight=False):
        require(send_counts_tensor is None and recv_counts_tensor is None, "counts tensors: not supported yet")
        self.w.calls.append("npu_gmm_alltoallv")
        e, W = self._check(gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, trans_gmm_weight,
                           token_side_rows=sum(recv_counts), expert_side_rows=gmm_x.shape[0])
        self._volume(gmm_x.shape[0], sum(recv_counts), W.shape[2] * gmm_x.element_size())
        world = self.w.world
        expert_rows = [sum(send_counts[r * e + j] for r in range(world)) for j in range(e)]
        per_expert = _blocks(gmm_x, expert_rows)
        gmm_y = [self._gmm([per_expert[j]], W[j:j + 1], gmm_x.dtype) for j in range(e)]
        # Unpermute: expert j's rows are the blocks for destinations r = 0..N-1, in order
        pieces = [_blocks(gmm_y[j], [send_counts[r * e + j] for r in range(world)]) for j in range(e)]
        got = self._exchange([pieces[j][r] for r in range(world) for j in range(e)])  # index r * e + j
        for s in range(world):
            for j in range(e):
                require(got[s][j].shape[0] == recv_counts[s * e + j],
                        f"recv_counts[{s * e + j}] = {recv_counts[s * e + j]}, {got[s][j].shape[0]} rows arrive")
        y = torch.cat([got[s][j] for s in range(world) for j in range(e)])
        return y, None
