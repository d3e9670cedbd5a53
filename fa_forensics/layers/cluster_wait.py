"""How long a Dask cluster may have no worker before a fan-out fails: a light module, so that the CLI's option
table can show the default without importing the fan-out (and torch)."""

WORKER_WAIT_SECONDS = 60.0  # at the start, or after losing every worker
