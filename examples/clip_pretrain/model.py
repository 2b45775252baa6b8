"""A small CLIP: a ViT image tower and a causal text transformer, written out by hand.

LayerNorm, attention, GELU (erf form in the image tower, CLIP's QuickGELU in the text tower) and
the L2 normalisation of the embeddings are spelled out with plain tensor ops.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class CLIPConfig:
    embed_dim: int = 128
    image_size: int = 32
    patch_size: int = 4
    vision_width: int = 128
    vision_layers: int = 3
    vision_heads: int = 4
    vocab_size: int = 256
    context_length: int = 16
    text_width: int = 128
    text_layers: int = 3
    text_heads: int = 4


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.weight * (x - mean) / torch.sqrt(var + self.eps) + self.bias


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def l2_normalize(x):
    return x / x.norm(dim=-1, keepdim=True)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.in_proj(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        if self.causal:
            mask = torch.ones(N, N, dtype=torch.bool, device=x.device).triu(1)
            attn = attn.masked_fill(mask, float("-inf"))
        attn = attn.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.out_proj(out)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool, activation):
        super().__init__()
        self.ln_1 = LayerNorm(width)
        self.attn = Attention(width, heads, causal)
        self.ln_2 = LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)
        self.activation = activation

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.c_proj(self.activation(self.c_fc(self.ln_2(x))))
        return x


class VisionTransformer(nn.Module):
    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        width = cfg.vision_width
        num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.conv1 = nn.Conv2d(3, width, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        scale = width**-0.5
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(num_patches + 1, width))
        self.ln_pre = LayerNorm(width)
        self.blocks = nn.ModuleList(
            [ResidualAttentionBlock(width, cfg.vision_heads, False, gelu) for _ in range(cfg.vision_layers)]
        )
        self.ln_post = LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, cfg.embed_dim))

    def forward(self, images):
        x = self.conv1(images)  # B, width, grid, grid
        x = x.flatten(2).transpose(1, 2)  # B, patches, width
        cls = self.class_embedding.expand(x.size(0), 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding
        x = self.ln_pre(x)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x[:, 0]) @ self.proj


class TextTransformer(nn.Module):
    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        width = cfg.text_width
        self.token_embedding = nn.Embedding(cfg.vocab_size, width)
        self.positional_embedding = nn.Parameter(0.01 * torch.randn(cfg.context_length, width))
        self.blocks = nn.ModuleList(
            [ResidualAttentionBlock(width, cfg.text_heads, True, quick_gelu) for _ in range(cfg.text_layers)]
        )
        self.ln_final = LayerNorm(width)
        self.text_projection = nn.Parameter(width**-0.5 * torch.randn(width, cfg.embed_dim))
        nn.init.normal_(self.token_embedding.weight, std=0.02)

    def forward(self, tokens):
        x = self.token_embedding(tokens) + self.positional_embedding[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        x = self.ln_final(x)
        # pool at the end-of-text token, which has the largest id in each caption
        eot = x[torch.arange(x.size(0), device=x.device), tokens.argmax(dim=-1)]
        return eot @ self.text_projection


class CLIP(nn.Module):
    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.visual = VisionTransformer(cfg)
        self.text = TextTransformer(cfg)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, images, tokens):
        image_features = l2_normalize(self.visual(images))
        text_features = l2_normalize(self.text(tokens))
        logit_scale = self.logit_scale.exp()
        logits_per_image = logit_scale * image_features @ text_features.t()
        return logits_per_image
