"""How a model is judged: the held-out validation loss at fixed noise (`heldout`), images from
an exported pipeline (`generate`), the training run's sample grids (`sample_grid`), and CLIP
score and FID (`image_metrics`)."""
