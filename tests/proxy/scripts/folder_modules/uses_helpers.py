# A script whose loops live in a helper module beside it, as people split their code.
import random

from helpers import Trainer, epochs

random.seed(5)
trainer = Trainer(4)
for epoch in epochs(3):
    print("epoch", epoch, "loss", repr(trainer.run_epoch(epoch)))
print("final", repr(trainer.total))
