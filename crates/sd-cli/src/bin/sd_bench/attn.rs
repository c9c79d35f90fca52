//! `sd-bench attn`: one attention of a model's shape on a backend, in the layouts the
//! models can hand to ggml, timed alone. It isolates ggml's attention kernels from the
//! rest of a step (the FLUX census found ggml's flash attention at 41% of the step's GPU
//! time) and tells which layout, if any, a kernel prefers.
//!
//! Variants (each one graph, inputs on the backend, timed synchronously; all compute the
//! same attention of the same values, and each line gives its largest difference from the
//! first variant's output):
//! - `views`: what `sd_models::nn::attention` builds now: Q f32 `[h*d, n, B]` read through
//!   a permuted view, K and V f16 in the same token-major layout, read through permuted
//!   views.
//! - `heads`: Q f32, K and V f16, each contiguous per head (`[d, n, h, B]`).
//! - `heads_f16q`: as `heads` with Q in f16 too (the CPU backend only: ggml's CUDA flash
//!   attention reports the op supported and then aborts on a Q that is not f32).
//! - `products`: no flash attention: `K Q` as a product, `soft_max_ext`, `V^T P` (f32
//!   scores, as the models' fallback).

use std::time::Instant;

use serde_json::json;

use sd_tensor::ggml::{Backend, Context, GTensor, Graph};
use sd_tensor::DType;

use crate::{BenchError, Result};

/// One attention's shape: head width, heads, tokens (queries = keys), batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Head width.
    pub d: usize,
    /// Heads.
    pub heads: usize,
    /// Tokens (queries and keys).
    pub tokens: usize,
    /// Batch.
    pub batch: usize,
}

impl AttnShape {
    /// Parses `d,heads,tokens,batch`.
    pub fn parse(s: &str) -> std::result::Result<AttnShape, String> {
        let v: Vec<usize> = s
            .split(',')
            .map(|p| p.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| format!("shape '{s}': {e} (expected d,heads,tokens,batch)"))?;
        match v[..] {
            [d, heads, tokens, batch] if d > 0 && heads > 0 && tokens > 0 && batch > 0 => {
                Ok(AttnShape {
                    d,
                    heads,
                    tokens,
                    batch,
                })
            }
            _ => Err(format!(
                "shape '{s}': expected four positive numbers d,heads,tokens,batch"
            )),
        }
    }

    /// The multiply-adds of `softmax(Q K^T) V`, as FLOPs (2 per multiply-add, two products).
    pub fn flops(&self) -> f64 {
        4.0 * (self.tokens as f64).powi(2) * (self.d * self.heads * self.batch) as f64
    }

    /// Elements of Q (and of K, and of V).
    fn elements(&self) -> usize {
        self.d * self.heads * self.tokens * self.batch
    }
}

/// The shapes of the models' largest attentions at their usual sizes, when none is named:
/// FLUX.1 (1024x1024, 512 text tokens), SD3.5 Large (1024x1024 with CFG, 333 text tokens),
/// SDXL's two levels (1024x1024 with CFG), SD1.5 (512x512 with CFG; its 40-wide heads run
/// at 64).
pub const MODEL_SHAPES: [(&str, AttnShape); 5] = [
    (
        "flux",
        AttnShape {
            d: 128,
            heads: 24,
            tokens: 4608,
            batch: 1,
        },
    ),
    (
        "sd35-large",
        AttnShape {
            d: 64,
            heads: 38,
            tokens: 4429,
            batch: 2,
        },
    ),
    (
        "sdxl-64x64",
        AttnShape {
            d: 64,
            heads: 10,
            tokens: 4096,
            batch: 2,
        },
    ),
    (
        "sdxl-32x32",
        AttnShape {
            d: 64,
            heads: 20,
            tokens: 1024,
            batch: 2,
        },
    ),
    (
        "sd15-64x64",
        AttnShape {
            d: 64,
            heads: 8,
            tokens: 4096,
            batch: 2,
        },
    ),
];

/// The variants, in the order they are timed.
pub const VARIANTS: [&str; 4] = ["views", "heads", "heads_f16q", "products"];

