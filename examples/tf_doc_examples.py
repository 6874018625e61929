"""Every example of TensorFlow's documentation for ``CentralStorageStrategy``, ported.

The examples come from the API pages of ``tf.distribute.experimental.CentralStorageStrategy``
and of what it inherits from ``tf.distribute.Strategy``, plus ``ReplicaContext``,
``ValueContext`` and ``InputContext``, which those pages use. Each is ported by renaming
``tf.distribute`` to ``cs`` and ``tf.data.Dataset`` to ``cs.Dataset``, and:

* ``tf.constant``/``tf.identity`` become ``torch.tensor``/``torch.as_tensor``;
  ``@tf.function`` is dropped (PyTorch runs eagerly); ``tf.device`` becomes ``torch.device``.
* The documentation's devices (``"GPU:0", "GPU:1"``) become logical CPU devices when fewer GPUs
  are visible, so that every example runs on any machine with the same number of replicas.
* Where an example cannot run as written (an infinite dataset, an unbatched one), the change
  is made and said in the printed output.

Run: ``python examples/tf_doc_examples.py``
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

import centralstore as cs


def devices(n: int) -> list[str]:
    """The documentation's ``["GPU:0", ..., "GPU:n-1"]``, or logical CPU devices without them."""
    if torch.cuda.device_count() >= n:
        return [f"GPU:{i}" for i in range(n)]
    return [f"CPU:{i}" for i in range(n)]


def section(title: str) -> None:
    print(f"\n== {title}")


def show(label: str, value: object) -> None:
    text = repr(value)
    print(f"{label}:" + ("\n" + text if "\n" in text else f" {text}"))


def central_storage_class() -> None:
    section("CentralStorageStrategy (class docstring)")
    strategy = cs.CentralStorageStrategy()  # the defaults: every GPU, else the CPU
    show("strategy", strategy)
    # Create a dataset
    ds = cs.Dataset.range(5).batch(2)
    # Distribute that dataset
    dist_dataset = strategy.experimental_distribute_dataset(ds)

    with strategy.scope():

        def train_step(val: torch.Tensor) -> torch.Tensor:
            return val + 1

        # Iterate over the distributed dataset
        for x in dist_dataset:
            # process dataset elements
            show("train_step(x)", strategy.run(train_step, args=(x,)))


def central_storage_distribute_dataset() -> None:
    section("CentralStorageStrategy.experimental_distribute_dataset")
    strategy = cs.CentralStorageStrategy(devices(2))
    dataset = cs.Dataset.range(10).batch(2)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    for x in dist_dataset:
        show("x", x)  # PerReplica values [0], [1], then [2], [3], ...


def central_storage_reduce() -> None:
    section("CentralStorageStrategy.reduce")
    gpu_or_cpu = "GPU:0" if torch.cuda.is_available() else "CPU:1"
    strategy = cs.CentralStorageStrategy(
        compute_devices=["CPU:0", gpu_or_cpu], parameter_device="CPU:0"
    )
    ds = cs.Dataset.range(10)
    try:
        for _ in strategy.experimental_distribute_dataset(ds):
            pass
    except ValueError as error:
        print(f"as written (an unbatched dataset) -> ValueError: {error}")
    print("so batched by 8, which gives the documented result:")
    ds = cs.Dataset.range(8).batch(8)
    # Distribute that dataset
    dist_dataset = strategy.experimental_distribute_dataset(ds)

    with strategy.scope():

        def train_step(val: torch.Tensor) -> torch.Tensor:
            # pass through
            return val

        # Iterate over the distributed dataset
        for x in dist_dataset:
            result = strategy.run(train_step, args=(x,))

    per_replica = result
    result = strategy.reduce(cs.ReduceOp.SUM, result, axis=None).numpy()
    show("reduce(SUM, axis=None)", result)  # array([ 4,  6,  8, 10])
    show("reduce(SUM, per-replica result, axis=0)", strategy.reduce("SUM", per_replica, axis=0))
    result = strategy.reduce(cs.ReduceOp.SUM, torch.as_tensor(result), axis=0).numpy()
    show("reduce(SUM, the reduced result, axis=0) as the doc writes it", result)
    print(
        "  (the doc's comment says 28; a plain value counts as present on every replica, "
        "so TensorFlow and centralstore both give 2 x 28 = 56)"
    )


def scope() -> None:
    section("Strategy.scope")
    strategy = cs.CentralStorageStrategy(devices(2))
    # Variable created inside scope:
    with strategy.scope():
        central_variable = cs.Variable(1.0)
    show("variable created inside scope", central_variable)
    show("  central", strategy.extended.variable_created_in_scope(central_variable))
    show("  stored once", strategy.experimental_local_results(central_variable))
    # Variable created outside scope:
    regular_variable = cs.Variable(1.0)
    show("variable created outside scope", regular_variable)
    show("  central", strategy.extended.variable_created_in_scope(regular_variable))


