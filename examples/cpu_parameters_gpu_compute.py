"""Variables on the CPU, computation on the GPUs: CentralStorageStrategy's own placement.

The model and the optimizer state live once, in host memory (``parameter_device="cpu:0"``);
every visible GPU runs a replica on its slice of each global batch; the replicas' gradients
come back to the CPU, where the optimizer updates the one copy of the weights. This is the
placement TensorFlow's CentralStorageStrategy picks by default with several GPUs.

The optimizer's update then runs on the host, once a step, over every weight: its fused
kernel (``fused=True``) updates each tensor in one pass instead of one pass per operation,
several times faster for Adam on the CPU (docs/performance.md). An optimizer without one
makes temporaries as large as its tensors at every step: call ``cs.keep_host_memory()``
first, and glibc keeps the memory they leave for the next step instead of faulting it in
again (README).

On a machine without GPUs the same program computes on two logical CPU devices (``cpu:0``,
``cpu:1``: two names for the host CPU) and says so; the code does not change.

Run: ``python examples/cpu_parameters_gpu_compute.py``
"""

from __future__ import annotations

import torch
from torch import nn

import centralstore as cs

GLOBAL_BATCH_SIZE = 64
STEPS = 40


def compute_devices() -> list[str]:
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if gpus:
        print(f"computing on {len(gpus)} GPU(s): {', '.join(gpus)}")
        return gpus
    print("no GPU is visible: computing on the logical CPU devices cpu:0 and cpu:1 instead")
    return ["cpu:0", "cpu:1"]


def main() -> None:
    strategy = cs.CentralStorageStrategy(compute_devices=compute_devices(), parameter_device="cpu")
    print(
        f"{strategy.num_replicas_in_sync} replica(s) on {', '.join(strategy.compute_devices)}; "
        f"variables on {strategy.parameter_device}"
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)  # on the host
    print(f"parameters live on: {sorted({str(p.device) for p in model.parameters()})}")

    # A regression problem, generated on the host: y = x @ w + noise.
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(16, 4, generator=generator)
    x = torch.randn(STEPS * GLOBAL_BATCH_SIZE, 16, generator=generator)
    y = x @ w + 0.01 * torch.randn(len(x), 4, generator=generator)
    dataset = cs.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)  # slices go to the devices

    def train_step(features: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, str]:
        predictions = model(features)  # the replica computes on its device
        per_example = ((predictions - targets) ** 2).mean(dim=1)
        loss = cs.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH_SIZE)
        loss.backward()
        where = f"input on {features.device}, output on {predictions.device}"
        return loss.detach(), where

    for step, (features, targets) in enumerate(dist_dataset):
        optimizer.zero_grad()
        loss, placement = strategy.run(train_step, args=(features, targets))
        optimizer.step()  # once, on the CPU, with the gradients summed over the replicas
        if step == 0:
            for replica, where in enumerate(strategy.experimental_local_results(placement)):
                print(f"replica {replica} ({strategy.compute_devices[replica]}): {where}")
        if step % 10 == 0 or step == STEPS - 1:
            total = strategy.reduce(cs.ReduceOp.SUM, loss, axis=None)
            print(f"step {step:>2}: loss {float(total):.4f} (reduced onto {total.device})")

    weight = model[0].weight
    assert weight.grad is not None
    print(f"gradients arrive on: {weight.grad.device}")
    print(f"optimizer state lives on: {optimizer.state[weight]['exp_avg'].device}")
    (stored,) = strategy.experimental_local_results(weight)
    print(f"one copy of each variable: {stored is weight}")


if __name__ == "__main__":
    main()
