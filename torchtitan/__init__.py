"""TorchDiTan: a distributed trainer for Diffusion Transformers, in the style of TorchTitan."""