def distribute_dataset() -> None:
    section("Strategy.experimental_distribute_dataset")
    global_batch_size = 2
    # Passing the devices is optional.
    strategy = cs.CentralStorageStrategy(compute_devices=devices(2))
    # Create a dataset
    dataset = cs.Dataset.range(4).batch(global_batch_size)
    # Distribute that dataset
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_fn(input: torch.Tensor) -> torch.Tensor:
        return input * 2

    result = []
    # Iterate over the distributed dataset
    for x in dist_dataset:
        # process dataset elements
        result.append(strategy.run(replica_fn, args=(x,)))
    print(result)


def distribute_datasets_from_function() -> None:
    section("Strategy.distribute_datasets_from_function (InputContext)")
    strategy = cs.CentralStorageStrategy(devices(2))
    global_batch_size = 4

    def dataset_fn(input_context: cs.InputContext) -> cs.Dataset:
        print(f"dataset_fn received {input_context}")
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        d = cs.Dataset.from_tensors([[1.0]]).repeat().batch(batch_size)
        return d.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    def replica_fn(batch: torch.Tensor) -> torch.Tensor:
        return batch.sum()

    inputs = strategy.distribute_datasets_from_function(dataset_fn)
    print("the dataset repeats forever; the first 2 steps:")
    for batch in itertools.islice(inputs, 2):
        replica_results = strategy.run(replica_fn, args=(batch,))
        show("replica_results", replica_results)
    old_name = strategy.experimental_distribute_datasets_from_function(dataset_fn)
    show("experimental_ name, first step", next(iter(old_name)))
    try:
        cs.InputContext(num_replicas_in_sync=2).get_per_replica_batch_size(5)
    except ValueError as error:
        print(f"get_per_replica_batch_size(5) with 2 replicas -> ValueError: {error}")


def run() -> None:
    section("Strategy.run")
    # 1. Constant tensor input.
    strategy = cs.CentralStorageStrategy(devices(2))
    tensor_input = torch.tensor(3.0)

    def replica_fn(input: torch.Tensor) -> torch.Tensor:
        return input * 2.0

    result = strategy.run(replica_fn, args=(tensor_input,))
    show("1. constant input", result)

    # 2. DistributedValues input.
    def run() -> object:
        def value_fn(value_context: cs.ValueContext) -> int:
            return value_context.num_replicas_in_sync

        distributed_values = strategy.experimental_distribute_values_from_function(value_fn)

        def replica_fn2(input: int) -> int:
            return input * 2

        return strategy.run(replica_fn2, args=(distributed_values,))

    show("2. distributed values input (every replica returned the same 4)", run())

    # 3. Use ReplicaContext to allreduce values.
    def run3() -> object:
        def value_fn(value_context: cs.ValueContext) -> torch.Tensor:
            return torch.tensor(value_context.replica_id_in_sync_group)

        distributed_values = strategy.experimental_distribute_values_from_function(value_fn)

        def replica_fn(input: torch.Tensor) -> torch.Tensor:
            return cs.get_replica_context().all_reduce("sum", input)

        return strategy.run(replica_fn, args=(distributed_values,))

    show("3. all_reduce('sum', replica id)", run3())
    show("experimental_run_v2 (the older name)", strategy.experimental_run_v2(replica_fn, (1.5,)))


def reduce() -> None:
    section("Strategy.reduce")
    strategy = cs.CentralStorageStrategy(devices(2))

    def step_fn() -> torch.Tensor:
        i = cs.get_replica_context().replica_id_in_sync_group
        return torch.as_tensor(i)

    per_replica_result = strategy.run(step_fn)
    total = strategy.reduce("SUM", per_replica_result, axis=None)
    show("total", total)
    # Check devices on which per replica result is:
    show("replica 0 result on", strategy.experimental_local_results(per_replica_result)[0].device)
    show("replica 1 result on", strategy.experimental_local_results(per_replica_result)[1].device)
    # Check device on which reduced result is:
    show("total on", total.device)

    print("_What should axis be?_ A global batch of 8 examples over 2 replicas:")
    per_example = strategy.experimental_distribute_dataset(cs.Dataset.range(8).batch(8))
    per_replica_result = strategy.run(lambda x: x, args=(next(iter(per_example)),))
    show(
        "  reduce('sum', axis=None)  [0+4, 1+5, 2+6, 3+7]",
        strategy.reduce("sum", per_replica_result, axis=None),
    )
    show(
        "  reduce('sum', axis=0)     0+1+...+7", strategy.reduce("sum", per_replica_result, axis=0)
    )
    partial = strategy.experimental_distribute_dataset(cs.Dataset.range(6).batch(6))
    last = strategy.run(lambda x: x, args=(next(iter(partial)),))
    show("  a last partial batch of 6, split", strategy.experimental_local_results(last))
    show("  reduce(MEAN, axis=0) (denominator 6)", strategy.reduce(cs.ReduceOp.MEAN, last, axis=0))


