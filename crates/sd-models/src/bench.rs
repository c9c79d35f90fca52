//! Synthetic full-size models for benchmarks: the SD1.5 UNet with random weights, one
//! denoising step of it on any ggml backend, and the FLOP count of a graph.
//!
//! Used by `crates/sd-models/benches/unet_step.rs` (`cargo xtask bench unet`, CPU); any other
//! backend (CUDA, a simulated device) can reuse [`SyntheticUnet::new`] with its buffer type
//! and [`UnetStep`] with its backend.

use std::time::Instant;

use sd_tensor::ggml::{Backend, Buffer, BufferType, GTensor, Gallocr, Graph};
use sd_tensor::DType;

use crate::unet::{UnetConfig, UnetModel};
use crate::{ComputeOptions, GraphCtx, ParamBuilder, Params, Result};

/// Graph capacity (descriptors and nodes) of one SD1.5 UNet step.
pub const UNET_GRAPH: usize = 16384;

/// A UNet whose parameters hold random values, allocated in one buffer.
#[derive(Debug)]
pub struct SyntheticUnet {
    /// The model.
    pub model: UnetModel,
    /// Its parameters.
    pub params: Params,
    // Holds the parameters' memory.
    _buffer: Buffer,
}

/// A small deterministic generator (xorshift64*) for synthetic weights.
struct XorShift(u64);

impl XorShift {
    fn next_unit(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        v as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

impl SyntheticUnet {
    /// Declares `config` with parameters stored as `dtype` (1-D parameters f32, see
    /// [`ParamBuilder::with_synthetic_dtype`]), allocates them in `buffer_type` and fills
    /// them from `seed`: weights uniform with the variance of `1 / fan_in` (activations keep
    /// their scale through the network), 1-D `weight`s 1 and biases 0.
    pub fn new(
        config: UnetConfig,
        dtype: DType,
        buffer_type: &BufferType,
        seed: u64,
    ) -> Result<Self> {
        let _span = tracing::info_span!("synthetic_unet", ?dtype).entered();
        let pb = ParamBuilder::with_synthetic_dtype(None, 4096, dtype)?;
        let model = UnetModel::new(&pb, config)?;
        let params = pb.finish();
        let buffer = buffer_type.alloc_context_tensors(&params.ctx)?;
        let mut rng = XorShift(seed.wrapping_mul(2).wrapping_add(0x9e37_79b9_7f4a_7c15) | 1);
        for (name, t) in &params.tensors {
            let ne = t.ne();
            let dims = ne.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
            let n = t.nelements();
            let values: Vec<f32> = if dims <= 1 {
                let v = if name.ends_with("weight") { 1.0 } else { 0.0 };
                vec![v; n]
            } else {
                let fan_in = (n / ne[dims - 1]).max(1);
                let a = (3.0 / fan_in as f32).sqrt();
                (0..n).map(|_| a * rng.next_unit()).collect()
            };
            t.write_f32(&values)?;
        }
        Ok(SyntheticUnet {
            model,
            params,
            _buffer: buffer,
        })
    }

    /// The SDXL base UNet ([`UnetConfig::sdxl`]) with `dtype` weights in host memory.
    pub fn sdxl_cpu(dtype: DType, seed: u64) -> Result<Self> {
        Self::new(UnetConfig::sdxl(), dtype, &BufferType::cpu(), seed)
    }

    /// The SD1.5 UNet ([`UnetConfig::sd1`]) with `dtype` weights in host memory.
    pub fn sd15_cpu(dtype: DType, seed: u64) -> Result<Self> {
        Self::new(UnetConfig::sd1(), dtype, &BufferType::cpu(), seed)
    }
}

/// The input sizes of one UNet evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    /// Batch (2 for classifier-free guidance).
    pub batch: usize,
    /// Latent width.
    pub width: usize,
    /// Latent height.
    pub height: usize,
    /// Context tokens (77 per prompt chunk).
    pub tokens: usize,
}

impl StepShape {
    /// A 1024x1024 SDXL image with CFG: batch 2, latent 128x128, 77 tokens.
    pub const SDXL_1024_CFG: StepShape = StepShape {
        batch: 2,
        width: 128,
        height: 128,
        tokens: 77,
    };

