"""Devices, precision and processes of a run: the run's one `accelerate.Accelerator`, owned here.

A run is one process (`clbench run ...`) or N data-parallel processes started by a launcher
(`accelerate launch --multi_gpu --num_processes N -m clbench.cli run ...`, or `torchrun`).
:class:`Distributed` is created once per run by the protocol and handed to methods in
`StageContext.dist`; it holds:

- the device of this process and the run's :class:`Precision`: with `mixed_precision` (the
  default) the weights, and so the optimizer's updates, stay fp32 and forwards run under bf16
  autocast (:meth:`Distributed.autocast`, entered by the protocol around the whole run and by
  each method around its stage); without it the weights are stored in bf16, which halves memory
  but rounds away updates below bf16's resolution (about 0.4% of a weight, far above a 1e-6
  learning rate's step). The Accelerator itself is always built with `mixed_precision="no"`:
  accelerate would bake into the prepared model an autocast read from its process-wide state at
  prepare time, which another Accelerator in the same process may have changed (to fp16 on
  CUDA), and bf16 needs no grad scaler;
- the prepared student (:meth:`Distributed.prepare_student`): DDP-wrapped when N > 1, so training
  forwards through it all-reduce gradients in backward; generation, teachers and evaluation use
  the plain model. Under an FSDP2 accelerate config (`sharding == "fsdp2"`) it is a sharded copy
  of the student, and the plain model a whole copy that :meth:`Distributed.sync_student` brings
  up to date after every optimizer step;
- rank, world size, barriers and the gather / broadcast / mean helpers the loop and the protocol
  use so that only the main process writes and logs global numbers.

With one process nothing is wrapped or communicated and, in fp32, every number is what it was
without accelerate (the tests compare a resumed run's matrix bit for bit).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from clbench.errors import UserError
from clbench.train.cpu import keep_freed_pages, process_allocator, use_cpu_share

if TYPE_CHECKING:
    from pathlib import Path

    from accelerate import Accelerator

T = TypeVar("T")

#: How long a process waits in a collective for the others. lm-eval probes run on the main
#: process alone while the rest wait, which can outlast torch's default of 30 minutes.
COLLECTIVE_TIMEOUT = timedelta(hours=6)


def launched_world_size() -> int:
    """Processes of this launch, as torchrun / `accelerate launch` announce it (1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE") or 1)


def launched_as_main() -> bool:
    """Whether this process is the main one of its launch (rank 0, or not launched at all)."""
    return int(os.environ.get("RANK") or 0) == 0


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Precision:
    """How the student's weights are stored and what its forwards compute in."""

    weights: torch.dtype   # parameters and therefore the optimizer's updates
    compute: torch.dtype   # forwards (autocast when it differs from `weights`)

    @property
    def mixed(self) -> bool:
        return self.weights != self.compute

    @property
    def label(self) -> str:
        """`fp32`, `bf16-mixed` (fp32 weights, bf16 autocast) or `bf16` (bf16 weights)."""
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            self.compute, str(self.compute).replace("torch.", ""))
        return f"{name}-mixed" if self.mixed else name


def resolve_precision(dtype: str | torch.dtype | None, mixed_precision: bool,
                      device: torch.device) -> Precision:
    """The run's precision from the model spec's `dtype` and `mixed_precision` on `device`."""
    from clbench.models import ModelLoadError, resolve_dtype

    compute = resolve_dtype(dtype, device)
    if compute == torch.float16:
        # fp16 needs loss scaling to train (its range underflows small gradients) and fp16
        # weights lose small updates; bf16 has fp32's range and needs neither.
        raise ModelLoadError("model.dtype float16 cannot be trained by clbench (fp16 needs "
                             "loss scaling); use bfloat16 where the device supports it, or "
                             "float32")
    weights = torch.float32 if mixed_precision else compute
    return Precision(weights=weights, compute=compute)


