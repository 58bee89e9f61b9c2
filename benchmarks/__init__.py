"""stree's benchmarks: run each from the repository root as a module (python -m benchmarks.<group>.<script>), so
no script's folder lands first on sys.path to shadow an installed package. benchmarks/README.md lists them."""
