"""A tiny model trained by Hugging Face transformers' Trainer: the loop is the library's."""
import argparse
import hashlib
import time

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--accumulate", type=int, default=1)
a = p.parse_args()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 2))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Report(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']!r} lr {logs['learning_rate']!r}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if a.sleep:
            time.sleep(a.sleep)


g = torch.Generator().manual_seed(1)
xs = torch.randn(48, 8, generator=g)
ys = (xs[:, 0] + xs[:, 1] > 0).long()
data = [{"x": xs[i], "labels": ys[i]} for i in range(len(xs))]

torch.manual_seed(0)
model = Tiny()
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, num_train_epochs=a.epochs,
                         gradient_accumulation_steps=a.accumulate, learning_rate=0.05, lr_scheduler_type="linear",
                         warmup_steps=3, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                         use_cpu=True, seed=0, dataloader_num_workers=0, remove_unused_columns=False)
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Report()])
trainer.remove_callback(PrinterCallback)
trainer.train()
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()
print("weights", digest)
