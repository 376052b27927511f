"""The SU-ALS engine: clusters, per-half-step task graphs and reductions on Dask."""
