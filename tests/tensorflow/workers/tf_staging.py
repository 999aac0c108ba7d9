"""ddl.tensorflow's host staging of GPU tensors, named in the timeline. This machine's
TensorFlow has no GPU, so the device check is told the inputs live on GPU:0 (TensorFlow's
soft placement then keeps the copies on the CPU): what runs is the staging path itself,
its two named ranges and their byte counts, on 1 rank.

argv[1]: the timeline file. Prints one JSON line."""

import json
import sys

import numpy as np
import tensorflow as tf

import ddl.tensorflow as hvd
from ddl.tensorflow import op_runner

hvd.init()
GPU = "/job:localhost/replica:0/task:0/device:GPU:0"


class OnGpu:
    device = GPU


class OnCpu:
    device = "/job:localhost/replica:0/task:0/device:CPU:0"


found = {"gpu": op_runner._accelerator([OnCpu(), OnGpu()]),
         "cpu": op_runner._accelerator([OnCpu(), tf.ones(2)])}
hvd.start_timeline(sys.argv[1])
x = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
plain = hvd.allreduce(x, op=hvd.Sum)  # a host tensor: no staging
op_runner._accelerator = lambda inputs: GPU
staged = hvd.allreduce(x, op=hvd.Sum, name="staged")
gathered = hvd.allgather(tf.ones((2, 3), tf.float64))
hvd.stop_timeline()
print(json.dumps({"found": found, "plain": plain.numpy().tolist(),
                  "staged": staged.numpy().tolist(), "gathered": gathered.shape.as_list()}))
