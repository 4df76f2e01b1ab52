"""The app builder a Ray Serve deploy config names (`app_spec.APP_BUILDER`).

`serve deploy serve.yaml` (and KubeRay's `serveConfigV2`) imports `APP_BUILDER` on the
cluster and calls it with `args`, the app config itself: the same `AppConfig` that
`fleetserve serve --config app.yaml` reads, built into the same application
(`deploy.build_app`). Unknown keys and bad values fail there with the field named,
before any replica starts, and `fleetserve build` runs the same validation first.
"""

from __future__ import annotations

from fleetserve.cluster.app_spec import validate_args
from fleetserve.cluster.deploy import build_app


def app_builder(args: dict):
    """Serve's import_path target: the app config (`args`) -> the fleetserve application."""
    return build_app(validate_args(args))
