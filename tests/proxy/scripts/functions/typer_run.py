"""``typer.run(main)`` with an option parsed by a function of the program (with a loop of its own):
typer calls that function first, then ``main``; a restore calls ``typer.run(main)`` again, lets
the parser run to its end and arrives in ``main``."""
import typer
import torch


def widths(value: str) -> list:
    out = []
    for part in value.split(","):
        if int(part) <= 0:
            raise typer.BadParameter("widths must be positive")
        out.append(int(part))
    return out


def fit(model, opt, batches):
    total = 0.0
    for x in batches:
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    return total / len(batches)


def main(steps: int = 10, lr: float = 0.05, hidden: str = typer.Option("4", callback=widths)):
    torch.manual_seed(0)
    sizes = [4, *hidden]
    layers = [layer for a, b in zip(sizes, sizes[1:]) for layer in (torch.nn.Linear(a, b), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(steps // 3):
        batches = [torch.randn(8, 4) for _ in range(3)]
        typer.echo(f"epoch {epoch} loss {fit(model, opt, batches):.8f}")
    typer.echo(f"weight {sum(p.sum() for p in model.parameters()).item():.8f}")


if __name__ == "__main__":
    typer.run(main)