# ---------------------------------------------------------------------------------------------
# The prepared student
# ---------------------------------------------------------------------------------------------

class StudentForward(nn.Module):
    """The module that gets prepared (DDP-wrapped or sharded): the causal LM, with a forward
    that can stop at the final hidden states and hand them to a projection.

    The engine projects hidden states to the vocabulary a chunk at a time (bounded memory), so
    it cannot use the LM's own forward. DDP only all-reduces gradients of a backward that
    follows a forward through the wrapper, and FSDP2 gathers the output embedding only inside
    that forward, so the projection runs there: `forward(hidden_only=True, then=f)` returns
    `f(lm, hidden_states)`.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        # FSDP's transformer-based wrap policy shards the layer classes the LM names
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    def forward(self, *args: Any, hidden_only: bool = False,
                then: Callable[[nn.Module, torch.Tensor], Any] | None = None,
                **kwargs: Any) -> Any:
        if hidden_only:
            hidden = self.lm.get_decoder()(*args, **kwargs).last_hidden_state
            return then(self.lm, hidden) if then is not None else hidden
        return self.lm(*args, **kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The causal LM inside a prepared student (DDP and :class:`StudentForward` peeled off)."""
    while True:
        if isinstance(model, StudentForward):
            model = model.lm
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def is_prepared(model: nn.Module) -> bool:
    """Whether `model` is a prepared student (forward through it, project with :func:`unwrap`)."""
    return isinstance(model, (StudentForward, nn.parallel.DistributedDataParallel))


# ---------------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------------