def local_results() -> None:
    section("Strategy.experimental_local_results")
    strategy = cs.CentralStorageStrategy(devices(2))
    result = strategy.run(lambda: cs.get_replica_context().replica_id_in_sync_group * 10)
    show("of a PerReplica", strategy.experimental_local_results(result))
    show("of a plain value", strategy.experimental_local_results(torch.tensor(7)))


def distribute_values_from_function() -> None:
    section("Strategy.experimental_distribute_values_from_function")
    # 1. Return constant value per replica:
    strategy = cs.CentralStorageStrategy(devices(2))

    def value_fn(ctx: cs.ValueContext) -> object:
        return torch.tensor(1.0)

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)
    local_result = strategy.experimental_local_results(distributed_values)
    show("1. constant per replica", local_result)

    # 2. Distribute values in array based on replica_id:
    array_value = np.array([3.0, 2.0, 1.0])

    def value_fn2(ctx: cs.ValueContext) -> object:
        return array_value[ctx.replica_id_in_sync_group]

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn2)
    local_result = strategy.experimental_local_results(distributed_values)
    show("2. array[replica_id]", local_result)

    # 3. Specify values using num_replicas_in_sync:
    def value_fn3(ctx: cs.ValueContext) -> object:
        return ctx.num_replicas_in_sync

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn3)
    local_result = strategy.experimental_local_results(distributed_values)
    show("3. num_replicas_in_sync", local_result)

    # 4. Place values on devices and distribute:
    worker_devices = strategy.extended.worker_devices
    multiple_values = []
    for i in range(strategy.num_replicas_in_sync):
        with torch.device(worker_devices[i]):
            multiple_values.append(torch.tensor(1.0))

    def value_fn4(ctx: cs.ValueContext) -> object:
        return multiple_values[ctx.replica_id_in_sync_group]

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn4)
    show("4. placed on the worker devices", distributed_values)


def value_context() -> None:
    section("ValueContext")

    # 1. Directly constructed.
    def value_fn(context: cs.ValueContext) -> float:
        return context.replica_id_in_sync_group / context.num_replicas_in_sync

    context = cs.ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    per_replica_value = value_fn(context)
    show("1. directly constructed", per_replica_value)

    # 2. Passed in by experimental_distribute_values_from_function.
    strategy = cs.CentralStorageStrategy(devices(2))

    def value_fn2(value_context: cs.ValueContext) -> int:
        return value_context.num_replicas_in_sync

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn2)
    local_result = strategy.experimental_local_results(distributed_values)
    show("2. passed in", local_result)


def gather() -> None:
    section("Strategy.gather")
    strategy = cs.CentralStorageStrategy(devices(2))
    # A DistributedValues with component tensor of shape (2, 1) on each replica
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda _: torch.as_tensor(torch.tensor([[1], [2]]))
    )

    def run() -> torch.Tensor:
        return strategy.gather(distributed_values, axis=0)

    show("gather of (2, 1) x 2, axis=0", run())

    # Consider the following example for more combinations:
    strategy = cs.CentralStorageStrategy(devices(4))
    single_tensor = torch.reshape(torch.arange(6), shape=(1, 2, 3))
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda _: torch.as_tensor(single_tensor)
    )

    def run_axis(axis: int) -> torch.Tensor:
        return strategy.gather(distributed_values, axis=axis)

    for axis in (0, 1, 2):
        show(
            f"gather of (1, 2, 3) x 4, axis={axis}, shape {tuple(run_axis(axis).shape)}",
            run_axis(axis),
        )


