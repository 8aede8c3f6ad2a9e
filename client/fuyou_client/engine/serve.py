"""A dedicated optimizer host, the optimizer ranks' side: ``serve_optimizer(model,
optimizer, optimizer_ranks=[...])`` (parallel/remote.py is the workers' side; parallel/link.py the layout
and the commands).

An optimizer rank has no GPU and runs no forward or backward. It takes part in attach as
the workers do (the same agreements on the model, the job's name, each rank's errors),
builds an ordinary single-process engine of the layer groups it owns against its own
fuyoud (every master weight and moment of them on its SSD array, the compute-dtype
weights in shared memory), and then serves its link until the workers close: each
command (link.py) is one of

* reduce: the workers' shards of the sum of their gradients (they reduce-scattered them
  among themselves) gathered into the group's gradient buffer, divided by the number of
  workers; with "step", the step submitted to the daemon at once;
* step: the step, with the workers' clipping coefficient;
* norm: its share of the squared norm of the mean gradient;
* weights: the step's outcome and, stepped, the new weights, one shard to each worker (a
  scatter: the workers all-gather them);
* fetch: an offloaded block's weights, the same way, ahead of the workers' forward or
  backward (they keep none between uses);
* hyper: the workers' learning rates and hyperparameters, for the steps that follow;
* checkpoint: its groups' state and the workers' client state, written under the
  directory on this host (``optimizer-<k>/``, beside ``optimizer-host.json``);
* masters: a group's fp32 master weights (export);
* close: the workers are done.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fuyou_client.connection import connect
from fuyou_client.device import resolve
from fuyou_client.engine.build import build
from fuyou_client.engine.options import AttachOptions, check_optimizer_ranks
from fuyou_client.errors import NonFinite
from fuyou_client.gradients import guard
from fuyou_client.groups.masters import read_masters
from fuyou_client.model import split
from fuyou_client.model.blocks import flat_parts
from fuyou_client.model import resolve as resolve_groups
from fuyou_client.optim import AdamW
from fuyou_client.parallel import link as wire
from fuyou_client.parallel import world as distributed
from fuyou_client.parallel.link import Layout, Link
from fuyou_client.parallel.remote import agree_on_job
from fuyou_client.parallel.seam import SingleProcess
from fuyou_client.parallel.world import CollectiveError, World

log = logging.getLogger("fuyou_client.serve")

LAYOUT_FILE = "optimizer-host.json"
ARENA = 1 << 20  # (its engine's activation arena: an optimizer rank runs no forward)
LAYOUT_FORMAT = 1


def checkpoint_part(directory, index: int) -> Path:
    """Where optimizer rank ``index`` writes its share of a checkpoint."""
    return Path(directory) / f"optimizer-{index:05d}"


@dataclass
class Served:
    """What ``serve_optimizer`` did: the commands it served by kind, and the steps."""
    commands: dict
    steps: int


def serve_optimizer(model: torch.nn.Module, optimizer=None, *, optimizer_ranks, socket=None, namespace=None,
                    resume=None, param_groups=None, no_decay=None, blocks=None, process_group=None) -> Served:
    """Serve the workers of an optimizer-host job until they close: this rank (one of
    ``optimizer_ranks`` of ``process_group``, default torch.distributed's) owns a share
    of the layer groups, keeps their optimizer state and master weights in its fuyoud
    (``socket``), steps them with the workers' reduced gradients and sends the new
    weights back. ``model`` is the workers' model, built on the CPU or on the meta
    device (the first worker's weights are the initial ones; only the owned groups
    take memory here); ``optimizer``, ``param_groups``, ``no_decay`` and ``blocks`` as
    the workers' attach has them (checked: they must agree). ``resume``: a directory
    ``engine.save_checkpoint`` wrote (this rank reads its share, on this host).

    Every rank of the job is in it: the workers call ``attach(model, optimizer,
    optimizer_ranks=...)`` at the same time (docs/guide/optimizer-host.md)."""
    check_optimizer_ranks(optimizer_ranks)
    opts = AttachOptions(socket=socket, namespace=namespace, resume=resume, param_groups=param_groups,
                         no_decay=no_decay, blocks=blocks, process_group=process_group, offload=False, device="cpu",
                         optimizer_ranks=optimizer_ranks, host_budget=ARENA)
    world = World.of(process_group)
    layout = Layout.of(world, optimizer_ranks)
    world = layout.world
    error, prepared = None, None
    try:
        if not layout.is_optimizer:
            raise ValueError(f"rank {world.rank} called serve_optimizer but is not one of optimizer_ranks "
                             f"{list(optimizer_ranks)}: a worker calls attach(model, optimizer, optimizer_ranks=...)")
        torch_groups = resolve_groups(model, optimizer or AdamW(), param_groups, no_decay)
        prepared = torch_groups, split(model, blocks, torch_groups.index)
    except BaseException as exc:  # noqa: BLE001 - agreed below
        error = exc
    world.agree(error, "attach")  # (the workers' first agreement)
    torch_groups, groups = prepared
    index = layout.optimizer_ranks.index(world.rank)
    link = layout.link(index)
    assignments = agree_on_job(layout, groups, torch_groups)  # (spec, owner) of every trained group
    job = distributed.job_id(world, namespace)
    session = None
    try:
        session = connect(socket, namespace=f"{job}.opt{index}")
    except BaseException as exc:  # noqa: BLE001 - agreed below
        error = exc
    world.agree(error, "connecting to fuyoud")
    try:
        return _serve(model, session, layout, link, assignments, torch_groups, opts)
    finally:
        session.close()


def _serve(model, session, layout: Layout, link: Link, assignments: list, torch_groups, opts) -> Served:
    world, index = layout.world, link.index
    owned = [spec for spec, k in assignments if k == index]
    # -- attach, in step with the workers' (remote.py OptimizerHostWorker.restore and joined)
    error, state = None, None
    try:
        _owned_on_cpu(owned)
        if opts.resume is not None:
            state = _restore(session, layout, index, owned, opts.resume)
    except BaseException as exc:  # noqa: BLE001 - agreed below
        error = exc
    world.agree(error, "resume")
    if opts.resume is not None:
        world.from_rank(layout.optimizer_ranks[0], state)  # (the workers' client state: the first's)
    else:
        with torch.no_grad():
            for spec in owned:  # the first worker's weights are the initial ones
                params = [p for _, p in spec.params]
                flat = torch.empty(spec.numel, dtype=params[0].dtype)
                link.from_first_worker(flat)
                for p, part in zip(params, flat_parts(flat, [p.shape for p in params])):
                    p.copy_(part.view(p.shape))
    engine = None
    try:
        engine = build(model, session, torch_groups, owned, opts, resolve("cpu", model), False,
                       opts.resume is not None, None, SingleProcess())
    except BaseException as exc:  # noqa: BLE001 - agreed below
        error = exc
    try:  # (after a resume the workers fetch their resident groups' weights first)
        world.agree(error, "attach")
        world.gather(distributed.daemon_identity(session))
        return Server(engine, layout, link, assignments).run()
    finally:
        if engine is not None:  # (also when another rank's attach failed)
            engine.close(materialize=False)


def _owned_on_cpu(owned: list) -> None:
    """The owned groups' parameters as CPU tensors (a model on the meta device: empty
    ones, which the first worker's weights fill)."""
    with torch.no_grad():
        for spec in owned:
            for _, p in (*spec.params, *spec.frozen):
                if p.device.type != "cpu":  # (the parameter object stays: the model's modules hold it)
                    torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                                   requires_grad=p.requires_grad))


