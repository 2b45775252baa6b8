"""The NPU attention helpers that `trainbridge port --to npu` writes into a ported file.

TrainBridge never imports this module: tools/porting/attention.py copies its definitions (everything
below the imports) into a ported module that uses FlexAttention or flash-attn, after that module's
imports, so the port stays one self-contained file. The names start with `_tb_npu_` so they do not
meet the user's own.

Semantics (reference/npu/semantics.md 1.4-1.6, 1.13): npu_fusion_attention's scale defaults to 1.0,
so the default 1/sqrt(D) is passed; its atten_mask marks EXCLUDED positions, and without one
sparse_mode and pre/next_tockens are ignored, so every causal or windowed call passes the compressed
2048x2048 template. A band keeps keys `i + delta - pre <= j <= i + delta + next` (bottom-right origin,
sparse_mode 4); FlexAttention's `q_idx >= kv_idx` is top-left causal (sparse_mode 2), flash-attn's
causal bottom-right (sparse_mode 3). Documents and flash-attn's varlen batches become input_layout
"TND" with cumulative end offsets (host ints: reading them is one device sync per mask or call).
Those offsets change with every batch, so the code that reads and passes them runs outside a program's
torch.compile (`torch.compiler.disable`): traced, each new document layout guarded a new graph, one
recompile a step until Dynamo's limit (Modded-NanoGPT record 12's document mask under its own
torch.compile(model), on the host's Inductor reference as on an NPU's graph backend).
"""

import torch
import torch_npu

_TB_NPU_UNLIMITED = 2147483647
_tb_npu_templates = {}


def _tb_npu_causal_template(device):
    """torch_npu's compressed causal mask (True = excluded), made once per device."""
    key = str(device)
    if key not in _tb_npu_templates:
        _tb_npu_templates[key] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    return _tb_npu_templates[key]


def _tb_npu_int(value):
    """A window or length as a host int (a tensor is read from its device)."""
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _tb_npu_band_attention(q, k, v, layout, scale, left, right, top_left, seq_q=None, seq_kv=None, keep_prob=1.0):
    """npu_fusion_attention keeping keys left before and right after the aligned diagonal (-1: unlimited)."""
    extra = {"actual_seq_qlen": seq_q, "actual_seq_kvlen": seq_kv} if layout == "TND" else {}
    if left < 0 and right < 0:
        return torch_npu.npu_fusion_attention(q, k, v, q.shape[-2], layout, scale=scale, keep_prob=keep_prob,
                                              **extra)[0]
    if left < 0 and right == 0:
        mode, pre, nxt = (2 if top_left else 3), _TB_NPU_UNLIMITED, 0
    else:
        mode = 4
        pre = left if left >= 0 else _TB_NPU_UNLIMITED
        nxt = right if right >= 0 else _TB_NPU_UNLIMITED
    return torch_npu.npu_fusion_attention(q, k, v, q.shape[-2], layout, atten_mask=_tb_npu_causal_template(q.device),
                                          scale=scale, keep_prob=keep_prob, pre_tockens=pre, next_tockens=nxt,
                                          sparse_mode=mode, **extra)[0]


class _TbNpuMask:
    """What a FlexAttention block mask selected, as npu_fusion_attention needs it: causal (q_idx >= kv_idx),
    window (keys with q_idx - kv_idx < window; None: unlimited) and the documents (cumulative end offsets
    of the runs of equal document ids; None: one sequence). Told apart by the attribute below, so a mask made
    by another ported file's copy of these helpers is accepted too."""

    _tb_npu_mask = True

    def __init__(self, causal, window, ends, length):
        self.causal, self.window, self.ends, self.length = causal, window, ends, length
        self.documents = ends is not None  # read where traced: `ends` is only read outside a compiled graph


def _tb_npu_document_ends(docs):
    """Cumulative end offsets of the runs of equal ids in a 1-D, non-decreasing document-id tensor."""
    if bool((docs[1:] < docs[:-1]).any()):
        raise ValueError("the document ids of a document mask must not decrease (e.g. (inputs == EOS).cumsum(0)); "
                         "trainbridge's NPU port reads each run of equal ids as one document")
    starts = torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1
    return [int(s) for s in starts.tolist()] + [docs.numel()]


def _tb_npu_mask(causal, window=None, docs=None, length=None):
    """The mask create_block_mask built from a mask_mod the port recognised; read now, as the original is."""
    if docs is not None:
        return _tb_npu_document_mask(causal, window, docs, length)
    window = None if window is None else _tb_npu_int(window)
    return _TbNpuMask(causal, window, None, None if length is None else _tb_npu_int(length))


@torch.compiler.disable
def _tb_npu_document_mask(causal, window, docs, length):
    """A document mask: its end offsets are this batch's, read on the host outside any compiled graph."""
    window = None if window is None else _tb_npu_int(window)
    ends = _tb_npu_document_ends(docs.reshape(-1))
    return _TbNpuMask(causal, window, ends, None if length is None else _tb_npu_int(length))


