"""A click command as the entry point: options on ``main``, ``@click.pass_context``, ``main()``
under the main guard. click's frames stood between the top level and the loop, so no safe point
was usable; a restore now calls the command again as the call site did."""
import click
import torch


@click.command()
@click.option("--steps", default=10, type=int)
@click.option("--lr", default=0.05, type=float)
@click.pass_context
def main(ctx, steps, lr):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x = torch.randn(8, 4)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        click.echo(f"{ctx.info_name} step {step} loss {loss.item():.8f}")


if __name__ == "__main__":
    main()
