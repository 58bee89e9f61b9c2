"""Install the `stree` namespace: stree/ itself, triton_kernels/ as stree.triton_kernels, distill/ as
stree.distill (docs/design.md §5: nothing is installed outside `stree`)."""
from setuptools import setup

setup(
    packages=["stree", "stree.models", "stree.search", "stree.triton_kernels", "stree.distill"],
    package_dir={"stree": "stree", "stree.triton_kernels": "triton_kernels", "stree.distill": "distill"},
    package_data={"stree": ["assets/demo/*/*.json", "assets/demo/*/*.safetensors", "assets/demo/*.json"]},
)
