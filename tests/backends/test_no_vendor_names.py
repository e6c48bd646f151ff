"""No file of glm5_core outside a vendor folder (``glm5_core/backends/<vendor>/``) names a vendor: code reads the
vendors' device facts instead (device type, distributed backend, visible-devices variable, Ray resource), so a
new vendor is its folder and nothing else."""
import pathlib
import re

from glm5_core import registry

PACKAGE = pathlib.Path(registry.__file__).resolve().parent
BRANDS = ("nvidia", "amd", "huawei", "hip", "rocr_visible_devices", "torch_npu", "rccl", "aiter", "cann")
# Words of the facts that are not a vendor's: the host device and torch's own backend (cpu, gloo) and Ray's
# built-in accelerator resource (GPU: every GPU vendor's, and a common word).
GENERIC = {"cpu", "gloo", "gpu"}
# Folders outside the vendor folders that may still name vendors, each with why (none today: the shared Triton
# kernels' vendor specifics, launch facts and shared-memory limits, are in each vendor's launch.py).
EXEMPT_FOLDERS: set = set()
# (file, word) pairs that may stay, each with why.
ALLOWED = {
    # SGLang's /init_weights_update_group defaults its backend to "nccl": the engine serves that protocol as is
    ("rl/serving/weight_updates.py", "nccl"),
    # SGLang's /update_weights_from_disk request field "recapture_cuda_graph": accepted by name, as SGLang spells it
    ("rl/serving/server.py", "cuda"),
}


def vendor_words():
    words = set(BRANDS)
    for name in registry.builtin_backend_names():
        facts = registry.get_backend(name).facts
        words |= {name, facts.device_type, facts.dist_backend, facts.visible_devices_env or "",
                  facts.ray_resource or ""}
    return {w.lower() for w in words if w} - GENERIC


def vendor_folders():
    return {f"backends/{name}" for name in registry.builtin_backend_names()}


def scanned_files():
    skip = vendor_folders() | EXEMPT_FOLDERS
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.is_file() and path.suffix in (".py", ".md", ".yaml", ".json", ".txt") and "__pycache__" not in rel \
                and not any(rel.startswith(folder + "/") for folder in skip):
            yield rel, path


def test_the_scan_knows_the_vendor_words_and_sees_the_package():
    words = vendor_words()
    assert {"cuda", "rocm", "ascend", "npu", "nccl", "hccl", "cuda_visible_devices", "hip_visible_devices",
            "ascend_rt_visible_devices"} <= words and not words & GENERIC
    files = dict(scanned_files())
    assert "registry.py" in files and "rl/fleet/placement.py" in files and "backends/cuda/backend.py" not in files


def test_no_file_outside_the_vendor_folders_names_a_vendor():
    pattern = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(sorted(map(re.escape, vendor_words()), key=len, reverse=True))
                         + r")(?![A-Za-z0-9])", re.IGNORECASE)
    found = []
    for rel, path in scanned_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in pattern.finditer(line):
                if (rel, match.group(1).lower()) not in ALLOWED:
                    found.append(f"glm5_core/{rel}:{number}: {match.group(1)!r}: {line.strip()[:100]}")
    assert not found, "vendor names outside glm5_core/backends/<vendor>/ (read the device facts instead):\n" + \
        "\n".join(found)
