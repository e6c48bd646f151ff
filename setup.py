"""glm5-core: portable kernels for GLM-5-class models.

The top-level ``backends/<vendor>/`` folders are installed as ``glm5_core.backends.<vendor>``.
Nothing here probes hardware: native extensions are built on first use (see ``backends/cpu``).
"""
from setuptools import find_packages, setup

VENDORS = ("cpu", "cuda", "rocm", "ascend")

# Auto-discovery does not follow package_dir mappings: the vendor folders and csrc/ are listed explicitly.
PACKAGES = find_packages(include=["glm5_core", "glm5_core.*"]) + ["glm5_core.csrc"] + [
    f"glm5_core.backends.{p}" for p in find_packages(where="backends")
]

# csrc/ (C++ and CUDA sources) ships inside the package so the extensions can be built on first use.
PACKAGE_DIR = {f"glm5_core.backends.{v}": f"backends/{v}" for v in VENDORS}
PACKAGE_DIR["glm5_core.csrc"] = "csrc"

ENTRY_POINTS = {
    "console_scripts": ["glm5 = glm5_core.cli:main"],
    "glm5_core.backends": [f"{v} = glm5_core.backends.{v}.backend:BACKEND" for v in VENDORS],
}

TRAIN = ["pyyaml>=6", "safetensors>=0.4", "tqdm>=4.60", "numpy>=1.24"]

EXTRAS = {
    "cuda": ["triton>=3.0"],
    "rocm": ["triton>=3.0"],
    "ascend": ["torch-npu>=2.4", "decorator", "attrs", "psutil"],
    "onnx": ["onnx>=1.16", "onnxruntime>=1.18", "onnxscript>=0.1"],
    "rl": ["ray>=2.9"],
    "metrics": ["tensorboard>=2.14", "matplotlib>=3.7"],
    "dev": [
        "pytest>=7",
        "hypothesis>=6.80",
        "pytest-benchmark>=4",
        "ninja>=1.11",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
        "tokenizers>=0.15",
        "onnx>=1.16",
        "onnxruntime>=1.18",
        "onnxscript>=0.1",
        "triton>=3.0; platform_system == 'Linux' and platform_machine == 'x86_64'",
    ],
}

setup(
    name="glm5-core",
    version="0.1.0",
    description="Portable MLA / DSA / MoE / Muon kernels and training drivers for GLM-5-class models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"glm5_core.csrc": ["*.cpp", "*.h", "*.cu", "*.cuh"]},
    install_requires=["torch>=2.4"] + TRAIN,
    extras_require=EXTRAS,
    entry_points=ENTRY_POINTS,
)
