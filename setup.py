"""Maps the repository's top-level folders under one import package, `fleetserve`.

The folders stay where they are (`scheduler/`, `replica/`, ...); what an install puts
on the import path is `fleetserve` with them as subpackages (`fleetserve.scheduler`, ...),
for regular and editable installs alike. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

SUBPACKAGES = ["scheduler", "replica", "router", "cluster", "kv_transfer", "sim"]

packages = ["fleetserve"]
package_dir = {"fleetserve": "fleetserve"}
for top in SUBPACKAGES:
    package_dir[f"fleetserve.{top}"] = top
    packages += [f"fleetserve.{top}"] + [f"fleetserve.{top}.{sub}" for sub in find_packages(top)]

setup(packages=packages, package_dir=package_dir)
