"""What the training loop (`models.train`) is made of: the denoising objective (`loss`), the
state it carries across launches (`state`) and its atomic checkpoints (`checkpoint`), the
divergence rule (`divergence`), the fault points of the stage file (`faults`), FLOPs and MFU
(`flops`), the metrics it logs (`metrics`), and the CPU threads a process trains on
(`cpu_threads`)."""
