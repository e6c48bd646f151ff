"""glm5-core: portable kernels for GLM-5-class models.

Every vendor lives in ``glm5_core/backends/<vendor>/`` (its ``backend.py`` declares ``BACKEND``); the
entry points of the group ``glm5_core.backends`` are derived from those folders, the same group an
out-of-tree vendor package uses. Nothing here probes hardware: native extensions are built on first use.
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
VENDOR_FOLDERS = sorted(p.parent.name for p in (HERE / "glm5_core" / "backends").glob("*/backend.py"))

ENTRY_POINTS = {
    "console_scripts": ["glm5 = glm5_core.cli:main"],
    "glm5_core.backends": [f"{v} = glm5_core.backends.{v}.backend:BACKEND" for v in VENDOR_FOLDERS],
}

TRAIN = ["pyyaml>=6", "safetensors>=0.4", "tqdm>=4.60", "numpy>=1.24"]



def vendor_requirements(vendor: str) -> list:
    """The PyPI requirements a vendor folder lists in its ``requirements.txt`` (one per line; ``#`` comments): the
    extra ``glm5-core[<vendor>]``. A vendor whose stack is not on PyPI lists none (its folder says where it comes
    from): naming an unpublished package would let anyone publish one under that name."""
    path = HERE / "glm5_core" / "backends" / vendor / "requirements.txt"
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


EXTRAS = {
    "cuda": ["triton>=3.0"],
    "rocm": ["triton>=3.0"],
    "ascend": ["torch-npu>=2.4", "decorator", "attrs", "psutil"],
    "onnx": ["onnx>=1.16", "onnxruntime>=1.18", "onnxscript>=0.1"],
    "rl": ["ray>=2.9"],
    # real tokenizers with chat templates (the ``tokenizer:`` setting) and the OpenAI-compatible rollout proxy
    # transformers interop (kernelize, checking against transformers): releases before 5.17 compute another function
    "transformers": ["transformers>=5.17,<6"],
    "agents": ["transformers>=5.17,<6", "tokenizers>=0.15", "jinja2>=3.1", "openai>=1.40"],  # openai: env openai_agent
    "metrics": ["tensorboard>=2.14", "matplotlib>=3.7"],
    # pytest benchmarks --backends ...: pytest-benchmark, ninja (builds the cpu kernels), render.py's plot, the
    # transformers peer (bench_moe.py)
    "bench": ["pytest>=7", "pytest-benchmark>=4", "ninja>=1.11", "matplotlib>=3.7", "transformers>=5.24,<6"],
    "dev": [
        "pytest>=7",
        "hypothesis>=6.80",
        "pytest-benchmark>=4",
        "ninja>=1.11",
        "ruff>=0.6",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
        "tokenizers>=0.15",
        "transformers>=5.24,<6",  # glm_moe_dsa interop (>= 5.17) and chat templates (sanitize_control_tokens)
        "jinja2>=3.1",
        "openai>=1.40",  # the OpenAI-compatible rollout proxy is tested with the real client
        "onnx>=1.16",
        "onnxruntime>=1.18",
        "onnxscript>=0.1",
        "triton>=3.0; platform_system == 'Linux' and platform_machine == 'x86_64'",
    ],
}

for _vendor in VENDOR_FOLDERS:  # a vendor folder with a requirements.txt is an extra (a new vendor needs no line here)
    if (HERE / "glm5_core" / "backends" / _vendor / "requirements.txt").is_file():
        EXTRAS.setdefault(_vendor, vendor_requirements(_vendor))

setup(
    name="glm5-core",
    version="0.1.0",
    description="Portable MLA / DSA / MoE / Muon kernels and training drivers for GLM-5-class models",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["glm5_core", "glm5_core.*"]),
    # native sources ship inside their vendor's folder so the extensions can be built on first use
    package_data={"glm5_core.backends": ["*/csrc/*.cpp", "*/csrc/*.h", "*/requirements.txt"]},
    install_requires=["torch>=2.4"] + TRAIN,
    extras_require=EXTRAS,
    entry_points=ENTRY_POINTS,
)
