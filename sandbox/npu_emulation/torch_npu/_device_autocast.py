"""torch.autocast("npu") for the emulated device: kernels on the AutocastPrivateUse1 key.

Like PyTorch's C++ autocast (and torch_npu's, whose lists follow CUDA's): ops of the lower-precision
list run with their floating device inputs cast to the autocast dtype, ops of the fp32 list with
them cast to float32; every other op runs unchanged. The casts happen above autograd, so gradients
come back in the parameters' dtype. No weight-cast cache (cache_enabled is accepted and ignored).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

LOWER_PRECISION = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear",
    "addbmm", "baddbmm", "bmm", "prelu", "scaled_dot_product_attention",
)
FLOAT32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "norm.Scalar", "norm.ScalarOpt_dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "softmax.int", "log_softmax.int", "cross_entropy_loss",
    "cumprod", "cumsum", "sum", "prod",
)

_lib: torch.library.Library | None = None
_fallthrough: torch.library.Library | None = None
_KEY = torch._C.DispatchKey.AutocastPrivateUse1


def _kernel(op: str, to_fp32: bool):
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name)
    target = getattr(packet, overload or "default")

    def run(*args, **kwargs):
        dtype = torch.float32 if to_fp32 else torch.get_autocast_dtype("npu")

        def cast(a):
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.device.type == "npu" and a.dtype != dtype:
                return a.to(dtype)
            return a

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            return target(*tree_map(cast, args), **tree_map(cast, kwargs))

    return run


def install() -> None:
    global _lib, _fallthrough
    if _lib is not None:
        return
    # every other op passes through the autocast key unchanged (torch_npu registers the same in C++)
    _fallthrough = torch.library.Library("_", "IMPL")
    _fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _lib = torch.library.Library("aten", "IMPL")
    for ops, to_fp32 in ((LOWER_PRECISION, False), (FLOAT32, True)):
        for op in ops:
            _lib.impl(op, _kernel(op, to_fp32), "AutocastPrivateUse1")
