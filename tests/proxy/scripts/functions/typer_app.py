"""A typer app with two commands, called as ``app()``: the command line picks ``train``; a
restore calls ``app()`` again, which picks it again from the carried ``sys.argv``."""
import typer
import torch

app = typer.Typer()


def fit(model, opt, batches):
    total = 0.0
    for x in batches:
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    return total / len(batches)


@app.command("train")
def main(steps: int = 10, lr: float = 0.05):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(steps // 3):
        batches = [torch.randn(8, 4) for _ in range(3)]
        print(f"epoch {epoch} loss {fit(model, opt, batches):.8f}")
    print(f"weight {model.weight.sum().item():.8f}")


@app.command()
def evaluate(path: str):
    print("evaluate", path)


if __name__ == "__main__":
    app()