def _restore(session, layout: Layout, index: int, owned: list, directory) -> bytes:
    """This rank's share of an optimizer-host checkpoint restored into ``session``;
    returns the client state it holds."""
    directory = Path(directory)
    try:
        written = json.loads((directory / LAYOUT_FILE).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} holds no optimizer-host checkpoint ({LAYOUT_FILE} is missing on this "
                                "host): resume from a directory the workers' engine.save_checkpoint wrote") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory / LAYOUT_FILE} is unreadable: {exc}") from None
    if not isinstance(written, dict) or written.get("format") != LAYOUT_FORMAT:
        raise ValueError(f"{directory / LAYOUT_FILE} is not an optimizer-host checkpoint this version reads")
    if written.get("optimizer_ranks") != len(layout.optimizer_ranks):
        raise ValueError(f"{directory} was written by {written.get('optimizer_ranks')} optimizer ranks and this job "
                         f"has {len(layout.optimizer_ranks)}: resume with as many optimizer ranks (any number of "
                         "workers)")
    groups = written.get("groups")
    if not isinstance(groups, list) or len(groups) != len(layout.optimizer_ranks):
        raise ValueError(f"{directory / LAYOUT_FILE} does not list each optimizer rank's groups: it is damaged")
    names = [spec.name for spec in owned]
    if groups[index] != names:
        raise ValueError(f"{directory}: optimizer rank {index} owned other layer groups when it was written "
                         f"({groups[index]} now {names}): the checkpoint is of another model")
    restored = session.restore(checkpoint_part(directory, index))
    return restored.client_state


