"""Data-parallel ResNet-18 training with jax_blink, written out as a user would write it.

    python examples/train_resnet.py --size tiny --steps 20 --collective blink   # CPU: 8 host devices
    python examples/train_resnet.py --size full --steps 50 --collective blink   # GPUs (224x224, 1000 classes)

As examples/train_gpt2.py, with BatchNorm: each device normalises with its own batch's statistics
(as DDP without SyncBatchNorm), and the running statistics travel in the gradients' buckets and
are averaged, so that every device keeps the same model. Needs ``pip install -e ".[train]"``.
"""
import argparse
import functools
import os

# Without GPUs JAX gives one CPU device, and a collective over one device moves nothing: ask XLA
# for 8 CPU host devices before JAX starts (GPUs ignore the flag), unless XLA_FLAGS names a count.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    print("XLA_FLAGS: this example asked XLA for 8 CPU host devices (used where there is no GPU)")
os.environ.setdefault("PJRT_NPROC", "16")  # enough CPU client threads for 8 host devices on a small machine

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_blink  # noqa: E402
from jax_blink.api.buckets import BucketLayout, bucketed  # noqa: E402
from jax_blink.tools.train.data import image_batches  # noqa: E402
from jax_blink.tools.train.models import SIZES, ResNet, resnet_loss  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=SIZES["resnet"], default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--collective", choices=("psum", "blink"), default="blink")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    args = ap.parse_args(argv)
    jax_blink.config.dispatch = "blink"  # always the executor

    cfg = SIZES["resnet"][args.size]
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    graphdef, params, stats = nnx.split(ResNet(cfg, rngs=nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    tx = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9))
    params, stats, opt_state = jax.device_put((params, stats, tx.init(params)), NamedSharding(mesh, P()))
    layout = BucketLayout.of((params, stats), int(args.bucket_mb * (1 << 20)))
    print(layout.describe())
    sum_over_devices = jax_blink.all_reduce if args.collective == "blink" else lax.psum

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P(), P("data")),
                       out_specs=(P(), P(), P(), P()))
    def step(params, stats, opt_state, batch):
        mine = jax.tree.map(lambda p: lax.pcast(p, "data", to="varying"), params)

        def loss_of(p):
            model = nnx.merge(graphdef, p, stats, copy=True)  # BatchNorm updates its statistics
            return resnet_loss(model, batch), nnx.state(model, nnx.BatchStat)

        (loss, new_stats), grads = jax.value_and_grad(loss_of, has_aux=True)(mine)
        grads, stats = bucketed((grads, new_stats), lambda buf: sum_over_devices(buf, "data") / n,
                                layout, ordered=True)  # jax_blink's calls in bucket order on every device
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, lax.pmean(loss, "data")

    data = image_batches(cfg, cfg.batch * n, count=4)
    for i in range(args.steps):
        batch = jax.device_put(data[i % len(data)], NamedSharding(mesh, P("data")))
        params, stats, opt_state, loss = step(params, stats, opt_state, batch)
        print(f"step {i} loss {float(loss):.6f}")
    # What ran the sums: jax_blink's custom call in the compiled step (lax.psum compiles to all-reduce).
    text = step.lower(params, stats, opt_state, batch).as_text()
    print(f"{n} x {jax.devices()[0].device_kind}: the step holds {text.count('@jax_blink_collective')} jax_blink "
          f"collective call(s) and {text.count('all_reduce')} XLA all-reduce(s) (--collective {args.collective})")


if __name__ == "__main__":
    main()
