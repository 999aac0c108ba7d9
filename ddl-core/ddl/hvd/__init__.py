"""The Horovod-level layer, framework-free: what ``ddl.torch`` and ``ddl.tensorflow`` share.

- :mod:`.negotiate`: submitting a Horovod-level call, and the handle of the ``*_async``
  calls (a ``ddl.Handle``);
- :mod:`.control`: the identity exchange every Horovod-level call starts with, and each
  process set's state; :mod:`.descriptor`: what the exchange carries, and the mismatch
  message; :mod:`.fold`: the exchange riding on the data's first step;
- :mod:`.collectives`: where every Horovod collective is found, and the reductions' plans
  (scaling, compression, grouping); :mod:`.movement` (allgather, broadcast, alltoall),
  :mod:`.objects` (objects, barrier), :mod:`.adasum_plan`: the other plans;
  :mod:`.arguments`: the checks they share;
- :mod:`.join`: ``hvd.join()``: a rank out of data keeps serving the others;
- :mod:`.fusion`: the DistributedOptimizer's fusion-buffer planning;
- :mod:`.compression`: Horovod's compressor objects;
- :mod:`.arrays`: the few array operations above, for numpy arrays and torch tensors;
- :mod:`.lifecycle`: ``hvd.init()``/``hvd.shutdown()`` with the collective shutdown step,
  and what this build has (``mpi_built()``...);
- :mod:`.settings`: the environment variables of this layer.

Nothing here imports a framework (a test imports it with torch and tensorflow made
unimportable).
"""
