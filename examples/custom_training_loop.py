"""A complete custom training loop with CentralStorageStrategy, checkpointed and resumed.

The loop is TensorFlow's custom-training tutorial in PyTorch: the model and optimizer built in
``strategy.scope()``, global batches split over the replicas by
``experimental_distribute_dataset``, the loss scaled with ``compute_average_loss`` (and an L2
penalty with ``scale_regularization_loss``), metrics summed with ``strategy.reduce``. After each
epoch a plain ``torch.save`` of the ``state_dict``s writes a checkpoint; the job then stops
halfway, as if preempted, and a new strategy resumes from the checkpoint. The resumed run ends
with exactly the weights of a run that never stopped.

The model has a BatchNorm layer: its running statistics are averaged over the replicas and
``num_batches_tracked`` counts each step once. Each replica normalizes over its own slice of the
global batch, so with BatchNorm (unlike without) two replicas do not train exactly like one
device; resumed and uninterrupted runs, both on two replicas, still agree exactly.

Run: ``python examples/custom_training_loop.py [--checkpoint-dir DIR]``
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import centralstore as cs

GLOBAL_BATCH_SIZE = 32
EPOCHS = 4
STOP_AFTER = 2  # epochs before the simulated preemption
WEIGHT_DECAY = 1e-4
DEVICES = ["cpu:0", "cpu:1"]  # two logical CPU devices: runs anywhere


def make_data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Three Gaussian blobs in 8 dimensions: 480 training and 120 test examples."""
    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 8, generator=generator) * 1.5
    labels = torch.randint(0, 3, (600,), generator=generator)
    features = centers[labels] + torch.randn(600, 8, generator=generator)
    return (features[:480], labels[:480]), (features[480:], labels[480:])


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))


