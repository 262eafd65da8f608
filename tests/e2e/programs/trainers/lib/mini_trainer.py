"""A stand-in for an installed trainer library: the training loop is in here, not in the job."""
import time

import torch


class MiniTrainer:
    def __init__(self, model, lr, sleep):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self.sleep = sleep
        self.history = []

    def fit(self, x, y, steps):
        for step in range(steps):
            loss = self.train_step(x, y)
            self.history.append(loss)
            print(f"step {step} loss {loss!r}", flush=True)
            time.sleep(self.sleep)
        return self.history

    def train_step(self, x, y):
        idx = torch.randint(0, len(x), (8,))
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x[idx]), y[idx])
        loss.backward()
        self.opt.step()
        return loss.item()
