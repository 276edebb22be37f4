"""Triton and TileLang implementations, one folder per operator family.

kernels/<family>/__init__.py holds the family's operator records (entry points, input maker,
comparison, cost model, presets); triton_kernels.py and tilelang_kernels.py hold one source per
DSL with its tuning space. kernels/_triton and kernels/_tilelang hold what the DSLs share.
"""