    /// A 512x512 SD1.5 image with CFG: batch 2, latent 64x64, 77 tokens.
    pub const SD15_512_CFG: StepShape = StepShape {
        batch: 2,
        width: 64,
        height: 64,
        tokens: 77,
    };
}

/// One UNet step, built and allocated on a backend, ready to run repeatedly.
pub struct UnetStep {
    graph: Graph,
    _galloc: Gallocr,
    _g: GraphCtx,
    out: GTensor,
    flops: f64,
}

impl std::fmt::Debug for UnetStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnetStep")
            .field("flops", &self.flops)
            .finish_non_exhaustive()
    }
}

impl UnetStep {
    /// Builds the graph of `unet` on `shape` with `opts`, allocates it with `backend`'s buffer
    /// type and writes fixed inputs (latents and context from a fixed generator, timestep
    /// 500). The parameters must be readable by `backend`.
    pub fn new(
        unet: &UnetModel,
        shape: StepShape,
        opts: ComputeOptions,
        backend: &Backend,
    ) -> Result<Self> {
        let StepShape {
            batch,
            width,
            height,
            tokens,
        } = shape;
        let mut g = GraphCtx::new(UNET_GRAPH, UNET_GRAPH, opts)?;
        let c = unet.config.in_channels;
        let x = g.ctx.new_tensor(DType::F32, &[width, height, c, batch])?;
        let t = g.ctx.new_tensor(DType::F32, &[batch])?;
        let ctx = g
            .ctx
            .new_tensor(DType::F32, &[unet.config.context_dim, tokens, batch])?;
        // SDXL's `y` (pooled text and size embeddings).
        let y = match unet.config.adm_in_channels {
            Some(n) => Some(g.ctx.new_tensor(DType::F32, &[n, batch])?),
            None => None,
        };
        for i in [&x, &t, &ctx].into_iter().chain(y.as_ref()) {
            i.set_input();
        }
        let out = unet.forward(&mut g, &x, &t, &ctx, y.as_ref())?;
        out.set_output();
        let mut graph = Graph::new(&g.ctx, UNET_GRAPH)?;
        graph.build_forward_expand(&out)?;
        let mut galloc = Gallocr::new(backend.buffer_type())?;
        galloc.alloc_graph(&graph)?;
        let mut rng = XorShift(7);
        let mut fill = |t: &GTensor| -> Result<()> {
            let v: Vec<f32> = (0..t.nelements()).map(|_| rng.next_unit()).collect();
            Ok(t.write_f32(&v)?)
        };
        fill(&x)?;
        fill(&ctx)?;
        if let Some(y) = &y {
            fill(y)?;
        }
        t.write_f32(&vec![500.0; batch])?;
        for aux in &g.aux {
            aux.data.write_to(&aux.tensor)?;
        }
        let flops = graph_flops(&graph);
        Ok(UnetStep {
            graph,
            _galloc: galloc,
            _g: g,
            out,
            flops,
        })
    }

    /// Runs the step once on `backend`; returns the wall time in seconds.
    pub fn run(&self, backend: &Backend) -> Result<f64> {
        let _span = tracing::info_span!("unet_step").entered();
        let start = Instant::now();
        backend.compute(&self.graph)?;
        Ok(start.elapsed().as_secs_f64())
    }

    /// The floating point operations of one step ([`graph_flops`]).
    pub fn flops(&self) -> f64 {
        self.flops
    }

    /// The output tensor (`[W, H, out_channels, B]`).
    pub fn output(&self) -> &GTensor {
        &self.out
    }
}

/// Floating point operations of the matrix products of `graph`, the work that dominates a
/// diffusion model: `2 K M N` for every `MUL_MAT` of `[K, M] x [K, N]` (times its batch
/// dimensions; convolutions are `IM2COL` + `MUL_MAT` and counted here), and `4 d n_q n_kv`
/// per head for `FLASH_ATTN_EXT`. Normalisations, activations and element-wise ops (a few
/// percent for SD UNets) are not counted.
pub fn graph_flops(graph: &Graph) -> f64 {
    let mut total = 0.0f64;
    for node in graph.nodes() {
        match node.op_name() {
            "MUL_MAT" => {
                if let Some(a) = node.src(0) {
                    total += 2.0 * a.ne()[0] as f64 * node.nelements() as f64;
                }
            }
            "FLASH_ATTN_EXT" => {
                if let (Some(q), Some(k)) = (node.src(0), node.src(1)) {
                    let [d, nq, heads, b] = q.ne();
                    total += 4.0 * (d * nq * heads * b) as f64 * k.ne()[1] as f64;
                }
            }
            _ => {}
        }
    }
    total
}
