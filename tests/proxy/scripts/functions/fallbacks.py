"""Shapes that run unchanged (no safe point inside them) yet must run and resume correctly:
recursion, a generator function, a library decorator, a lambda, a thread, and a closure over a
variable its function rebinds in a function that reads ``locals()``."""
import random
import threading


def fib(n):
    if n < 2:
        return n
    total = 0
    for part in (fib(n - 1), fib(n - 2)):
        total += part
    return total


def walk(depth):
    for i in range(2):
        if depth:
            walk(depth - 1)
        else:
            print("  leaf", random.random())


def numbers(n):
    for i in range(n):
        yield i * random.random()


def rebinding():
    lr = 1.0
    decay = lambda: lr * 0.5  # noqa: E731
    for i in range(3):
        lr = decay()
    assert "lr" in locals()
    return lr


def worker(out):
    for i in range(1000):
        out.append(i)


def in_thread():
    box = []
    t = threading.Thread(target=worker, args=(box,))
    t.start()
    t.join()
    return box


def main():
    random.seed(3)
    for epoch in range(3):
        walk(2)
        print("fib", fib(8 + epoch))
        print("gen", [f"{v:.12f}" for v in numbers(3)])
        print("lr", rebinding())
        box = in_thread()
        print("thread", len(box), sum(box))
        print("lambda", sorted([3, 1, 2], key=lambda v: -v))


if __name__ == "__main__":
    main()
