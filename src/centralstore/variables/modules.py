"""Module slots: the entries of modules that hold central variables, filled with one
replica's views while that replica runs on the calling thread.

Every replica of a run runs on the calling thread until a rendezvous needs threads (§5.2).
Such a replica finds its views in the modules themselves, as with
``torch.func.functional_call``: each ``module._parameters`` or ``module._buffers`` entry that
holds a central variable holds the replica's view while the replica runs. Module code then
computes on plain tensors, so no torch call pays for ``__torch_function__``, and
``torch.compile`` traces the views like any parameters: it guards on their shapes and dtypes,
not on which tensor they are, and compiles once for every replica. A replica that computes
where the parameters live leaves the slots of those it uses directly (``direct.py``) as they
are. The resolving class (``views.py``) still serves every other reference to a variable (a
``cs.Variable``, a list of parameters taken before ``run``) and the replicas on threads,
which cannot share a module.

A write through a filled slot is not seen call by call, so it is read off the view when the
slot is emptied: a moved version counter is a write, recorded as a delta, and a floating
buffer whose value changed without one was written by a kernel such as batch norm, an
assignment. Two kinds of slot stay with the resolving class, because their writes must be
seen as they happen: a variable with SUM aggregation (a delta and an assignment fold
differently) and a parameter whose view shares its storage and whose aggregation allows
writes (the write is first routed to a private copy). A shared parameter with aggregation
NONE may not be written by several replicas at all; such a write is found after the fact,
when it has already reached the parameter, and raises.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain, compress, repeat
from operator import attrgetter, call, eq, is_, is_not, ne, not_, setitem
from typing import Any, NamedTuple

import torch
from torch._C import DisableTorchFunctionSubclass

from .._aggregation import VariableAggregation
from .._autograd import no_grad
from .records import Central
from .views import ASSIGN, DELTA, ReplicaViews, View

# (module, attribute name, record, whether the module keeps a list of its weights besides
# its _parameters: an RNN's _flat_weights) of each place a module holds a central variable.
Slot = tuple[weakref.ref[torch.nn.Module], str, Central, bool]


def slots_of(records: dict[int, Central]) -> list[Slot]:
    """Every slot that can take a view: the variables' owners, except SUM-aggregated ones."""
    return [
        (ref, name, record, "_flat_weights_names" in vars(module))
        for record in records.values()
        if record.aggregation is not VariableAggregation.SUM
        for ref, name in record.owners
        if (module := ref()) is not None
    ]


def _plain(slot: Slot) -> bool:
    """A slot of a module parameter with aggregation NONE, neither ON_READ nor in an RNN's
    list of weights."""
    _, _, record, keeps_list = slot
    return (
        not record.is_buffer and record.aggregation is VariableAggregation.NONE
        and not record.on_read and not keeps_list
    )


def _buffer(slot: Slot) -> bool:
    """A slot of a module buffer that is not ON_READ."""
    return slot[2].is_buffer and not slot[2].on_read


class Slots:
    """Module slots (``items``) as a run's plan keeps them, with what filling them all at
    once needs. The slots of module parameters with aggregation NONE (no RNN weight list, no
    ON_READ variable, no parameter in two slots) are ``plain``; a replica fills, checks and
    empties those in passes in C instead of a loop over slots when its views of them all
    share their variables' storage (every replica of a worker process on the parameter
    device) or are all private copies of trained parameters (GPU replicas). The slots of
    buffers (not ON_READ, not in two slots) are ``buffers``, filled in passes in C too when
    the replica's copies of them all exist; the others (``rest``: tied or aggregated
    parameters, ON_READ variables) one by one."""

    __slots__ = ("buffers", "items", "keys", "names", "plain", "records", "refs", "rest")

    def __init__(self, items: list[Slot], part: bool = False) -> None:
        self.items = items
        self.refs = [ref for ref, _, _, _ in items]
        self.names = [name for _, name, _, _ in items]
        self.records = [record for _, _, record, _ in items]
        self.keys = [record.key for record in self.records]
        self.plain: Slots | None = None
        self.buffers: Slots | None = None
        self.rest: list[Slot] = []
        if part:  # the plain slots or the buffers' of a run's plan
            return
        tied = {key for key in self.keys if self.keys.count(key) > 1} if (
            len(set(self.keys)) < len(self.keys)
        ) else set()
        plain = [slot for slot in items if _plain(slot) and slot[2].key not in tied]
        buffers = [slot for slot in items if _buffer(slot) and slot[2].key not in tied]
        self.plain = Slots(plain, part=True) if plain else None
        self.buffers = Slots(buffers, part=True) if buffers else None
        if len(plain) + len(buffers) < len(items):
            chosen = {id(slot) for slot in plain + buffers}
            self.rest = [slot for slot in items if id(slot) not in chosen]

    def __len__(self) -> int:
        return len(self.items)


