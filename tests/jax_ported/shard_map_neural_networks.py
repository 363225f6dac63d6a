# The "Neural networks" section of jax's shard_map tutorial (docs/notebooks/shard_map.py, jax v0.10.2:
# https://github.com/jax-ml/jax/blob/jax-v0.10.2/docs/notebooks/shard_map.py, lines 1275-1537: data
# parallelism, FSDP, tensor parallelism, FSDP + TP), unchanged, after the notebook's set-up lines that
# it relies on (lines 47-48, 55-60, 86, 108). Random data, as in the notebook.
# tests/unit/test_switch_ported.py runs it with and without jax_blink's switch.
import os
os.environ["XLA_FLAGS"] = '--xla_force_host_platform_device_count=8' # Use 8 CPU devices
from functools import partial

import jax
import jax.numpy as jnp

from jax.sharding import Mesh, PartitionSpec as P
from jax.tree_util import tree_map, tree_all
from jax.sharding import NamedSharding
# ### Neural networks
#
# We can use `shard_map` to parallelize computation in neural networks, either by
# itself or in combination with the automatic partitioning in `jax.jit`. This
# section has a few examples based on this toy neural network and random data:

# +
import jax
import jax.numpy as jnp

def predict(params, inputs):
  for W, b in params:
    outputs = jnp.dot(inputs, W) + b
    inputs = jax.nn.relu(outputs)
  return outputs

def loss(params, batch):
  inputs, targets = batch
  predictions = predict(params, inputs)
  return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


# +
def init_layer(key, n_in, n_out):
  k1, k2 = jax.random.split(key)
  W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
  b = jax.random.normal(k2, (n_out,))
  return W, b

def init(key, layer_sizes, batch_size):
  key, *keys = jax.random.split(key, len(layer_sizes))
  params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

  key, *keys = jax.random.split(key, 3)
  inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
  targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

  return params, (inputs, targets)


# +
layer_sizes = [784, 128, 128, 128, 128, 128, 8]
batch_size = 32

params, batch = init(jax.random.key(0), layer_sizes, batch_size)
# -

# Compare these examples with the purely [automatic partitioning examples in the
# "Distributed arrays and automatic partitioning"
# doc](https://docs.jax.dev/en/latest/parallel.html).
# While in those automatic partitioning examples we don't need to edit the model
# functions to use different parallelization strategies, with `shard_map` we
# often do.
#
# #### 8-way batch data parallelism
#
# The simplest multi-device parallelism strategy is to shard the batch of inputs
# and targets over multiple devices, replicate the parameters over those devices,
# and apply the model in parallel to those shards of data. To evaluate the total
# loss, the devices need only communicate with a scalar-sized all-reduce-sum at
# the end. (To evaluate the gradient of the loss, the devices must perform
# all-reduce-sums of parameter gradients in the backward pass.)

# +
from jax.sharding import Mesh, PartitionSpec as P

mesh = jax.make_mesh((8,), ('batch',))
jax.set_mesh(mesh)

# replicate initial params on all devices, shard data batch over devices
batch = jax.device_put(batch, NamedSharding(mesh, P('batch')))
params = jax.device_put(params, NamedSharding(mesh, P()))

# adapt the loss function to sum the losses across devices
@jax.shard_map(out_specs=P())
def loss_dp(params, local_batch):
  inputs, targets = local_batch
  predictions = predict(params, inputs)  # use reference 'predict`
  local_loss = jnp.mean(jnp.sum((predictions - targets)**2, axis=-1))
  return jax.lax.pmean(local_loss, 'batch')


# -

# We can check that the loss and its gradients match the reference (base) model:

print(jax.jit(loss)(params, batch))
print(jax.jit(loss_dp)(params, batch))


# +
def allclose(a, b):
  return tree_all(tree_map(partial(jnp.allclose, atol=1e-2, rtol=1e-2), a, b))

print(allclose(jax.jit(jax.grad(loss))(params, batch),
               jax.jit(jax.grad(loss_dp))(params, batch)))
# -

# We can print the compiler IR to inspect the gradient computation and verify
# that the collective all-reduce-sum operations happen where we'd expect: at the
# end of the forward pass to compute the loss value, and in the backward pass to
# compute the total parameter gradients.
#
# #### 8-way fully sharded data parallelism (FSDP)
#
# Another strategy is to additionally shard the parameters over the devices,
# all-gathering each one when the full value is needed for the `jnp.dot` or bias
# addition. Since we only have one full parameter in local device memory at a
# time, rather than keeping all parameters in all device memories as in the
# preceding DP example, we free up significant memory that we can use for larger
# models or larger batch sizes. And because XLA will overlap computation and
# inter-device communication, the wall-clock time doesn't suffer.
#
# So now we need collectives in two places: the model prediction function
# `predict` needs to all-gather the parameters before they're used, and as in the
# DP case the loss function needs to sum the local losses to compute the total
# loss.
#
# There's one other ingredient we need: we don't want to store the fully gathered
# parameters from the forward pass for use on the backward pass. Instead, we want
# to gather them again on the backward pass. We can express that by using
# `jax.remat` with a [custom
# policy](https://docs.jax.dev/en/latest/notebooks/autodiff_remat.html#custom-policies-for-what-s-saveable)
# (or a `custom_vjp`), though XLA typically does that rematerialization
# automatically.
#
# This general [FSDP
# approach](https://engineering.fb.com/2021/07/15/open-source/fsdp/) is similar
# to [weight update sharding (WUS)](https://arxiv.org/abs/2004.13336) and
# [ZeRO-3](https://arxiv.org/abs/1910.02054).

