"""The model's parts: the UNet, VAE, text encoder, tokenizer and schedulers built from config
dicts or loaded from a local path (`factory`), the tiny preset's VAE fitted on the data
(`vae_fit`), the UNet's EMA (`ema`), and a stage's export (`export`)."""