def _tb_npu_kv_block_mask(kv_num_blocks, full_kv_num_blocks, block_size, causal, window=None, docs=None):
    """BlockMask.from_kv_blocks with a recognised mask_mod: the window is the most KV blocks one query block
    reads (partial + full), as a token window of that many blocks (up to block_size - 1 more keys than the
    block-granular original at the start of a block), or the mask_mod's own token window where smaller."""
    blocks = kv_num_blocks if full_kv_num_blocks is None else kv_num_blocks + full_kv_num_blocks
    block_window = _tb_npu_int(blocks.amax()) * _tb_npu_int(block_size)
    length = kv_num_blocks.shape[-1] * _tb_npu_int(block_size)
    if window is not None:
        block_window = min(block_window, _tb_npu_int(window))
    return _tb_npu_mask(causal, None if block_window >= length else block_window, docs)


def _tb_npu_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                           return_lse=False, kernel_options=None):
    """flex_attention(q, k, v) in [B, H, S, D] with a mask from _tb_npu_mask, on npu_fusion_attention."""
    if score_mod is not None or return_lse:
        raise NotImplementedError("trainbridge's NPU port of flex_attention carries block masks only (no score_mod, "
                                  "no return_lse): port this call by hand")
    if block_mask is not None and not getattr(block_mask, "_tb_npu_mask", False):
        raise TypeError("this BlockMask was built by code `trainbridge port` did not carry to the NPU (see the port "
                        "report): express it as causal/window/document masks or port it by hand")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    mask = block_mask or _TbNpuMask(False, None, None, None)
    right = 0 if mask.causal else -1
    left = mask.window - 1 if mask.window is not None else -1
    if mask.window is not None and query.shape[-2] != key.shape[-2]:
        raise NotImplementedError("a windowed flex_attention with query and key lengths that differ has no "
                                  "npu_fusion_attention band with FlexAttention's top-left origin: port it by hand")
    documents = getattr(mask, "documents", None)  # None: a mask from an earlier port's copy of these helpers
    if not (mask.ends is not None if documents is None else documents):
        # [B, H, S, D] of records is a transposed [B, S, H, D]: BSND reads it without a copy
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        return _tb_npu_band_attention(q, k, v, "BSND", scale, left, right, True).transpose(1, 2)
    return _tb_npu_document_attention(query, key, value, mask, scale, left, right)


@torch.compiler.disable
def _tb_npu_document_attention(query, key, value, mask, scale, left, right):
    """One sequence per document (TND): the batch's end offsets reach npu_fusion_attention outside any graph."""
    if query.shape[0] != 1 or mask.ends[-1] != query.shape[-2]:
        raise ValueError(f"a document mask over {mask.ends[-1]} tokens needs batch size 1 and that many queries, got "
                         f"query {tuple(query.shape)}")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    out = _tb_npu_band_attention(q, k, v, "TND", scale, left, right, True, mask.ends, mask.ends)
    return out.transpose(0, 1).unsqueeze(0)


def _tb_npu_flash_band(causal, window_size):
    left, right = (_tb_npu_int(w) for w in window_size)
    return left, (0 if causal else right)


def _tb_npu_flash_attn(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), dropout_p=0.0,
                       deterministic=False):
    """flash_attn_func(q, k, v) in [B, S, H, D] (FlashAttention 2 and 3) on npu_fusion_attention (BSND)."""
    left, right = _tb_npu_flash_band(causal, window_size)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _tb_npu_band_attention(q, k, v, "BSND", scale, left, right, False, keep_prob=1.0 - dropout_p)


def _tb_npu_varlen_ends(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    """npu_fusion_attention's cumulative end offsets from flash-attn's cu_seqlens (leading 0); sequences empty
    on both sides are dropped, and tokens after the last offset form one more sequence."""
    ends_q = [int(e) for e in cu_seqlens_q[1:].tolist()]
    ends_k = [int(e) for e in cu_seqlens_k[1:].tolist()]
    seq_q, seq_k = [], []
    for eq, ek in zip(ends_q, ends_k):
        if (seq_q and eq == seq_q[-1] and ek == seq_k[-1]) or (not seq_q and eq == 0 and ek == 0):
            continue
        seq_q.append(eq)
        seq_k.append(ek)
    if not seq_q or seq_q[-1] < total_q or seq_k[-1] < total_k:
        seq_q.append(total_q)
        seq_k.append(total_k)
    return seq_q, seq_k


@torch.compiler.disable  # cu_seqlens change with every batch: read on the host outside any compiled graph
def _tb_npu_flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                              softmax_scale=None, causal=False, window_size=(-1, -1), dropout_p=0.0,
                              deterministic=False):
    """flash_attn_varlen_func(q, k, v) in [T, H, D] (FlashAttention 2 and 3) on npu_fusion_attention (TND)."""
    left, right = _tb_npu_flash_band(causal, window_size)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    seq_q, seq_k = _tb_npu_varlen_ends(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _tb_npu_band_attention(q, k, v, "TND", scale, left, right, False, seq_q, seq_k, keep_prob=1.0 - dropout_p)


class _TbNpuFlashAttention3:
    """Stands in for the FlashAttention-3 kernel the `kernels` hub loads on a GPU."""

    flash_attn_func = staticmethod(_tb_npu_flash_attn)
    flash_attn_varlen_func = staticmethod(_tb_npu_flash_attn_varlen)


_TbNpuFlashAttention3.flash_attn_interface = _TbNpuFlashAttention3
