"""The activation planner behind ``attach(activations="auto")``: per block, keep, swap
or recompute, so that the iteration (one forward and backward: a micro-batch under
gradient accumulation) is fastest within the memory budgets.

Inputs (a ``Profile``, measured on a first iteration by the engine, or made up by
tests): per block its forward time, the bytes it saves for backward and the bytes of
its inputs; the device<->host copy bandwidth and whether copies overlap compute; the
SSD's write and read bandwidth; the device budget for activations and the host arena.

The model of one iteration, per treatment of block i (f = forward time, a = saved
bytes, x = input bytes, backward ~ ``backward_factor`` x forward):

* keep:      a on the device until its backward; no extra time.
* recompute: x on the device; its forward runs again in backward: + f.
* swap:      nothing on the device; a goes to the host arena, or - when the arena is
             full, for the earliest blocks, which backward needs last - on to SSD.
             Time: the copies out and back (hidden behind compute when copies overlap
             it, as on CUDA side streams; not on a CPU), the SSD write in forward, and
             the part of the SSD read that backward of the following block does not hide.

Device peak = what every block leaves on the device + the largest block's own
activations (the working set of the block in forward or backward). The planner starts
from "keep everywhere", converts the block that frees the most bytes per second of
added time until the plan fits the budget, then improves it block by block while it
fits. A device budget below the largest working set is refused at planning time with
that minimum named.
"""
from __future__ import annotations

from dataclasses import dataclass, field

CHOICES = ("keep", "swap", "recompute")


@dataclass(frozen=True)
class BlockProfile:
    name: str
    forward_s: float
    activation_bytes: int
    input_bytes: int


@dataclass
class Profile:
    blocks: list[BlockProfile]
    copy_bps: float  # device <-> host
    ssd_write_bps: float
    ssd_read_bps: float
    device_budget: int  # bytes for activations on the compute device
    host_budget: int  # the host arena
    copies_overlap: bool = False  # True on CUDA (side streams), False when the device is the CPU
    backward_factor: float = 2.0

    @property
    def minimum_device_bytes(self) -> int:
        return max((b.activation_bytes for b in self.blocks), default=0)


@dataclass
class Plan:
    treatments: dict[str, str]
    device_peak: int
    host_bytes: int
    ssd_bytes: int
    overhead_s: float  # modelled time added to an iteration that keeps everything
    compute_s: float  # modelled forward + backward compute
    fits: bool
    profile: Profile | None = field(default=None, repr=False)

    @property
    def iteration_s(self) -> float:
        return self.compute_s + self.overhead_s

    def summary(self) -> str:
        """A readable table: what each block does and what the plan costs."""
        lines = [f"activation plan: {self.iteration_s * 1e3:.1f} ms per forward and backward modelled "
                 f"({self.overhead_s * 1e3:.1f} ms over keeping everything), device peak "
                 f"{self.device_peak / 2**20:.1f} MiB, host {self.host_bytes / 2**20:.1f} MiB, "
                 f"SSD {self.ssd_bytes / 2**20:.1f} MiB each"]
        if self.profile is not None:
            p = self.profile
            lines.append(f"  budgets: device {p.device_budget / 2**20:.1f} MiB, host {p.host_budget / 2**20:.1f} MiB; "
                         f"copy {p.copy_bps / 1e9:.2f} GB/s, SSD write {p.ssd_write_bps / 1e9:.2f} / read "
                         f"{p.ssd_read_bps / 1e9:.2f} GB/s")
            for b in p.blocks:
                lines.append(f"  {b.name:12} {self.treatments[b.name]:9} forward {b.forward_s * 1e3:7.2f} ms, "
                             f"saves {b.activation_bytes / 2**20:7.2f} MiB, inputs {b.input_bytes / 2**20:6.2f} MiB")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def evaluate(profile: Profile, treatments: dict[str, str]) -> Plan:
    blocks = profile.blocks
    resident = {"keep": lambda b: b.activation_bytes, "recompute": lambda b: b.input_bytes, "swap": lambda b: 0}
    device_peak = sum(resident[treatments[b.name]](b) for b in blocks) + profile.minimum_device_bytes
    # Swapped bytes fill the host arena from the last block back; the earliest spill to SSD.
    host_free, on_ssd = profile.host_budget, {}
    for b in reversed(blocks):
        if treatments[b.name] == "swap":
            if b.activation_bytes <= host_free:
                host_free -= b.activation_bytes
                on_ssd[b.name] = False
            else:
                on_ssd[b.name] = True
    overhead, ssd_bytes = 0.0, 0
    for i, b in enumerate(blocks):
        t = treatments[b.name]
        if t == "recompute":
            overhead += b.forward_s
        elif t == "swap":
            copies = 2 * b.activation_bytes / profile.copy_bps
            overhead += 0.0 if profile.copies_overlap else copies
            if on_ssd[b.name]:
                ssd_bytes += b.activation_bytes
                overhead += b.activation_bytes / profile.ssd_write_bps  # written in forward
                later = blocks[i + 1] if i + 1 < len(blocks) else None
                window = later.forward_s * profile.backward_factor if later is not None else 0.0
                overhead += max(0.0, b.activation_bytes / profile.ssd_read_bps - window)  # read ahead
    compute = sum(b.forward_s for b in blocks) * (1 + profile.backward_factor)
    host_bytes = profile.host_budget - host_free
    return Plan(dict(treatments), device_peak, host_bytes, ssd_bytes, overhead, compute,
                device_peak <= profile.device_budget, profile)


def plan(profile: Profile) -> Plan:
    if profile.device_budget < profile.minimum_device_bytes:
        raise ValueError(
            f"the device budget for activations ({profile.device_budget} bytes) is below one block's working set: "
            f"at least {profile.minimum_device_bytes} bytes are needed (the largest block saves that much)")
    current = {b.name: "keep" for b in profile.blocks}
    best = evaluate(profile, current)
    while not best.fits:  # convert the block that frees the most bytes per added second
        candidates = []
        for b in profile.blocks:
            for choice in CHOICES:
                if choice == current[b.name]:
                    continue
                trial = evaluate(profile, {**current, b.name: choice})
                freed = best.device_peak - trial.device_peak
                if freed > 0:
                    candidates.append((freed / max(trial.overhead_s - best.overhead_s, 1e-9), trial))
        if not candidates:
            raise ValueError("no plan fits the device budget")  # (cannot happen: swapping all fits)
        best = max(candidates, key=lambda c: c[0])[1]
        current = dict(best.treatments)
    improved = True
    while improved:  # then any single change that is faster and still fits
        improved = False
        for b in profile.blocks:
            for choice in CHOICES:
                trial = evaluate(profile, {**current, b.name: choice})
                if trial.fits and trial.overhead_s < best.overhead_s - 1e-12:
                    best, current, improved = trial, dict(trial.treatments), True
    return best


def uniform(profile: Profile, choice: str) -> Plan:
    return evaluate(profile, {b.name: choice for b in profile.blocks})
