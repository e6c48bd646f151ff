"""What the training tests share: the 2-layer model (1 dense + 1 MoE layer, a full and a shared indexer, MTP),
a small text corpus, and a guard that keeps a test reading a FIFO from hanging."""
import subprocess
import sys
from pathlib import Path

SMALL_MODEL = dict(
    preset="tiny", hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=64,
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, num_attention_heads=2, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=2, index_head_dim=8,
    index_topk=6, indexer_types=["full", "shared"], max_position_embeddings=64,
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.getcwd())\n",
]


def small_model_kwargs() -> dict:
    """SMALL_MODEL as GLM5Config keyword arguments (without the preset name)."""
    return {k: v for k, v in SMALL_MODEL.items() if k != "preset"}


_RELEASE = """
import os, sys, time
time.sleep(float(sys.argv[2]))
try:
    os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody is blocked on it
except OSError:
    pass
"""


def unblock_readers_later(fifo: Path, after_s: float = 10.0) -> None:
    """A reader blocked opening the FIFO (inside native code that holds the GIL, where neither SIGALRM nor a
    thread can reach) is let go after ``after_s`` by a process that opens the writing end, so a regression
    fails the test instead of hanging it."""
    subprocess.Popen([sys.executable, "-S", "-c", _RELEASE, str(fifo), str(after_s)])
