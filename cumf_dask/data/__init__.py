"""Rating data: the Zarr store, its builders, ingestion and the synthetic generator.

* :mod:`.store`: :class:`~.store.RatingsStore`, the tiled on-disk format and its reader.
* :mod:`.target`: where a build writes, its writer lock, and how it is published (never over
  a foreign folder).
* :mod:`.bands`: writing one band and transposing, the pure functions every build runs.
* :mod:`.spill`: :class:`~.spill.StoreBuilder`, COO chunks of any size in bounded memory.
* :mod:`.duplicates`: the repeated-pair policy; :mod:`.hashing`: splitmix64 and the split.
* :mod:`.formats`, :mod:`.readers` and :mod:`.ingest`: rating files and in-memory ratings
  into a store; :mod:`.inputs`: what ``ALS.fit`` takes (pandas, Dask, SciPy, arrays).
* :mod:`.presets`, :mod:`.sampling`, :mod:`.planted`, :mod:`.synthetic`: the planted model
  and its parallel generator.

Nothing here imports the config schema: every function takes plain arguments and checks
them with :mod:`cumf_dask.checks` (a bad argument is a ConfigError, bad data an IngestError).
"""
