"""A dedicated optimizer host, the workers' side: ``attach(model, optimizer,
optimizer_ranks=[...])`` on every worker (engine/serve.py is the optimizer ranks' side; link.py
the layout and the commands between them).

A worker holds no optimizer state and no master weights: its daemon gives it shared
memory only. Each layer group belongs to one optimizer rank (``Layout.owners``).

* Gradients (``Remote``): when a group's gradients are final (its last backward, or at
  ``step()`` with clipping), the workers reduce-scatter them among themselves (each
  gets its shard of the sum, in the group's compute dtype, as DDP sums them; added in
  rank order: world.reduce_scatter) and each sends its shard to the owner (a gather on
  the link): the optimizer rank receives the sum once, one vector whatever the number of
  workers, divides it by that number and submits the step to its daemon while the
  workers go on with backward. On a device with its own memory the gradients are
  downloaded to host memory first (the links are gloo: the optimizer host has no GPU).
* Weights: at the barrier, in group order, the owner sends each stepped group's new
  weights cut in one shard per worker (a scatter on its link: one vector out of it), and
  the workers all-gather them straight into the parameters' memory (on a GPU, the host
  buffer, then uploaded). An offloaded block keeps no weights between uses: each fetch,
  ahead of its forward and its backward, brings them the same way into a slot. A step
  the owner's daemon refused is NonFinite here too, and the group keeps its weights
  everywhere. Per worker and step: (N-1)/N + 1/N of a vector out and in each way for
  the gradients and again for the weights, the sharded mode's 2 (N-1)/N at most.
* Clipping is exact: the norm is computed where the gradients are summed (each owner's
  share of the squared norm of the mean gradient, summed over the links), the
  coefficient here, and every step is sent with it.
* Learning rates and hyperparameters are the workers' (schedulers run here): they go to
  an optimizer rank with its first step after they changed.
* Checkpoints are written by the optimizer ranks alone, each its groups' state; they
  resume at any number of workers. Export streams the masters from the owners; the
  first worker writes the files.
"""
from __future__ import annotations

import dataclasses
import math
from concurrent.futures import Future

import torch
import torch.distributed as dist

from fuyou_client.checkpoints import client_state, export, load_client_state
from fuyou_client.errors import NonFinite
from fuyou_client.gradients.clipping import NormClipper
from fuyou_client.gradients.strategy import GradientStrategy, Start
from fuyou_client.groups.layer_group import flat_copy
from fuyou_client.model.blocks import flat_parts
from fuyou_client.optim import StepInfo
from fuyou_client.parallel import link as wire
from fuyou_client.parallel import world as distributed
from fuyou_client.parallel.link import Layout, Link
from fuyou_client.parallel.seam import SingleProcess
from fuyou_client.parallel.world import Collectives, World