class Trainer:
    """A model and its optimizer, stored once by ``strategy``, and the loop that trains them."""

    def __init__(self, strategy: cs.Strategy) -> None:
        self.strategy = strategy
        torch.manual_seed(0)
        with strategy.scope():
            self.model = make_model()
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.epoch = 0

    # -- checkpoints: plain state_dicts, portable across replica counts ---------------------

    def save(self, path: Path) -> None:
        state = {
            "epoch": self.epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        torch.save(state, path)

    def restore(self, path: Path) -> None:
        state = torch.load(path)
        self.model.load_state_dict(state["model"])  # cross-replica: writes apply directly
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch = state["epoch"]

    # -- training ---------------------------------------------------------------------------

    def train_epoch(self, train: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
        """One pass over the data, shuffled by a seed derived from the epoch (so that a resumed
        run sees the same batches as an uninterrupted one). Returns loss and accuracy."""
        strategy, model, optimizer = self.strategy, self.model, self.optimizer
        dataset = (
            cs.Dataset.from_tensor_slices(train)
            .shuffle(len(train[1]), seed=self.epoch)
            .batch(GLOBAL_BATCH_SIZE)
        )

        def train_step(
            features: torch.Tensor, labels: torch.Tensor, global_batch: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
            logits = model(features)
            per_example = F.cross_entropy(logits, labels, reduction="none")
            loss = cs.compute_average_loss(per_example, global_batch_size=global_batch)
            l2 = sum(p.pow(2).sum() for p in model.parameters())
            loss = loss + cs.scale_regularization_loss(WEIGHT_DECAY * l2)
            loss.backward()
            return loss.detach(), (logits.argmax(1) == labels).float()

        model.train()
        total_loss, correct, seen = 0.0, 0.0, 0
        for features, labels in strategy.experimental_distribute_dataset(dataset):
            size = sum(len(t) for t in strategy.experimental_local_results(labels))
            optimizer.zero_grad()
            loss, hits = strategy.run(train_step, args=(features, labels, size))
            optimizer.step()
            total_loss += float(strategy.reduce(cs.ReduceOp.SUM, loss, axis=None)) * size
            correct += float(strategy.reduce(cs.ReduceOp.SUM, hits, axis=0))
            seen += size
        self.epoch += 1
        return total_loss / seen, correct / seen

    def test_accuracy(self, test: tuple[torch.Tensor, torch.Tensor]) -> float:
        strategy, model = self.strategy, self.model
        dataset = cs.Dataset.from_tensor_slices(test).batch(GLOBAL_BATCH_SIZE)

        def test_step(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return (model(features).argmax(1) == labels).float()

        model.eval()
        correct = 0.0
        with torch.no_grad():
            for features, labels in strategy.experimental_distribute_dataset(dataset):
                hits = strategy.run(test_step, args=(features, labels))
                correct += float(strategy.reduce("SUM", hits, axis=0))
        return correct / len(test[1])

    def fit(
        self,
        train: tuple[torch.Tensor, torch.Tensor],
        test: tuple[torch.Tensor, torch.Tensor],
        until: int,
        checkpoint: Path | None,
    ) -> None:
        while self.epoch < until:
            loss, accuracy = self.train_epoch(train)
            line = (
                f"epoch {self.epoch}/{EPOCHS}: loss {loss:.4f}, accuracy {accuracy:.4f}, "
                f"test accuracy {self.test_accuracy(test):.4f}"
            )
            if checkpoint is not None:
                self.save(checkpoint)
                line += f" -> saved {checkpoint.name}"
            print(line)


def max_difference(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max(float((x.double() - y.double()).abs().max()) for x, y in pairs)


def main(checkpoint_dir: Path) -> None:
    train, test = make_data()
    checkpoint = checkpoint_dir / "checkpoint.pt"
    strategy = cs.CentralStorageStrategy(DEVICES)
    print(
        f"custom training loop: {strategy.num_replicas_in_sync} replicas on "
        f"{', '.join(strategy.compute_devices)}, variables on {strategy.parameter_device}, "
        f"global batch {GLOBAL_BATCH_SIZE}"
    )
    first = Trainer(strategy)
    first.fit(train, test, until=STOP_AFTER, checkpoint=checkpoint)
    print(f"(the job stops here, as if preempted, after epoch {first.epoch})")

    resumed = Trainer(cs.CentralStorageStrategy(DEVICES))  # a new process would do this
    resumed.restore(checkpoint)
    print(f"resumed from {checkpoint.name} at epoch {resumed.epoch}")
    resumed.fit(train, test, until=EPOCHS, checkpoint=checkpoint)

    batch_norm = resumed.model[1]
    steps = EPOCHS * -(-len(train[1]) // GLOBAL_BATCH_SIZE)
    print(
        f"BatchNorm num_batches_tracked: {int(batch_norm.num_batches_tracked)} "
        f"(one per step: {EPOCHS} epochs x {steps // EPOCHS} steps = {steps}); "
        f"running_mean averaged over the replicas, e.g. {batch_norm.running_mean[0]:.4f}"
    )

    uninterrupted = Trainer(cs.CentralStorageStrategy(DEVICES))
    uninterrupted.fit(train, test, until=EPOCHS, checkpoint=None)
    difference = max_difference(resumed.model, uninterrupted.model)
    print(f"resumed vs uninterrupted run: max |weight difference| = {difference:.1e}")

    plain = make_model()  # the checkpoint is plain PyTorch: no strategy needed to use it
    plain.load_state_dict(torch.load(checkpoint)["model"])
    plain.eval()
    with torch.no_grad():
        accuracy = float((plain(test[0]).argmax(1) == test[1]).float().mean())
    print(
        f"checkpoint loaded into a model built outside any strategy: test accuracy {accuracy:.4f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", type=Path, help="default: a temporary directory")
    args = parser.parse_args()
    if args.checkpoint_dir is not None:
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        main(args.checkpoint_dir)
    else:
        with tempfile.TemporaryDirectory() as directory:
            main(Path(directory))
