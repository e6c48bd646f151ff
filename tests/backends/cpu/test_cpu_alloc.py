"""A native kernel's working memory follows its inputs, not a width argument, and an allocation that fails
inside an OpenMP region is an error, never an abort (an exception leaving a region is std::terminate).

The kernels run in a child process under an address-space limit (RLIMIT_AS) a little above what the process
already maps, so an allocation sized by a huge argument fails for real, where it would abort the process.
"""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")

LIMITED_RUN = """
import resource, sys
import torch
from glm5_core.backends.cpu import dsa as native_dsa
from glm5_core.backends.cpu import extension
from glm5_core.ops import dsa

assert extension.load().built, extension.load().describe()
g = torch.Generator().manual_seed(0)
q, k, w = torch.randn(1, 3, 2, 8, generator=g), torch.randn(1, 5, 8, generator=g), torch.rand(1, 3, 2, generator=g)
want = dsa.indexer_topk_reference(q, k, w, topk=5, start_pos=2)  # [1, 3, 5]: every key, ranked, -1 where unseen
native_dsa.indexer_topk(q, k, w, topk=5, start_pos=2)  # the OpenMP team and malloc arenas exist from here on


def mapped_bytes():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


headroom = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))
{body}
print("completed")
"""

# topk = 2**24: the output [1, 3, topk] int32 is 192 MiB and fits the 320 MiB of headroom; a kernel that keeps
# (topk + slack) candidates of 8 bytes per query wants 3 x 128 MiB more inside its parallel region.
WIDE_TOPK = """
idx = native_dsa.indexer_topk(q, k, w, topk=int(sys.argv[1]), start_pos=2)
assert idx.shape == (1, 3, int(sys.argv[1]))
assert torch.equal(idx[..., :5], want), (idx[..., :5], want)
for t in range(3):  # each row's padding is contiguous: reductions over it need no copy
    assert int(idx[0, t, 5:].max()) == -1 and int(idx[0, t, 5:].min()) == -1
"""


def _run(body: str, *args: int) -> subprocess.CompletedProcess:
    script = LIMITED_RUN.replace("{body}", body)
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="2"))


def test_topk_far_past_the_key_count_costs_its_output_and_nothing_more(native):
    result = _run(WIDE_TOPK, 2**24, 320 << 20)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])  # was -6: SIGABRT
    assert "completed" in result.stdout


# Per-thread scratch of 256 keys x D, with one 5-key row of k: D = 2**22 makes each thread's block 4 GiB.
HUGE_HEAD_DIM = """
qd, kd, wd = torch.randn(1, 1, 1, 2**22), torch.randn(1, 1, 2**22), torch.rand(1, 1, 1)
try:
    native_dsa.indexer_topk(qd, kd, wd, topk=1, start_pos=0)
except (RuntimeError, MemoryError) as exc:
    print("raised", type(exc).__name__)
else:
    print("ran")
"""


def test_scratch_that_does_not_fit_is_an_error_not_an_abort(native):
    result = _run(HUGE_HEAD_DIM, 1, 256 << 20)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "completed" in result.stdout and "raised" in result.stdout, result.stdout
