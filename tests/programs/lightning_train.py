"""A Lightning job as its users write it, for tests/with_torch/test_torch_autoload.py: ``mpiexec -n 2 python lightning_train.py BACKEND DIR [fp16]``.

It never imports mpidist: the backend names "mpi" and "mpidist" must work from
``pip install mpidist`` alone (torch's entry points). Trains a small regression
with ``prepare_data`` (rank 0 writes the data set, which Lightning guards with a
barrier on a gloo side group), a validation loop, and a checkpoint; prints one
``DIR/result-<rank>.json`` per rank with the final weights' bytes (hex) and the
validation loss, to compare bitwise against the same job on gloo. With ``fp16``
the gradients go through torch's ``fp16_compress_hook``, registered on CPU by
the strategy subclass docs/torch-backend.md shows (Lightning registers hooks
on CUDA only).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.utils.data import DataLoader, TensorDataset

BACKEND, OUT = sys.argv[1], sys.argv[2]
HOOK = fp16_compress_hook if sys.argv[3:] == ["fp16"] else None
torch.set_num_threads(1)
IMPORTED_BEFORE_FIT = "mpidist" in sys.modules


class Data(LightningDataModule):
    def prepare_data(self) -> None:  # rank 0 only, behind Lightning's barrier
        rng = np.random.default_rng(7)
        x = rng.standard_normal((256, 8)).astype(np.float32)
        y = x @ np.arange(1, 9, dtype=np.float32) + 0.1 * rng.standard_normal(256).astype(np.float32)
        np.savez(os.path.join(OUT, "data.npz"), x=x, y=y)

    def setup(self, stage: str) -> None:
        found = np.load(os.path.join(OUT, "data.npz"))
        data = TensorDataset(torch.from_numpy(found["x"]), torch.from_numpy(found["y"]))
        self.train, self.val = torch.utils.data.random_split(data, [192, 64], torch.Generator().manual_seed(0))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=16)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=16)


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x).squeeze(1), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CPUHookDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy registers ``ddp_comm_hook`` only on CUDA; this registers it on CPU too."""

    def _register_ddp_hooks(self) -> None:
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)  # fmt: skip
        self.hooks = [hook.__qualname__ for hook, _ in self.model._comm_hooks]  # what the test checks


seed_everything(0, workers=True)
model = Model()
checkpoints = ModelCheckpoint(dirpath=os.path.join(OUT, "ckpt"), monitor="val_loss", save_last=True)
trainer = Trainer(
    accelerator="cpu", devices=2, num_nodes=1, strategy=CPUHookDDPStrategy(process_group_backend=BACKEND, ddp_comm_hook=HOOK),
    max_epochs=2, callbacks=[checkpoints], logger=False, enable_progress_bar=False,
    enable_model_summary=False, deterministic=True, default_root_dir=OUT,
)  # fmt: skip
trainer.fit(model, datamodule=Data())
weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
result = {
    "rank": trainer.global_rank,
    "backend": torch.distributed.get_backend(),
    "hooks": trainer.strategy.hooks,
    "mpidist_imported_before_fit": IMPORTED_BEFORE_FIT,
    "weights": weights.tobytes().hex(),
    "val_loss": float(trainer.callback_metrics["val_loss"]),
    "checkpoint": os.path.basename(checkpoints.last_model_path),
}
with open(os.path.join(OUT, f"result-{trainer.global_rank}.json"), "w") as f:
    json.dump(result, f)
