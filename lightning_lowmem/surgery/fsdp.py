"""Surgery on a model that FSDP2 (``fully_shard``) has already sharded.

Lightning's ``ModelParallelStrategy`` has the user shard the model in ``configure_model``, before
the surgery can run (it runs after that hook, or at the first training forward). FSDP2 records, per
parameter, the module and attribute it sets that parameter on: the gathered parameter before a
forward, the shard after it. A replacement module holds the same ``Parameter`` objects under the
same names, so pointing those records at it is all FSDP2 needs: it then gathers and reshards the
parameters of the new module. Its state-dict hooks (which reshard a group before ``state_dict()``)
are re-registered on the modules the records name.

At the first training forward the surgery runs in a forward pre-hook registered after FSDP2's own
(which FSDP2 prepends): FSDP2 has then done its lazy init and gathered the root's parameters, and the
surgery's own forwards (probe, check, measurement) go through FSDP2's hooks like any forward.

These records are FSDP2's internals (``FSDPParam._module_info``, torch 2.4+; tested on the torch of
the test environment): an attribute renamed in a later torch fails loudly here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule


def _groups(module: FSDPModule) -> Iterator:
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):  # newer torch: a group per mesh; older: at most one
        yield from state._fsdp_param_groups
    elif state._fsdp_param_group is not None:
        yield state._fsdp_param_group


def param_groups(model: nn.Module) -> Iterator:
    """The FSDP2 parameter groups of the modules of ``model`` that ``fully_shard`` sharded."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield from _groups(module)


def owners(model: nn.Module) -> dict[str, FSDPModule]:
    """Each module's name -> the module ``fully_shard`` sharded that holds its parameters (the nearest one above it,
    or itself), for the modules of ``model`` that have one."""
    found: dict[str, FSDPModule] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            found[name] = module
        else:
            parent = name.rpartition(".")[0] if "." in name else ("" if name else None)
            if parent is not None and parent in found:
                found[name] = found[parent]
    return found


@contextmanager
def gathered(owner: FSDPModule | None) -> Iterator[None]:
    """The parameters ``owner`` shards, whole for the duration, as in its own forward (a check that runs a module
    outside its block's forward needs them so); sharded again after, unless they were whole already (the root's,
    during the forward a deferred conversion runs in)."""
    sharded = owner is not None and any(not group.is_unsharded for group in _groups(owner))
    if not sharded:
        yield
        return
    owner.unshard()
    try:
        yield
    finally:
        owner.reshard()


def param_records(model: nn.Module) -> dict[int, list[tuple]]:
    """``id(module)`` -> ``(group, record)`` for each FSDP2 record (``ParamModuleInfo``) of a parameter set on
    that module, with the parameter group holding it."""
    records: dict[int, list[tuple]] = {}
    for group in param_groups(model):
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            for module in {id(m): m for m in (info.module, *info.shared_modules)}.values():
                records.setdefault(id(module), []).append((group, info))
    return records


def repoint(info, old: nn.Module, new: nn.Module) -> dict[str, object]:
    """The new attribute values of FSDP2's record ``info`` once ``new`` replaces ``old``; raises unless
    ``new`` holds the record's parameters under the same names (then FSDP2 would shard a stale copy)."""
    changes: dict[str, object] = {}
    if info.module is old:
        changes["module"] = new
    if any(m is old for m in info.shared_modules):
        changes["shared_modules"] = [new if m is old else m for m in info.shared_modules]
    names = [info.param_name] * ("module" in changes) + [
        name for m, name in zip(info.shared_modules, info.shared_param_names) if m is old
    ]
    for name in names:
        if new._parameters.get(name) is not old._parameters.get(name):
            raise RuntimeError(
                f"surgery under FSDP2: {type(new).__name__} does not hold {type(old).__name__}'s parameter {name!r}"
            )
    return changes


def owns_hook(hook: object) -> bool:
    """A module hook FSDP2 registered (its gathering before a forward, its resharding after)."""
    return type(getattr(hook, "__self__", None)).__module__.startswith("torch.distributed.fsdp")


def refresh_state_dict_hooks(group) -> None:
    """Re-register FSDP2's state-dict hooks of ``group`` on the modules its records now name (if it had
    registered them: it does at its lazy init, on the modules of that moment)."""
    saves, loads = group._module_to_pre_save_state_dict_hook_handle, group._module_to_pre_load_state_dict_hook_handle
    if not saves:
        return
    for handle in (*saves.values(), *loads.values()):
        handle.remove()
    saves.clear()
    loads.clear()
    group._register_state_dict_hooks()
