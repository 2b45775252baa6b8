"""What the static scan must report on each bundled example (shared by test_static_scan.py and
test_analyst.py): (category, file, first line, last line) per intent, with the code it points at."""

from __future__ import annotations

Row = tuple[str, str, int, int]

EXPECTED_EXAMPLES: dict[str, list[Row]] = {
    "llama_pretrain": [
        ("rmsnorm", "model.py", 33, 33),  # x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        ("rope", "model.py", 51, 52),  # q_embed / k_embed = (q * cos) + (rotate_half(q) * sin)
        ("silu", "model.py", 57, 57),  # def silu(x): return x * torch.sigmoid(x)
        ("swiglu", "model.py", 68, 68),  # silu(self.gate_proj(x)) * self.up_proj(x)
        ("attention", "model.py", 74, 78),  # scores = q @ k.T * scale ... masked_fill, softmax, return probs @ v
        ("permute_reshape", "model.py", 97, 97),  # out.transpose(1, 2).contiguous().view(bsz, seq_len, dim)
        ("cross_entropy", "model.py", 142, 144),  # log_softmax, -gather(...).squeeze(-1), nll.mean()
        ("host_sync", "train.py", 60, 60),  # loss_value = loss.item() in train_step
        ("optimizer_step", "train.py", 70, 72),  # torch.optim.AdamW(..., foreach=False)
    ],
    "gpt2_pretrain": [
        ("layernorm", "model.py", 32, 34),  # mean, var of (x - mean)^2, (x - mean) / sqrt(var + eps) * w + b
        ("gelu", "model.py", 38, 38),  # 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
        ("attention", "model.py", 57, 60),  # att = q @ k.T * scale, masked_fill, softmax, y = att @ v
        ("permute_reshape", "model.py", 61, 61),  # y.transpose(1, 2).contiguous().view(B, T, C)
        ("cross_entropy", "train.py", 52, 54),  # logsumexp - gather, mean
        ("optimizer_step", "train.py", 73, 73),  # torch.optim.AdamW(groups, ..., foreach=False)
    ],
    "resnet_classify": [
        ("conv_layout", "train.py", 76, 76),  # ResNet(...).to(device): no channels_last anywhere
        ("optimizer_step", "train.py", 77, 79),  # torch.optim.SGD(...) with the default implementation
    ],
    "clip_pretrain": [
        ("layernorm", "model.py", 37, 39),  # mean, x.var(unbiased=False), w * (x - mean) / sqrt(var + eps) + b
        ("gelu", "model.py", 43, 43),  # 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
        ("gelu", "model.py", 47, 47),  # QuickGELU: x * torch.sigmoid(1.702 * x)
        ("normalize", "model.py", 51, 51),  # x / x.norm(dim=-1, keepdim=True)
        ("attention", "model.py", 66, 71),  # attn = q @ k.T * scale, [masked_fill], softmax, (attn @ v)
        ("permute_reshape", "model.py", 71, 71),  # (attn @ v).transpose(1, 2).reshape(B, N, C)
        ("cross_entropy", "train.py", 71, 72),  # -log_softmax(logits, dim=1 / dim=0).diagonal().mean()
        ("optimizer_step", "train.py", 99, 99),  # torch.optim.AdamW(groups, ..., foreach=False)
    ],
}
