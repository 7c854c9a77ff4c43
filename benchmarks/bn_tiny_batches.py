"""One SGD step of the smoke-scale FedProTIP model on minibatches of a few rows: why a
client holding 2 rows of a task blew up every method's test loss (issue 17, make smoke).

``resnet18_imagenet`` from random initialisation at 32x32 (as ``scale: smoke`` builds it)
has a 1x1 layer-4 feature map, so a BatchNorm there normalises over as many values per
channel as the minibatch has rows. The step is the FedProTIP Table 3 optimizer (SGD lr
0.01, weight decay 5e-4) on random inputs and labels of 20 classes; reported per batch
size: the step's training loss, its gradient norm, and the test loss of the stepped model
in eval mode (running statistics) on 200 other random rows. Same seed for every size.

    python benchmarks/bn_tiny_batches.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from fedforget.models import build_model

SIZES = (2, 3, 5, 10, 64)
CLASSES = 20


def one_step(n: int, x_test: torch.Tensor, y_test: torch.Tensor) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_model("resnet18_imagenet", (3, 32, 32), CLASSES)
    x, y = torch.rand(n, 3, 32, 32), torch.randint(0, CLASSES, (n,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=5e-4)
    model.train()
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    grad_norm = float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())))
    opt.step()
    model.eval()
    with torch.no_grad():
        test_loss = float(F.cross_entropy(model(x_test), y_test))
    return {"rows": n, "train_loss": float(loss.detach()), "grad_norm": grad_norm, "test_loss": test_loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(1)
    x_test = torch.rand(200, 3, 32, 32, generator=gen)
    y_test = torch.randint(0, CLASSES, (200,), generator=gen)
    rows = [one_step(n, x_test, y_test) for n in SIZES]
    for r in rows:
        print(f"{r['rows']:>3} rows: train loss {r['train_loss']:.3f}, grad norm {r['grad_norm']:.4g}, "
              f"test loss {r['test_loss']:.4g}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": "resnet18_imagenet 32x32, random init", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
