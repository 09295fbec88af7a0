"""Held-out validation loss and the conditioning gap, at fixed timesteps and fixed noise.

The training loss is a noisy estimate (a fresh timestep and fresh noise per sample), so it can
hide a regression for thousands of steps. Esser et al. (2024, the SD3 paper) report that a
validation loss taken at fixed timesteps with fixed noise tracks human preference closely.
Here nothing about the number is random, so it is comparable across steps, stages, restarts,
ranks and runs:

- the eval set is a fixed subset of the stage's validation split: the `val_max_samples` keys
  with the smallest hash (the same images however the split is sharded);
- the timesteps are `val_timesteps` evenly spaced ones, t_i = floor((i + 1/2) T / n);
- the noise of each (sample, timestep), and of the VAE posterior's sample, comes from a CPU
  `torch.Generator` seeded by a stable hash of the sample's key and t;
- no caption dropout and no hflip.

The conditioning gap is the same loss with the captions rolled by one across the whole eval
set (sample p gets the caption of sample p + 1: a derangement), minus the loss with the right
captions. It is zero for a model that ignores its text and grows as conditioning is learned.

Ranks split the work by batch: the eval set is cut once into a fixed list of batches (each
within one aspect bucket), and rank r takes batches r, r + W, ... Each sample's losses land in
their own row of a table that is all-reduced with sum (every row has one writer, so the sum is
exact), and every rank averages the same table in the same order: the same bits on any number
of ranks (on one kind of device and thread count; across those, equal to float32 rounding).
The frozen encoders' outputs (latents, text states) are computed once per process and kept,
so an evaluation runs only the UNet. Training's RNG is never touched: evaluation runs under a
guard that restores torch's, numpy's and Python's global RNG states.

`HeldOutLoss` is the training loop's callback: an evaluation at step 0 of a fresh stage, every
`train.eval_every` steps and at the stage's end. `models.heldout_loss` evaluates an exported
stage with the same `Validator` (a bootstrap CI on its gap, and a command line).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType

from kiln_config.errors import InputError, MissingInput
from models.components.sharding import is_sharded, whole_unet
from models.data.collation import KilnCollate
from models.data.images import width_height
from models.data.loader import (
    TRAINING_COLUMNS,
    ImageCaptionDataset,
    _stored_ids_match,
    dataset_buckets,
)
from models.training.loss import diffusion_target, encode_latents, encode_text

__all__ = [
    "EvalSet",
    "Validator",
    "build_validator",
    "eval_timesteps",
    "noise_seed",
]

log = logging.getLogger("kiln.validation")

LATENT_T = -1  # the "timestep" whose seed draws the VAE posterior's sample
SUBSET_T = -2  # the one whose seed orders the split: the eval subset is its first keys


def eval_timesteps(num_train_timesteps: int, n: int) -> list[int]:
    """`n` evenly spaced timesteps, the middle of each of n equal bins of [0, T)."""
    if not 1 <= n <= num_train_timesteps:
        raise InputError(f"train.val_timesteps must be in [1, {num_train_timesteps}], got {n}")
    return [(2 * i + 1) * num_train_timesteps // (2 * n) for i in range(n)]


def noise_seed(key: str, t: int) -> int:
    """A seed fixed by (sample key, timestep): blake2b, not Python's salted `hash`."""
    digest = hashlib.blake2b(f"{key}\x00{t}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _noise(keys: list[str], t: int, like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise shaped like `like`, each row drawn on the CPU from its own
    (key, t) seed, so it is the same in any batch, on any device and any rank."""
    out = torch.empty(like.shape, dtype=torch.float32)
    for i, key in enumerate(keys):
        g = torch.Generator().manual_seed(noise_seed(key, t))
        torch.randn(like.shape[1:], generator=g, out=out[i])
    return out.to(like.device, like.dtype)


@contextmanager
def _rng_untouched(device: torch.device) -> Iterator[None]:
    """Restore every global RNG on exit: training must be bit-identical with and without
    validation, and a resumed run restores these states from its checkpoint."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class EvalSet:
    """The fixed eval subset of a validation split, cut into a fixed list of batches.

    Args:
        local: The split's MDS folder (a plain dataset, or aspect buckets with buckets.json).
        tokenizer: The model's tokenizer (captions of shards without usable token ids).
        resolution: The stage's image size.
        batch_size: Samples per batch.
        max_samples: Size of the subset.
    """

    def __init__(self, local: str, tokenizer, resolution, batch_size: int, max_samples: int):
        from streaming import Stream

        if not Path(local).is_dir():
            raise MissingInput(
                f"val_shards {local} is not a folder: run the shard step with "
                "shards.val_fraction > 0, or unset val_shards"
            )
        buckets = dataset_buckets(local)
        sizes = None
        if buckets:
            streams = [Stream(local=str(Path(local) / b["name"])) for b in buckets]
            sizes = sorted(
                {(b["width"], b["height"]) for b in buckets} | {width_height(resolution)}
            )
            self.dataset = ImageCaptionDataset(streams=streams, batch_size=1, shuffle=False)
        else:
            self.dataset = ImageCaptionDataset(local=local, batch_size=1, shuffle=False)
        self.collate = KilnCollate(tokenizer, sizes or resolution)
        stored = _stored_ids_match(self.dataset, self.collate.ids)  # as the training loader
        self.dataset.columns = TRAINING_COLUMNS - ({"caption"} if stored else {"input_ids"})
        self.batches = self._plan(batch_size, max_samples)
        self.order = [i for b in self.batches for i in b]  # the global order captions roll in
        self.starts = np.cumsum([0] + [len(b) for b in self.batches]).tolist()
        if not self.order:
            raise ValueError(f"the validation split {local} holds no samples")

    def _plan(self, batch_size: int, max_samples: int) -> list[list[int]]:
        ds = self.dataset
        stream_of = np.repeat(np.arange(len(ds.samples_per_stream)), ds.samples_per_stream)
        keyed = [
            (noise_seed(str(ds.read_sample(i, frozenset({"key"}))["key"]), SUBSET_T), i)
            for i in range(ds.num_samples)
        ]
        chosen = sorted(keyed)[:max_samples]
        # Grouped by bucket (a batch has one image shape), in hash order within each.
        chosen.sort(key=lambda hi: (int(stream_of[hi[1]]), hi[0]))
        batches: list[list[int]] = []
        for s in sorted({int(stream_of[i]) for _, i in chosen}):
            idx = [i for _, i in chosen if stream_of[i] == s]
            batches += [idx[k : k + batch_size] for k in range(0, len(idx), batch_size)]
        return batches

    def __len__(self) -> int:
        return len(self.order)

    def close(self) -> None:
        """Free the split's shared memory (the training process, a test session live on)."""
        self.dataset.release()

    def samples(self, j: int) -> tuple[list[dict], dict]:
        """Batch `j`'s samples, and the sample after it in the global order (whose caption
        the batch's last sample gets when captions are rolled)."""
        batch = [self.dataset[i] for i in self.batches[j]]
        nxt = self.dataset[self.order[self.starts[j + 1] % len(self.order)]]
        return batch, nxt


def _text_batch(samples: list[dict], collate: KilnCollate) -> dict:
    """Only the text columns of `samples`, batched as `KilnCollate` does (no dropout)."""
    first = samples[0]
    if "text_hidden" in first:
        hidden = np.stack([np.asarray(s["text_hidden"]) for s in samples])
        return {
            "text_hidden": torch.from_numpy(hidden),
            "drop": torch.zeros(len(samples), dtype=torch.bool),
        }
    if "input_ids" in first:
        ids = np.stack([np.asarray(s["input_ids"]) for s in samples]).astype(np.int64)
        return {"input_ids": torch.from_numpy(ids)}
    return {"input_ids": collate.ids([s["caption"] for s in samples])}


class Validator:
    """Evaluates the validation loss and conditioning gap of the raw (and EMA) weights.

    Args:
        evalset: The eval subset.
        accelerator: The run's Accelerator (device, rank split, all-reduce).
        comps: The components; `comps.unet` may be `prepare`d.
        ema: The EMAModel, or None.
        weight_dtype: The frozen encoders' dtype.
        timesteps: Number of evenly spaced timesteps.
        every: Evaluate every this many optimizer steps (None: at the stage's end only).
        max_steps: The stage's last step, always evaluated.
        channels_last: Feed the UNet channels-last inputs, as training does.
    """

    def __init__(
        self,
        evalset,
        accelerator,
        comps,
        ema,
        weight_dtype,
        timesteps: int,
        every: int | None,
        max_steps: int,
        channels_last: bool = False,
    ):
        self.evalset, self.accelerator, self.comps, self.ema = evalset, accelerator, comps, ema
        self.weight_dtype, self.every, self.max_steps = weight_dtype, every, max_steps
        self.channels_last = channels_last
        sched = comps.noise_scheduler
        self.timesteps = eval_timesteps(sched.config.num_train_timesteps, timesteps)
        world, rank = accelerator.num_processes, accelerator.process_index
        self.mine = list(range(rank, len(evalset.batches), world))
        # FSDP's forward is a collective: every rank runs as many batches (padded, discarded).
        rounds = -(-len(evalset.batches) // world)
        self.pad = rounds - len(self.mine) if self._fsdp() else 0
        self._cache: dict[int, tuple] = {}

    def _fsdp(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.FSDP

    def due(self, step: int) -> bool:
        return step == self.max_steps or (self.every is not None and step % self.every == 0)

    def _encoded(self, j: int) -> tuple:
        """Batch j's keys, latents, and text states: the right captions', then the rolled
        ones' (one UNet call takes both). Computed once: the encoders are frozen."""
        if j not in self._cache:
            comps, dtype, device = self.comps, self.weight_dtype, self.accelerator.device
            samples, nxt = self.evalset.samples(j)
            batch = self.evalset.collate(samples)
            keys = [str(k) for k in batch["key"]]

            def posterior_noise(like):
                return _noise(keys, LATENT_T, like)

            latents = encode_latents(comps, batch, dtype, device, noise_like=posterior_noise)
            text = encode_text(
                comps, _text_batch([*samples, nxt], self.evalset.collate), dtype, device
            )
            self._cache[j] = (keys, latents, torch.cat([text[:-1], text[1:]]))
        return self._cache[j]

    def _table(self, unet) -> torch.Tensor:
        """(samples, timesteps, 2) per-sample losses, right and rolled captions, all ranks'."""
        sched, device = self.comps.noise_scheduler, self.accelerator.device
        table = torch.zeros(
            len(self.evalset), len(self.timesteps), 2, dtype=torch.float64, device=device
        )
        jobs = [(j, True) for j in self.mine] + [(0, False)] * self.pad
        for j, real in jobs:
            keys, latents, hidden = self._encoded(j)
            n, start = len(keys), self.evalset.starts[j]
            for k, t in enumerate(self.timesteps):
                noise = _noise(keys, t, latents)
                tt = torch.full((n,), t, dtype=torch.long, device=device)
                noisy = sched.add_noise(latents, noise, tt)
                target = diffusion_target(sched, latents, noise, tt).float().repeat(2, 1, 1, 1)
                noisy = noisy.repeat(2, 1, 1, 1)  # the same inputs, right then rolled captions
                if self.channels_last:
                    noisy = noisy.contiguous(memory_format=torch.channels_last)
                pred = unet(noisy, tt.repeat(2), hidden).sample
                per = F.mse_loss(pred.float(), target, reduction="none").mean(dim=(1, 2, 3))
                if real:
                    table[start : start + n, k] = per.double().view(2, n).T
        return self.accelerator.reduce(table, "sum").cpu()

    def _metrics(self, prefix: str, table: torch.Tensor) -> dict[str, float]:
        loss, gap = table[..., 0], table[..., 1] - table[..., 0]
        out = {
            f"{prefix}/val/loss": loss.mean().item(),
            f"{prefix}/val/cond_gap": gap.mean().item(),
        }
        for k, t in enumerate(self.timesteps):
            out[f"{prefix}/val/loss_t{t}"] = loss[:, k].mean().item()
            out[f"{prefix}/val/cond_gap_t{t}"] = gap[:, k].mean().item()
        return out

    def tables(self) -> dict[str, torch.Tensor]:
        """The per-sample tables, `raw` and (once EMA has started) `ema`; for bootstrap CIs."""
        device = self.accelerator.device
        fsdp = self._fsdp()
        unet = self.comps.unet if fsdp else self.accelerator.unwrap_model(self.comps.unet)
        sharded = is_sharded(unet)
        if sharded:  # Kiln's FSDP: every rank evaluates its share on a whole copy
            unet = whole_unet(unet)
        out = {}
        # The whole copy is a plain module: autocast as the prepared UNet's forward has it.
        amp = self.accelerator.autocast() if sharded else contextlib.nullcontext()
        with _rng_untouched(device), torch.no_grad(), amp:
            was_training = unet.training
            unet.eval()
            try:
                out["raw"] = self._table(unet)
                ema = self.ema
                # Before start_step the EMA decay is 0: it just copies the raw weights.
                if ema is not None and ema.optimization_step > ema.update_after_step:
                    ema.store(unet.parameters())  # to the CPU; restored exactly below
                    ema.copy_to(unet.parameters())
                    try:
                        out["ema"] = self._table(unet)
                    finally:
                        ema.restore(unet.parameters())
            finally:
                unet.train(was_training)
        return out

    def evaluate(self) -> dict[str, float]:
        """`raw/val/...` and `ema/val/...` metrics, and `val/eval_s` (what it cost)."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        for prefix, table in self.tables().items():
            metrics.update(self._metrics(prefix, table))
        metrics["val/eval_s"] = time.perf_counter() - t0
        return metrics

    def run(self, state, sink) -> float:
        """Evaluate at `state.step`, log the metrics, append them to `state.val`; returns the
        seconds it took, which the caller keeps out of the training step time (and adds to
        `state.elapsed_s`: the device time is spent all the same)."""
        metrics = self.evaluate()
        # sink.last feeds the manifest's last-window training metrics: keep them.
        last = sink.last
        sink.log(state.step, **metrics)
        sink.last = last
        state.val.append({"step": state.step, **metrics})
        state.elapsed_s += metrics["val/eval_s"]
        log.info(
            "validation at step %d: %s",
            state.step,
            {k: round(v, 5) for k, v in metrics.items() if k.count("/") == 2 and "_t" not in k},
        )
        return metrics["val/eval_s"]

    def finish(self, state, sink) -> None:
        """The end-of-stage evaluation, unless a relaunch resumed past it (the checkpoint
        it resumed from holds it)."""
        if not state.val or state.val[-1]["step"] != state.step:
            self.run(state, sink)


def build_validator(run, accelerator, comps, ema, weight_dtype) -> Validator | None:
    """The stage's Validator, or None when the stage has no validation split."""
    if run.val_shards is None:
        return None
    cfg, stage = run.train, run.stage
    with _rng_untouched(accelerator.device):
        evalset = EvalSet(
            run.val_shards, comps.tokenizer, stage.resolution, stage.batch_size, cfg.val_max_samples
        )
    return Validator(
        evalset,
        accelerator,
        comps,
        ema,
        weight_dtype,
        cfg.val_timesteps,
        cfg.eval_every,
        stage.max_steps,
        cfg.channels_last,
    )
