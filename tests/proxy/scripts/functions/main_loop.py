"""The loop lives in main(), called under `if __name__ == "__main__":`; argparse defaults."""
import argparse
import random


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=4)
    return p.parse_args()


def step(state, epoch, i):
    state["total"] += random.random() * (epoch + 1)
    return state["total"]


def main():
    args = parse()
    random.seed(args.seed)
    state = {"total": 0.0}
    history = []
    for epoch in range(args.epochs):
        for i in range(4):
            value = step(state, epoch, i)
            history.append(value)
            print(f"epoch {epoch} step {i} total {value:.12f}")
        print("epoch done", epoch, len(history))
    return history


if __name__ == "__main__":
    out = main()
    print("final", len(out), f"{sum(out):.12f}")
