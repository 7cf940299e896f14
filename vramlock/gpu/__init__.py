"""The GPU's own interfaces: each binding in one module, nothing above them.

cuda    the CUDA driver (its checkpoint API), through ctypes
nvml    NVML, through pynvml: what the GPUs are and what they hold
swap/   the preload library behind ``--release swap``, and building it
"""
