"""Which decoder layers run as one ``lax.scan`` over stacked parameters, and which run one by one.

K3 repeats one group of layers (KDA, KDA, KDA, MLA; every layer after the first a LatentMoE) 22 times; Llama repeats
one layer. With ``RunConfig(scan_layers=True)`` the model keeps the parameters of the longest such run stacked
(leading dimension: the group's repetition) and runs it as one scan, so XLA and the kernel compilers see one group
instead of every layer: compile time falls roughly by the repetition count. The layers before and after the run
(K3: the dense layer 0 and the final MLA layers) stay unrolled.

What a scan costs at run time: the TPU and GPU compilers copy each iteration's slice of a stacked weight (and of a
stacked cache) into a buffer of its own before the kernel or dot that reads it (measured with the deviceless
compilers, see README), so a bandwidth-bound decode step reads those bytes about three times. Scanning is
therefore off by default; it pays where compilation dominates (``kimi-jax plan --compile``, training, one-shot
runs of a large model). AttnRes block sealing (every ``attn_res_block_size`` layers) follows the traced layer
number inside the scan, so it need not line up with the group.
"""

from __future__ import annotations

import dataclasses

from kimi_jax.model.config import ModelConfig

MAX_PERIOD = 12  # the longest repeating group looked for (K3's AttnRes block)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Layers ``start .. start + period * count - 1`` run as a scan over ``count`` groups of ``period`` layers
    (stacked parameters); every other layer runs unrolled. ``count == 0``: nothing is scanned."""

    num_layers: int
    start: int = 0
    period: int = 0
    count: int = 0

    @property
    def scanned(self) -> range:
        return range(self.start, self.start + self.period * self.count)

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count

    def unrolled(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.scanned]

    def slot(self, layer: int) -> tuple[int, int] | None:
        """``(position in the group, repetition)`` of a scanned layer; None for an unrolled one."""
        if layer not in self.scanned:
            return None
        g, j = divmod(layer - self.start, self.period)
        return j, g

    def layer(self, position: int, repetition: int) -> int:
        return self.start + repetition * self.period + position


def layer_plan(cfg: ModelConfig, scan: bool) -> LayerPlan:
    """The longest run of at least two identical groups of consecutive layers (same attention and FFN kind at each
    position); ties go to the shorter group, then the earlier start. ``scan=False``: everything unrolled."""
    n = cfg.num_layers
    if not scan:
        return LayerPlan(n)
    kinds = cfg.layer_kinds()
    best = LayerPlan(n)
    for period in range(1, min(MAX_PERIOD, n // 2) + 1):
        for start in range(0, n - 2 * period + 1):
            count = 1
            while start + (count + 1) * period <= n and all(
                    kinds[start + count * period + j] == kinds[start + j] for j in range(period)):
                count += 1
            if count >= 2 and period * count > best.period * best.count:
                best = LayerPlan(n, start, period, count)
    return best
