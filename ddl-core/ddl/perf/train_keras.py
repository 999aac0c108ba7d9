"""``ddl-perf train --framework keras``: the same measurement as the PyTorch one
(``train.py``), for Keras 3 on its TensorFlow backend::

    ddlrun -n 2 ddl-perf train --framework keras --model gpt2 --layers 2 --width 256 \\
        --heads 4 --seq-len 128 --via optimizer
    ddlrun -n 2 ddl-perf train --framework keras --model resnet50 --batch 16 --via mwms

Models (``build``):

- ``resnet50``: ``keras.applications.ResNet50(weights=None)`` (nothing downloaded), logits
  out. Keras's count is 25,636,712 against torchvision's 25,557,032: its convolutions
  carry a bias (26,560 more weights, trainable) and ``count_params`` includes the batch
  norms' moving mean and variance (53,120, torch's buffers, which torch's count leaves
  out). It is ResNet v1 (the stride on the first 1x1 convolution), torchvision's v1.5 puts
  it on the 3x3: the same weights, a little less compute. It has no stem-width knob, so
  ``--width`` is refused for it.
- ``gpt2``: the decoder of ``models.py`` in Keras layers: token and position embeddings,
  pre-norm blocks of causal ``MultiHeadAttention`` (its query, key, value and output
  projections are torch's qkv and proj: 4 d^2 + 4 d) and a 4x GELU (tanh) MLP, a final
  layer norm, the head tied to the token embedding: the same 12 d^2 + 13 d per block and
  the same total as ``models.gpt2_params``.

``--via`` (``VIAS``), and what the compute-only step is for each:

- ``optimizer``: ``ddl.keras.DistributedOptimizer(SGD)`` applied in a ``tf.function``
  train step (a ``tf.GradientTape``, then ``optimizer.apply``, where ddl averages the
  gradients in one grouped allreduce). Compute: the same step on the same model with a
  plain SGD of its own.
- ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` (RING), one worker per rank,
  ``TF_CONFIG`` built from the job (``mwms_strategy``), a custom loop as in
  ``keras_bench`` (Keras 3.15's ``fit`` fails inside the strategy's scope). Compute: a
  twin model built outside the strategy (same seed), plain SGD, no all-reduce.
- ``alone``: a plain SGD, every rank training its own copy at the same time: the
  no-communication reference (its comm share is the noise between identical steps).

Precision (``POLICIES``): Keras dtype policies set before the model is built: ``fp32``
``float32``, ``bf16`` ``bfloat16`` (weights and math), ``amp`` ``mixed_bfloat16``
(float32 weights, bfloat16 math). The loss is taken in float32.

A step: the batch taken (synthetic: one batch made once per rank, so input is ~0), the
``tf.function`` called and its loss fetched, which waits for the update (its stateful ops
run before the function returns). Both functions are traced (run once, untimed) before
the first round. Rounds, medians and shares are ``train_result.measure``'s and
``summarize``'s, so the JSON is the same document with ``"framework": "keras"`` and
``ddl-perf scale --framework keras`` works unchanged. Threads: ``TF_NUM_INTRAOP_THREADS``
when set; else ``OMP_NUM_THREADS`` (ddlrun sets it); else cores per rank - 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from .models import ModelSpec
from .train_result import KERAS_VIAS as VIAS
from .train_result import format_result, measure, summarize, write_json

POLICIES = {"fp32": "float32", "bf16": "bfloat16", "amp": "mixed_bfloat16"}
RESNET50_PARAMS = 25_636_712  # count_params(): with conv biases and batch-norm statistics

def check(spec: ModelSpec, via: str, data: str | None) -> None:
    """The Keras-only checks of a request (ValueError naming the flag); imports nothing."""
    if via not in VIAS:
        raise ValueError(f"--via {via} is a PyTorch exchange; with --framework keras choose "
                         f"one of {', '.join(VIAS)}")
    if data is not None:
        raise ValueError("--data: --framework keras trains on synthetic data only; drop "
                         "--data or use --framework torch")
    if spec.name == "resnet50" and spec.width not in (None, 64):
        raise ValueError(f"--width {spec.width}: keras.applications.ResNet50 has no stem "
                         "width knob; drop --width with --framework keras")


# ------------------------------------------------------------------------ the models
def build(keras: Any, spec: ModelSpec) -> Any:
    """The Keras model of ``spec``, built (seeded: every rank makes the same weights), under
    whatever dtype policy is set."""
    spec.validate()
    keras.utils.set_random_seed(0)
    if spec.name == "resnet50":
        return keras.applications.ResNet50(
            weights=None, input_shape=(spec.image_size, spec.image_size, 3),
            classes=spec.classes, classifier_activation=None)
    model = _gpt2(keras, spec)
    model(keras.ops.zeros((1, spec.seq_len), dtype="int32"))  # creates the variables
    return model


def _gpt2(keras: Any, spec: ModelSpec) -> Any:
    from keras import layers, ops

    d, heads = spec.model_width, spec.heads
    init = keras.initializers.RandomNormal(stddev=0.02)  # models.py's normal_(std=0.02)

    class Block(layers.Layer):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.ln1 = layers.LayerNormalization(epsilon=1e-5)
            self.attn = layers.MultiHeadAttention(num_heads=heads, key_dim=d // heads,
                                                  kernel_initializer=init)
            self.ln2 = layers.LayerNormalization(epsilon=1e-5)
            self.fc = layers.Dense(4 * d, kernel_initializer=init)
            self.out = layers.Dense(d, kernel_initializer=init)

        def call(self, x: Any) -> Any:
            h = self.ln1(x)
            x = x + self.attn(h, h, use_causal_mask=True)
            return x + self.out(keras.activations.gelu(self.fc(self.ln2(x)), approximate=True))

    class GPT2(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="gpt2")
            self.wte = layers.Embedding(spec.vocab, d, embeddings_initializer=init)
            self.wpe = layers.Embedding(spec.seq_len, d, embeddings_initializer=init)
            self.blocks = [Block(name=f"block{i}") for i in range(spec.layers)]
            self.ln_f = layers.LayerNormalization(epsilon=1e-5)

        def call(self, tokens: Any) -> Any:
            x = self.wte(tokens) + self.wpe(ops.arange(ops.shape(tokens)[1]))[None]
            for block in self.blocks:
                x = block(x)
            x = self.ln_f(x)
            # the tied head; under mixed_bfloat16 the table is float32, the activations not
            return ops.matmul(x, ops.transpose(ops.cast(self.wte.embeddings, x.dtype)))

    return GPT2()


def synthetic_batch(spec: ModelSpec, batch: int, seed: int) -> tuple[Any, Any]:
    """One batch of numpy inputs and targets: NHWC images, or tokens and shifted targets."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if spec.name == "resnet50":
        x = rng.standard_normal((batch, spec.image_size, spec.image_size, 3), dtype=np.float32)
        return x, rng.integers(0, spec.classes, batch, dtype=np.int32)
    tokens = rng.integers(0, spec.vocab, (batch, spec.seq_len + 1), dtype=np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def per_sample_loss(keras: Any, spec: ModelSpec, target: Any, logits: Any) -> Any:
    """Cross-entropy per sample in float32 (gpt2: the mean over its tokens)."""
    loss = keras.losses.sparse_categorical_crossentropy(
        target, keras.ops.cast(logits, "float32"), from_logits=True)
    return loss if spec.name == "resnet50" else keras.ops.mean(loss, axis=-1)


# --------------------------------------------------------- MultiWorkerMirroredStrategy
def job_address() -> tuple[str, int]:
    """This rank's address towards rank 0 (``MASTER_ADDR``) and a free TCP port on it."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))  # UDP: no packet sent, only the route chosen
        host = s.getsockname()[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def mwms_strategy(hvd: Any) -> Any:
    """A MultiWorkerMirroredStrategy (RING) over the ddl job, one worker per rank, its
    ``TF_CONFIG`` made from every rank's ``job_address()``: call before any TensorFlow op
    (the strategy must configure the runtime first)."""
    host, port = job_address()
    workers = [f"{h}:{p}" for h, p in hvd.allgather_object((host, port))]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": hvd.rank()}})
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


# ------------------------------------------------------------------ one rank's steps
def _sgd(keras: Any) -> Any:
    return keras.optimizers.SGD(0.01, momentum=0.9)  # as the torch trainer's


def _train_step(tf: Any, keras: Any, spec: ModelSpec, model: Any, optimizer: Any,
                global_batch: int | None = None) -> Callable[[Any, Any], Any]:
    """forward + backward + ``optimizer.apply`` of one batch (not yet a tf.function): the
    loss averaged over this rank's batch, or over ``global_batch`` under a strategy."""

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            per_sample = per_sample_loss(keras, spec, y, model(x, training=True))
            if global_batch is None:
                loss = keras.ops.mean(per_sample)
            else:
                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return step


class KerasTrainer:
    """The model(s) of ``cfg`` on this rank and two compiled steps, ``step`` (with the
    exchange) and ``compute`` (without), shaped as ``train_result.Trainer`` for ``measure``."""

    def __init__(self, cfg: Any, hvd: Any, tf: Any, keras: Any, strategy: Any) -> None:
        spec = cfg.model
        self.spec = spec
        if cfg.via == "mwms":
            with strategy.scope():
                model = build(keras, spec)
                opt = _sgd(keras)
                opt.build(model.trainable_variables)
            local = _train_step(tf, keras, spec, model, opt,
                                cfg.batch * strategy.num_replicas_in_sync)

            def with_exchange(x: Any, y: Any) -> Any:
                per_replica = strategy.run(local, args=(x, y))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

            twin = build(keras, spec)  # outside the scope: the default strategy, no all-reduce
            plain = _train_step(tf, keras, spec, twin, _sgd(keras))
        else:
            model = build(keras, spec)
            plain = _train_step(tf, keras, spec, model, _sgd(keras))
            with_exchange = plain
            if cfg.via == "optimizer":
                opt = hvd.DistributedOptimizer(_sgd(keras))
                opt.build(model.trainable_variables)
                with_exchange = _train_step(tf, keras, spec, model, opt)
                hvd.broadcast_variables(model.variables, 0)
        self.model, self.params = model, int(model.count_params())
        # no Python control flow to convert; XLA cannot compile ddl's numpy_function
        self._step = tf.function(with_exchange, jit_compile=False, autograph=False)
        self._compute = (self._step if plain is with_exchange
                         else tf.function(plain, jit_compile=False, autograph=False))
        self.tf = tf

    def trace(self, x: Any, y: Any) -> None:
        """Both steps run once, untimed: tracing a ResNet-50 takes longer than many steps,
        and no round, even with ``--warmup 0``, should pay for it."""
        self._step(x, y).numpy()
        self._compute(x, y).numpy()

    def to_device(self, x: Any, y: Any) -> tuple[Any, Any]:
        return self.tf.constant(x), self.tf.constant(y)

    def step(self, batches: Iterator[Any]) -> tuple[float, float, None, Any]:
        """(step, input, None, the batch) of one real training step."""
        import time

        t0 = time.perf_counter()
        x, y = next(batches)
        t1 = time.perf_counter()
        self._step(x, y).numpy()
        return time.perf_counter() - t0, t1 - t0, None, (x, y)

    def compute(self, x: Any, y: Any) -> float:
        """The same step without the exchange, on a batch already there."""
        import time

        t0 = time.perf_counter()
        self._compute(x, y).numpy()
        return time.perf_counter() - t0


def _threads(tf: Any, local_size: int) -> int:
    """Intra-op threads: TF's own env var, else OMP_NUM_THREADS, else cores per rank - 1
    (a core left for ddl's progress threads), as the torch trainer does."""
    if not os.environ.get("TF_NUM_INTRAOP_THREADS"):
        omp = os.environ.get("OMP_NUM_THREADS")
        n = int(omp) if omp else max(1, (os.cpu_count() or 1) // local_size - 1)
        tf.config.threading.set_intra_op_parallelism_threads(n)
    return tf.config.threading.get_intra_op_parallelism_threads()


def _device(tf: Any, want: str, local_rank: int) -> str:
    """Make this rank's device the only one TensorFlow sees; its name, in words."""
    gpus = tf.config.list_physical_devices("GPU")
    if want == "cuda" and not gpus:
        raise ValueError("--device cuda: TensorFlow sees no GPU here (tensorflow-cpu, or no "
                         "CUDA); drop --device or use --device cpu")
    if want == "cpu" or not gpus:
        if gpus:
            tf.config.set_visible_devices([], "GPU")
        return "cpu"
    gpu = gpus[local_rank % len(gpus)]
    tf.config.set_visible_devices([gpu], "GPU")
    tf.config.experimental.set_memory_growth(gpu, True)
    return f"GPU {local_rank % len(gpus)}"


def train_keras(cfg: Any) -> int:
    """``ddl-perf train --framework keras`` on every rank of the job (or alone)."""
    import keras

    import ddl
    import ddl.keras as hvd

    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"--framework keras measures Keras on TensorFlow; KERAS_BACKEND is "
                         f"{keras.backend.backend()!r}: set KERAS_BACKEND=tensorflow")
    hvd.init()
    import tensorflow as tf

    rank = hvd.rank()
    threads = _threads(tf, hvd.local_size())
    dev = _device(tf, cfg.device, hvd.local_rank())
    strategy = mwms_strategy(hvd) if cfg.via == "mwms" else None  # before any other op
    keras.config.set_dtype_policy(POLICIES[cfg.precision])
    trainer = KerasTrainer(cfg, hvd, tf, keras, strategy)
    batch = trainer.to_device(*synthetic_batch(cfg.model, cfg.batch, rank))
    trainer.trace(*batch)
    batches: Iterator[Any] = iter(lambda: batch, None)
    mine = dataclasses.replace(measure(cfg, trainer, batches, ddl.barrier), rank=rank)
    times = sorted(hvd.allgather_object(mine), key=lambda t: t.rank)
    if rank == 0:
        where = (f"{dev}, Keras {keras.__version__} on TensorFlow {tf.__version__}, "
                 f"{threads or 'default'} intra-op thread(s) per rank")
        desc = "synthetic (one batch made once per rank, on the device: input time is ~0)"
        doc = summarize(cfg, times, trainer.params, desc, where)
        print(format_result(doc), flush=True)
        write_json(cfg, doc)
    return 0