/// Logical inputs in [-1, 1) (a linear congruential sequence), ordered `[B][h][n][d]`:
/// every variant lays the same values out in its own way, so all compute one attention.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// Where the logical element `(b, h, t, i)` (`[B][h][n][d]`) lies in a tensor of layout
/// `layout`: `Heads` `[d, n, h, B]`, `Tokens` `[h*d, n, B]` (and flash attention's output
/// `[d, h, n, B]`), `Transposed` `[n, d, h, B]` (V for the products).
#[derive(Clone, Copy)]
enum Layout {
    Heads,
    Tokens,
    Transposed,
}

/// Reorders logical values (`[B][h][n][d]`) into `layout`, or back with `back`.
fn relayout(v: &[f32], shape: AttnShape, layout: Layout, back: bool) -> Vec<f32> {
    let AttnShape {
        d,
        heads: h,
        tokens: n,
        batch: b,
    } = shape;
    let mut out = vec![0.0f32; v.len()];
    for bi in 0..b {
        for hi in 0..h {
            for t in 0..n {
                for i in 0..d {
                    let logical = ((bi * h + hi) * n + t) * d + i;
                    let at = match layout {
                        Layout::Heads => logical,
                        Layout::Tokens => ((bi * n + t) * h + hi) * d + i,
                        Layout::Transposed => ((bi * h + hi) * d + i) * n + t,
                    };
                    if back {
                        out[logical] = v[at];
                    } else {
                        out[at] = v[logical];
                    }
                }
            }
        }
    }
    out
}

/// A variant's graph: its inputs (Q, K, V) with their layouts, and its output with its.
struct Built {
    inputs: Vec<(GTensor, Layout)>,
    out: (GTensor, Layout),
}

/// Builds `variant` of `shape` in `ctx`.
fn build(ctx: &Context, shape: AttnShape, variant: &str) -> Result<Built> {
    let AttnShape {
        d,
        heads: h,
        tokens: n,
        batch: b,
    } = shape;
    let scale = 1.0 / (d as f32).sqrt();
    // Token-major `[h*d, n, B]` viewed as `[d, n, h, B]`.
    let heads_view = |t: &GTensor| -> Result<GTensor> {
        let t = ctx.reshape(t, &[d, h, n, b])?;
        Ok(ctx.permute(&t, [0, 2, 1, 3])?)
    };
    Ok(match variant {
        "views" => {
            let q = ctx.new_tensor(DType::F32, &[h * d, n, b])?;
            let k = ctx.new_tensor(DType::F16, &[h * d, n, b])?;
            let v = ctx.new_tensor(DType::F16, &[h * d, n, b])?;
            let o = ctx.flash_attn_ext(
                &heads_view(&q)?,
                &heads_view(&k)?,
                &heads_view(&v)?,
                None,
                scale,
            )?;
            Built {
                inputs: vec![
                    (q, Layout::Tokens),
                    (k, Layout::Tokens),
                    (v, Layout::Tokens),
                ],
                out: (o, Layout::Tokens),
            }
        }
        "heads" | "heads_f16q" => {
            let qt = if variant == "heads" {
                DType::F32
            } else {
                DType::F16
            };
            let q = ctx.new_tensor(qt, &[d, n, h, b])?;
            let k = ctx.new_tensor(DType::F16, &[d, n, h, b])?;
            let v = ctx.new_tensor(DType::F16, &[d, n, h, b])?;
            let o = ctx.flash_attn_ext(&q, &k, &v, None, scale)?; // [d, h, n, B]
            Built {
                inputs: vec![(q, Layout::Heads), (k, Layout::Heads), (v, Layout::Heads)],
                out: (o, Layout::Tokens),
            }
        }
        "products" => {
            let q = ctx.new_tensor(DType::F32, &[d, n, h, b])?;
            let k = ctx.new_tensor(DType::F32, &[d, n, h, b])?;
            // V transposed per head: [n, d, h, B].
            let vt = ctx.new_tensor(DType::F32, &[n, d, h, b])?;
            let scores = ctx.mul_mat(&k, &q)?; // [n_kv, n_q, h, B]
            let probs = ctx.soft_max_ext(&scores, None, scale)?;
            let o = ctx.mul_mat(&vt, &probs)?; // [d, n_q, h, B]
            Built {
                inputs: vec![
                    (q, Layout::Heads),
                    (k, Layout::Heads),
                    (vt, Layout::Transposed),
                ],
                out: (o, Layout::Heads),
            }
        }
        other => {
            return Err(BenchError::Usage(format!(
                "unknown attention variant '{other}' (one of {})",
                VARIANTS.join(", ")
            )))
        }
    })
}

