"""Triton kernels of fusedattn, installed as `fusedattn.triton_kernels`.

Only @triton.jit kernels and their config/heuristics live here; launchers, autograd and
dispatch are in `fusedattn.ops`. Importing this package does not import triton: kernel
modules do, so `import fusedattn` works where triton is absent.
"""
