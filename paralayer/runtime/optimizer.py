"""AdamW with the fastest implementation the parameters' device has, and its parameter groups.

On CUDA, ``fused=True`` runs the whole update of every parameter in a few kernels (torchtitan's
default); elsewhere ``foreach=True`` (one vectorised op per step over lists of tensors). The
foreach kernels refuse to mix DTensors with plain tensors (MoE blocks stay plain under TP), so
each kind gets its own parameter group.

Weight decay (``train.weight_decay_1d``): by default 1-D parameters (RMSNorm gains, biases) are
not decayed, as Megatron-LM (``no_weight_decay_cond``), nanoGPT (``dim() < 2``) and OLMo do:
decaying a norm gain pulls it towards 0, not towards its init of 1, and only shrinks the
activations the next matrix has to re-grow; matrices (embeddings included) are decayed.
``train.weight_decay_1d=true`` decays every parameter, as torchtitan does. A parameter's
dimension is its logical one: a DTensor's ``.dim()`` is the full tensor's (an FSDP2 or TP shard
of a norm gain is still 1-D, a row shard of a matrix still 2-D).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


def decays(p: torch.Tensor, decay_1d: bool) -> bool:
    """Whether AdamW's weight decay applies to ``p`` (its logical shape: DTensor ``dim()`` is global)."""
    return decay_1d or p.dim() >= 2


def param_groups(params: Sequence[nn.Parameter], weight_decay: float = 0.0, decay_1d: bool = True) -> list[dict]:
    """DTensor and plain parameters in separate groups (the foreach kernels do not mix them),
    each split into decayed and not decayed (``decay_1d=False``: 1-D parameters get
    ``weight_decay=0``); empty groups dropped, order: DTensor before plain, decayed before not."""
    from torch.distributed.tensor import DTensor

    groups = []
    for is_dt in (True, False):
        kind = [p for p in params if isinstance(p, DTensor) == is_dt]
        for decay in (True, False):
            g = [p for p in kind if decays(p, decay_1d) == decay]
            if g:
                groups.append({"params": g, "weight_decay": weight_decay if decay else 0.0})
    return groups


