"""megatron_oases: faster, planned tensor parallelism for Megatron-Core (Oases, ATP, 3-D TP, DistSim)."""
from setuptools import find_packages, setup

setup(
    name="megatron_oases",
    version="0.1.0",
    description="Overlapped, planned tensor parallelism plug-in for NVIDIA Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # benchmarks/: the benchmark harness, its own top-level package beside the library (it imports
    # megatron_oases, never the reverse), so scripts and tests import it without sys.path edits.
    packages=find_packages(include=["megatron_oases", "megatron_oases.*", "benchmarks", "benchmarks.*"]),
    package_data={"megatron_oases": ["topology/examples/*.yaml", "pricing/gemm_table.json"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",  # megatron_oases/mcore_compat.py bridges the releases
        "pulp>=2.7,<4",  # PuLP 4 no longer bundles CBC, the planner's default solver
        "pyyaml>=6",
        "numpy",
        "psutil",  # Megatron's torch_dist checkpoint writer
        "matplotlib>=3.5",  # scripts/compare.py's chart (Agg backend), sim --png timelines
    ],
    extras_require={
        "test": ["pytest>=7"],
        # CUDA-only accelerators; never required, imported lazily behind HAVE_APEX / HAVE_TE.
        "gpu": ["apex", "transformer-engine"],
        # What megatron.training (a Megatron-LM checkout) imports beyond megatron-core.
        "megatron-lm": ["six", "einops", "pydantic", "pybind11", "regex", "triton"],
    },
    entry_points={"console_scripts": ["megatron-oases=megatron_oases.cli:main"]},
)
