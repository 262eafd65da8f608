# Spends a long time inside one library call before its loop: no safe point until the call returns.
import os
import time


def load_everything():
    print("loading", flush=True)
    time.sleep(float(os.environ.get("STUCK_S", "0")))


load_everything()
for i in range(int(os.environ.get("STEPS", "40"))):
    print(i, flush=True)
    time.sleep(0.05)
"done"
