# A small torch training loop: its checkpoints record the torch version they depend on.
import os
import time

import torch

torch.manual_seed(0)
w = torch.zeros(4)
for step in range(int(os.environ.get("STEPS", "100"))):
    x = torch.randn(4)
    w += 0.1 * x
    print(step, float(w.sum()), flush=True)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))
float(w.sum())