class OptimizerHostWorker(SingleProcess):
    """The parallelism seam (seam.py) of a worker in an optimizer-host job."""
    data_parallel = True
    strategy_kind = "remote"
    holds_state = False

    def __init__(self, layout: Layout):
        self.layout = layout
        self.world = layout.world
        self.links = [layout.link(i) for i in range(len(layout.optimizer_ranks))]
        self.workers = World(layout.workers_group, layout.workers.index(layout.world.rank), layout.worker_count,
                             layout.world.backend)  # (export: the first worker writes)
        self.collectives: Collectives | None = None
        self.remote: Remote | None = None
        self._owner: dict[str, Link] = {}  # layer group name -> its optimizer rank's link
        self._resume = False
        self._groups: list = []
        self._serving = False  # the optimizer ranks serve this engine (attach succeeded everywhere)

    # -- attach ---------------------------------------------------------------------------
    def check_options(self, opts) -> None:
        if opts.session is not None:
            raise ValueError("an optimizer-host worker opens its session itself: pass socket= rather than session=")
        if opts.offload == "host":
            raise ValueError("attach(optimizer_ranks=...) takes offload=True (each block's weights sent by the "
                             "optimizer host ahead of its forward and backward, no copy kept between uses) or "
                             "False (resident), not \"host\"")
        if opts.reduce != "step":
            raise ValueError("attach(optimizer_ranks=...) reduces each group's gradients once, after the last "
                             "backward of a step: reduce='backward' is the sharded mode's")
        if opts.reshard:
            raise ValueError("reshard= is for the sharded mode's checkpoints: an optimizer host's checkpoint resumes "
                             "at any number of workers as it is")

    def check_model(self, materializer) -> None:
        if materializer is not None:
            raise ValueError("a model on the meta device cannot be attached by an optimizer-host worker yet: build "
                             "it on the CPU on every worker (the first worker's weights are the initial ones)")

    def agree(self, error: BaseException | None, what: str) -> None:
        self.world.agree(error, what)

    def shards(self, numel: int):
        """This worker's shard of a group's flat vector (padded: the flat gradients and
        weights are, so that the workers' reduce-scatter and all-gather cut them evenly)."""
        return self.layout.shards(numel)

    def agree_on_model(self, groups, torch_groups) -> None:
        self._owner = {spec.name: self.links[k] for spec, k in agree_on_job(self.layout, groups, torch_groups)}

    def namespace(self, namespace: str | None) -> str:
        return f"{distributed.job_id(self.world, namespace)}.w{self.world.rank}"

    def restore(self, session, model, groups, opts) -> dict | None:
        """The checkpoint's client state from the first optimizer rank (which read it), or,
        starting afresh, the first worker's weights on every worker and on their owners."""
        self.world.agree(None, "resume")  # (the optimizer ranks read their checkpoints)
        self._resume = opts.resume is not None
        grouped = set()
        with torch.no_grad():
            if not self._resume:
                for spec in groups:
                    if spec.params:
                        params = [p for _, p in spec.params]
                        grouped.update(id(p) for p in params)
                        flat = torch.empty(spec.numel, dtype=params[0].dtype)  # (host memory: the links are gloo)
                        flat_copy(params, flat)
                        self._owner[spec.name].from_first_worker(flat)
                        for p, part in zip(params, flat_parts(flat, [p.shape for p in params])):
                            p.copy_(part.view(p.shape))
            rest = [t for t in (*model.parameters(), *model.buffers()) if id(t) not in grouped]
            for t in rest:  # (frozen parameters and buffers: the workers' own, the first one's)
                host = t.detach().cpu()
                first = self.world.global_rank(self.layout.workers[0])
                dist.broadcast(host, src=first, group=self.layout.workers_group)
                t.data.copy_(host)
        if not self._resume:
            return None
        state = self.world.from_rank(self.layout.optimizer_ranks[0], None)
        return load_client_state(state)

    def joined(self, session) -> list:
        """(every rank) Each rank's daemon; after a resume, each resident group's weights
        from its owner (offloaded ones come with their first fetch)."""
        self.world.agree(None, "attach")
        peers = self.world.gather(distributed.daemon_identity(session))
        self._serving = True
        if self._resume:
            for g in self._groups:
                if g.offloaded is None:
                    self.remote.pull(g)
        return peers

    # -- the engine's parts ---------------------------------------------------------------
    def gradient_strategy(self, options, device, param_groups) -> "Remote":
        self.collectives = Collectives(self.world)
        self.remote = Remote(self, device, param_groups)
        return self.remote

    def bind(self, session, group) -> None:
        self._groups.append(group)
        group.grads.tensor(torch.uint8).zero_()  # (the padding stays zero: the reduce-scatter reads it)
        self.remote.link_of[group.spec.name] = self._owner[group.spec.name]
        self.remote.index_of[group.spec.name] = len(self._groups) - 1

    def fetch_gather(self, session, groups):
        """The offloader's ``gather``: an offloaded block's weights from its owner."""
        return self.remote.fetch_from_owner

    def clipper(self, model, groups):
        return RemoteClipper(self.remote, groups)

    def refuse_train_step(self) -> None:
        raise RuntimeError("train_step is not built for an optimizer host yet: train with the ordinary loop "
                           "(accumulation_steps=K for K micro-batches per step)")

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, session, groups, param_groups, extra, directory, mode, timeout):
        """(every worker) Each optimizer rank writes its groups' state and this client state
        under ``directory`` on its own host; an error on any is raised on every worker."""
        request = (str(directory), client_state(param_groups, extra), mode, timeout)

        def run():
            outcomes = []
            for link in self.links:
                link.command(wire.CHECKPOINT)
                link.object_from_first_worker(request)
                outcomes.append(link.object_from_optimizer())
            return outcomes
        outcomes = self.collectives.run("checkpoint", run)
        failed = [(link, o) for link, o in zip(self.links, outcomes) if isinstance(o, str)]
        if failed:
            raise RuntimeError("save_checkpoint failed on " + "; ".join(f"{link}: {o}" for link, o in failed))
        return {"directory": str(directory), "optimizer_ranks": outcomes}

    def export(self, trained, directory, dtype):
        """(every worker) The masters streamed from their owners; the first worker writes."""
        return export(dataclasses.replace(trained, world=self.workers), directory, dtype,
                      masters=lambda session, spec: self.remote.masters(spec))

    def held_parts(self, groups):
        return iter(())  # (no daemon group here)

    def close(self) -> None:
        """Tell the optimizer ranks this worker is done (every worker closes; an optimizer
        rank stops serving when the workers have), unless the link is broken already."""
        if self.collectives is None:
            return
        if self._serving and self.collectives.broken is None:
            try:
                self.collectives.run("close", lambda: [link.command(wire.CLOSE) for link in self.links])
            except Exception:  # noqa: BLE001 - closing: the error that broke the link was raised before
                pass
        self.collectives.close()


