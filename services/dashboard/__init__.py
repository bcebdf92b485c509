"""The dashboard: the running cluster as a live web page and a Prometheus ``/metrics``.

Read-only over the cluster's Redis (`common.records`): `state` reads what the
page draws, `tails` keeps each job's streams between looks, `prometheus` is
the scrape-time collector, `app` the HTTP routes, `main` the service
(`asteroid-dashboard`; `asteroid dashboard` runs it in the foreground).
"""

__all__ = ["DEFAULT_PORT"]

DEFAULT_PORT = 8050
"""The dashboard's usual port (the gateway's is 8000); here, so that `asteroid dashboard`'s
option knows it without loading the settings."""
