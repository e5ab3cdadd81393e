"""One module per kernel family, each with `bench(copy_bw: float) -> None` printing a markdown table;
benchmarks/kernels.py runs them (see its BENCHES)."""
