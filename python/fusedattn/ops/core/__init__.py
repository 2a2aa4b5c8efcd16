"""The machinery every op family stands on, and nothing op-specific: the backend registry, the
refusals and `auto`'s choice (backends.py, auto.py with its generated auto_table.py), the
eager calls' plan cache and the tracing switch (plans.py), Triton launching with its launch
cache (triton_launch.py), the CUDA extension's loader and first-use build (extension.py),
what kernel launchers read of the process and the devices (kernels.py), and the output
buffers (outputs.py). Imports nothing of ops above it."""
