"""Maps the design card's top-level folders under the one import name `flashkern`.

kernels/ -> flashkern.kernels, reference/ -> flashkern.reference, autotune/ -> flashkern.autotune.
Sub-packages (one per operator family) are found automatically, so adding a family needs no edit here.
"""

from setuptools import find_packages, setup

ROOTS = {
    "flashkern": "flashkern",
    "flashkern.kernels": "kernels",
    "flashkern.reference": "reference",
    "flashkern.autotune": "autotune",
}

setup(
    package_dir=ROOTS,
    py_modules=["flashkern_cli"],  # the command line's front door (flashkern_cli.py): no heavy imports
    packages=[f"{name}.{sub}" if sub else name for name, folder in ROOTS.items() for sub in ["", *find_packages(folder)]],
)
