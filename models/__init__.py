"""The ML code that runs inside `accelerate launch`; no Prefect.

The `-m` entry points sit here: `train`, `precompute`, `study_images`, `heldout_loss`,
`collective_check`, `node_launch` and `sd2_components`, with `measure_throughput`, which drives
the training loop for `kiln plan`. Library code lives in subpackages by concept: `data/`,
`components/`, `training/`, `evaluation/`, and `callbacks/`, the loop's thin adapters over them.
"""
