"""The SU-ALS engine on Dask. Read its modules in this order:

1. :mod:`.plan`: p and q for each half-step from sizes and memory (the paper's model);
2. :mod:`.placement`: which worker holds each block, factor piece and reduction slice;
3. :mod:`.tasks`: the pure functions that run on the workers (load, update, hermitian, ...);
4. :mod:`.reduce`: the reductions of partial Hermitians when p > 1;
5. :mod:`.halfstep`: one half-step as a task graph (model or data parallel);
6. :mod:`.fit`: the loop (start or resume, iterate, score, checkpoint);
7. :mod:`.session`: a finished fit's factors on the workers (export, gather, recommend).

:mod:`.cluster` makes clients and tells the planner what the workers have (from a running
cluster, or for a local one from this machine without starting it); :mod:`.costs` prices
a half-step for the planner and for the job forecast (:mod:`cumf_dask.budget`); :mod:`.watch`
is how every wait of the engine fails fast (a lost or memory-starved worker) instead of
hanging, and :mod:`.fit` recovers from a lost worker. What a row update solves (explicit
ratings or implicit feedback, Cholesky or CG) is the backend's
:class:`~cumf_dask.backend.objective.UpdateSpec`; the engine only adds what the implicit
model and CG need: the fixed factor's Gram each half-step and the solved factor's previous
iterate (:mod:`.halfstep`).
"""
