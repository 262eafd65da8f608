"""A sibling module of train.py: it imports only if the script's folder is first on sys.path."""
import csv


def load_points(path):
    """(x, y) rows of a CSV file with a header line."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    return [[float(v) for v in row] for row in rows]


def describe(step, loss, phase):
    return f"step {step:3d} loss {loss:.10f} phase {phase}"
