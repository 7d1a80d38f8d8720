"""The user-facing layer: recipes, hybrid builder, tasks, training, ablations, benchmarks, CLI."""
