"""tenantq.search: experiment specs, search spaces, objectives, the Optuna driver, the front.

`load_spec` validates a study TOML; `space.plan_from_params` is the one way trial parameters
become a `QuantPlan`; `SearchDriver` runs the study on Ray workers and records it in MLflow.
Importing this package loads no JAX, Ray or MLflow: the driver imports them when it runs.
"""

from tenantq.search.spec import ExperimentSpec, load_spec, parse_spec

__all__ = ["ExperimentSpec", "load_spec", "parse_spec"]
