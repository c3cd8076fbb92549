"""Sharded data-parallel training on PyTorch FSDP2 (actor.strategy=fsdp2).

Each decoder layer is one FSDP unit, the rest of the model (embeddings, final norm, LM head, tied
or not) is the root unit. Every rank stores 1/N of the parameters, gradients and AdamW state (N:
the data-parallel x sequence-parallel ranks, training/mesh.py `gradient_group`);
a unit's parameters are all-gathered for its forward / backward and its gradients
reduce-scattered after its backward. Under tensor parallelism (actor.tensor_parallel_size,
training/tensor_parallel.py) the model is first sliced over the tp ranks and FSDP2 shards each
slice over the other ranks: a 2-D mesh (shard x tp, training/mesh_groups.py `device_mesh`).

Three differences from the replicated engine (ddp.py), each for a reason:

* Gradients are *summed* over ranks, not averaged (FSDP2's default): the PPO actor's loss is
  already each micro-batch's share of the global mean (workers/actor.py), exactly as the DDP
  engine's flat all-reduce assumes. Reduce-scatter runs after every backward and accumulates into
  the sharded gradient, which is the same sum as one reduction per optimizer step.
* Every forward is a collective, but ranks plan their micro-batches on their own shard of the
  batch, so their counts differ. Before each training forward a rank announces itself with a
  one-element all-reduce; a rank that has run out of micro-batches answers from its next
  collective entry point (all_reduce / optimizer_step / logprobs / weights / save) and runs a
  zero-loss forward + backward for every announcement it hears (`_drain`). Zero loss gives zero
  gradients, so the result is the one DDP computes; the PPO actor needs no change.
* `named_weights()` gathers one full tensor at a time (DTensor.full_tensor) and every rank of
  the group must iterate it together (`gathers_weights`). A tensor bigger than `piece_bytes`
  (the weight-sync bucket) is gathered in dim-0 slices instead, each owner broadcasting its rows
  of the slice into one slice-sized buffer: `weight_stream()` yields those slices (the sender
  holds one slice, never the tensor; polyrl/weights/base.py `TensorSpec.pieces`), and
  `named_weights()` copies them into the whole tensor. The slices are planned from the shapes
  alone (`row_pieces`), so every rank runs the same gathers whichever of the two it iterates.

Loading: a model from `load_causal_lm(..., deferred=True)` arrives on the meta device and each
rank reads only its own shards from the safetensors files once they are laid out
(sharded_load.py), so no rank ever holds the whole model.

Checkpoints: `torch.distributed.checkpoint` for the sharded model + optimizer (any world size can
read them) and, like the DDP engine, a Hugging Face `policy/` directory gathered tensor by tensor
(checkpoint_io.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from polyrl.batch import MicroBatch, Ragged, RolloutBatch, scatter_rows
from polyrl.batch.packed import plan_layout
from polyrl.platform import Platform
from polyrl.training import batch_invariant, checkpoint_io, expert_parallel, lora, sharded_load, tensor_parallel
from polyrl.training.ddp import _OPS, DDPEngine
from polyrl.training.logprobs import response_logprobs
from polyrl.training.config import ActorConfig
from polyrl.training.mesh import ParallelDims
from polyrl.training.optim import build_optimizer
from polyrl.training.vlm import is_vlm_config
from polyrl.weights.base import TensorSpec, WeightStream, row_pieces

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_IDLE, _TRAIN, _NO_GRAD = 0, 1, 2
"""What a rank announces before a forward: nothing more to run, a forward followed by a
backward, or a forward without gradient (the drainers mirror whichever is heard)."""


class _HeadRoot(torch.nn.Module):
    """The root FSDP unit: FSDP2 all-gathers a unit's parameters in its forward hook, and the PPO
    forward (training/logprobs.py) calls the model's trunk and LM head rather than `model(...)`,
    so the hook must sit on a module whose forward is that whole computation (`head`: the
    engine's per-token output, log-probs or a critic's values, as in ddp.py)."""

    def __init__(self, lm: torch.nn.Module, head: Callable):
        super().__init__()
        self.lm, self.head = lm, head

    def forward(self, mb: MicroBatch, with_entropy: bool, entropy_grad: bool):
        logprob, entropy = self.head(self.lm, mb, with_entropy=with_entropy, entropy_grad=entropy_grad)
        # FSDP2 hooks the backward on the unit's outputs; an in-place op on a view would bypass it
        return logprob.clone(), None if entropy is None else entropy.clone()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: those of the model's `_no_split_modules` classes (what
    transformers itself never splits across devices), else the entries of `model.model.layers`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        trunk = getattr(getattr(model, "model", None), "layers", None)
        layers = list(trunk) if isinstance(trunk, torch.nn.ModuleList) else []
    if not layers:
        raise ValueError(f"actor.strategy=fsdp2: {type(model).__name__} has no decoder layers to shard "
                         "(no module of its _no_split_modules classes, no model.layers); "
                         "use actor.strategy=ddp for this model")
    return layers


class FSDP2Engine(DDPEngine):
    gathers_weights = True
    """Every rank of the group must iterate named_weights() together (each tensor is gathered)."""
    piece_bytes: int = 64 << 20
    """A parameter bigger than this is gathered in dim-0 slices of at most this many bytes
    (`weights.bucket_mb`'s default; PolicyWorker sets the run's bucket on every rank alike)."""

    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, platform: Platform,
                 device: torch.device, *, rank: int = 0, world_size: int = 1, group=None,
                 horizon: int | None = None, head: Callable = response_logprobs,
                 mesh: ParallelDims | None = None):
        layers = decoder_layers(model.get_base_model() if lora.is_lora(model) else model)  # a bad model fails cleanly
        # FSDP2 needs a mesh even on one rank (`_default_group`)
        group = group if group is not None else _default_group(platform, device, world_size)
        self._init_common(model, cfg, platform, device, rank=rank, world_size=world_size, group=group,
                          horizon=horizon, head=head, mesh=mesh)
        self._dummy: MicroBatch | None = None
        # parameters are sharded over every rank whose gradients are summed: data and sp axes
        self.shard_group = self.gradient_group
        # checkpoints: every rank holding a block, under tp the tp ranks too (over the shard group
        # alone each tp slice would write the same files as the others)
        self.state_group = group if self.mesh.tensor is not None else self.shard_group
        self.compiled = False  # actor.compile compiles ddp only (on is refused for fsdp2 in config)
        self._setup_packing()
        # gradient checkpointing (PolicyWorker enables it before this): transformers checkpoints
        # each layer non-reentrantly by default, under which FSDP2 re-gathers a layer for its
        # recomputation (tests/training/test_fsdp2.py trains with it)
        self.root = _HeadRoot(self.module, head)
        param_dtype = _DTYPES[cfg.param_dtype]
        # reduce in fp32 whatever the compute dtype; all-gather in the compute dtype
        mp = MixedPrecisionPolicy(param_dtype=None if self.compute_dtype == param_dtype else self.compute_dtype,
                                  reduce_dtype=torch.float32)
        if self.mesh.tensor is not None:  # tensor parallelism: slice, then shard each slice (2-D mesh)
            mesh2d = self._tensor_parallel(model, device)
            kwargs = dict(mesh=mesh2d["shard"], mp_policy=mp)
        else:
            kwargs = dict(mesh=DeviceMesh.from_group(self.shard_group, device.type), mp_policy=mp)
        if cfg.offload and device.type != "cpu":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        elif cfg.offload:
            logger.info("actor.offload=true on a CPU device: parameters and optimizer state are "
                        "already in host memory; nothing to offload")
        # expert parallelism: each rank's experts sharded on their own mesh first (expert_parallel.py).
        # A frozen model without experts (horizon None: a dense distillation teacher held on an
        # MoE policy's ranks, distill.placement=colocated) has none to split: its MLPs stay whole
        # in the plain sharding below; a trained one is refused there (expert_parallel.check_supported)
        frozen_dense = horizon is None and not expert_parallel.expert_modules(model)
        self.expert_mesh = (expert_parallel.shard_experts(self, model, device, kwargs)
                            if getattr(cfg, "expert_parallel_size", 1) > 1 and not frozen_dense else None)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(self.root, **kwargs)
        for m in self.root.modules():
            if isinstance(m, FSDPModule):
                # a plain sum (see the module docstring); force SUM because gloo has no PREMUL_SUM
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        if sharded_load.is_deferred(self.module):  # built on the meta device: read this rank's shards only
            # initial values (LoRA adapters, a value head) broadcast over every trainer rank: the
            # tp ranks too, which a parameter in no tp plan (an MoE's experts) is not sharded over
            sharded_load.materialize(self.module, torch.device("cpu") if "offload_policy" in kwargs else device,
                                     root=self.root, group=group)
        if horizon is not None:
            self.optimizer, self.scheduler = build_optimizer(model.parameters(), cfg, horizon)
        # the announce/drain handshake on a CPU group: no device sync per micro-batch
        self.control = self.shard_group if device.type == "cpu" else dist.new_group(
            dist.get_process_group_ranks(self.shard_group), backend=platform.cpu_dist_backend(),
            use_local_synchronization=True)

    def _tensor_parallel(self, model: torch.nn.Module, device: torch.device):
        """Slice the model over the tp ranks (training/tensor_parallel.py) and return the 2-D
        mesh fsdp2 shards the slices over; refuses what is not implemented with tp."""
        tp = self.mesh.dims.tp
        refused = {"a vision-language model": is_vlm_config(getattr(self.module, "config", None)),
                   "rollout.batch_invariant=true": batch_invariant.is_enabled(self.module),
                   "actor.offload=true": self.cfg.offload}
        for what, present in refused.items():
            if present:
                raise ValueError(f"actor.tensor_parallel_size={tp} with {what} is not implemented; "
                                 "set actor.tensor_parallel_size=1")
        # a deferred model is sliced on the meta device and each rank reads its block of every
        # tensor once FSDP2 has sharded the slices (sharded_load.py, as without tp)
        mesh2d = self.mesh.device_mesh(device.type)
        tensor_parallel.parallelize(self.module, mesh2d["tp"], tp=tp)
        return mesh2d

    # --- forward / backward -----------------------------------------------------------------------
    def forward(self, mb: MicroBatch, with_entropy: bool = False,
                entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._announce(_TRAIN if torch.is_grad_enabled() else _NO_GRAD)
        return self._forward(mb, with_entropy, entropy_grad)

    def _forward(self, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False):
        with self.platform.training_attention(self.compute_dtype):
            return self.root(mb, with_entropy, entropy_grad)

    def _announce(self, what: int) -> int:
        if self.gradient_ranks == 1:
            return what
        flag = torch.tensor([what], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return int(flag)

    def _drain(self) -> None:
        """Mirror the forwards other ranks still run (see the module docstring) until all are
        idle; called before every other collective."""
        while (heard := self._announce(_IDLE)) != _IDLE:
            self._dummy_pass(with_grad=heard == _TRAIN)

    def _dummy_pass(self, with_grad: bool) -> None:
        """One forward (+ backward) that moves the same collectives as a real micro-batch and adds
        exactly zero to every gradient."""
        if self._dummy is None:  # packed under sequence parallelism, like every micro-batch then
            self._dummy = self._collate(_one_token_batch(), [0], packed=self.sp is not None)
        mb = self._dummy
        with torch.set_grad_enabled(with_grad):
            logprob, _ = self._forward(mb)
            if with_grad:
                (logprob.sum() * 0.0).backward()

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> Ragged:
        """Log-probs of every response token of `batch`; ranks with fewer micro-batches run
        empty forwards so every rank moves the same all-gathers."""
        self._drain()
        was_training = self.root.training
        self.root.eval()
        out = Ragged.full_like(batch.response_ids, 0.0, torch.float32)
        packed, plan = plan_layout(batch.lengths, self.cfg.micro_batch_tokens, self.packing)
        count = self.all_reduce(torch.tensor([len(plan)], dtype=torch.int64), "max")
        for i in range(int(count)):
            if i < len(plan):
                mb = self._collate(batch, plan[i], packed)
                lp, _ = self._forward(mb)
                scatter_rows(out, mb, lp.float().cpu())
            else:
                self._dummy_pass(with_grad=False)
        self.root.train(was_training)
        self.root.reshard()  # the root unit stays gathered after a forward without backward
        return out

    # --- optimizer ---------------------------------------------------------------------------------
    def optimizer_step(self, loss_value: float):
        self._drain()
        return super().optimizer_step(loss_value)

    def _reduce_and_clip(self) -> float:
        """Gradients are already summed and sharded (reduce-scatter after each backward); the norm
        is over the DTensor shards, all-reduced into the global norm."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # as ddp.py: no backward anywhere this step still steps with zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        if self.mesh.tensor is not None or self.expert_mesh is not None:
            return _clip_across_meshes(grads, self.cfg.grad_clip)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, norm)
        return float(norm)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._drain()
        if self.world_size > 1:
            dist.all_reduce(tensor, op=_OPS[op], group=self.group)
        return tensor

    # --- weights and checkpoints --------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, gathered one parameter at a time (a collective: every rank iterates);
        nothing is kept, so a rank holds its shards plus the tensors its consumer keeps. LoRA:
        the merged weights under their Hugging Face names, each from its gathered W, A and B."""
        return iter(self.weight_stream())  # whole: sliced ones assembled

    def stream_specs(self) -> list[TensorSpec]:
        """`weight_specs()` as the stream announces them: a parameter bigger than `piece_bytes`
        with its row slices."""
        if self.lora:
            return [TensorSpec(n, tuple(shape), dtype) for n, shape, dtype in self.weight_specs()]
        return [TensorSpec(name, tuple(p.shape), p.dtype, self._pieces(p)) for name, p in self.model.named_parameters()]

    def weight_stream(self) -> WeightStream:
        """The weights as a transport sends them: whole tensors, and parameters bigger than
        `piece_bytes` as their row slices, each gathered when the consumer asks for it."""
        return WeightStream(self.stream_specs(), self._weight_items(), device=self.device)

    def _pieces(self, p: torch.Tensor) -> tuple[int, ...]:
        if expert_parallel.is_expert_param(p):  # one expert per piece, each from its owner
            return expert_parallel.expert_pieces(p)
        # FSDP2's dim-0 shards; on the (shard, tp) mesh over a tp slice of rows they are torch's
        # _StridedShard (rows of each tp slice), which is not a Shard
        if not (isinstance(p, DTensor) and getattr(p.placements[0], "dim", None) == 0):
            return ()
        return row_pieces(p.shape, p.dtype, self.piece_bytes)

    @torch.no_grad()
    def _weight_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._drain()
        self.root.reshard()
        if self.lora:
            yield from lora.merged_named_weights(self.model, full=_full)
            return
        for name, p in self.model.named_parameters():
            if expert_parallel.is_expert_param(p):
                yield from ((name, row) for row in expert_parallel.stream_pieces(p, self.device))
                continue
            pieces = self._pieces(p)
            if not pieces:
                yield name, _full(p)
                continue
            gather = _gather_rows if p.device_mesh.ndim == 1 else _gather_rows_2d
            for start, stop in zip(pieces, pieces[1:]):
                yield name, gather(p, start, stop, self.device)

    @torch.no_grad()
    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the adapter tensors alone, each gathered (every rank iterates, as named_weights)."""
        if not self.lora:
            raise ValueError("rollout.lora_mode=adapter needs a LoRA policy (model.lora_rank > 0)")
        self._drain()
        self.root.reshard()
        yield from lora.adapter_named_tensors(self.model, full=_full)

    def save(self, directory: Path) -> None:
        """`dcp/`: model and optimizer shards (torch.distributed.checkpoint); `engine.pt` (rank 0):
        schedule and counters; `policy/` (rank 0): the model in Hugging Face format."""
        self._drain()
        self.root.reshard()
        checkpoint_io.save_sharded(directory, self.model, self.optimizer, self.state_group)
        if self.rank == 0 and self.scheduler is not None:
            torch.save({"scheduler": self.scheduler.state_dict(), "nonfinite_in_a_row": self.nonfinite_in_a_row},
                       directory / checkpoint_io.ENGINE_FILE)
        # whole tensors (checkpoint_io writes tensors, not row slices), gathered one at a time
        whole = WeightStream(self.weight_specs(), self.named_weights(), device=self.device)
        tensors = checkpoint_io.model_tensors(self.module, whole)
        checkpoint_io.write_hf_dir(directory / "policy", tensors, self.module.config,
                                   getattr(self.module, "generation_config", None), write=self.rank == 0)
        if self.lora:  # the adapter alone in peft's format, for `polyrl export --adapter-only`
            adapter = {name: _full(p.detach()) for name, p in self.model.named_parameters() if p.requires_grad}
            if self.rank == 0:
                lora.save_adapter(self.model, directory / lora.ADAPTER_DIR, state_dict=adapter)

    def load(self, directory: Path) -> None:
        """From this engine's own checkpoints (any world size) or a DDP checkpoint."""
        if self.lora and not (directory / checkpoint_io.DCP_DIR).is_dir():
            raise ValueError(f"checkpoint {directory} has no {checkpoint_io.DCP_DIR}/ (written by actor.strategy=ddp): "
                             "a LoRA run resumes under actor.strategy=fsdp2 from an fsdp2 checkpoint only; "
                             "resume it with actor.strategy=ddp")
        self._drain()
        self.root.reshard()
        checkpoint_io.load_sharded(directory, self.model, self.optimizer, self.state_group)
        if self.scheduler is not None:
            saved = checkpoint_io.engine_state(directory)
            self.scheduler.load_state_dict(saved["scheduler"])
            self.nonfinite_in_a_row = saved["nonfinite_in_a_row"]

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (its shards)."""
        return checkpoint_io.local_state_bytes(self.model, self.optimizer)


def _clip_across_meshes(grads: list[torch.Tensor], max_norm: float | None) -> float:
    """The global gradient norm (and clipping to `max_norm`) under tensor parallelism, where the
    gradients lie on two meshes: the sliced parameters' on (shard, tp), the rest (norms, a MoE
    layer's experts) on shard alone, whole on every tp rank. Each mesh's norm is completed over
    its own ranks, so a tp-replicated gradient counts once."""
    by_mesh: dict = {}
    for g in grads:  # parameter order: the same on every rank, and so are the collectives
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = torch.zeros((), dtype=torch.float32)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares += norm.float().cpu() ** 2
    total = float(squares.sqrt())
    if max_norm is not None:
        coef = min(1.0, max_norm / (total + 1e-6))  # torch's clip_grads_with_norm_
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole: gathered from the shards (a collective) if it is a DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _gather_rows(p: DTensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Rows [start, stop) of a dim-0 sharded parameter, whole on every rank of its mesh: each
    rank owning some of them broadcasts them into one buffer of the slice's size (no gather of
    the full tensor, no padded all-gather buffer). FSDP2 shards dim 0 as torch.chunk does:
    rank k holds rows [k c, (k + 1) c) with c = ceil(rows / ranks)."""
    return _gather_local_rows(p.to_local(), tuple(p.shape), start, stop, p.device_mesh.get_group(), device)