def adamw(params: Sequence[nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float,
          eps: float = 1e-8, fused: Optional[bool] = None, decay_1d: bool = True) -> torch.optim.AdamW:
    """AdamW, fused on CUDA (``fused=None``: decided by the first parameter's device);
    ``decay_1d=False``: no weight decay on 1-D parameters (:func:`param_groups`)."""
    if fused is None:
        fused = bool(params) and params[0].device.type == "cuda"
    impl = {"fused": True} if fused else {"foreach": True}
    return EagerAdamW(param_groups(params, weight_decay, decay_1d), lr=lr, betas=betas,
                             weight_decay=weight_decay, eps=eps, **impl)


def local_shards(params: list, *lists: list) -> tuple[list, ...]:
    """Each DTensor of ``params`` and of the lists beside it (grads, Adam's moments) as its local
    shard, where every tensor of a parameter shares its mesh and placements: AdamW is elementwise,
    so the update of the shards is the update of the DTensors, bit for bit, without DTensor's
    per-op sharding propagation (a cache miss for every new set of shapes: in a 4-rank run of a
    tiny model it was ~40% of a rank's CPU). Any other case (a Partial gradient, a plain tensor
    in the group) keeps the DTensors, whose dispatch redistributes as it must."""
    from torch.distributed.tensor import DTensor

    from paralayer.parallel.local_shard import local_tensor

    def same(p, t) -> bool:
        return (isinstance(t, DTensor) and t.device_mesh == p.device_mesh and t.placements == p.placements
                and t.shape == p.shape)

    for i, p in enumerate(params):
        if not isinstance(p, DTensor) or not all(same(p, lst[i]) for lst in lists if lst):
            return (params, *lists)
    return tuple([local_tensor(t) for t in lst] for lst in (params, *lists))


class EagerAdamW(torch.optim.AdamW):
    """torch.optim.AdamW without its torch.compile guards, so that a rank never imports torch._dynamo.

    In torch 2.13 ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` are
    ``@torch._disable_dynamo`` and ``step`` is ``@_use_grad_for_differentiable``; each imports
    torch._dynamo on its first call (~0.5 s CPU per rank, seconds of wall when ranks share cores:
    issue #36). Outside torch.compile those wrappers only turn grad off around the same body, so
    these methods call the undecorated bodies (``__wrapped__``) instead: the same update, bit for bit
    (tests/test_optimizer_eager.py). A compiled step would want the guards; paralayer compiles the
    blocks and the loss, never the optimizer step.
    """

    def add_param_group(self, param_group: dict) -> None:
        torch.optim.Optimizer.add_param_group.__wrapped__(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        torch.optim.Optimizer.zero_grad.__wrapped__(self, set_to_none)

    def state_dict(self) -> dict:
        return torch.optim.Optimizer.state_dict.__wrapped__(self)

    def load_state_dict(self, state_dict: dict) -> None:
        torch.optim.Optimizer.load_state_dict.__wrapped__(self, state_dict)

    def step(self, closure=None):
        """Adam.step's body with grad off (``differentiable`` is False here), calling the functional
        ``adam`` without its dynamo-disable wrapper."""
        self._accelerator_graph_capture_health_check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.set_grad_enabled(False):
            self._step_groups()
        return loss

    def _step_groups(self) -> None:
        for group in self.param_groups:
            self._adam_group(group)

    def _adam_group(self, group: dict) -> None:
        from torch.optim.adam import adam

        if group["differentiable"]:
            raise ValueError("EagerAdamW: differentiable=True is not supported")
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = local_shards(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
        beta1, beta2 = group["betas"]
        adam.__wrapped__(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                         amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                         lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                         maximize=group["maximize"], foreach=group["foreach"],
                         capturable=group["capturable"], differentiable=False, fused=group["fused"],
                         grad_scale=getattr(self, "grad_scale", None),
                         found_inf=getattr(self, "found_inf", None),
                         decoupled_weight_decay=group["decoupled_weight_decay"])


class MuonAdamW(EagerAdamW):
    """``train.optimizer=muon``: Muon on the blocks' matrices (paralayer/optim/muon.py), AdamW on the
    rest, one optimizer so that the LR schedule, the state dict and ZeRO-1's sharing see one object.
    The Muon group holds one state per parameter, ``momentum_buffer`` (shaped as its gradient, a
    DTensor where the gradient is one); its Newton-Schulz runs where ``exchange`` places it."""

    def __init__(self, muon_params: Sequence[nn.Parameter], adam_params: Sequence[nn.Parameter], *, lr: float,
                 betas: tuple[float, float], weight_decay: float, eps: float, decay_1d: bool, muon_lr: float,
                 momentum: float, nesterov: bool, ns_steps: int, adjust_lr: str, exchange, fused: bool = False):
        groups = param_groups(adam_params, weight_decay, decay_1d)
        if muon_params:
            groups.append({"params": list(muon_params), "lr": muon_lr, "weight_decay": weight_decay, "muon": True,
                           "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "adjust_lr": adjust_lr})
        impl = {"fused": True} if fused else {"foreach": True}
        super().__init__(groups, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, **impl)
        self.exchange = exchange

    def __setstate__(self, state: dict) -> None:
        """A loaded state dict (``load_state_dict`` ends here): Adam's fix-ups read every state's
        ``step``, which Muon's states have not; they run on the AdamW groups only."""
        groups = state["param_groups"]
        state["param_groups"] = [g for g in groups if not g.get("muon")]
        super().__setstate__(state)
        self.param_groups = groups

    def _step_groups(self) -> None:
        for group in self.param_groups:
            if not group.get("muon"):
                self._adam_group(group)
        self._muon_step([g for g in self.param_groups if g.get("muon")])

    def _muon_step(self, groups: list[dict]) -> None:
        from paralayer.optim.muon import adjusted_lr
        from paralayer.parallel.local_shard import local_tensor

        params, updates, owner_group = [], [], []
        for group in groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                g, buf = local_tensor(p.grad), local_tensor(state["momentum_buffer"])
                buf.lerp_(g, 1 - mu)
                params.append(p)
                updates.append(g.lerp(buf, mu) if group["nesterov"] else buf)
                owner_group.append(group)
        if not params:
            return
        for p, o, group in zip(params, self.exchange(params, updates), owner_group):
            w, lr = local_tensor(p.data), group["lr"]
            w.mul_(1 - lr * group["weight_decay"])
            w.add_(o, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))


def muon_maker(cfg, built, meshes):
    """``make(params)`` for ``train.optimizer=muon``: a :class:`MuonAdamW` over ``params`` (every
    parameter of the rank, or ZeRO-1's share of them, whose matrices are then all local). Owners
    are dealt over dp·cp (paralayer/optim/owners.py); experts under ep stay on their rank; the
    iteration runs in bf16 on CUDA (torch.optim.Muon's), fp32 elsewhere."""
    import torch.distributed as dist

    from paralayer.optim.muon import DataGroup, MatrixExchange, split_params

    t, mu = cfg.train, cfg.train.muon
    names = {id(p): n for c in built.chunks for n, p in c.named_parameters(remove_duplicate=False)}
    zero1 = int(cfg.parallel.zero) == 1 and meshes.size("dp_cp") > 1
    if meshes.size("dp_cp") > 1 and not zero1:
        m = meshes["dp_cp"]
        data = DataGroup(m.get_group(), m.get_local_rank(), m.size(), dist.get_process_group_ranks(m.get_group()),
                         {id(p) for p in built.expert_params})
    else:  # one data rank, or ZeRO-1: the share is owned whole by this rank
        data = DataGroup(None)
    dtype = torch.bfloat16 if built.device.type == "cuda" else torch.float32

    def make(params):
        muon, adam = split_params((names.get(id(p), ""), p) for p in params)
        return MuonAdamW(muon, adam, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, eps=t.adam_eps,
                         decay_1d=t.weight_decay_1d, muon_lr=mu.lr if mu.lr is not None else t.lr,
                         momentum=mu.momentum, nesterov=mu.nesterov, ns_steps=mu.ns_steps, adjust_lr=mu.adjust_lr,
                         exchange=MatrixExchange(data, mu.ns_steps, dtype), fused=built.device.type == "cuda")

    return make


def implementation(opt: torch.optim.Optimizer) -> str:
    """'fused', 'foreach' or 'for-loop': what the optimizer's first group runs."""
    g = opt.param_groups[0]
    return "fused" if g.get("fused") else "foreach" if g.get("foreach") else "for-loop"


#: Hyperparameters the recipe sets (train.weight_decay, weight_decay_1d, beta1, beta2, adam_eps), which a
#: loaded checkpoint must not override: DCP's set_optimizer_state_dict restores each group's values
#: from the checkpoint, so a resumed run would keep the old decay (e.g. on the norm gains) and ignore
#: a changed setting. The LR is the schedule's (restored with it), not listed here.
RECIPE_HYPERPARAMS = ("weight_decay", "betas", "eps")


def recipe_hyperparams(opt) -> list[dict]:
    """Per param group, the values the recipe gave (taken before a checkpoint is loaded)."""
    return [{k: g[k] for k in RECIPE_HYPERPARAMS if k in g} for g in getattr(opt, "inner", opt).param_groups]


def reapply_hyperparams(opt, saved: list[dict]) -> None:
    """Put the recipe's values back after a load (the groups are the same objects and order)."""
    groups = getattr(opt, "inner", opt).param_groups
    if len(groups) != len(saved):
        raise RuntimeError(f"optimizer has {len(groups)} param groups after the load, {len(saved)} before")
    for g, vals in zip(groups, saved):
        g.update(vals)
