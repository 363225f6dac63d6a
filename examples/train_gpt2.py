"""Data-parallel GPT-2 training with jax_blink, written out as a user would write it.

    python examples/train_gpt2.py --size tiny --steps 20 --collective blink     # CPU: 8 host devices
    python examples/train_gpt2.py --size full --steps 50 --collective blink     # GPUs

Parameters replicated, the batch split over the mesh axis "data" (``jax.shard_map``), each
device's gradients summed over the axis in DDP-style buckets (:mod:`jax_blink.api.buckets`) by
``jax_blink.all_reduce`` (or ``lax.psum``). ``python -m jax_blink.tools.train`` is the same with timing.
Needs the train extra: ``pip install -e ".[train]"``.
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
from jax_blink.tools.train.data import token_batches  # noqa: E402
from jax_blink.tools.train.models import GPT2, SIZES, gpt2_loss  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=SIZES["gpt2"], default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--collective", choices=("psum", "blink"), default="blink")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    args = ap.parse_args(argv)
    # Always the executor (the default, "auto", sends sizes where psum was measured faster to it).
    jax_blink.config.dispatch = "blink"

    cfg = SIZES["gpt2"][args.size]
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    graphdef, params = nnx.split(GPT2(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    params, opt_state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
    layout = BucketLayout.of(params, int(args.bucket_mb * (1 << 20)))
    print(layout.describe())
    sum_over_devices = jax_blink.all_reduce if args.collective == "blink" else lax.psum

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))
    def step(params, opt_state, tokens):
        # This device's copy of the parameters: its gradient is its own (left replicated, jax
        # would sum the gradients itself, one all-reduce per leaf).
        mine = jax.tree.map(lambda p: lax.pcast(p, "data", to="varying"), params)
        loss, grads = jax.value_and_grad(lambda p: gpt2_loss(nnx.merge(graphdef, p), tokens))(mine)
        grads = bucketed(grads, lambda buf: sum_over_devices(buf, "data") / n, layout,
                         ordered=True)  # jax_blink's calls in bucket order on every device
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")

    data = token_batches(cfg, cfg.batch * n, count=4)
    for i in range(args.steps):
        tokens = jax.device_put(data[i % len(data)], NamedSharding(mesh, P("data")))
        params, opt_state, loss = step(params, opt_state, tokens)
        print(f"step {i} loss {float(loss):.6f}")
    # What ran the sums: jax_blink's custom call in the compiled step (lax.psum compiles to all-reduce).
    text = step.lower(params, opt_state, tokens).as_text()
    print(f"{n} x {jax.devices()[0].device_kind}: the step holds {text.count('@jax_blink_collective')} jax_blink "
          f"collective call(s) and {text.count('all_reduce')} XLA all-reduce(s) (--collective {args.collective})")


if __name__ == "__main__":
    main()