def eval_share(n: int, rank: int, world: int) -> range:
    """Indices of this rank's contiguous share of `n` evaluation items (sizes differ by <= 1),
    so concatenating the shares in rank order gives the original order."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


# ---------------------------------------------------------------------------------------------
# The run's accelerator
# ---------------------------------------------------------------------------------------------

class Distributed:
    """The run's Accelerator, device and precision (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, device: torch.device,
                 precision: Precision) -> None:
        self.accelerator = accelerator
        self.device = device
        self.precision = precision
        #: "fsdp2" when the launch's accelerate config shards the student, else None (DDP or
        #: one process); see :func:`sharding_of`
        self.sharding = sharding_of(accelerator)

    @classmethod
    def create(cls, device: str | torch.device | None = "auto", dtype: str | None = "float32",
               mixed_precision: bool = True, trackers: Sequence[str] = (),
               tracker_dir: Path | None = None) -> Distributed:
        """The run's accelerator for the requested device and the model spec's precision
        (logging to `trackers`, accelerate's names, with files under `tracker_dir`).

        Launched with N > 1 processes, each uses the launcher's device for its rank (its own GPU,
        or the CPU); an explicit `cuda:N` is then refused.
        """
        from clbench.models import resolve_device

        world = launched_world_size()
        if world > 1:
            local = int(os.environ.get("LOCAL_RANK") or 0)
            wanted = str(device) if device is not None else "auto"
            if wanted.startswith("cuda:"):
                raise UserError(f"--device {wanted}: with {world} processes each uses its own "
                                "GPU; use --device auto (or cuda)")
            if wanted != "auto":
                # the errors one process gives: an invalid name, or `cuda` without CUDA
                kind = resolve_device(wanted).type
                if kind not in ("cpu", "cuda"):
                    raise UserError(f"--device {wanted}: several processes train on CUDA GPUs "
                                    "or on the CPU; use --device auto, cuda or cpu")
            use_cuda = wanted != "cpu" and torch.cuda.is_available()
            resolved = torch.device("cuda", local) if use_cuda else torch.device("cpu")
        else:
            resolved = resolve_device(device)
        precision = resolve_precision(dtype, mixed_precision, resolved)
        accelerator = _new_accelerator(cpu=resolved.type == "cpu", trackers=trackers,
                                       tracker_dir=tracker_dir)
        if world > 1:
            resolved = accelerator.device
            if resolved.type == "cpu":
                resolved = torch.device("cpu")  # accelerate says cpu:0; keep the plain name
            elif resolved.type == "cuda":
                torch.cuda.set_device(resolved)
        return cls(accelerator, resolved, precision)

    def take_cpu_share(self) -> None:
        """On the CPU, torch's thread count from the cores this process may use, shared with
        the other processes of its node (:mod:`clbench.train.cpu`; OMP_NUM_THREADS wins). A
        run calls it; a script that sets its own thread count does not. Under a preloaded
        jemalloc it also keeps freed pages between the run's releases (`keep_freed_pages`)."""
        if self.device.type == "cpu":
            use_cpu_share(int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
            keep_freed_pages()

    def load_model(self, spec: Any, seed: int = 0) -> tuple[Any, Any]:
        """`(model, tokenizer)` of a model spec on this process's device, its weights in this
        run's precision (fp32 under mixed precision): the model as `clbench run` trains and
        evaluates it, for the protocol and for scripts that must see the same. `seed` matters
        only for `tiny-*` models (their initialisation)."""
        from clbench.models import load_model

        return load_model(spec, device=self.device, dtype=self.precision.weights, seed=seed)

    @classmethod
    def for_model(cls, model: nn.Module, device: str | torch.device | None = None
                  ) -> Distributed:
        """One process that trains `model` as it is stored (no autocast): the default of a
        `StageContext` built without one (tests, scripts)."""
        from clbench.models import resolve_device

        dtype = next(model.parameters()).dtype
        resolved = resolve_device(device if device is not None else
                                  next(model.parameters()).device)
        accelerator = _new_accelerator(cpu=resolved.type == "cpu")
        return cls(accelerator, resolved, Precision(weights=dtype, compute=dtype))

    # -- processes -----------------------------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def process_index(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def wait(self) -> None:
        """Barrier: every process arrives before any goes on (a no-op with one process)."""
        if self.num_processes > 1:
            self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """The processes part: a barrier, then the process group destroyed (a no-op with one
        process). Left to the interpreter's exit, gloo's threads are torn down while a peer may
        still be talking to them, and a rank aborts ("terminate called without an active
        exception") after its work is done: a failed launch for a finished run."""
        if self.num_processes > 1:
            self.wait()
            self.accelerator.state.destroy_process_group()

    def gather(self, items: list[T]) -> list[T]:
        """Every rank's list, concatenated in rank order, on every rank."""
        if self.num_processes == 1:
            return list(items)
        from accelerate.utils import gather_object

        return list(gather_object(list(items)))

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (every rank gets the same answer)."""
        return any(self.gather([bool(flag)]))

    def broadcast(self, obj: T) -> T:
        """The main process's `obj` on every rank."""
        if self.num_processes == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def mean_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """Numeric fields averaged over the ranks that have them; others as on this rank.

        Ranks hold equally many prompts and rollouts, so means of per-rank means and fractions
        are the global ones; `reward_std` and the like are means of per-rank values."""
        if self.num_processes == 1:
            return record
        out = dict(record)
        sums: dict[str, list[float]] = {}
        for rec in self.gather([record]):
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    sums.setdefault(k, []).append(float(v))
        for k, values in sums.items():
            if k != "step":
                out[k] = sum(values) / len(values)
        return out

    def sum_counts(self, counts: dict[str, int],
                   shared: tuple[str, ...] = ("optimizer_steps",)) -> dict[str, int]:
        """Counters summed over the ranks, except the `shared` ones every rank counts alike
        (the ranks take their optimizer steps together)."""
        if self.num_processes == 1:
            return dict(counts)
        total: dict[str, int] = {}
        for rec in self.gather([counts]):
            for k, v in rec.items():
                total[k] = total.get(k, 0) + int(v)
        total.update({k: int(counts[k]) for k in shared if k in counts})
        return total

    # -- training ------------------------------------------------------------------------------

    def autocast(self) -> Any:
        """Autocast to the compute dtype (mixed precision); does nothing otherwise.

        The only autocast of a run (the Accelerator has none): the protocol enters it around the
        whole run (evaluation included) and methods around their stage, so training forwards,
        rollouts and teacher scoring all run under it. Built from this run's precision, not
        from accelerate's process-wide state, which a later Accelerator (another run in the
        same process) may have replaced."""
        if not self.precision.mixed:
            return nullcontext()
        # No weight cache: torch keeps the bf16 copy of each weight until the outermost autocast
        # exits, and this one spans optimizer steps, so cached copies would be stale (every
        # forward would see the weights as first cast). Each forward casts afresh instead.
        return torch.autocast(device_type=self.device.type, dtype=self.precision.compute,
                              cache_enabled=False)

    def prepare_student(self, model: nn.Module) -> nn.Module:
        """The module training forwards go through: :class:`StudentForward`, DDP-wrapped with
        several processes. Prepare once per run; the model stays where it is.

        Sharded (FSDP2), the prepared student is a sharded copy of `model`, and `model` stays
        a whole, plain copy of the student (the "mirror": generation, teachers, evaluation and
        checkpoints read it without collectives), brought up to date from the shards by
        :meth:`sync_student` after every optimizer step.
        """
        if self.sharding is None:
            return self.accelerator.prepare_model(StudentForward(model), device_placement=False)
        student = StudentForward(copy.deepcopy(model))
        # accelerate shards a model only together with an optimizer, whose parameters it then
        # swaps for the shards; each stage builds its own optimizer on the shards instead
        placeholder = torch.optim.SGD(student.parameters(), lr=0.0)
        prepared, _ = self.accelerator.prepare(student, placeholder)
        local = sum(_local(p).numel() for p in prepared.parameters())
        whole = sum(p.numel() for p in model.parameters())
        logging.getLogger(__name__).info(
            "student sharded (%s) over %d processes: this one holds %d of its %d parameters "
            "and their optimizer state, plus a whole copy for generation and evaluation",
            self.sharding, self.num_processes, local, whole)
        return prepared

    def sync_student(self, train_model: nn.Module, model: nn.Module) -> None:
        """After an optimizer step: the plain student `model` takes the trained weights of the
        sharded `train_model` (a collective: every process calls it). Nothing to do unsharded,
        where both are the same weights."""
        if self.sharding is None:
            return
        shards = dict(unwrap(train_model).named_parameters())
        with torch.no_grad():
            for name, param in unwrap(model).named_parameters():
                shard = shards[name]
                full = shard.full_tensor() if hasattr(shard, "full_tensor") else shard
                param.copy_(full)

    def optimizer_state(self, train_model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """A stage optimizer's state for a checkpoint. Sharded, the shards are gathered whole
        onto the main process (a collective: every process calls it; the others get an empty
        dict), keyed by parameter name."""
        if self.sharding is None:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            train_model, getattr(optimizer, "optimizer", optimizer),
            options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, train_model: nn.Module, optimizer: Any,
                             state: dict[str, Any]) -> None:
        """Put :meth:`optimizer_state`'s `state` (read by every process) back; sharded, each
        process keeps its shards of it."""
        if self.sharding is None:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(train_model, getattr(optimizer, "optimizer", optimizer),
                                 optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wrap a stage's optimizer for the accelerator.

        Built directly rather than through `accelerator.prepare`, which would keep every stage's
        optimizer (and its state, twice the model's size) referenced for the whole run."""
        from accelerate.optimizer import AcceleratedOptimizer

        return AcceleratedOptimizer(optimizer, device_placement=False)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def no_sync(self, train_model: nn.Module, sync: bool) -> Any:
        """Context of a micro-batch: gradients are all-reduced only when `sync` (the last one)."""
        if sync or self.num_processes == 1:
            return nullcontext()
        return self.accelerator.no_sync(train_model)

    def sum_int(self, value: int) -> int:
        """`value` summed over the ranks."""
        if self.num_processes == 1:
            return int(value)
        return sum(int(v) for v in self.gather([int(value)]))

    def describe(self) -> dict[str, Any]:
        """What results.json records under `model.resolved`."""
        described = {"precision": self.precision.label, "num_processes": self.num_processes}
        if self.sharding is not None:
            described["sharding"] = self.sharding
        if self.device.type == "cpu":
            described["cpu_threads"] = torch.get_num_threads()
            if (kind := process_allocator()) is not None:
                described["allocator"] = kind
        return described


def _local(param: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter: its shard when sharded (a DTensor), else itself."""
    return param.to_local() if hasattr(param, "to_local") else param


#: The first accelerate release that prepares FSDP2 (`fsdp_version: 2`).
FSDP2_ACCELERATE = "1.6.0"


def sharding_of(accelerator: Accelerator) -> str | None:
    """How the launch's accelerate config trains the student: "fsdp2" (sharded) or None
    (one process, or DDP). FSDP1 and DeepSpeed are refused with what to use instead.

    accelerate ignores an FSDP config when the processes run on the CPU (it trains DDP there);
    clbench honours it, so that the sharded path runs, and is tested, on CPUs over gloo too.
    """
    from accelerate.utils import DistributedType

    state = accelerator.state
    kind = state.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise UserError("DeepSpeed is not supported by clbench: its engine owns the optimizer "
                        "and the backward, which the methods drive themselves. Shard with "
                        "FSDP2 instead (an accelerate config with `distributed_type: FSDP` and "
                        "`fsdp_config: {fsdp_version: 2}`, as examples/accelerate/fsdp2.yaml)")
    wants_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if kind == DistributedType.FSDP or (wants_fsdp and kind == DistributedType.MULTI_CPU):
        import accelerate
        from packaging.version import Version

        if Version(accelerate.__version__) < Version(FSDP2_ACCELERATE):
            raise UserError(f"sharded training (FSDP2) needs accelerate >= {FSDP2_ACCELERATE}, "
                            f"this environment has {accelerate.__version__}: "
                            f"pip install 'accelerate>={FSDP2_ACCELERATE}'")
        version = (state.fsdp_plugin.fsdp_version if kind == DistributedType.FSDP
                   else int(os.environ.get("FSDP_VERSION", "1")))
        if version != 2:
            raise UserError(f"FSDP version {version} is not supported by clbench: set "
                            "`fsdp_version: 2` under `fsdp_config` in the accelerate config "
                            "(FSDP2, as examples/accelerate/fsdp2.yaml)")
        if kind == DistributedType.MULTI_CPU:
            from accelerate.utils import FullyShardedDataParallelPlugin

            state.fsdp_plugin = FullyShardedDataParallelPlugin()  # read from the launch's env
            state.distributed_type = DistributedType.FSDP
        return "fsdp2"
    return None


def _new_accelerator(cpu: bool, trackers: Sequence[str] = (),
                     tracker_dir: Path | None = None) -> Accelerator:
    """An Accelerator without mixed precision of its own: clbench autocasts from the run's
    :class:`Precision` (:meth:`Distributed.autocast`), see the module docstring."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    if launched_world_size() == 1:
        # accelerate keeps one state per process and refuses an Accelerator with other settings;
        # a single process may hold several runs (a sweep, the tests) with other precisions or
        # devices, and without a process group nothing else hangs on the old state.
        AcceleratorState._reset_state(reset_partial_state=True)
    extra: dict[str, Any] = {}
    if trackers:
        extra = {"log_with": list(trackers), "project_dir": str(tracker_dir)}
    return Accelerator(cpu=cpu, mixed_precision="no",
                       kwargs_handlers=[InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT)],
                       **extra)
