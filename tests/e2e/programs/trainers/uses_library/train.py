"""A job whose loop lives in a library module outside its folder (found through PYTHONPATH)."""
import hashlib
import os

import torch
from mini_trainer import MiniTrainer

torch.manual_seed(0)
x = torch.randn(64, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
model = torch.nn.Linear(4, 1)
trainer = MiniTrainer(model, lr=0.01, sleep=float(os.environ.get("STEP_SLEEP", "0.2")))
trainer.fit(x, y, int(os.environ.get("STEPS", "30")))
print("weights", hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest())
