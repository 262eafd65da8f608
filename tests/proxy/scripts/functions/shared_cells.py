"""Closures over variables their function rebinds, in the shapes training code has them: an LBFGS
closure defined in the loop, a generator expression over the loop's batch, hooks that read the
loop variable late, a nonlocal counter, a parameter the loop rebinds, and names a nested scope
binds itself, an annotated one. Each function keeps its safe points (its shared variables live in
one object)."""
import torch


def fit(model, lr):
    opt = torch.optim.LBFGS(model.parameters(), lr=lr, max_iter=2)
    hooks = []
    for epoch in range(4):
        x = torch.randn(16, 3)
        y = x.sum(1, keepdim=True)

        def closure():
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()  # its own `loss`, the loop's x and y
            loss.backward()
            return loss

        loss = opt.step(closure)
        lr = lr * 0.5  # a parameter rebound in the loop, read by the hooks below
        hooks.append(lambda: (epoch, lr))  # late binding: every hook reads the newest values
        parts = sum(float(v) for v in y[:3, 0] * epoch)  # a generator expression over the loop's y
        print("fit", epoch, f"{loss.item():.8f}", f"{parts:.6f}", [h() for h in hooks])
    return lr


class Trainer:
    def __init__(self):
        self.seen = []

    def run(self, n):
        for i in range(n):
            scale = i + 1
            self.seen.append(lambda v: v * scale)  # a method's closure over its loop's variable
            print("trainer", i, [f(1) for f in self.seen])


def main():
    torch.manual_seed(0)
    Trainer().run(4)
    total = 0

    def bump(k):
        nonlocal total
        total += k
        return total

    shadow: int = 10  # annotated: a boxed variable cannot keep a simple annotated target
    for step in range(6):
        own = (lambda shadow: shadow * 2)(step)  # the lambda's own `shadow`
        squares = [step * step for step in range(3)]  # the comprehension's own `step`
        print("main", step, bump(step), own, squares, (lambda: shadow + step)())
        shadow += 1
    print("lr", fit(torch.nn.Linear(3, 1), 0.8), "total", total)


if __name__ == "__main__":
    main()