_parameters_of = attrgetter("_parameters")
_buffers_of = attrgetter("_buffers")
_tensor_of = attrgetter("tensor")
_private_of = attrgetter("private")
_epoch_of = attrgetter("epoch")
_shape_of = attrgetter("shape")
_dtype_of = attrgetter("dtype")
_requires_grad_of = attrgetter("requires_grad")
_version_of = attrgetter("_version")
_hooks_of = attrgetter("_backward_hooks")
_stamp_of = attrgetter("stamp")
_central_ptr_of = attrgetter("central_ptr")
_central_version_of = attrgetter("central_version")
_start_version_of = attrgetter("start_version")
_assigned_of = attrgetter("assigned")
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_is_floating_point = torch.Tensor.is_floating_point
_is_buffer_of = attrgetter("record.is_buffer")
_on_read_of = attrgetter("record.on_read")
_aggregation_of = attrgetter("record.aggregation")
_ref_of = attrgetter("record.ref")
_device_of = attrgetter("device")
_layout_of = attrgetter("layout")
_unseen_of = attrgetter("unseen")


def _is_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


def _set_all(objects: list[Any], name: str, values: Any) -> None:
    """``obj.name = value`` for each pair, the loop in C."""
    deque(map(setattr, objects, repeat(name), values), maxlen=0)


class _AllFilled(NamedTuple):
    """Slots filled all at once: their tables, names, central variables, views, the tensors
    put in them and those tensors' versions then."""

    tables: list[dict[str, Any]]
    names: list[str]
    centrals: list[torch.Tensor]
    views: list[View]
    tensors: list[torch.Tensor]
    versions: list[int]


# A filled slot: (its table, its name, the central variable, the view, the tensor put in
# the slot, that tensor's version then).
_Entry = tuple[dict[str, Any], str, torch.Tensor, View, torch.Tensor, int]


def _stale(views: list[View], centrals: list[torch.Tensor], records: list[Central]) -> list[bool]:
    """``ReplicaViews.validate``'s test of whether each private copy needs a refresh, in
    passes in C: its variable is trained (changed at every step, also through ``.data``),
    or its version counter or optimizer stamp moved, or the copy was written."""
    return list(map(any, zip(
        map(_requires_grad_of, centrals),
        map(ne, map(_version_of, centrals), map(_central_version_of, views)),
        map(ne, map(_stamp_of, records), map(_stamp_of, views)),
        map(_assigned_of, views),
        map(ne, map(_version_of, map(_tensor_of, views)), map(_start_version_of, views)),
    )))


