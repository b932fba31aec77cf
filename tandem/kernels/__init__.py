"""Compiled kernels (C++ today; Triton would go here), a leaf package: models and the
runner call them, they import nothing of tandem's."""
