"""The activation policy: per block, keep, swap or recompute what its forward saves for
backward (``attach(activations=...)``; ``"auto"`` changes it from a profile: autoplan.py).

* keep: autograd's saved tensors stay where they are;
* swap: they leave the compute device (swapper.py; the model's hooks ask ``swaps(name)``);
* recompute: the block's ``forward`` is replaced by one that keeps only its inputs and
  runs again in backward (swapper.py ``recomputed``), after the offloader has made its
  weights resident and held them (the recomputed graph refers to them).
"""
from __future__ import annotations


CUT_RECOMPUTE = (
    "is cut into sub-blocks (granularity='module': the device does not hold a whole block), and its "
    "activations are recomputed (activations='recompute'; the Trainer's and TRL's gradient_checkpointing=True): "
    "in this loop torch's checkpoint would keep every recomputed sub-block's weights until backward reaches "
    "them, more than the device holds, so it is refused. Use engine.train_step(micro_batches, loss_fn), which "
    "recomputes cut blocks, or activations='keep' or 'swap' (gradient_checkpointing=False), or "
    "granularity='block' on a device that holds a block")


def _refused(name: str, forward):
    """A cut block's forward where recomputation is refused (CUT_RECOMPUTE): without grad
    (evaluation, generation) it runs as it is."""
    import torch

    def refusing(*args, **kwargs):
        if torch.is_grad_enabled():
            raise RuntimeError(f"block {name} {CUT_RECOMPUTE}")
        return forward(*args, **kwargs)

    return refusing


class ActivationPolicy:
    def __init__(self, blocks: list, swapper, offloader, treatment: dict[str, str]):
        """``blocks``: the layer groups that are blocks (groups.LayerGroup, with a module);
        ``treatment``: each one's, by name (swapper.treatments)."""
        self._by_name = {g.spec.name: g for g in blocks}
        self._swapper, self._offloader = swapper, offloader
        self._treatment: dict[str, str] = {}
        self._originals: dict[str, object] = {}  # block -> its own forward, while recomputing
        self.apply(treatment)

    def apply(self, treatments: dict[str, str]) -> None:
        """Keep, swap or recompute, per block, from the next forward on."""
        self._treatment.update(treatments)
        for name, g in self._by_name.items():
            recompute = self._treatment[name] == "recompute"
            if recompute and name not in self._originals:
                self._originals[name] = g.spec.module.forward
                if g.offloaded is not None and g.offloaded.cut:
                    g.spec.module.forward = _refused(name, g.spec.module.forward)
                    continue
                g.spec.module.forward = self._swapper.recomputed(g.spec.module.forward,
                                                                 lambda og=g.offloaded: self._resident(og))
            elif not recompute and name in self._originals:
                del g.spec.module.forward  # the class's own forward again
                del self._originals[name]

    def _resident(self, og) -> None:
        """Before a block is recomputed in backward: its weights, held until its gradients
        are complete."""
        if og is not None:
            self._offloader.hold(og)

    def swaps(self, name: str) -> bool:
        return self._treatment[name] == "swap"

    @property
    def treatments(self) -> dict[str, str]:
        """Each block's treatment now."""
        return dict(self._treatment)

    def forward_of(self, name: str, module):
        """A block's own forward (not the recomputing one this policy may have patched in)."""
        return self._originals.get(name, module.forward)

    def close(self) -> None:
        """Every patched forward the class's own again."""
        self.apply({name: "keep" for name in self._by_name})
