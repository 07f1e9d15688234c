"""CUDA C++ sources compiled at run time by CuPy (installed as ``commpress.kernels``)."""