/// Times `variant` of `shape` on `backend`: `iters` synchronous computes after one warm-up.
/// Returns the median ms and the output in logical order (`[B][h][n][d]`), or why the
/// backend cannot compute it (an op it does not run, or too little memory).
fn time_variant(
    backend: &Backend,
    shape: AttnShape,
    variant: &str,
    iters: usize,
) -> Result<std::result::Result<(f64, Vec<f32>), String>> {
    if variant == "heads_f16q" && !backend.is_cpu() {
        return Ok(Err(format!(
            "{}: ggml's GPU flash attention takes Q in f32 only (CUDA asserts it)",
            backend.name()
        )));
    }
    let ctx = Context::new_descriptors(16, 16, 1)?;
    let built = build(&ctx, shape, variant)?;
    let mut graph = Graph::new(&ctx, 16)?;
    graph.build_forward_expand(&built.out.0)?;
    if let Some(node) = graph.nodes().into_iter().find(|n| !backend.supports_op(n)) {
        return Ok(Err(format!(
            "{} does not run {}",
            backend.name(),
            node.op_name()
        )));
    }
    let _buf = match backend.buffer_type().alloc_context_tensors(&ctx) {
        Ok(b) => b,
        Err(e) => return Ok(Err(format!("allocation: {e}"))),
    };
    for (i, (t, layout)) in built.inputs.iter().enumerate() {
        let logical = values(shape.elements(), i as u32 + 1);
        t.write_f32(&relayout(&logical, shape, *layout, false))?;
    }
    backend.compute(&graph)?;
    let mut times = Vec::with_capacity(iters.max(1));
    for _ in 0..iters.max(1) {
        backend.synchronize();
        let t0 = Instant::now();
        backend.compute(&graph)?;
        backend.synchronize();
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let (out, layout) = &built.out;
    let o = relayout(&out.read_f32()?, shape, *layout, true);
    Ok(Ok((times[times.len() / 2], o)))
}

/// `sd-bench attn`: every variant of every shape, one JSON line each.
pub fn cmd_attn(
    name: &str,
    shapes: &[(String, AttnShape)],
    variants: &[String],
    iters: usize,
    threads: usize,
) -> Result<()> {
    let backend = Backend::by_name(name)?;
    if backend.is_cpu() {
        backend.set_threads(threads);
    }
    for (label, shape) in shapes {
        // The first variant's output: the others' largest difference from it.
        let mut first: Option<(String, Vec<f32>)> = None;
        for variant in variants {
            let r = time_variant(&backend, *shape, variant, iters)?;
            let line = match r {
                Ok((ms, out)) => {
                    let (vs, diff) = match &first {
                        Some((name, f)) => (
                            Some(name.clone()),
                            Some(
                                f.iter()
                                    .zip(&out)
                                    .map(|(a, b)| (a - b).abs())
                                    .fold(0.0f32, f32::max),
                            ),
                        ),
                        None => (None, None),
                    };
                    let mean_abs =
                        out.iter().map(|x| f64::from(x.abs())).sum::<f64>() / out.len() as f64;
                    if first.is_none() {
                        first = Some((variant.clone(), out));
                    }
                    json!({
                        "cmd": "attn", "backend": backend.name(), "shape": label,
                        "d": shape.d, "heads": shape.heads, "tokens": shape.tokens,
                        "batch": shape.batch, "variant": variant, "ms": ms,
                        "tflops": shape.flops() / ms / 1e9, "mean_abs": mean_abs,
                        "max_diff": diff, "max_diff_vs": vs,
                    })
                }
                Err(why) => json!({
                    "cmd": "attn", "backend": backend.name(), "shape": label,
                    "variant": variant, "skipped": why,
                }),
            };
            println!("{line}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_refuse() {
        assert_eq!(
            AttnShape::parse("128,24,4608,1").unwrap(),
            AttnShape {
                d: 128,
                heads: 24,
                tokens: 4608,
                batch: 1
            }
        );
        assert!(AttnShape::parse("128,24,4608").is_err());
        assert!(AttnShape::parse("128,0,4608,1").is_err());
        assert!(AttnShape::parse("a,b,c,d").is_err());
        assert_eq!(
            MODEL_SHAPES[0].1.flops(),
            4.0 * 4608.0 * 4608.0 * 128.0 * 24.0
        );
    }
}
