"""``fire.Fire(main)`` as the entry point (flags from ``main``'s parameters): fire's frames stand
between the top level and ``main``; a restore calls ``fire.Fire(main)`` again, which parses the
carried command line into the same call."""
import fire
import torch


def fit(model, opt, batches, epoch):
    total = 0.0
    for x in batches:
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    return total / len(batches)


def main(steps: int = 10, lr: float = 0.05, name: str = "fire"):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(steps // 3):
        batches = [torch.randn(8, 4) for _ in range(3)]
        print(f"{name} epoch {epoch} loss {fit(model, opt, batches, epoch):.8f}")
    print(f"{name} weight {model.weight.sum().item():.8f}")


if __name__ == "__main__":
    fire.Fire(main)
