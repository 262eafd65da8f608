"""A closure with its own loop, a call with side-effecting arguments (`train(next(it))`), a
result used in an f-string and in `append`, and a user decorator (functools.wraps)."""
import functools
import random


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        print("logged", fn.__name__, f"{out:.12f}")
        return out
    return wrapper


@logged
def train(n):
    acc = 0.0
    for i in range(n):
        acc += random.random()
        print("  train", n, i, f"{acc:.12f}")
    return acc


def evaluate(values):
    total = 0.0
    for v in values:
        total += v * random.random()
    return total


def count_to(n):
    c = 0
    for i in range(n):
        c += i
    return c


class Timer:
    """A context manager whose constructor runs a function of the program: on restore the with
    header is evaluated again, and that call must run as plain code inside the restore."""

    def __init__(self, name):
        self.name = name
        self.ticks = count_to(4)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main():
    random.seed(7)
    scale = 3
    results = []

    def accumulate(k):
        s = 0.0
        for j in range(k):
            s += scale * random.random()
            print("  closure", k, j, f"{s:.12f}")
        return s

    it = iter([2, 3, 1])
    for epoch in range(3):
        with Timer(epoch) as tm:
            got = train(next(it))  # next(it) must not run again on restore
        results.append(accumulate(epoch + 1))
        print(f"epoch {epoch} got {got:.12f} eval {evaluate(results):.12f} ticks {tm.ticks}")
    print("rest", list(it), len(results))


if __name__ == "__main__":
    main()
