"""``@hydra.main`` on ``main(cfg)``, called as ``main()``, in the shape of hydra's tutorial: a config
folder, command-line overrides, the job run inside its output folder (``chdir``), a module
logger that hydra sends to the console and to the folder's log file, a data file found through
``get_original_cwd()``, an output path from ``${hydra:runtime.output_dir}`` and
``HydraConfig.get()``. A restore re-enters ``main`` without hydra's setup (no second output
folder, no second set of log handlers) and finds all of that where it was."""
import logging
import os

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd, to_absolute_path
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def fit(model, opt, batches):
    total = 0.0
    for x in batches:
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    return total / len(batches)


@hydra.main(version_base=None, config_path="hydra_conf", config_name="config")
def main(cfg: DictConfig) -> None:
    torch.manual_seed(cfg.seed)
    with open(os.path.join(get_original_cwd(), "tests/proxy/scripts/functions", cfg.data)) as f:
        scale = torch.tensor([float(line) for line in f])
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for epoch in range(cfg.epochs):
        batches = [torch.randn(8, 4) * scale for _ in range(3)]
        log.info("epoch %d loss %.8f", epoch, fit(model, opt, batches))
        print(f"{HydraConfig.get().job.name} epoch {epoch} in its output folder: "
              f"{os.getcwd() == HydraConfig.get().runtime.output_dir}")
    torch.save(model.state_dict(), "model.pt")  # relative: the job runs in its output folder
    with open(cfg.out_file, "w") as f:
        f.write(" ".join(f"{w:.8f}" for w in model.weight.flatten().tolist()))
    print("saved in the output folder:", os.path.dirname(cfg.out_file) == os.getcwd() == to_absolute_path(os.getcwd()))


if __name__ == "__main__":
    main()