class Filled:
    """The slots one replica has filled with its views, until ``empty``."""

    __slots__ = ("_all", "_entries", "_rnns", "views")

    def __init__(self, views: ReplicaViews, slots: Slots) -> None:
        self.views = views
        self._entries: list[_Entry] = []
        self._rnns: list[torch.nn.Module] = []  # modules that keep a list of their weights
        self._all: _AllFilled | None = None  # slots filled at once (``_fill_all``)
        try:
            with DisableTorchFunctionSubclass():  # the variables' own shapes and versions
                plain, buffers = slots.plain, slots.buffers
                if plain is not None and not self._fill_all(plain):
                    self._fill(plain.items)
                if buffers is not None and not self._fill_buffers(buffers):
                    self._fill(buffers.items)
                if slots.rest:
                    self._fill(slots.rest)
        except BaseException:
            self.empty(check=False)
            raise

    def _fill_all(self, slots: Slots) -> bool:
        """Fill every slot in passes in C, if each module still holds its parameter and this
        replica's view of each, not yet current this epoch, needs nothing from
        ``ReplicaViews.validate`` but the stamps that make it current and, for a private copy
        (a GPU replica's, of a variable elsewhere), a refresh where ``validate`` would make
        one (a trained variable, or a frozen one that changed): the views all share their
        parameters' storage, or are all private copies whose variables' storage stayed.
        False, with nothing changed, otherwise: ``_fill`` takes them one by one."""
        replica = self.views
        found = self._found(slots, _parameters_of)
        if found is None:
            return False
        tables, centrals, views = found
        private = list(map(_private_of, views))
        copies = any(private)
        if copies and not all(private):
            return False
        tensors = list(map(_tensor_of, views))
        pointers = list(map(_data_ptr, centrals))
        if (
            list(map(_epoch_of, views)).count(replica.epoch)
            or list(map(_shape_of, tensors)) != list(map(_shape_of, centrals))
            or list(map(_dtype_of, tensors)) != list(map(_dtype_of, centrals))
            or list(map(_requires_grad_of, tensors)) != list(map(_requires_grad_of, centrals))
            or not all(map(is_, map(_hooks_of, tensors), map(_hooks_of, centrals)))
        ):
            return False
        if copies:
            if list(map(_central_ptr_of, views)) != pointers:  # moved: pinned again
                return False
            # what ``validate`` does for each, and one event after all
            if all(map(_requires_grad_of, centrals)):  # trained: changed at every step
                with no_grad():
                    replica.refresh(tensors, centrals)
            elif any(stale := _stale(views, centrals, slots.records)):  # some frozen
                with no_grad():
                    replica.refresh(list(compress(tensors, stale)), list(compress(centrals, stale)))
        elif list(map(_data_ptr, tensors)) != pointers:  # storage replaced (.data = ...)
            return False
        _set_all(views, "central_ptr", pointers)
        versions = self._put(slots, tables, centrals, views, tensors, shared=not copies)
        self._all = _AllFilled(tables, slots.names, centrals, views, tensors, versions)
        return True

    def _fill_buffers(self, slots: Slots) -> bool:
        """Fill the slots of buffers in passes in C, if each module still holds its buffer
        and this replica has a private copy of each, not yet current this epoch, that
        ``ReplicaViews.validate`` would only refresh, where its buffer may have changed,
        and stamp: same shape, dtype and storage, no gradient. False, with nothing changed,
        otherwise: ``_fill`` takes them one by one."""
        replica = self.views
        found = self._found(slots, _buffers_of)
        if found is None:
            return False
        tables, centrals, views = found
        tensors = list(map(_tensor_of, views))
        if (
            list(map(_epoch_of, views)).count(replica.epoch)
            or list(map(_shape_of, tensors)) != list(map(_shape_of, centrals))
            or list(map(_dtype_of, tensors)) != list(map(_dtype_of, centrals))
            or any(map(_requires_grad_of, centrals)) or any(map(_requires_grad_of, tensors))
            or list(map(_central_ptr_of, views)) != list(map(_data_ptr, centrals))
        ):
            return False
        stale = _stale(views, centrals, slots.records)
        if any(stale):
            with no_grad():
                replica.refresh(list(compress(tensors, stale)), list(compress(centrals, stale)))
        started = self._put(slots, tables, centrals, views, tensors)
        self._entries.extend(zip(tables, slots.names, centrals, views, tensors, started))
        return True

    def _found(
        self, slots: Slots, table_of: Callable[[Any], dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[Any], list[Any]] | None:
        """The slots' tables, the central variables in them and this replica's views of
        those, if every module lives, still holds its variable in the slot and has a view
        made: ``_fill_all``'s and ``_fill_buffers``' first checks, in C. None otherwise."""
        try:
            tables: list[dict[str, Any]] = list(map(table_of, map(call, slots.refs)))
            centrals: list[Any] = list(map(dict.get, tables, slots.names))
            if list(map(id, centrals)) != slots.keys:  # a slot holds something else now
                return None
            views: list[Any] = list(map(self.views.views.__getitem__, slots.keys))
        except (AttributeError, TypeError, KeyError):  # a module died (its reference gives
            return None  # None), or its table is not a dict, or a view is not made yet
        return tables, centrals, views

    def _put(
        self, slots: Slots, tables: list[dict[str, Any]], centrals: list[torch.Tensor],
        views: list[View], tensors: list[torch.Tensor], shared: bool = False,
    ) -> list[int]:
        """Stamp the views current, as ``validate`` and ``_current`` do, and put them in the
        slots; returns their versions now, from which their writes are told. ``shared``:
        every view is its variable's ``detach()``, whose version counter it shares."""
        replica = self.views
        _set_all(views, "stamp", map(_stamp_of, slots.records))
        versions = list(map(_version_of, tensors))
        _set_all(views, "central_version", versions if shared else map(_version_of, centrals))
        _set_all(views, "start_version", versions)
        _set_all(views, "assigned", repeat(False))
        _set_all(views, "epoch", repeat(replica.epoch))
        replica.touched.extend(views)
        deque(map(setitem, tables, slots.names, tensors), maxlen=0)
        return versions

    def _fill(self, slots: list[Slot]) -> None:
        replica = self.views
        known, epoch, validate = replica.views, replica.epoch, replica.validate
        append = self._entries.append
        for module_ref, name, record, keeps_list in slots:
            module = module_ref()
            if module is None:
                continue
            table: dict[str, Any] = module._buffers if record.is_buffer else module._parameters
            central: Any = table.get(name)
            # The module may hold something else now. (A live tensor with the record's id is
            # its variable: the record of a dead one is gone, and with it the cached slots.)
            if id(central) != record.key:
                continue
            view = known.get(record.key)
            if view is None or view.epoch != epoch:
                view = validate(record, central, view)
            if not view.private and record.aggregation is not VariableAggregation.NONE:
                continue
            tensor = view.tensor
            table[name] = tensor
            append((table, name, central, view, tensor, tensor._version))
            if keeps_list and module not in self._rnns:
                self._rnns.append(module)
        for module in self._rnns:
            _refresh_weight_list(module)

    def empty(self, check: bool) -> None:
        """Give the slots back their central variables. ``check``: the replica finished its
        code or reached a sync point, so its writes through the slots are recorded (which
        raises for a variable that several replicas may not write); otherwise it failed, and
        the run is discarded."""
        filled, self._all = self._all, None
        if filled is not None:
            self._empty_all(filled, check)
        entries, self._entries = self._entries, []
        if entries:
            tables, names, centrals, _, tensors, _ = zip(*entries, strict=True)
            if all(map(is_, map(dict.get, tables, names), tensors)):
                deque(map(setitem, tables, names, centrals), maxlen=0)
            else:  # the replica's own code replaced some (``functional_call``): those stay
                for table, name, central, tensor in zip(tables, names, centrals, tensors):
                    if table.get(name) is tensor:
                        table[name] = central
        rnns, self._rnns = self._rnns, []
        for module in rnns:
            _refresh_weight_list(module)
        if check:
            self._record_writes(entries)

    def _empty_all(self, filled: _AllFilled, check: bool) -> None:
        """``empty`` of slots filled at once: shared views of parameters with aggregation
        NONE, which no replica may write, or private copies, whose writes are recorded."""
        tables, names, centrals, _, tensors, versions = filled
        if all(map(is_, map(dict.get, tables, names), tensors)):
            deque(map(setitem, tables, names, centrals), maxlen=0)
        else:  # the replica's own code replaced some (``functional_call``): those stay
            for table, name, central, tensor in zip(tables, names, centrals, tensors):
                if table.get(name) is tensor:
                    table[name] = central
        if check and list(map(_version_of, tensors)) != versions:
            if filled.views[0].private:  # private copies: writes recorded as ``_fill``'s are
                self._record_writes(list(zip(tables, names, centrals, filled.views, tensors,
                                             versions, strict=True)))
                return
            for name, central, tensor, version in zip(names, centrals, tensors, versions):
                if tensor._version != version:
                    raise_shared_write(self.views.replica, name, central)

    def _record_writes(self, entries: list[_Entry]) -> None:
        """Record the writes made through filled slots: a moved version counter is a delta
        (and raises where the view shares its variable); a floating buffer's private copy
        whose counter stayed may still have been written by a kernel (``record_unseen``)."""
        if not entries:
            return
        views = self.views
        _, _, _, candidates, tensors, versions = map(list, zip(*entries, strict=True))
        moved = list(map(ne, map(_version_of, tensors), versions))
        if any(moved):
            written = list(compress(candidates, moved))
            # ``note_write`` of a delta seen by its counter only refuses an aggregation NONE
            # of several replicas: when every copy written is private (the usual case, a
            # batch norm's counter) and none refuses, there is nothing to do (checked in C)
            if not (
                all(map(_private_of, written))
                and all(map(is_, compress(tensors, moved), map(_tensor_of, written)))
                and (views.num_replicas == 1
                     or VariableAggregation.NONE not in map(_aggregation_of, written))
            ):
                for _, name, central, view, tensor, _ in compress(entries, moved):
                    if not view.private or tensor is not view.tensor:
                        raise_shared_write(views.replica, name, central)
                    views.note_write(view, DELTA, moved=True)
            stayed = list(map(not_, moved))
            candidates = list(compress(candidates, stayed))
            tensors = list(compress(tensors, stayed))
        views.unseen.extend(compress(candidates, map(all, zip(
            map(_private_of, candidates), map(_is_buffer_of, candidates),
            map(_is_floating_point, tensors), map(not_, map(_assigned_of, candidates)),
        ))))


# A module slot whose entry the replica's own code replaced (``functional_call``): the slot's
# table, its name, and what the code put there.
Replaced = tuple[dict[str, Any], str, Any]


def keep_replaced(slots: Slots) -> list[Replaced]:
    """The entries of ``slots`` that replica code replaced (``torch.func.functional_call``,
    a pre-hook), each given back its central variable while the replica waits in a
    rendezvous, so that the next replica does not compute with them."""
    kept: list[Replaced] = []
    for module_ref, name, record, _ in slots.items:
        module = module_ref()
        if module is None:
            continue
        table: dict[str, Any] = module._buffers if record.is_buffer else module._parameters
        current = table.get(name)
        if current is not None and id(current) != record.key:
            central = record.ref()
            if central is not None:
                kept.append((table, name, current))
                table[name] = central
    return kept


def put_back(kept: list[Replaced]) -> None:
    """What ``keep_replaced`` took, back in the slots: the replica runs on."""
    for table, name, value in kept:
        table[name] = value


def record_unseen(replicas: list[ReplicaViews]) -> None:
    """Record the writes that kernels made to buffers in slots behind their version counter
    (batch norm's running statistics): each buffer a replica left unchanged by its counter is
    compared with its central value. This waits for the devices, so it happens once, before
    a sync point, rather than when each replica ends, which would wait for each GPU in turn
    and keep the next replica from starting its work meanwhile."""
    owners = list(chain.from_iterable(map(repeat, replicas, map(len, map(_unseen_of, replicas)))))
    unseen: list[View] = list(chain.from_iterable(map(_unseen_of, replicas)))
    for views in replicas:
        views.unseen.clear()
    centrals = list(map(call, map(_ref_of, unseen)))
    alive = list(map(is_not, centrals, repeat(None)))
    if not all(alive):
        owners, unseen = list(compress(owners, alive)), list(compress(unseen, alive))
        centrals = list(compress(centrals, alive))
    changed = _changed(list(map(_tensor_of, unseen)), centrals)
    written = list(compress(unseen, changed))
    if any(map(_on_read_of, written)) or (
        replicas[0].num_replicas > 1 and VariableAggregation.NONE in map(_aggregation_of, written)
    ):  # ``note_write`` raises, or counts the write on the copy's version
        for views, view in compress(zip(owners, unseen, strict=True), changed):
            if not view.assigned:
                views.note_write(view, ASSIGN, moved=False)
    else:  # what ``note_write`` does for each
        _set_all(written, "assigned", repeat(True))


def _refresh_weight_list(module: torch.nn.Module) -> None:
    """Make an RNN's list of weights (and the weak references by which it checks that list
    at each forward) hold what its slots hold now. ``RNNBase._init_flat_weights`` would also
    ``flatten_parameters()``, which on a GPU copies every weight into one buffer: at every
    run, and into the views."""
    names: list[str] = module._flat_weights_names  # type: ignore[assignment]
    weights = [getattr(module, name, None) for name in names]
    state = vars(module)
    state["_flat_weights"] = weights
    state["_flat_weight_refs"] = [None if w is None else weakref.ref(w) for w in weights]


def _changed(tensors: list[torch.Tensor], centrals: list[torch.Tensor]) -> list[bool]:
    """Whether each view differs from its central value: pair by pair where both are on the
    CPU (or one is sparse); otherwise all of a device's at once, their central values
    brought in one copy, with one wait for the device."""
    with DisableTorchFunctionSubclass():  # the central value, not the replica's view of it
        devices = list(map(_device_of, tensors))
        found: dict[torch.device, Iterator[bool]] = {}
        for device in dict.fromkeys(devices):
            chosen = list(map(eq, devices, repeat(device)))
            mine, theirs = list(compress(tensors, chosen)), list(compress(centrals, chosen))
            if device.type == "cpu" and all(map(_is_cpu, map(_device_of, theirs))):
                found[device] = map(not_, map(torch.equal, mine, theirs))
            elif not all(map(is_, map(_layout_of, mine + theirs), repeat(torch.strided))):
                found[device] = map(_differ, mine, theirs)  # sparse ones pair by pair
            else:
                found[device] = iter(_changed_on(device, mine, theirs))
        return list(map(next, map(found.__getitem__, devices)))


def _differ(tensor: torch.Tensor, central: torch.Tensor) -> bool:
    return bool((tensor != central.to(tensor.device)).any())


def _changed_on(
    device: torch.device, tensors: list[torch.Tensor], centrals: list[torch.Tensor]
) -> list[bool]:
    """``_changed`` of views on one device that is not the CPU, or of central values that
    are not there: one copy of the central values to the device, one wait for it."""
    numels = list(map(_numel, tensors))
    now = torch.cat(list(map(torch.reshape, tensors, repeat((-1,)))))
    before = torch.cat(list(map(torch.reshape, centrals, repeat((-1,)))))
    differs = (now != before.to(device, non_blocking=True)).cpu().long()  # the wait
    host = differs.device  # (not the default device, which replica code may have set)
    which = torch.repeat_interleave(
        torch.arange(len(tensors), device=host), torch.tensor(numels, device=host)
    )
    counts = torch.zeros(len(tensors), dtype=torch.int64, device=host).index_add_(
        0, which, differs
    )
    return list(map(bool, counts.tolist()))


def raise_shared_write(replica: int, name: str, central: torch.Tensor) -> None:
    """A write to the module parameter ``name`` that the replicas share, found after it."""
    raise ValueError(
        f"Replica {replica} wrote in place to the module parameter {name!r} of "
        f"shape {tuple(central.shape)}, which the replicas share and whose aggregation "
        "is NONE, so the replicas' writes cannot be combined; the write has already changed "
        "the parameter. Write it outside run (after optimizer.step()), or inside "
        "merge_call, or give it an aggregation: cs.set_aggregation(param, "
        "cs.VariableAggregation.MEAN) (or SUM, ONLY_FIRST_REPLICA) inside strategy.scope()."
    )