def _gather_rows_2d(p: DTensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Rows [start, stop) of a parameter on the (shard, tp) mesh, whole on every rank, holding
    no more than the rows: FSDP2 shards each tp slice by rows over the shard group, so the ranks
    of one tp slice gather its part of the rows (`_gather_local_rows`), then the tp group puts
    the slices together: by rows (a slice of output features or vocabulary: its owner
    broadcasts them) or by columns (a row-wise layer's input features: all-gathered)."""
    mesh = p.device_mesh
    shard_group, tp_group = mesh.get_group("shard"), mesh.get_group("tp")
    tp_place = p.placements[1]
    local = p.to_local()
    ranks, me = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if not tp_place.is_shard():  # replicated over tp (Qwen3's per-head norms)
        return _gather_local_rows(local, tuple(p.shape), start, stop, shard_group, device)
    if tp_place.dim == 1:
        cols = p.shape[1] // ranks  # tensor_parallel.check_divisible: the sliced input widths divide
        mine = _gather_local_rows(local, (p.shape[0], cols, *p.shape[2:]), start, stop, shard_group, device)
        blocks = [torch.empty_like(mine) for _ in range(ranks)]
        dist.all_gather(blocks, mine.contiguous(), group=tp_group)
        return torch.cat(blocks, dim=1)
    if tp_place.dim != 0:
        raise RuntimeError(f"fsdp2: a tensor-parallel slice along dim {tp_place.dim} of {tuple(p.shape)}")
    chunk = -(-p.shape[0] // ranks)  # tp slices rows as torch.chunk does (a vocabulary need not divide)
    out = torch.empty((stop - start, *p.shape[1:]), dtype=p.dtype, device=device)
    for k in range(ranks):
        lo, hi = max(start, k * chunk), min(stop, (k + 1) * chunk)
        if lo >= hi:
            continue
        rows = out[lo - start: hi - start]
        if k == me:  # every rank of this slice's shard group has k == me: they gather together
            slice_rows = max(0, min(p.shape[0], (k + 1) * chunk) - k * chunk)
            rows.copy_(_gather_local_rows(local, (slice_rows, *p.shape[1:]), lo - k * chunk, hi - k * chunk,
                                          shard_group, device))
        dist.broadcast(rows, src=dist.get_global_rank(tp_group, k), group=tp_group)
    return out


def _gather_local_rows(local: torch.Tensor, shape: tuple[int, ...], start: int, stop: int, group,
                       device: torch.device) -> torch.Tensor:
    """Rows [start, stop) of a tensor of `shape` whose rows `group`'s ranks hold as torch.chunk
    gives them (`local`: this rank's), whole on every rank of `group`."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    if ranks == 1:
        return local[start:stop].detach()
    chunk = -(-shape[0] // ranks)
    mine = max(0, min(shape[0], (me + 1) * chunk) - me * chunk)
    if local.shape[0] != mine:
        raise RuntimeError(f"fsdp2: a shard of {local.shape[0]} rows where torch.chunk gives {mine} "
                           f"(rank {me} of {ranks}, {shape[0]} rows)")
    out = torch.empty((stop - start, *shape[1:]), dtype=local.dtype, device=device)
    for k in range(ranks):
        lo, hi = max(start, k * chunk), min(stop, (k + 1) * chunk)
        if lo >= hi:
            continue
        rows = out[lo - start: hi - start]
        if k == me:
            rows.copy_(local[lo - k * chunk: hi - k * chunk])
        dist.broadcast(rows, src=dist.get_global_rank(group, k), group=group)
    return out


def _one_token_batch() -> RolloutBatch:
    """A batch of one sample (one prompt token, one response token) that trains nothing: its
    loss mask zero."""
    one = Ragged.from_rows([[0]], torch.long)
    zero = torch.zeros(1, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=one, response_ids=one, loss_mask=one.with_values(torch.zeros(1)),
                         group=zero, stop_reason=zero, finished_with_eos=zero.bool(), weight_version=zero,
                         min_version=zero, max_version=zero, continuations=zero)
    return batch


def _default_group(platform: Platform, device: torch.device, world_size: int):
    """The world group; a one-rank run has none (PolicyWorker starts torch.distributed only for
    several ranks), and FSDP2 needs a mesh, so a private one-process world is started."""
    if not dist.is_initialized():
        if world_size != 1:
            raise RuntimeError(f"actor.world_size={world_size} but torch.distributed is not initialized")
        backend = platform.group_backend(device.type)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD
