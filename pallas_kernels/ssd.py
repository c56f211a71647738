"""TEMPORARY (replaced by the ssd-kernel branch): the sequential SSD recurrence."""
import jax
import jax.numpy as jnp


def ssd_reference(x, dt, A, B, C, *, initial_state=None, return_final_state=False):
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    rep = h // g
    Bh = jnp.repeat(B.astype(jnp.float32), rep, axis=2)
    Ch = jnp.repeat(C.astype(jnp.float32), rep, axis=2)
    zero = jnp.einsum("bhp,bhn->bhpn", x[:, 0].astype(jnp.float32) * 0, Bh[:, 0] * 0 + Ch[:, 0] * 0 + dt[:, 0, :, None] * 0)
    s0 = zero if initial_state is None else initial_state.astype(jnp.float32) + zero

    def step(s, inp):
        xt, dtt, bt, ct = inp
        s = s * jnp.exp(dtt * A)[..., None, None] + (dtt[..., None] * xt)[..., None] * bt[:, :, None, :]
        return s, jnp.einsum("bhpn,bhn->bhp", s, ct)

    s, y = jax.lax.scan(step, s0, (x.astype(jnp.float32).swapaxes(0, 1), dt.astype(jnp.float32).swapaxes(0, 1),
                                   Bh.swapaxes(0, 1), Ch.swapaxes(0, 1)))
    y = y.swapaxes(0, 1).astype(x.dtype)
    return (y, s) if return_final_state else y


def ssd_chunked(x, dt, A, B, C, *, chunk_size, initial_state=None, return_final_state=False):
    return ssd_reference(x, dt, A, B, C, initial_state=initial_state, return_final_state=return_final_state)
