"""Benchmarks: the same workload, weights and starting latents in diffusers and in our artifacts,
interleaved, with medians, pairwise ratios, peak RSS and FLOP bounds. `make bench` writes
BENCHMARKS.md from it; no number there comes from anywhere else."""
