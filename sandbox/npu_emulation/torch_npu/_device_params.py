"""Parameters keep their Python attributes when a module moves to the emulated device.

On an NPU, `model.npu()` / `.to("npu")` / `.cuda()` ported give each parameter its device data in place
(`param.data = ...`): the Parameter object, and attributes a program set on it (`param.label = "attn"`, as the
later Modded-NanoGPT records tag their parameters for the optimizers), stay. The emulated device's tensors are a
wrapper subclass, so Module._apply swaps each parameter with a new one (torch.utils.swap_tensors), and the swap
exchanges the objects' __dict__ too: the attributes were lost. They are put back after every _apply.
"""

from __future__ import annotations

import torch

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    original = torch.nn.Module._apply

    def _apply(self, fn, *args, **kwargs):
        saved = [(p, dict(p.__dict__)) for p in self.parameters() if p.__dict__]
        result = original(self, fn, *args, **kwargs)
        for param, attributes in saved:
            for name, value in attributes.items():
                param.__dict__.setdefault(name, value)
        return result

    torch.nn.Module._apply = _apply
    _installed = True
