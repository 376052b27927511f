"""Rating data: the Zarr store, its builders, ingestion and the synthetic generator."""
