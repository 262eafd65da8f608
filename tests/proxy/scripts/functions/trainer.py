"""A Trainer class: fit() loops over epochs and calls train_epoch() (a DataLoader loop) and
evaluate() (a `with torch.no_grad():` loop inside a `try`); tensors shared between frames."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Trainer:
    def __init__(self, model, loader, lr):
        self.model = model
        self.loader = loader
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.loss_fn = nn.MSELoss()
        self.history = []

    def fit(self, epochs):
        for epoch in range(epochs):
            loss = self.train_epoch(epoch, self.model)
            self.history.append(loss)
            score = self.evaluate(self.model)
            print(f"epoch {epoch} train {loss:.10f} eval {score:.10f}")
        return self.history

    def train_epoch(self, epoch, model):
        model.train()
        total = 0.0
        for i, (xb, yb) in enumerate(self.loader):
            self.opt.zero_grad()
            loss = self.loss_fn(model(xb), yb)
            loss.backward()
            self.opt.step()
            total += loss.item()
            print(f"  e{epoch} b{i} {loss.item():.10f} shared={model is self.model}")
        return total

    def evaluate(self, model):
        model.eval()
        try:
            errors = []
            with torch.no_grad():
                for xb, yb in self.loader:
                    errors.append(self.loss_fn(model(xb), yb).item())
                    print(f"  eval {errors[-1]:.10f} grad={torch.is_grad_enabled()}")
            return sum(errors) / len(errors)
        except ZeroDivisionError:
            return float("nan")
        finally:
            model.train()


def main():
    torch.manual_seed(0)
    x = torch.randn(24, 3)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(24, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))
    trainer = Trainer(model, loader, lr=0.05)
    history = trainer.fit(3)
    print("final", [f"{h:.10f}" for h in history], float(model[0].weight.detach().sum()))


if __name__ == "__main__":
    main()