def replica_context() -> None:
    section("ReplicaContext")
    strategy = cs.CentralStorageStrategy(devices(2))

    def func() -> int:
        replica_context = cs.get_replica_context()
        return replica_context.replica_id_in_sync_group

    show("replica_id_in_sync_group", strategy.run(func))

    section("ReplicaContext.all_reduce")

    def step_fn() -> torch.Tensor:
        ctx = cs.get_replica_context()
        value = torch.as_tensor(1.0)
        return ctx.all_reduce(cs.ReduceOp.SUM, value)

    show("all_reduce(SUM, 1.)", strategy.experimental_local_results(strategy.run(step_fn)))

    def step_fn2() -> list[torch.Tensor]:
        ctx = cs.get_replica_context()
        value1 = torch.as_tensor(1.0)
        value2 = torch.as_tensor(2.0)
        return ctx.all_reduce(cs.ReduceOp.SUM, [value1, value2])

    show("all_reduce(SUM, [1., 2.])", strategy.experimental_local_results(strategy.run(step_fn2)))

    def gradient_fn() -> torch.Tensor:
        ctx = cs.get_replica_context()
        value = torch.tensor(1.0, requires_grad=True)
        y = ctx.all_reduce(cs.ReduceOp.SUM, value)
        (gradient,) = torch.autograd.grad(y, value)
        return gradient

    show("the gradient of an all-sum is an all-sum", strategy.run(gradient_fn))

    section("ReplicaContext.all_gather")

    def gather_value() -> torch.Tensor:
        ctx = cs.get_replica_context()
        local_value = torch.tensor([1, 2, 3])
        return ctx.all_gather(local_value, axis=0)

    result = strategy.run(gather_value)
    show("all_gather([1, 2, 3], axis=0)", result)
    show("local results", strategy.experimental_local_results(result))

    def gather_nest() -> list[torch.Tensor]:
        ctx = cs.get_replica_context()
        value_1 = torch.tensor([1, 2, 3])
        value_2 = torch.tensor([[1, 2], [3, 4]])
        # all_gather a nest of values
        return ctx.all_gather([value_1, value_2], axis=0)

    result = strategy.run(gather_nest)
    show("all_gather of a nest", result)

    def gather_shapes() -> dict[str, torch.Tensor]:
        ctx = cs.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            value = {"a": torch.tensor([0]), "b": torch.tensor([[0, 1]])}
        else:
            value = {"a": torch.tensor([1]), "b": torch.tensor([[2, 3], [4, 5]])}
        return ctx.all_gather(value, axis=0)

    result = strategy.experimental_local_results(strategy.run(gather_shapes))[0]
    show("different shapes along axis 0 (the doc prints 'a' as [1, 2], a typo)", result)

    section("ReplicaContext.merge_call")

    def merge_fn(strategy: cs.Strategy, value: cs.PerReplica[torch.Tensor]) -> torch.Tensor:
        # This code runs once, in cross-replica context, with the replicas' values regrouped.
        print(f"  merge_fn runs once; in cross-replica context: {cs.in_cross_replica_context()}")
        return strategy.reduce(cs.ReduceOp.SUM, value, axis=None)

    def replica_fn() -> torch.Tensor:
        ctx = cs.get_replica_context()
        value = torch.as_tensor(float(ctx.replica_id_in_sync_group + 1))
        return ctx.merge_call(merge_fn, args=(value,))

    show("merge_call(reduce SUM) gives every replica", strategy.run(replica_fn))


def custom_training_loop() -> None:
    section("Strategy (class docstring): a custom training loop")
    my_strategy = cs.CentralStorageStrategy(devices(2))
    dataset = cs.Dataset.range(12).batch(4)
    epochs = 2
    with my_strategy.scope():

        def distribute_train_epoch(dataset: object) -> torch.Tensor:
            def replica_fn(input: torch.Tensor) -> torch.Tensor:
                # process input and return result
                return input.sum()

            total_result = torch.tensor(0)
            for x in dataset:
                per_replica_result = my_strategy.run(replica_fn, args=(x,))
                total_result += my_strategy.reduce(cs.ReduceOp.SUM, per_replica_result, axis=None)
            return total_result

        dist_dataset = my_strategy.experimental_distribute_dataset(dataset)
        for epoch in range(epochs):
            train_result = distribute_train_epoch(dist_dataset)
            show(f"epoch {epoch}: sum of 0..11", train_result)


def make_numpy_dataset() -> None:
    section("Strategy.experimental_make_numpy_dataset (TF 1 page)")
    strategy = cs.CentralStorageStrategy(devices(2))
    numpy_input = np.ones([10], dtype=np.float32)
    dataset = strategy.experimental_make_numpy_dataset(numpy_input)
    print("batched by 4 before distributing (an element must be a global batch):")
    dist_dataset = strategy.experimental_distribute_dataset(dataset.batch(4))
    for x in dist_dataset:
        show("x", x)


def main() -> None:
    print(f"centralstore {cs.__version__}: TensorFlow's documentation examples, ported")
    print(f"devices used for the documentation's 'GPU:0', 'GPU:1': {devices(2)}")
    central_storage_class()
    central_storage_distribute_dataset()
    central_storage_reduce()
    scope()
    distribute_dataset()
    distribute_datasets_from_function()
    run()
    reduce()
    local_results()
    distribute_values_from_function()
    value_context()
    gather()
    replica_context()
    custom_training_loop()
    make_numpy_dataset()
    print("\nall examples ran")


if __name__ == "__main__":
    main()
