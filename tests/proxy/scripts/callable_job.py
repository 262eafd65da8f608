"""Builds the pickled callable job: `python callable_job.py OUT` writes cloudpickle((fn, args, kwargs)).

The function trains a tiny model in its own body loops (nested, with a while and an if); it is
pickled by value, as the SDK ships a callable, with its source attached.
"""
import inspect
import sys

import cloudpickle
import torch


def train(n_epochs, width, *, lr=0.05):
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Dropout(0.3), torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = [(torch.randn(5, 3), torch.randn(5, 1)) for _ in range(4)]
    history = []
    for epoch in range(n_epochs):
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            history.append(loss.item())
            print(f"epoch {epoch} loss {loss.item():.10f}")
        if epoch % 2 == 0:
            k = 0
            while k < 2:
                k += 1
                print(f"even epoch {epoch} extra {k} {torch.rand(1).item():.8f}")
    return round(sum(history), 10)


if __name__ == "__main__":
    # what the SDK does: cloudpickle drops the file name, so the source travels with the function
    train.__singularity_source__ = inspect.getsource(train)
    with open(sys.argv[1], "wb") as f:
        f.write(cloudpickle.dumps((train, (3, 8), {"lr": 0.02})))
