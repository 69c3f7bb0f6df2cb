"""The package layout, which pyproject.toml cannot express without listing every subpackage.

The repository keeps its top-level folders (rlkit/, rollout/, train/, buffers/), and they all
install under ONE import namespace: rollout/ is `rlkit.rollout`, train/ is `rlkit.train`,
buffers/ is `rlkit.buffers`. So a user's own `train.py` or `rollout.py` (beside a recipe, or in a
folder a dotted-path plugin puts on sys.path) never shadows rlkit's code, in the driver or in a
Ray worker. Metadata and dependencies live in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = {"rlkit": "rlkit", "rlkit.rollout": "rollout", "rlkit.train": "train",
           "rlkit.buffers": "buffers"}

packages = []
for name, folder in FOLDERS.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(package_dir=FOLDERS, packages=packages)
