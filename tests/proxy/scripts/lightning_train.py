"""Lightning in the shape of its docs: a LightningModule with ``training_step``,
``validation_step``, ``self.log`` and ``configure_optimizers`` with a scheduler; a
LightningDataModule; a Trainer with its defaults (model summary, validation every epoch) but a
CSV logger, a ModelCheckpoint keeping the best model, and no progress bar (it prints speeds)."""
import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset, random_split


class Regressor(L.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 16):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(320, 4, generator=g)
        y = x.sum(1, keepdim=True) + 0.1 * torch.randn(320, 1, generator=g)
        self.train_set, self.val_set = random_split(TensorDataset(x, y), [256, 64], generator=g)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", default="logs")
    args = parser.parse_args()
    L.seed_everything(0)
    checkpoint = ModelCheckpoint(dirpath=f"{args.out}/checkpoints", monitor="val_loss", save_top_k=1)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=CSVLogger(args.out, name="run"),
                        callbacks=[checkpoint], log_every_n_steps=4, enable_progress_bar=False)
    model = Regressor()
    trainer.fit(model, datamodule=Data())
    print("best", os.path.basename(checkpoint.best_model_path), f"{checkpoint.best_model_score.item():.6f}")
    print("weights", f"{sum(p.sum().item() for p in model.parameters()):.10f}")


if __name__ == "__main__":
    main()
