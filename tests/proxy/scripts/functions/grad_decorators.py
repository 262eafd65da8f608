"""Loops inside functions under grad-mode decorators: ``@torch.no_grad()`` on a Trainer's
``evaluate``, ``@torch.inference_mode()`` on ``predict``, and ``@torch.enable_grad()`` on
``finetune`` called after a plain ``torch.set_grad_enabled(False)``. Each decorator puts back,
on return, the mode its caller had; the prints after each call show the mode the program goes
on in (a restore that put back the wrong one would train without gradients, or not stop)."""
import torch


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def loss(self, x):
        return (self.model(x) - x.sum(1, keepdim=True)).pow(2).mean()

    def train_epoch(self, batches):
        for x in batches:
            self.opt.zero_grad()
            self.loss(x).backward()
            self.opt.step()

    @torch.no_grad()
    def evaluate(self, batches):
        total = 0.0
        for x in batches:
            total += self.loss(x).item()
        return total / len(batches), torch.is_grad_enabled()


@torch.inference_mode()
def predict(model, xs):
    out = []
    for x in xs:
        out.append(round(model(x).sum().item(), 6))
    return out


@torch.enable_grad()
def finetune(trainer, batches):
    for x in batches:
        trainer.opt.zero_grad()
        trainer.loss(x).backward()
        trainer.opt.step()
    return torch.is_grad_enabled()


def main():
    t = Trainer()
    for epoch in range(3):
        t.train_epoch([torch.randn(8, 4) for _ in range(3)])
        loss, inside = t.evaluate([torch.randn(8, 4) for _ in range(3)])
        print(f"epoch {epoch} eval {loss:.8f} grad inside {inside} after {torch.is_grad_enabled()}")
        print("predict", predict(t.model, [torch.randn(2, 4) for _ in range(2)]), torch.is_grad_enabled())
    torch.set_grad_enabled(False)
    inside = finetune(t, [torch.randn(8, 4) for _ in range(3)])
    print(f"finetune grad inside {inside} after {torch.is_grad_enabled()}")
    torch.set_grad_enabled(True)
    print("weights", [round(p.sum().item(), 6) for p in t.model.parameters()])


if __name__ == "__main__":
    main()
