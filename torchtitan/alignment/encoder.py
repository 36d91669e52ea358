"""The frozen encoder of representation alignment: clean images in, one feature per DiT token out.

REPA (sihyun-yu/REPA, train.py's `preprocess_raw_image` for DINOv2) takes uint8 images, divides by 255, normalizes
with ImageNet's mean and std, resizes bicubically to 224 * (resolution // 256) and keeps DINOv2's
`x_norm_patchtokens`. We take our images in [-1, 1] and resize to patch_size x the DiT's token grid, which is REPA's
size on its configurations (224 for 16 x 16 tokens at 256 px, 448 for 32 x 32 at 512 px) and lets any grid align
one feature per token. Grey images are repeated to RGB.

The encoder never trains and never enters a checkpoint: it is no part of the model. It runs without grad, in eval
mode, under bf16 autocast on a bf16 run (as REPA's accelerator autocast; its matmul weights are kept in bf16, which
is what autocast would cast them to each step), compiled when the run compiles its model.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.alignment.dinov2_weights import read_dinov2
from torchtitan.alignment.vit import VisionTransformer, ViTArgs

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm's IMAGENET_DEFAULT_MEAN / _STD, as REPA normalizes DINOv2's input
IMAGENET_STD = (0.229, 0.224, 0.225)


class FrozenEncoder(nn.Module):
    """DINOv2 patch features of images in [-1, 1]: (B, C, H, W) -> (B, grid^2, D).

    Args:
        args: the ViT's architecture at the DiT's token grid.
        state_dict: its weights (dinov2_weights.read_dinov2).
        bf16: run under bf16 autocast with bf16 matmul weights (CUDA runs in bf16).
    """

    def __init__(self, args: ViTArgs, state_dict: dict[str, torch.Tensor], bf16: bool = False):
        super().__init__()
        self.vit = VisionTransformer(args)
        self.vit.load_state_dict(state_dict, strict=True)
        self.bf16 = bf16
        if bf16:  # what autocast casts them to anyway; norms, tokens, positions and LayerScale stay fp32
            for module in self.vit.modules():
                if isinstance(module, nn.Linear | nn.Conv2d):
                    module.to(torch.bfloat16)
        self.requires_grad_(False)
        self.eval()
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    @property
    def feature_dim(self) -> int:
        return self.vit.args.dim

    def train(self, mode: bool = True) -> "FrozenEncoder":
        return super().train(False)  # always eval

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] (B, 1 or 3, H, W) -> ImageNet-normalized RGB at the encoder's size, in float32."""
        x = (images.float() + 1) / 2  # [0, 1], REPA's x / 255
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = (x - self.mean) / self.std
        size = self.vit.args.image_size
        return F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False)  # REPA: normalize, resize

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.preprocess(images)
        with torch.autocast(x.device.type, torch.bfloat16, enabled=self.bf16):
            return self.vit.forward_features(x)["x_norm_patchtokens"].float()  # (B, T, D)


def build_encoder(alignment_config, grid: int, device: torch.device, bf16: bool, compile: bool) -> nn.Module:
    """The `[alignment]` encoder (encoder = "dinov2") for a DiT of `grid` x `grid` tokens, on `device`.

    Raises:
        FileNotFoundError, ValueError: alignment.encoder_path is missing or holds no DINOv2 weights (named).
    """
    args, state = read_dinov2(alignment_config.encoder_path, grid)
    encoder = FrozenEncoder(args, state, bf16=bf16).to(device)
    if compile:
        encoder.vit.forward_features = torch.compile(encoder.vit.forward_features)
    return encoder