class Server:
    """The command loop of one optimizer rank."""

    def __init__(self, engine, layout: Layout, link: Link, assignments: list):
        self.engine, self.layout, self.link = engine, layout, link
        self.names = [spec.name for spec, _ in assignments]  # the workers' group index -> name
        self.all_names = [[spec.name for spec, k in assignments if k == m] for m in range(len(layout.optimizer_ranks))]
        self.workers = layout.worker_count
        self.by_name = {g.spec.name: g for g in engine.groups}
        # One buffer for every gather and scatter, the largest owned group's padded vector
        # and a row for this rank's own part: the loop runs one exchange at a time.
        per = max(layout.shards(g.numel).per for g in engine.groups)
        self._staging = torch.zeros((self.workers + 1) * per, dtype=max((g.dtype for g in engine.groups),
                                                                        key=lambda d: d.itemsize))
        self.steps: dict[int, object] = {}  # group -> its step's future
        self.commands: dict[str, int] = {}
        self.stepped = 0

    def run(self) -> Served:
        """Serve until the workers close; a failed collective (a lost rank) is a
        CollectiveError naming it."""
        try:
            return self._run()
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistBackendError) as exc:
            world = self.layout.world
            raise CollectiveError(distributed.explain(f"optimizer rank {world.rank}: serving the workers failed",
                                                      exc, world)) from exc

    def _rows(self, g) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The staging buffer as the group's padded vector and its rows: one shard per
        worker, then this rank's own (the link's order)."""
        per = self.layout.shards(g.numel).per
        flat = self._staging.view(torch.uint8)[:(self.workers + 1) * per * g.dtype.itemsize].view(g.dtype)
        return flat, list(flat.view(self.workers + 1, per))

    def _run(self) -> Served:
        link = self.link
        while True:
            op, index, a, b = link.listen()
            name = wire.OP_NAMES.get(op, str(op))
            self.commands[name] = self.commands.get(name, 0) + 1
            if op == wire.CLOSE:
                break
            g = self._group(index) if op in (wire.REDUCE, wire.STEP, wire.WEIGHTS, wire.MASTERS,
                                             wire.FETCH) else None
            if op == wire.REDUCE:
                flat, rows = self._rows(g)
                link.gather(rows[-1], rows)  # (the last: its own, nothing)
                g.grads.tensor(g.dtype)[:g.numel].copy_(flat[:g.numel]).div_(self.workers)
                if a:
                    self._step(g, index, wire.scale_of(b))
            elif op == wire.STEP:
                self._step(g, index, wire.scale_of(b))
            elif op == wire.NORM:  # (the groups the workers touched this iteration: reduced here)
                part = torch.zeros(1, dtype=torch.float32)
                for i in link.object_from_first_worker():
                    if self.names[i] not in self.by_name:
                        continue  # (another optimizer rank's)
                    h = self._group(i)
                    part += torch.linalg.vector_norm(h.grads.tensor(h.dtype)[:h.numel].float(), 2.0) ** 2
                link.sum(part)
            elif op == wire.WEIGHTS:
                self._weights(g, index, status_only=bool(a))
            elif op == wire.FETCH:  # (an offloaded block's weights, ahead of a worker's forward or backward)
                if index in self.steps:
                    self.steps[index].exception()  # (its step in flight writes them: wait)
                self._send(g)
            elif op == wire.HYPER:
                for group, values in zip(self.engine.optimizer.param_groups, link.object_from_first_worker()):
                    group.update(values)
            elif op == wire.CHECKPOINT:
                link.object_from_optimizer(self._checkpoint(link.object_from_first_worker()))
            elif op == wire.MASTERS:
                buf, _ = read_masters(self.engine.session, g.spec)
                try:
                    link.broadcast(buf.tensor(torch.float32)[:g.numel])
                finally:
                    buf.free()
            else:
                raise RuntimeError(f"optimizer rank {self.layout.world.rank}: unknown command {op} from the workers "
                                   "(a worker of another version?)")
        return Served(self.commands, self.stepped)

    def _group(self, index: int):
        name = self.names[index] if 0 <= index < len(self.names) else None
        g = self.by_name.get(name)
        if g is None:
            raise RuntimeError(f"the workers sent group #{index} ({name}) to optimizer rank {self.layout.world.rank}, "
                               "which does not own it: the ranks disagree on the layout")
        return g

    def _step(self, g, index: int, scale) -> None:
        self.steps[index] = self.engine.coordinator.submit(g, scale)

    def _weights(self, g, index: int, status_only: bool = False) -> None:
        """The step's outcome (a small broadcast) and, stepped, the new weights (not to
        workers that keep no copy of them: ``status_only``)."""
        step = self.steps.pop(index, None)
        status = torch.zeros(8, dtype=torch.float64)
        message = None
        if step is None:
            status[0], message = wire.NOT_STEPPED, f"group {g.spec.name} was not stepped on its optimizer rank"
            log.warning("%s", message)
        else:
            try:
                info = step.result()
                status[:] = torch.tensor([wire.OK, info.step, info.read_seconds, info.compute_seconds,
                                          info.write_seconds, float(info.prefetched), info.cached_bytes,
                                          info.masters_bytes], dtype=torch.float64)
                self.stepped += 1
            except NonFinite as exc:
                status[0], message = wire.NONFINITE, str(exc)
            except Exception as exc:  # noqa: BLE001 - the workers raise it
                status[0], message = wire.FAILED, f"{type(exc).__name__}: {exc}"
                log.error("step of %s failed: %s", g.spec.name, message)
            finally:
                g.future, g.submitted, g.backwards = None, False, 0
                guard.release(g.spec.params)
        self.link.broadcast(status)
        if message is not None:
            self.link.object_from_optimizer(message)
        elif not status_only:
            self._send(g)

    def _send(self, g) -> None:
        """The group's weights, one shard to each worker."""
        flat, rows = self._rows(g)
        flat[:g.numel].copy_(g.weights.tensor(g.dtype)[:g.numel])
        flat[g.numel:].zero_()  # (the padding: what a gather left there)
        self.link.scatter(rows[-1], rows)

    def _checkpoint(self, request) -> object:
        """Write this rank's share; returns a summary, or the error as a string."""
        directory, state, mode, timeout = request
        try:
            part = checkpoint_part(directory, self.link.index)
            part.parent.mkdir(parents=True, exist_ok=True)
            result = self.engine.session.checkpoint(str(part), timeout, mode, state)
            _write_layout(Path(directory), self.layout, self.all_names)
            return {"rank": self.layout.world.rank, "directory": str(part), "mode": getattr(result, "mode", mode)}
        except Exception as exc:  # noqa: BLE001 - raised on the workers
            return f"{type(exc).__name__}: {exc}"


def _write_layout(directory: Path, layout: Layout, names: list[list[str]]) -> None:
    """``optimizer-host.json``: how many optimizer ranks wrote the checkpoint and which
    groups each owned (every optimizer rank writes the same, atomically)."""
    tmp = directory / f".{LAYOUT_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"format": LAYOUT_FORMAT, "optimizer_ranks": len(layout.optimizer_ranks),
                               "groups": names}))
    tmp.replace(directory / LAYOUT_FILE)