# +
# shard data batch *and params* over devices
mesh = jax.make_mesh((4,), ('batch',))
jax.set_mesh(mesh)
batch = jax.device_put(batch, P('batch'))
params = jax.device_put(params, P('batch'))

# adapt the prediction function to gather weights just before their use,
# and to re-gather them on the backward pass (rather than saving them)
@partial(jax.remat, policy=lambda op, *_, **__: str(op) != 'all_gather')
def predict_fsdp(params_frag, inputs):
  for W_frag, b_frag in params_frag:
    W = jax.lax.all_gather(W_frag, 'batch', tiled=True)
    b = jax.lax.all_gather(b_frag, 'batch', tiled=True)
    outputs = jnp.dot(inputs, W) + b
    inputs = jax.nn.relu(outputs)
  return outputs

@jax.shard_map(out_specs=P())
def loss_fsdp(local_params, local_batch):
  inputs, targets = local_batch
  predictions = predict_fsdp(local_params, inputs)
  local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
  return jax.lax.pmean(local_loss, 'batch')


# -

# Again we can check that the loss and its gradients match the reference model:

# +
repl_params = jax.device_put(params, P())
repl_batch = jax.device_put(batch, P())
print(jax.jit(loss)(repl_params, repl_batch))
print(jax.jit(loss_fsdp)(params, batch))

print(allclose(jax.jit(jax.grad(loss))(repl_params, repl_batch),
               jax.jit(jax.grad(loss_fsdp))(params, batch)))
# -

# #### 8-way tensor parallelism (TP)
#
# Usually we don't use tensor model parallelism by itself, but seeing it in
# isolation is a good warmup on parallel matrix multiplication. It's also a good
# example of using `shard_map` in a library function, called in a larger
# `jit`-based computation.
#
# The parallelization idea is that we'll keep the data/activations sharded over
# its feature axis (rather than its batch axis), and we'll similarly shard weight
# matrices over their input-feature axis (and biases over their feature axis).
# Then to perform the parallel matrix multiplication, we'll perform local matrix
# multiplications followed by a `psum_scatter` to sum the local results and
# efficiently scatter the result's shards.

# +
mesh = jax.make_mesh((8,), ('feats',))
jax.set_mesh(mesh)

batch = jax.device_put(batch, NamedSharding(mesh, P(None, 'feats')))
params = jax.device_put(params, NamedSharding(mesh, P('feats')))

def predict_tp(params, inputs):
  for W, b in params:
    outputs = gemm_tp(inputs, W, b)
    inputs = jax.nn.relu(outputs)
  return outputs

@jax.shard_map(in_specs=(P(None, 'feats'), P('feats', None), P('feats')),
               out_specs=P(None, 'feats'))
def gemm_tp(inputs, W, b):
  block_result = jnp.dot(inputs, W)
  return jax.lax.psum_scatter(block_result, 'feats',
                              scatter_dimension=1, tiled=True) + b

def loss_tp(params, batch):
  inputs, targets = batch
  predictions = predict_tp(params, inputs)
  return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))  # NOTE psum!


# -

# #### FSDP + TP, with `shard_map` at the top level
#
# We can compose these strategies together, using multiple axes of parallelism.

# +
mesh = jax.make_mesh((4, 2), ('batch', 'feats'))
jax.set_mesh(mesh)

batch = jax.device_put(batch, NamedSharding(mesh, P('batch', 'feats')))
params = jax.device_put(params, NamedSharding(mesh, P(('feats', 'batch'))))

# mostly same as previous predict_fsdp definition, except we call gemm_tp
@partial(jax.remat, policy=lambda op, *_, **__: str(op) != 'all_gather')
def predict_fsdp_tp(params_frag, inputs):
  for W_frag, b_frag in params_frag:
    W = jax.lax.all_gather(W_frag, 'batch', tiled=True)
    b = jax.lax.all_gather(b_frag, 'batch', tiled=True)
    block_result = jnp.dot(inputs, W)
    outputs = jax.lax.psum_scatter(block_result, 'feats',
                                   scatter_dimension=1, tiled=True) + b
    inputs = jax.nn.relu(outputs)
  return outputs

@jax.shard_map(in_specs=(P(('feats', 'batch')), P('batch', 'feats')),
               out_specs=P())
def loss_fsdp_tp(local_params, local_batch):
  inputs, targets = local_batch
  predictions = predict_fsdp_tp(local_params, inputs)
  sq_err = jax.lax.psum(jnp.sum((predictions - targets) ** 2, axis=-1), 'feats')
  return jax.lax.pmean(jnp.mean(sq_err), 'batch')


# -

# Notice how we have to do _two_ collective reductions: one over `'feats'` and
# one over `'batch'`. In the pure TP example, we didn't write the `'feats'`
# reduction explicitly because we only used `shard_map` within `gemm_tp`; in the
# caller `loss_tp`, the compiler automatically translated our use of `jnp.sum` to
# perform a `psum` as needed given the sharded result returned by `predict_tp`.

# +
repl_params = jax.device_put(params, P())
repl_batch = jax.device_put(batch, P())
print(jax.jit(loss)(repl_params, repl_batch))
print(jax.jit(loss_fsdp_tp)(params, batch))

print(allclose(jax.jit(jax.grad(loss))(repl_params, repl_batch),
               jax.jit(jax.grad(loss_fsdp_tp))(params, batch)))
# -

