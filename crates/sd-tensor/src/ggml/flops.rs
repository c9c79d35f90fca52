//! Floating point operations of a graph node's matrix products: the work that dominates a
//! diffusion model, counted for benchmarks (GFLOP/s) and for the engine's estimate of each
//! segment's compute (which weights it keeps on the device, `sd-exec`'s resident set).

use super::ops::{
    ATTENTION_HOST_NAME, IM2COL_CONV_NAME, IMPLICIT_CONV_NAME, LINEAR_HOST_NAME, TILE_CONV_NAME,
};
use super::tensor::GTensor;

/// Floating point operations of `node`'s matrix products: `2 K M N` for a `MUL_MAT` of
/// `[K, M] x [K, N]` (times its batch dimensions; ggml's convolutions are `IM2COL` +
/// `MUL_MAT` and counted there), `2 KW KH C` per output value for this crate's convolution ops
/// ([`IMPLICIT_CONV_NAME`], [`TILE_CONV_NAME`], [`IM2COL_CONV_NAME`]), `2 K` per output value
/// for its linear op ([`LINEAR_HOST_NAME`]), and `4 d n_q n_kv` per head for
/// `FLASH_ATTN_EXT` and its attention op ([`ATTENTION_HOST_NAME`]). Everything else
/// (normalisations, activations, element-wise ops: a few percent of an SD UNet) counts 0.
pub fn node_flops(node: &GTensor) -> f64 {
    match node.op_name() {
        "MUL_MAT" => node
            .src(0)
            .map_or(0.0, |a| 2.0 * a.ne()[0] as f64 * node.nelements() as f64),
        "FLASH_ATTN_EXT" => match (node.src(0), node.src(1)) {
            (Some(q), Some(k)) => {
                let [d, nq, heads, b] = q.ne();
                4.0 * (d * nq * heads * b) as f64 * k.ne()[1] as f64
            }
            _ => 0.0,
        },
        "CUSTOM" => {
            let name = node.name();
            if name == ATTENTION_HOST_NAME {
                // q [heads d, n_q, B], k [heads d, n_kv, B], v [heads dv, n_kv, B].
                match (node.src(0), node.src(1), node.src(2)) {
                    (Some(q), Some(k), Some(v)) => {
                        let [qw, nq, b, _] = q.ne();
                        let pairs = (nq * b) as f64 * k.ne()[1] as f64;
                        2.0 * pairs * (qw + v.ne()[0]) as f64
                    }
                    _ => 0.0,
                }
            } else if name == LINEAR_HOST_NAME {
                // [K, M] x [K, N]: 2 K per output value.
                node.src(1)
                    .map_or(0.0, |w| 2.0 * w.ne()[0] as f64 * node.nelements() as f64)
            } else if name == IMPLICIT_CONV_NAME
                || name == TILE_CONV_NAME
                || name == IM2COL_CONV_NAME
            {
                // A convolution op: 2 KW KH C per output value.
                node.src(1).map_or(0.0, |k| {
                    let [kw, kh, c, _] = k.ne();
                    2.0 * (kw * kh * c) as f64 * node.nelements() as f64
                })
            } else {
                0.0
            }
        }
        _ => 0.0,
    }
}