def agree_on_job(layout: Layout, groups, torch_groups) -> list:
    """(every rank of the job, workers and optimizer ranks) The model's layer groups and
    optimizer are the same everywhere; returns (spec, owner index) for each trained group."""
    layout.world.same("the model's layer groups and optimizer",
                      distributed.signature((spec, [torch_groups.spec(p.index) for p in spec.parts])
                                            for spec in groups))
    trained = [spec for spec in groups if spec.params]
    return list(zip(trained, layout.owners([spec.numel for spec in trained])))


class Remote(GradientStrategy):
    """Gradients reduce-scattered among the workers and their shards sent to the owning
    optimizer rank; the new weights scattered from it and all-gathered."""
    name = "remote"

    def __init__(self, seam: OptimizerHostWorker, device, param_groups):
        self.seam, self.device = seam, device
        self.collectives = seam.collectives
        self._param_groups = param_groups  # () -> the torch param groups (what schedulers change)
        self.link_of: dict[str, Link] = {}
        self.index_of: dict[str, int] = {}
        self._reduced: dict[str, Future] = {}  # group -> its reduce this iteration
        self._sent_hyper: dict[int, list] = {}  # link index -> the hyperparameters it has

    # -- gradients ------------------------------------------------------------------------
    def host_buffer_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return self.seam.layout.shards(numel).padded * dtype.itemsize

    def _host_grads(self, g) -> torch.Tensor:
        return g.grads.tensor(g.dtype)[:g.shard_padded]

    def _send_shard(self, link: Link, full: torch.Tensor, shards) -> None:
        """(collective thread) This worker's shard of the workers' sum of ``full``, to the owner."""
        mine = torch.empty(shards.per, dtype=full.dtype)
        distributed.reduce_scatter(mine, full, self.seam.layout.workers_group)
        link.gather(mine)

    def _receive(self, link: Link, full: torch.Tensor, shards) -> None:
        """(collective thread) The owner's vector into ``full`` (padded): this worker's
        shard from it, the rest from the other workers."""
        mine = torch.empty(shards.per, dtype=full.dtype)
        link.scatter(mine)
        distributed.all_gather(full, mine, self.seam.layout.workers_group)

    def _send(self, g, op: int, steps: bool, scale, ready=None, after: Future | None = None) -> Future:
        """(training thread) One unit on the collective thread: the hyperparameters if they
        changed, the command, and for a reduce the gradients."""
        link, index = self.link_of[g.spec.name], self.index_of[g.spec.name]
        hyper = self._hyper(link) if steps or op == wire.STEP else None

        def run():
            if hyper is not None:
                link.command(wire.HYPER)
                link.object_from_first_worker(hyper)
            if op == wire.REDUCE:
                ready.synchronize()
                host = self._host_grads(g)
                if g.device_grads is not None:  # (the link is gloo: the gradients cross PCIe first)
                    self.device.download(host[:g.numel], g.device_grads[:g.numel]).synchronize()
                link.command(op, index, float(steps), wire.scale_arg(scale))
                self._send_shard(link, host, self.seam.layout.shards(g.numel))
            else:
                link.command(op, index, float(steps), wire.scale_arg(scale))
        what = f"{wire.OP_NAMES[op]} {g.spec.name}"
        return self.collectives.submit(what, run, after=after)

    def _hyper(self, link: Link) -> list | None:
        """The torch param groups' hyperparameters, if ``link``'s optimizer rank does not have them."""
        now = [{k: v for k, v in group.items() if k != "params"} for group in self._param_groups()]
        if self._sent_hyper.get(link.index) == now:
            return None
        self._sent_hyper[link.index] = now
        return now

    def reduce(self, g) -> Future:
        """Reduce the group's gradients to its owner without stepping (clipping: the norm
        first), once per iteration."""
        if g.spec.name not in self._reduced:
            g.adopt_grads()
            self._reduced[g.spec.name] = self._send(g, wire.REDUCE, False, None, self.device.record())
        return self._reduced[g.spec.name]

    def submit(self, g, start: Start) -> Future:
        scale = getattr(start, "scale", None)
        reduced = self._reduced.get(g.spec.name)
        if reduced is None:
            g.adopt_grads()
            future = self._send(g, wire.REDUCE, True, scale, self.device.record())
            self._reduced[g.spec.name] = future
            return future
        return self._send(g, wire.STEP, True, scale, after=reduced)

    def landing(self, g, stepped: Future) -> Future:
        """At the barrier, in group order: the owner's outcome of the step and, stepped,
        the new weights into the parameters' host memory."""
        link, index = self.link_of[g.spec.name], self.index_of[g.spec.name]

        offloaded = g.offloaded is not None  # (no weights kept here: the next fetch brings the new ones)

        def pull():
            link.command(wire.WEIGHTS, index, float(offloaded))
            status = torch.zeros(8, dtype=torch.float64)
            link.broadcast(status)
            code = int(status[0])
            if code == wire.OK:
                if not offloaded:
                    self._receive(link, g.weights.tensor(g.dtype)[:g.shard_padded], self.seam.layout.shards(g.numel))
                step, read, compute, write, prefetched, cached, masters = status[1:].tolist()
                return StepInfo(int(step), read, compute, write, bool(prefetched), int(cached), int(masters))
            message = link.object_from_optimizer()
            # (the step's outcome, not a failed collective: returned, so the stream goes on)
            return NonFinite(message) if code == wire.NONFINITE else RuntimeError(f"{link}: {message}")
        pulled = self.collectives.submit(f"weights {g.spec.name}", pull, after=stepped)
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            result = None if exc is not None else f.result()
            if isinstance(result, BaseException):
                exc = result
            out.set_exception(exc) if exc is not None else out.set_result(result)
        pulled.add_done_callback(done)
        return out

    def zero(self, g, device) -> None:
        reduced = self._reduced.pop(g.spec.name, None)
        if reduced is not None:
            try:
                reduced.result()  # (it reads the gradients)
            except Exception:  # noqa: BLE001 - reported where the step waits for it
                pass
        if g.device_grads is not None:
            device.wait(g.downloaded)
            g.device_grads.zero_()
        else:
            self._host_grads(g).zero_()

    def discard(self) -> None:
        """(after a barrier or zero_grad) The next iteration reduces afresh."""
        for reduced in self._reduced.values():
            try:
                reduced.result()
            except Exception:  # noqa: BLE001 - reported where the step waits for it
                pass
        self._reduced.clear()

    def reclaim(self) -> tuple[dict, list]:
        self._reduced.clear()  # (every step has landed: the barrier)
        return {}, []

    def _fetch(self, name: str, full: torch.Tensor) -> None:
        """(collective thread) Group ``name``'s weights as its owner has them into ``full``
        (host memory, padded to the workers' shards)."""
        link = self.link_of[name]
        link.command(wire.FETCH, self.index_of[name])
        self._receive(link, full, self.seam.layout.shards(full.numel()))

    def pull(self, g) -> None:
        """(collective) A resident group's weights from its owner, as they are there."""
        host = g.weights.tensor(g.dtype)
        self.collectives.run(f"weights {g.spec.name}", lambda: self._fetch(g.spec.name, host[:g.shard_padded]))
        if g.device_weights is not None:
            g.device_weights[:g.numel].copy_(host[:g.numel])

    def fetch_from_owner(self, og, slot, fetch: Future) -> Future:
        """(the offloader's ``gather``) An offloaded block's weights into the slot, sent by
        its owner (on a device with its own memory, then uploaded into the slot there)."""
        def run():
            served = fetch.result()  # (nothing was read: [])
            flat = slot.host.tensor(og.dtype)[:og.numel]  # (og.numel: padded already)
            self._fetch(og.name, flat)
            if not self.device.shares_host_memory:  # (the slot's last compute is done with it)
                self.device.upload(slot.device.view(og.dtype)[:og.numel], flat, after=slot.released).synchronize()
            return served
        return self.collectives.submit(f"fetch {og.name}", run, after=fetch)

    # -- the norm and the masters ------------------------------------------------------------
    def norm_squared(self, groups) -> float:
        """(collective) The sum of the owners' shares of the squared norm of the mean
        gradient of ``groups`` (those touched this iteration, reduced already)."""
        indices = sorted(self.index_of[g.spec.name] for g in groups)

        def run():
            total = torch.zeros(1, dtype=torch.float32)
            for link in self.seam.links:
                link.command(wire.NORM)
                link.object_from_first_worker(indices)
                part = torch.zeros(1, dtype=torch.float32)
                link.sum(part)
                total += part
            return float(total)
        return self.collectives.run("gradient norm", run)

    def masters(self, spec) -> torch.Tensor:
        """(collective) The group's fp32 master weights, from its owner."""
        link, index = self.link_of[spec.name], self.index_of[spec.name]

        def run():
            link.command(wire.MASTERS, index)
            out = torch.empty(spec.numel, dtype=torch.float32)
            link.broadcast(out)
            return out
        return self.collectives.run(f"masters {spec.name}", run)


class RemoteClipper(NormClipper):
    """The global gradient norm of the workers' mean gradient, computed by the optimizer
    ranks where the gradients are summed (every worker calls it)."""
    made = "of the workers' mean gradient, on the optimizer ranks"

    def __init__(self, strategy: Remote, groups):
        self.strategy, self.groups = strategy, groups

    def total_norm(self) -> float:
        touched = [g for g in self.groups if g.backwards > 0 or g.pending != len(g.spec.params)]
        for g in reversed(touched):  # (in the order backward would have sent them)
            self.strategy.reduce(g)
        for g in touched:
            self.strategy.reduce(g).result()
        return math.sqrt(self.strategy.norm_squared(touched))
