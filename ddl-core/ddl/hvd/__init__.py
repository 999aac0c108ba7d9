"""The Horovod-level layer, framework-free: what ``ddl.torch`` and ``ddl.tensorflow`` share.

- :mod:`.negotiate`: the identity exchange every Horovod-level call starts with, and the
  handle type of the ``*_async`` calls;
- :mod:`.collectives`: each Horovod collective's one plan (scaling, compression, grouping);
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
