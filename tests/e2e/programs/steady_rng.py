# A steady job: STEPS steps (60 by default), each drawing from python, numpy and torch RNGs and printing them.
import os
import random
import time

import numpy as np
import torch

random.seed(8)
np.random.seed(9)
torch.manual_seed(10)
acc = 0.0
for step in range(int(os.environ.get("STEPS", "60"))):
    acc += random.random() + float(np.random.rand()) + torch.rand(1).item()
    print(f"step {step} acc {acc:.12f}", flush=True)
    time.sleep(0.05)
acc
