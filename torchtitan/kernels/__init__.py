"""Fused Triton and cuBLASLt kernels, and the converters that put them in a model (never imported by a model).

- triton_support.py: Triton where it is installed (and its CPU interpreter for tests); where a kernel path applies.
- cublaslt.py: cuBLASLt GEMMs with GELU epilogues, through ctypes.
- adaln_norm.py: adaLN's modulated norm after a gated residual add, one kernel each way.
- mlp.py: the MLP's bias + activation kernels, and the GELU MLP as cuBLASLt GEMMs.
- qkv.py: the attention's qkv Linear whose backward assembles the q, k, v gradients and the bias sum in one kernel.
- dit_modules.py: the DiT's modules that call them, with the plain modules' parameter names.
- converters.py: `[model] converters` -> apply_converters, called by parallelize_dit; float8 through torchao.
"""
